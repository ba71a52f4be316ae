//go:build integration

package faults

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// revokeTry bounds one try of "fenceline lease revoke" (see revokeNow).
const revokeTry = 8 * time.Second

// bound is how long after a revoke returns every boundary must refuse the
// revoked holder's writes (invariant 9).
const bound = time.Second

// envInt reads a positive integer from the environment, or def.
func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive integer", name, v)
	}
	return n
}

// The tables the agents' Postgres writes land in, one per lineage.
const (
	runTable = "public.fl_writes"
	podTable = "public.fl_pod_writes"
)

// agent is one agent of a lineage: its processes (in the order they stop)
// and its grant.
type agent struct {
	procs []*Proc
	lease Grant
}

// lineage is a claim that passes from agent to agent, one agent per round.
type lineage struct {
	name  string
	start func(i int) *agent
	// landed returns nil once a write of a landed at each of the
	// lineage's boundaries, after since when since is not zero (then at
	// one boundary is enough).
	landed func(a *agent, since time.Time) error
	// record reads every landed write back into h.
	record func(h *History)
}

// TestSingleBusKillRestartRevoke is the single-bus fault run. Three
// lineages of guarded agents write in a loop, each on its own claim:
//
//   - run: under "fenceline run" (the file guard asks the run's holder),
//     appending to a file and inserting rows through the Postgres fence;
//   - pod: the same writes in pod mode, "fenceline agent" beside
//     "fenceline sidecar" (the file guard follows the sidecar's view);
//   - git: under "fenceline run" in an exclusive workspace, pushing
//     commits made beforehand, one per push, through the git fence.
//
// Each round the bus is killed with -9 and restarted on the same port and
// store, and every lineage's lease is revoked the moment the bus answers
// (every other round: once the agents write again, so the revoke reaches
// their holders as a change notice); new agents are granted the same
// claims at once and write to the same places, while the revoked ones go
// on trying. Every grant and every landed write is recorded, and the
// standard checks run over them: no overlapping grants, no write landed
// more than 1 s after its lease's revoke returned, fences unique and
// rising; and the audit, read with "fenceline lease audit", must hold every
// grant, revoke and final release exactly once (AuditCheck).
//
// FENCELINE_FAULTS_ROUNDS sets the number of rounds (default 2: the CI
// form); scripts/faults.sh runs the long form.
func TestSingleBusKillRestartRevoke(t *testing.T) {
	rounds := envInt(t, "FENCELINE_FAULTS_ROUNDS", 2)
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rounds)*40*time.Second+90*time.Second)
	defer cancel()

	pg, err := pgtest.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := pg.Stop(); err != nil {
			t.Errorf("stop postgres: %v", err)
		}
	})
	env := NewEnv(t, Binary(t))
	bus := StartBus(t, env)
	defer bus.Stop()
	secret := preparePG(ctx, t, env, pg, runTable, podTable)
	co := newCheckout(t, "data", "pod")
	registerPG(ctx, t, env, co, secret)
	h := NewHistory()
	psql := filepath.Join(pg.BinDir, "psql")

	run := runLineage(ctx, t, env, h, pg, secret, co, "run", "data", runTable)
	pod := fileAndPG(ctx, t, pg, "pod", filepath.Join(co, "pod", "log"), podTable)
	pod.start = func(i int) *agent {
		sc := env.Start(t, fmt.Sprintf("sidecar-%d", i), "sidecar", "--repo", co, "--scope", "pod",
			"--table", podTable, "--pg-upstream", pg.Addr(),
			"--ttl", "30s", "--wait", "20s", "--agent", fmt.Sprintf("pod-%d", i), "--task", "faults")
		id := waitOutput(ctx, t, sc, sc.Stdout, sidecarLease)
		admin := waitOutput(ctx, t, sc, sc.Stdout, adminLine)
		p := env.Start(t, fmt.Sprintf("pod-%d", i), "agent", "--sidecar", admin, "--checkout", co, "--grace", "1s",
			"--log-format", "text", "--", "sh", "-c", writerScript(psql, pg.Admin, "pod", podTable))
		return &agent{procs: []*Proc{p, sc}, lease: recordGrant(ctx, t, env, h, id)}
	}
	git := gitLineage(ctx, t, env, h)
	lines := []*lineage{run, pod, git}
	crew := newCrew(ctx, t, env, h, lines...)
	for r := 1; r <= rounds; r++ {
		// Every boundary takes the current agents' writes.
		crew.waitLanded(time.Time{})

		bus.Kill()
		h.Fault("kill-9")
		restarted := time.Now()
		bus.Start()
		up := time.Now()
		if r%2 == 0 {
			// The holders are back and writing before the revoke: then
			// it reaches them as a change notice, which they confirm
			// with the service.
			crew.waitLanded(restarted)
		}
		crew.revokeAll("kill-9", fmt.Sprintf("round %d, right after a bus restart", r), up)
	}
	crew.finish()
	if err := AwaitAudit(ctx, h, 15*time.Second, func(ctx context.Context) ([]lease.AuditEvent, error) {
		return auditCLI(ctx, env)
	}); err != nil {
		t.Errorf("read the audit with lease audit: %v", err)
	}
	rep := Verify(h, append(StandardChecks(bound), AuditCheck())...)
	t.Logf("faults: %s", rep)
	n := len(lines)
	if rep.Faults["kill-9"] != rounds || rep.Revokes != n*rounds || rep.Grants != n*(rounds+1) {
		t.Errorf("want %d kills, %d revokes, %d grants: %s", rounds, n*rounds, n*(rounds+1), rep)
	}
	if rep.Audit[lease.EventGrant] < rep.Grants || rep.Audit[lease.EventRevoked] < rep.Revokes {
		t.Errorf("want at least %d grant and %d revoked events in the audit: %s", rep.Grants, rep.Revokes, rep)
	}
	for _, b := range []string{"run/file", "run/postgres", "pod/file", "pod/postgres", "git/push"} {
		if rep.Writes[b] == 0 {
			t.Errorf("no %s writes recorded: %s", b, rep)
		}
	}
	for _, v := range rep.Violations {
		t.Error(v)
	}
}

