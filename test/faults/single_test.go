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
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
)

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

// writerTable is where the agents' Postgres writes land.
const writerTable = "public.fl_writes"

// TestSingleBusKillRestartRevoke is the single-bus fault run: a guarded
// agent (`fenceline run`) appends to a file and inserts rows through the
// Postgres fence in a loop; the bus is killed with -9 and restarted on the
// same port and store, and the agent's lease is revoked the moment the bus
// answers (every other round: once the agent writes again, so the revoke
// reaches its holder as a change notice); a second agent is granted the same claim at once and writes the
// same file and table, while the first goes on trying. Each round repeats
// this with the newest agent. Every grant and every landed write is
// recorded, and the standard checks run over them: no overlapping grants,
// no write landed more than 1 s after its lease's revoke returned, fences
// unique and rising.
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
	secret := preparePG(ctx, t, env, pg)
	co := newCheckout(t)
	logFile := filepath.Join(co, "data", "log")
	h := NewHistory()

	agent := func(i int) *Proc {
		return env.Start(t, fmt.Sprintf("agent-%d", i), "run", "--repo", co, "--scope", "data",
			"--table", writerTable, "--pg-upstream", pg.Addr(), "--pg-secret-file", secret,
			"--ttl", "30s", "--wait", "20s", "--agent", fmt.Sprintf("agent-%d", i), "--task", "faults",
			"--", "sh", "-c", writerScript(filepath.Join(pg.BinDir, "psql"), pg.Admin))
	}
	cur := agent(0)
	curLease := waitGrant(ctx, t, env, h, cur)
	// Revoked agents keep trying to write; each is watched for watchFor
	// after its revoke, then stopped (so a long run does not pile them up).
	const watchFor = 3 * bound
	type revoked struct {
		p  *Proc
		at time.Time
	}
	var old []revoked
	for r := 1; r <= rounds; r++ {
		// Both boundaries take the current agent's writes.
		waitWrites(ctx, t, pg, logFile, curLease, cur)

		bus.Kill()
		h.Fault("kill-9")
		bus.Start()
		if r%2 == 0 {
			// Every other round the holder is back and writing before the
			// revoke: then the revoke reaches it as a change notice, which
			// it confirms with the service.
			waitFileWriteAfter(ctx, t, logFile, curLease, time.Now())
		}
		revokeAt, endedAt := revokeNow(ctx, t, env, curLease.LeaseID, fmt.Sprintf("faults: round %d, right after a bus restart", r))
		h.Revoked(curLease.LeaseID, revokeAt, endedAt)

		// The claim is granted again at once; the old agent keeps trying.
		next := agent(r)
		nextLease := waitGrant(ctx, t, env, h, next)
		t.Logf("round %d: revoked %s (fence %d), granted %s (fence %d) %s after the revoke returned",
			r, curLease.LeaseID, curLease.Fence, nextLease.LeaseID, nextLease.Fence, nextLease.GrantedAt.Sub(revokeAt).Round(time.Millisecond))
		old = append(old, revoked{cur, revokeAt})
		cur, curLease = next, nextLease
		for len(old) > 0 && time.Since(old[0].at) > watchFor {
			stopRun(t, old[0].p)
			old = old[1:]
		}
	}
	waitWrites(ctx, t, pg, logFile, curLease, cur)
	if len(old) > 0 {
		// Letting late writes happen, if any would.
		time.Sleep(watchFor - time.Since(old[len(old)-1].at))
	}
	for _, o := range old {
		stopRun(t, o.p)
	}
	stopRun(t, cur) // it releases its lease
	if l, err := showLease(ctx, env, curLease.LeaseID); err == nil && !l.EndedAt.IsZero() {
		h.Ended(l.LeaseID, l.EndedAt)
	}

	readFileWrites(t, h, logFile)
	readPGWrites(ctx, t, h, pg)
	rep := Verify(h, StandardChecks(bound)...)
	t.Logf("faults: %s", rep)
	if rep.Faults["kill-9"] != rounds || rep.Revokes != rounds || rep.Grants != rounds+1 {
		t.Errorf("want %d kills, %d revokes, %d grants: %s", rounds, rounds, rounds+1, rep)
	}
	if rep.Writes["file"] == 0 || rep.Writes["postgres"] == 0 {
		t.Errorf("no writes recorded at a boundary: %s", rep)
	}
	for _, v := range rep.Violations {
		t.Error(v)
	}
}