// runLineage is a lineage of "fenceline run" agents on the bus of env,
// each claiming dir of checkout co and running writerScript: lines
// appended to co/dir/log through the file guard, rows inserted into table
// through the run's Postgres fence.
func runLineage(ctx context.Context, t *testing.T, env *Env, h *History, pg *pgtest.Server, secret, co, name, dir, table string) *lineage {
	registerPG(ctx, t, env, co, secret)
	l := fileAndPG(ctx, t, pg, name, filepath.Join(co, dir, "log"), table)
	psql := filepath.Join(pg.BinDir, "psql")
	l.start = func(i int) *agent {
		p, id := startRun(ctx, t, env, h, fmt.Sprintf("%s-%d", name, i), "run", "--checkout", co, "--scope", dir,
			"--table", table, "--pg-upstream", pg.Addr(),
			"--ttl", "30s", "--wait", "20s", "--agent", fmt.Sprintf("%s-%d", name, i), "--task", "faults",
			"--", "sh", "-c", writerScript(psql, pg.Admin, dir, table))
		return &agent{procs: []*Proc{p}, lease: recordGrant(ctx, t, env, h, id)}
	}
	return l
}

// fileAndPG is a lineage whose agents append lines to logFile and insert
// rows into table (see writerScript); start is left to the caller.
func fileAndPG(ctx context.Context, t *testing.T, pg *pgtest.Server, name, logFile, table string) *lineage {
	return &lineage{
		name: name,
		landed: func(a *agent, since time.Time) error {
			if !since.IsZero() {
				return fileWriteAfter(logFile, a.lease.LeaseID, since)
			}
			b, _ := os.ReadFile(logFile)
			if !strings.Contains(string(b), a.lease.LeaseID+" ") {
				return errors.New("no file write yet")
			}
			conn, err := pgx.Connect(ctx, pg.AdminDSN(""))
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			var n int
			if err := conn.QueryRow(ctx, `SELECT count(*) FROM `+table+` WHERE lease = $1`, a.lease.LeaseID).Scan(&n); err != nil || n == 0 {
				return fmt.Errorf("no row yet (%v)", err)
			}
			return nil
		},
		record: func(h *History) {
			readFileWrites(t, h, name+"/file", logFile)
			readPGWrites(ctx, t, h, pg, name+"/postgres", table)
		},
	}
}

// fileWriteAfter: a line stamped after since landed under lease.
func fileWriteAfter(logFile, lease string, since time.Time) error {
	b, err := os.ReadFile(logFile)
	if err != nil {
		return err
	}
	for _, line := range strings.Split(string(b), "\n") {
		id, ns, _ := strings.Cut(line, " ")
		if at, err := parseNanos(ns); err == nil && id == lease && at.After(since) {
			return nil
		}
	}
	return fmt.Errorf("no write since %s", stamp(since))
}

// gitLineage is the lineage of pushes: a git server (the real git
// http-backend) with a post-receive hook that logs each landed ref update
// with the pushed commit's subject ("<lease> <k>") and the server's time;
// each agent works in its own clone, in an exclusive workspace claiming
// src, and pushes commits it made beforehand, one more per push, to a
// branch of its own.
func gitLineage(ctx context.Context, t *testing.T, env *Env, h *History) *lineage {
	t.Helper()
	gs, err := gitserver.Start(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { gs.Close() })
	bare, err := gs.NewRepo("faults.git")
	if err != nil {
		t.Fatal(err)
	}
	// A push counts from the moment the git server began to take it (its
	// pre-receive hook ran), which is after the git fence's last check of
	// the lease: a push the fence forwarded is in flight, as a COMMIT sent
	// to Postgres is, and how long the server then takes to land it (long,
	// on two loaded cores) is the server's. It is recorded once it landed.
	landedLog, arrived := filepath.Join(t.TempDir(), "landed"), t.TempDir()
	if err := gitserver.InstallHook(bare, "pre-receive", "#!/bin/sh\nwhile read old new ref; do\n  date +%s%N > "+arrived+"/$new\ndone\n"); err != nil {
		t.Fatal(err)
	}
	if err := gitserver.InstallHook(bare, "post-receive", "#!/bin/sh\nwhile read old new ref; do\n  echo \"$(git log -1 --format=%s $new) $(cat "+arrived+"/$new) $ref\" >> "+landedLog+"\ndone\n"); err != nil {
		t.Fatal(err)
	}
	seed := newCheckout(t, "src")
	gitIn(t, seed, "push", "--quiet", bare, "main")
	upstream := gs.URL + "/faults.git"
	return &lineage{
		name: "git",
		start: func(i int) *agent {
			clone := filepath.Join(t.TempDir(), "clone")
			gitIn(t, "", "clone", "--quiet", upstream, clone)
			p, id := startRun(ctx, t, env, h, fmt.Sprintf("git-%d", i), "run", "--checkout", clone, "--scope", "src", "--workspace", "exclusive",
				"--git-upstream", upstream, "--ttl", "30s", "--wait", "20s", "--agent", fmt.Sprintf("git-%d", i), "--task", "faults",
				"--", "sh", "-c", pushScript)
			return &agent{procs: []*Proc{p}, lease: recordGrant(ctx, t, env, h, id)}
		},
		landed: func(a *agent, since time.Time) error {
			for _, w := range readLanded(t, landedLog) {
				if w.LeaseID == a.lease.LeaseID && w.At.After(since) {
					return nil
				}
			}
			return errors.New("no push landed yet")
		},
		record: func(h *History) {
			for _, w := range readLanded(t, landedLog) {
				h.Write(w)
			}
		},
	}
}