// writerScript appends "<lease> <unix nanos>" lines to data/log and, in the
// background, inserts a row per iteration through the Postgres fence
// (PGHOST/PGPORT point at it), both about every 10 ms, forever; refusals
// are ignored, like a runaway agent would. psql is restarted if its
// connection ends.
func writerScript(psql, user string) string {
	return fmt.Sprintf(`
(
  while :; do
    while :; do echo "INSERT INTO %[3]s(lease) VALUES ('$FENCELINE_LEASE_ID');"; sleep 0.01; done |
      PGUSER=%[2]s PGDATABASE=postgres PGCONNECT_TIMEOUT=5 %[1]s -X -q >/dev/null 2>&1
    sleep 0.1
  done
) &
while :; do
  echo "$FENCELINE_LEASE_ID $(date +%%s%%N)" >> data/log
  sleep 0.01
done 2>/dev/null
`, psql, user, writerTable)
}

// preparePG creates the agents' table, fences it with "fenceline pg
// install" and returns the secret file the runs sign tokens with.
func preparePG(ctx context.Context, t *testing.T, env *Env, pg *pgtest.Server) string {
	t.Helper()
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	// Each row: the lease the agent wrote under, the token the fence set
	// in its transaction (it carries the fence), and the server's time.
	if _, err := admin.Exec(ctx, `DROP TABLE IF EXISTS `+writerTable+`;
		CREATE TABLE `+writerTable+` (id bigserial PRIMARY KEY, lease text NOT NULL,
			token text DEFAULT current_setting('fenceline.token', true),
			at timestamptz NOT NULL DEFAULT clock_timestamp())`); err != nil {
		t.Fatal(err)
	}
	secret := filepath.Join(t.TempDir(), "pg.key")
	if _, stderr, err := env.CLI(ctx, "pg", "install", "--dsn", pg.AdminDSN(""), "--table", writerTable,
		"--secret-file", secret, "--trigger", "plpgsql"); err != nil {
		t.Fatalf("pg install: %v\n%s", err, stderr)
	}
	return secret
}

// newCheckout makes a git checkout with a data/ directory.
func newCheckout(t *testing.T) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	if err := os.MkdirAll(filepath.Join(dir, "data"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "data", "seed"), []byte("seed\n"), 0o644); err != nil {
		t.Fatal(err)
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

var leaseLine = regexp.MustCompile(`lease (lease_[0-9a-zA-Z_-]+) (?:acquired|attached):`)

func leaseIDOf(stderr string) string {
	m := leaseLine.FindStringSubmatch(stderr)
	if m == nil {
		return ""
	}
	return m[1]
}

// waitGrant waits for p (a run) to say which lease it got, reads the
// record from the service and records the grant.
func waitGrant(ctx context.Context, t *testing.T, env *Env, h *History, p *Proc) Grant {
	t.Helper()
	var id string
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := Retry(wctx, 10*time.Millisecond, func() error {
		if id = leaseIDOf(p.Stderr()); id != "" {
			return nil
		}
		if p.Exited() {
			return &permanent{fmt.Errorf("%s exited without a lease:\n%s", p.Name, p.Stderr())}
		}
		return errors.New("no lease yet")
	}); err != nil {
		t.Fatalf("%s: %v\n%s", p.Name, err, p.Stderr())
	}
	l, err := showLease(wctx, env, id)
	if err != nil {
		t.Fatalf("lease show %s: %v", id, err)
	}
	g := Grant{LeaseID: l.LeaseID, Repo: l.Repo, Claim: l.Scope, Fence: l.Fence, GrantedAt: l.AcquiredAt}
	h.Grant(g)
	return g
}

func showLease(ctx context.Context, env *Env, id string) (*leasebus.Lease, error) {
	var l leasebus.Lease
	err := Retry(ctx, 20*time.Millisecond, func() error {
		out, stderr, err := env.CLI(ctx, "lease", "show", id, "--json")
		if err != nil {
			return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr))
		}
		return json.Unmarshal([]byte(out), &l)
	})
	return &l, err
}