// pushScript makes empty commits (subject "<lease> <k>") with git's
// plumbing, one before each push, and pushes each, about every 20 ms, to
// refs/heads/<lease> through the git fence (run routes origin to it),
// going on after a refusal of either (a push's last lines go to stderr,
// for the failure message); after 1,000 tries it idles. A commit is made just
// before its push, so the first push goes out at once: an agent that made
// all its commits first spent most of a busy machine's 30 s doing so.
const pushScript = `
export GIT_AUTHOR_NAME=faults GIT_AUTHOR_EMAIL=faults@example.invalid GIT_COMMITTER_NAME=faults GIT_COMMITTER_EMAIL=faults@example.invalid
tree=$(git rev-parse 'HEAD^{tree}') && c=$(git rev-parse HEAD) || exit 1
k=0
while [ $k -lt 1000 ]; do
  k=$((k+1))
  # The guard refuses the commit's objects while the lease is in doubt
  # (a fault): try again, as pushes do.
  n=$(git commit-tree "$tree" -p "$c" -m "$FENCELINE_LEASE_ID $k") || { sleep 0.1; continue; }
  c=$n
  git push -q origin "$c:refs/heads/$FENCELINE_LEASE_ID" 2>&1 | tail -n 2 >&2
  sleep 0.02
done
while :; do sleep 1; done
`

// readLanded reads the git server's log of landed pushes.
func readLanded(t *testing.T, file string) []Write {
	t.Helper()
	b, err := os.ReadFile(file)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var ws []Write
	for n, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(line)
		if len(f) != 4 {
			continue // a seed or other push
		}
		at, err := parseNanos(f[2])
		if err != nil {
			continue
		}
		ws = append(ws, Write{Boundary: "git/push", LeaseID: f[0], At: at, Detail: fmt.Sprintf("commit %s %s to %s (landed line %d)", f[0], f[1], f[3], n+1)})
	}
	return ws
}

// gitIn runs git in dir (the test's own, unguarded).
func gitIn(t *testing.T, dir string, args ...string) {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-c", "user.name=faults", "-c", "user.email=faults@example.invalid"}, args...)...)
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
}

// writerScript appends "<lease> <unix nanos>" lines to dir/log (the time is
// taken after the append's open passed the guard: the redirection of a
// { } group is made before its commands run, so a write held up at the
// open cannot look earlier than it was) and, in the
// background, inserts a row per iteration into table through the Postgres
// fence (PGHOST/PGPORT point at it), both about every 10 ms, forever;
// refusals are ignored, like a runaway agent would. psql is restarted if
// its connection ends.
func writerScript(psql, user, dir, table string) string {
	return fmt.Sprintf(`
(
  while :; do
    while :; do echo "INSERT INTO %[3]s(lease) VALUES ('$FENCELINE_LEASE_ID');"; sleep 0.01; done |
      PGUSER=%[2]s PGDATABASE=postgres PGCONNECT_TIMEOUT=5 %[1]s -X -q >/dev/null 2>&1
    sleep 0.1
  done
) &
while :; do
  { echo "$FENCELINE_LEASE_ID $(date +%%s%%N)"; } >> %[4]s/log
  sleep 0.01
done 2>/dev/null
`, psql, user, table, dir)
}

// preparePG creates the agents' tables, fences them with "fenceline pg
// install" and returns the secret file the fences sign tokens with.
func preparePG(ctx context.Context, t *testing.T, env *Env, pg *pgtest.Server, tables ...string) string {
	t.Helper()
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	args := []string{"pg", "install", "--dsn", pg.AdminDSN(""), "--trigger", "plpgsql"}
	for _, table := range tables {
		// Each row: the lease the agent wrote under, the token the fence
		// set in its transaction (it carries the fence), the server's time.
		if _, err := admin.Exec(ctx, `DROP TABLE IF EXISTS `+table+`;
			CREATE TABLE `+table+` (id bigserial PRIMARY KEY, lease text NOT NULL,
				token text DEFAULT current_setting('fenceline.token', true),
				at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
			t.Fatal(err)
		}
		args = append(args, "--table", table)
	}
	secret := filepath.Join(t.TempDir(), "pg.key")
	if _, stderr, err := env.CLI(ctx, append(args, "--secret-file", secret)...); err != nil {
		t.Fatalf("pg install: %v\n%s", err, stderr)
	}
	return secret
}

// registerPG registers the database's fence secret for repo with the lease
// service ("bus fence-secret set"): only the service and the database
// hold it, and each lease's acquirer gets a grant key derived from it.
func registerPG(ctx context.Context, t *testing.T, env *Env, repo, secret string) {
	t.Helper()
	args := []string{"bus", "fence-secret", "set", "--repo", repo, "--postgres", secret}
	if env.FenceSecrets != "" {
		args = append(args, "--dir", env.FenceSecrets)
	}
	if _, stderr, err := env.CLI(ctx, args...); err != nil {
		t.Fatalf("bus fence-secret set: %v\n%s", err, stderr)
	}
}

// newCheckout makes a git checkout with the directories dirs.
func newCheckout(t *testing.T, dirs ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	for _, d := range dirs {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, d, "seed"), []byte("seed\n"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, args := range [][]string{{"init", "--quiet", "--initial-branch=main"}, {"add", "-A"},
		{"-c", "user.name=faults", "-c", "user.email=faults@example.invalid", "commit", "--quiet", "-m", "seed"}} {
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	return dir
}

// What the processes print: a run's lease (stderr), a sidecar's lease
// and admin URL (stdout).
var (
	runLease     = regexp.MustCompile(`lease (lease_[0-9a-zA-Z_-]+) (?:acquired|attached):`)
	sidecarLease = regexp.MustCompile(`sidecar: lease (lease_[0-9a-zA-Z_-]+) `)
	adminLine    = regexp.MustCompile(`admin: (http://\S+) `)
)

// waitOutput waits until out (a process's output so far) matches re, and
// returns the first submatch.
func waitOutput(ctx context.Context, t *testing.T, p *Proc, out func() string, re *regexp.Regexp) string {
	t.Helper()
	got, err := awaitOutput(ctx, p, out, re)
	if err != nil {
		t.Fatalf("%s: %v\nstdout:\n%s\nstderr:\n%s", p.Name, err, p.Stdout(), p.Stderr())
	}
	return got
}

// awaitOutput is waitOutput returning its error: errExited when the
// process exited first.
func awaitOutput(ctx context.Context, p *Proc, out func() string, re *regexp.Regexp) (string, error) {
	var got string
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err := testutil.Retry(wctx, 10*time.Millisecond, func() error {
		if m := re.FindStringSubmatch(out()); m != nil {
			got = m[1]
			return nil
		}
		if p.Exited() {
			return testutil.Permanent(fmt.Errorf("%s %w", p.Name, errExited))
		}
		return fmt.Errorf("nothing matches %s yet", re)
	})
	return got, err
}

var errExited = errors.New("exited")

// startRun starts the agent "fenceline args..." (a run) and returns it
// with the lease it printed. A run that exits before its lease is granted
// (it could not reach the bus in time during a fault), or says nothing for
// 30 s (killed then), is counted as an incident and started again, up to 5
// times.
func startRun(ctx context.Context, t *testing.T, env *Env, h *History, name string, args ...string) (*Proc, string) {
	t.Helper()
	for try := 1; ; try++ {
		start := time.Now()
		p := env.Start(t, name, args...)
		id, err := awaitOutput(ctx, p, p.Stderr, runLease)
		if err == nil {
			return p, id
		}
		if try == 5 || ctx.Err() != nil {
			t.Fatalf("%s: %v\nstdout:\n%s\nstderr:\n%s", p.Name, err, p.Stdout(), p.Stderr())
		}
		if errors.Is(err, errExited) {
			h.Incident("agent-start-failed")
			t.Logf("incident: %s exited before its lease was granted (try %d), starting it again: %s", name, try, strings.TrimSpace(p.Stderr()))
			select { // retries spaced out, as a client backs off: the bus may need seconds after a fault
			case <-ctx.Done():
			case <-time.After(time.Duration(try) * 500 * time.Millisecond):
			}
			continue
		}
		p.KillTree()
		_, _ = p.Wait(10 * time.Second)
		h.Incident("agent-start-hung")
		t.Logf("incident: %s had no lease after %s (try %d), killed, starting it again; it said: %q", name, time.Since(start).Round(time.Millisecond), try, strings.TrimSpace(p.Stderr()))
	}
}

// recordGrant reads the record of lease id from the service and records
// the grant.
func recordGrant(ctx context.Context, t *testing.T, env *Env, h *History, id string) Grant {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	l, err := showLease(wctx, env, id)
	if err != nil {
		t.Fatalf("lease show %s: %v", id, err)
	}
	g := Grant{LeaseID: l.LeaseID, Repo: l.Repo, Claim: l.Scope, Fence: l.Fence, GrantedAt: l.AcquiredAt}
	h.Grant(g)
	return g
}

func showLease(ctx context.Context, env *Env, id string) (*lease.Lease, error) {
	var l lease.Lease
	err := testutil.Retry(ctx, 20*time.Millisecond, func() error {
		out, stderr, err := env.CLI(ctx, "lease", "show", id, "--json")
		if err != nil {
			return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr))
		}
		return json.Unmarshal([]byte(out), &l)
	})
	return &l, err
}

// recordEnd asks the service how lease id ended (its holder stopped) and
// records it: a release the audit must show, or just when it ended.
func recordEnd(ctx context.Context, env *Env, h *History, id string) {
	l, err := showLease(ctx, env, id)
	switch {
	case err != nil || l.EndedAt.IsZero():
	case l.Status == lease.StatusReleased:
		h.Released(id, l.EndedAt)
	default:
		h.Ended(id, l.EndedAt)
	}
}

// auditCLI reads every audit event with "fenceline lease audit --json",
// as an operator would (the viewer's credentials the CLI finds).
func auditCLI(ctx context.Context, env *Env) ([]lease.AuditEvent, error) {
	out, stderr, err := env.CLI(ctx, "lease", "audit", "--json")
	if err != nil {
		return nil, fmt.Errorf("lease audit: %w: %s", err, strings.TrimSpace(stderr))
	}
	var evs []lease.AuditEvent
	if err := json.Unmarshal([]byte(out), &evs); err != nil {
		return nil, fmt.Errorf("lease audit --json: %w", err)
	}
	return evs, nil
}

// revokeNow revokes id through the CLI, retrying until the restarted bus
// answers, and returns when the call returned and the service's endedAt.
//
// Each try is given revokeTry: a try that hangs longer (the CLI stuck on a
// node that is paused, say) is killed, counted as an incident and logged,
// and the revoke tried again; the lease's deadline for writes is then when
// a try returned, as the operator would see it.
//
// A lease the service had already reclaimed when the revoke reached it (a
// holder cut off from the service past its session's grace: its lease
// ends by the service's word, not the operator's) is recorded as that
// end, writes under it due to stop by the reclaim; ended is the audit
// event of the end.
func revokeNow(ctx context.Context, t *testing.T, env *Env, h *History, id, reason string) (returned, endedAt time.Time, ended string) {
	t.Helper()
	var l lease.Lease
	// 90 s: a revoke takes up to 12 s after a fault on a quiet machine
	// (docs/faults.md), and a loaded two-core CI machine runs the cluster
	// several times slower. (Stop 51's CI, 40 s with no takeover after a
	// partition of the primary's node, was a cut-off instance spinning on
	// its claim: fixed, TestClusterPrimaryCutOffWithTheClaimsLeader.) A
	// liveness bound the incidents count, not a safety one.
	rctx, cancel := context.WithTimeout(ctx, 90*time.Second)
	defer cancel()
	err := testutil.Retry(rctx, 10*time.Millisecond, func() error {
		tctx, cancel := context.WithTimeout(rctx, revokeTry)
		defer cancel()
		start := time.Now()
		out, stderr, err := env.CLI(tctx, "lease", "revoke", id, "--reason", reason, "--json")
		if err != nil {
			if tctx.Err() != nil && rctx.Err() == nil {
				h.Incident("revoke-try-hung")
				t.Logf("incident: lease revoke %s hung for %s, killed, trying again: %s", id, time.Since(start).Round(time.Millisecond), strings.TrimSpace(stderr))
			}
			return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr))
		}
		if said := strings.TrimSpace(stderr); said != "" {
			// What it waited for, said after revokePatience (2 s).
			t.Logf("lease revoke %s answered after %s, having said: %s", id, time.Since(start).Round(time.Millisecond), said)
		}
		return json.Unmarshal([]byte(out), &l)
	})
	returned = time.Now()
	if err != nil {
		t.Fatalf("lease revoke %s: %v", id, err)
	}
	switch l.Status {
	case lease.StatusRevoked:
		return returned, l.EndedAt, lease.EventRevoked
	case lease.StatusReclaimed:
		h.Incident("reclaimed-before-revoke")
		t.Logf("incident: lease revoke %s found it reclaimed at %s (%s)", id, l.EndedAt.Format(time.StampMilli), l.Reason)
		return l.EndedAt, l.EndedAt, lease.EventReclaimed
	}
	t.Fatalf("lease revoke %s: the lease is %s (%s), not revoked", id, l.Status, l.Reason)
	return
}