// revokeNow revokes id through the CLI, retrying until the restarted bus
// answers, and returns when the call returned and the service's endedAt.
func revokeNow(ctx context.Context, t *testing.T, env *Env, id, reason string) (returned, endedAt time.Time) {
	t.Helper()
	var l leasebus.Lease
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	err := Retry(rctx, 10*time.Millisecond, func() error {
		out, stderr, err := env.CLI(rctx, "lease", "revoke", id, "--reason", reason, "--json")
		if err != nil {
			return fmt.Errorf("%v: %s", err, strings.TrimSpace(stderr))
		}
		return json.Unmarshal([]byte(out), &l)
	})
	returned = time.Now()
	if err != nil {
		t.Fatalf("lease revoke %s: %v", id, err)
	}
	if l.Status != leasebus.StatusRevoked {
		t.Fatalf("lease revoke %s: the lease is %s (%s), not revoked", id, l.Status, l.Reason)
	}
	return returned, l.EndedAt
}

// waitWrites waits until both boundaries took a write under g.
func waitWrites(ctx context.Context, t *testing.T, pg *pgtest.Server, logFile string, g Grant, p *Proc) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(wctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	if err := Retry(wctx, 20*time.Millisecond, func() error {
		if p.Exited() {
			return &permanent{fmt.Errorf("%s exited", p.Name)}
		}
		b, _ := os.ReadFile(logFile)
		if !strings.Contains(string(b), g.LeaseID+" ") {
			return errors.New("no file write yet")
		}
		var n int
		if err := conn.QueryRow(wctx, `SELECT count(*) FROM `+writerTable+` WHERE lease = $1`, g.LeaseID).Scan(&n); err != nil || n == 0 {
			return fmt.Errorf("no row yet (%v)", err)
		}
		return nil
	}); err != nil {
		t.Fatalf("%s under %s: %v\nrun stderr:\n%s", p.Name, g.LeaseID, err, p.Stderr())
	}
}

// waitFileWriteAfter waits until a line stamped after since lands under g.
func waitFileWriteAfter(ctx context.Context, t *testing.T, logFile string, g Grant, since time.Time) {
	t.Helper()
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := Retry(wctx, 10*time.Millisecond, func() error {
		b, err := os.ReadFile(logFile)
		if err != nil {
			return err
		}
		for _, line := range strings.Split(string(b), "\n") {
			id, ns, _ := strings.Cut(line, " ")
			if at, err := parseNanos(ns); err == nil && id == g.LeaseID && at.After(since) {
				return nil
			}
		}
		return errors.New("no write since the restart")
	}); err != nil {
		t.Fatalf("%s does not write again after the bus restart: %v", g.LeaseID, err)
	}
}

// stopRun stops a run with SIGTERM (it stops its agent, settles and
// releases its lease, if still held) and waits for it.
func stopRun(t *testing.T, p *Proc) {
	t.Helper()
	if p.Exited() {
		return
	}
	_ = p.Signal(syscall.SIGTERM)
	if _, err := p.Wait(30 * time.Second); err != nil {
		t.Errorf("%v\n%s", err, p.Stderr())
	}
}

// readFileWrites records every line the agents appended to the log.
func readFileWrites(t *testing.T, h *History, logFile string) {
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
		h.Write(Write{Boundary: "file", LeaseID: id, At: at, Detail: fmt.Sprintf("%s line %d", filepath.Base(logFile), n)})
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
}

// readPGWrites records every committed row of the agents' table.
func readPGWrites(ctx context.Context, t *testing.T, h *History, pg *pgtest.Server) {
	t.Helper()
	conn, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(context.Background())
	rows, err := conn.Query(ctx, `SELECT id, lease, coalesce(token, ''), at FROM `+writerTable+` ORDER BY id`)
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
		h.Write(Write{Boundary: "postgres", LeaseID: lease, Fence: tokenFence(token), At: at, Detail: fmt.Sprintf("row %d", id)})
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
// or falling fence, a write carrying the wrong fence.
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
		return h
	}
	if rep := Verify(clean(), StandardChecks(bound)...); len(rep.Violations) != 0 {
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
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := clean()
			tc.mutate(h)
			rep := Verify(h, StandardChecks(bound)...)
			if len(rep.Violations) == 0 || rep.Violations[0].Check != tc.want {
				t.Fatalf("want a %s violation, got %s", tc.want, rep)
			}
		})
	}
}