// stopAgent stops an agent's processes in order with SIGTERM (a run or
// agent stops its command and settles; a sidecar then releases its lease,
// if still held) and waits for each.
func stopAgent(t *testing.T, a *agent) {
	t.Helper()
	for _, p := range a.procs {
		if p.Exited() {
			continue
		}
		_ = p.Signal(syscall.SIGTERM)
		if _, err := p.Wait(30 * time.Second); err != nil {
			t.Errorf("%v\n%s", err, p.Stderr())
		}
	}
}

// readFileWrites records every line the agents appended to the log.
func readFileWrites(t *testing.T, h *History, boundary, logFile string) {
	t.Helper()
	f, err := os.Open(logFile)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	n := 0
	for sc.Scan() {
		n++
		id, ns, ok := strings.Cut(sc.Text(), " ")
		at, err := parseNanos(ns)
		if !ok || err != nil {
			// A torn line would itself be a finding: appends are atomic.
			t.Errorf("%s line %d: %q is not \"<lease> <nanos>\"", logFile, n, sc.Text())
			continue
		}
		h.Write(Write{Boundary: boundary, LeaseID: id, At: at, Detail: fmt.Sprintf("%s line %d", filepath.Base(logFile), n)})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
}

// readPGWrites records every committed row of table.
func readPGWrites(ctx context.Context, t *testing.T, h *History, pg *pgtest.Server, boundary, table string) {
	t.Helper()
	conn, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT id, lease, coalesce(token, ''), at FROM `+table+` ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	for rows.Next() {
		var (
			id           int64
			lease, token string
			at           time.Time
		)
		if err := rows.Scan(&id, &lease, &token, &at); err != nil {
			t.Fatal(err)
		}
		h.Write(Write{Boundary: boundary, LeaseID: lease, Fence: tokenFence(token), At: at, Detail: fmt.Sprintf("row %d", id)})
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
}

// tokenFence is the fence a Postgres fence token carries ("v3:<fence>:…"),
// or 0 when it cannot be read.
func tokenFence(tok string) uint64 {
	parts := strings.SplitN(tok, ":", 3)
	if len(parts) < 3 {
		return 0
	}
	f, err := strconv.ParseUint(parts[1], 10, 64)
	if err != nil {
		return 0
	}
	return f
}

// The checks catch what they are for: an overlap, a late write, a repeated
// or falling fence, a write carrying the wrong fence, an acknowledged
// operation missing from the audit or written there twice.
func TestChecksCatchViolations(t *testing.T) {
	claim := func(p ...string) scope.Claim {
		c, err := scope.New(p, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	sec := func(n float64) time.Time { return t0.Add(time.Duration(n * float64(time.Second))) }
	clean := func() *History {
		h := NewHistory()
		h.Grant(Grant{LeaseID: "a", Repo: "r", Claim: claim("data"), Fence: 1, GrantedAt: sec(0)})
		h.Revoked("a", sec(10), sec(9.9))
		h.Grant(Grant{LeaseID: "b", Repo: "r", Claim: claim("data"), Fence: 2, GrantedAt: sec(10.1)})
		h.Grant(Grant{LeaseID: "c", Repo: "r", Claim: claim("docs"), Fence: 3, GrantedAt: sec(10.2)})
		h.Write(Write{Boundary: "file", LeaseID: "a", At: sec(10.9)})
		h.Write(Write{Boundary: "postgres", LeaseID: "b", Fence: 2, At: sec(11)})
		h.Released("b", sec(20))
		h.Refused("att-1")
		h.Audit([]lease.AuditEvent{
			{Type: lease.EventGrant, Boundary: lease.BoundaryLease, LeaseID: "a", Fence: 1},
			{Type: lease.EventRevoked, Boundary: lease.BoundaryLease, LeaseID: "a", Fence: 1},
			{Type: lease.EventGrant, Boundary: lease.BoundaryLease, LeaseID: "b", Fence: 2},
			{Type: lease.EventGrant, Boundary: lease.BoundaryLease, LeaseID: "c", Fence: 3},
			{Type: lease.EventRelease, Boundary: lease.BoundaryLease, LeaseID: "b", Fence: 2},
			{Type: lease.EventRefused, Boundary: lease.BoundaryLease, Owner: lease.Owner{AttemptID: "att-1"}},
			{Type: lease.EventDenied, Boundary: "postgres", LeaseID: "a", Fence: 1},
		})
		return h
	}
	checks := append(StandardChecks(bound), AuditCheck())
	if rep := Verify(clean(), checks...); len(rep.Violations) != 0 {
		t.Fatalf("a clean history: %s", rep)
	}
	for _, tc := range []struct {
		name   string
		mutate func(h *History)
		want   string
	}{
		{"overlap", func(h *History) {
			h.Grant(Grant{LeaseID: "d", Repo: "r", Claim: claim("data/x"), Fence: 4, GrantedAt: sec(12)})
		}, "no-overlap"},
		{"late write after revoke", func(h *History) {
			h.Write(Write{Boundary: "file", LeaseID: "a", At: sec(10.05 + 1)})
		}, "no-late-write"},
		{"write by an unknown lease", func(h *History) {
			h.Write(Write{Boundary: "file", LeaseID: "zz", At: sec(1)})
		}, "no-late-write"},
		{"repeated fence", func(h *History) {
			h.Grant(Grant{LeaseID: "e", Repo: "r", Claim: claim("other"), Fence: 2, GrantedAt: sec(20)})
		}, "fences"},
		{"wrong fence on a write", func(h *History) {
			h.Write(Write{Boundary: "postgres", LeaseID: "b", Fence: 1, At: sec(11)})
		}, "fences"},
		{"audit not read", func(h *History) {
			h.mu.Lock()
			h.auditRead = false
			h.mu.Unlock()
		}, "audit"},
		{"grant missing from the audit", func(h *History) { dropEvent(h, lease.EventGrant, "c") }, "audit"},
		{"revoke missing from the audit", func(h *History) { dropEvent(h, lease.EventRevoked, "a") }, "audit"},
		{"release missing from the audit", func(h *History) { dropEvent(h, lease.EventRelease, "b") }, "audit"},
		{"refusal missing from the audit", func(h *History) { h.Refused("att-2") }, "audit"},
		{"abandoned lease never ends in the audit", func(h *History) { h.Abandoned("c") }, "audit"},
		{"grant in the audit with another fence", func(h *History) {
			h.Grant(Grant{LeaseID: "c", Repo: "r", Claim: claim("docs"), Fence: 4, GrantedAt: sec(10.2)})
		}, "audit"},
		{"grant twice in the audit", func(h *History) {
			addEvent(h, lease.AuditEvent{Type: lease.EventGrant, Boundary: lease.BoundaryLease, LeaseID: "c", Fence: 3})
		}, "audit"},
		{"two ends in the audit", func(h *History) {
			addEvent(h, lease.AuditEvent{Type: lease.EventReclaimed, Boundary: lease.BoundaryLease, LeaseID: "a", Fence: 1})
		}, "audit"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := clean()
			tc.mutate(h)
			rep := Verify(h, checks...)
			if !slices.ContainsFunc(rep.Violations, func(v Violation) bool { return v.Check == tc.want }) {
				t.Fatalf("want a %s violation, got %s", tc.want, rep)
			}
		})
	}
}

// dropEvent removes the audit events of type typ of lease id from h's audit.
func dropEvent(h *History, typ, id string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.audit = slices.DeleteFunc(slices.Clone(h.audit), func(ev lease.AuditEvent) bool { return ev.Type == typ && ev.LeaseID == id })
}

// addEvent appends ev to h's audit.
func addEvent(h *History, ev lease.AuditEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.audit = append(slices.Clone(h.audit), ev)
}
