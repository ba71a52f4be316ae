//go:build integration

package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
)

// TestRunInAnotherCheckoutsPool: a run from a second checkout of a repo
// whose pool was declared from the first works in that pool's shards, and
// says so (its own checkout is not where its work lands).
func TestRunInAnotherCheckoutsPool(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "https://github.com/acme/payments.git")
	fl(t, "--nats", url, "shard", "pool", "--checkout", co, "--size", "1").want(t, ExitOK)
	co2 := newCheckout(t, "https://github.com/acme/payments.git")
	r := runFL(t, url, "--checkout", co2, "--", "true").want(t, ExitOK)
	mustContain(t, "run stderr", r.stderr, "was declared from the checkout "+co+": the attempt works in its shard, not in "+co2)
	r = runFL(t, url, "--checkout", co, "--", "true").want(t, ExitOK)
	if strings.Contains(r.stderr, "was declared from the checkout") {
		t.Errorf("a run from the pool's own checkout warned:\n%s", r.stderr)
	}
}

// TestShardGitRestrictions: a path lease in a shard cannot commit (shim
// and guard); the serialized commit capacity commits beside it but cannot
// write the worktree's files; the exclusive capacity waits until the
// shard is empty.
func TestShardGitRestrictions(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	realGit, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	ctl := newCtl(t)
	id := "-c user.name=agent -c user.email=agent@example.com"
	agent := `echo edit > in/work; git ` + id + ` commit -qam x; echo "commit=$?"; ` + realGit + ` ` + id + ` commit -qam x 2>/dev/null; echo "abs-commit=$?"`
	shared := startRun(t, url, "--checkout", co, "--scope", "in", "--allow-write", string(ctl), "--", "sh", "-c", ctl.waiter("s", agent))
	ctl.awaitReady(t, shared, "s")
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(shared.out.String(), "abs-commit=") {
			return errors.New("agent not done")
		}
		return nil
	})
	if out := shared.out.String(); !strings.Contains(out, "commit=3") || strings.Contains(out, "abs-commit=0") {
		t.Fatalf("a path lease committed: %s\n%s", out, shared.errOut)
	}

	// Serialized commit capacity, while the path lease still runs.
	commit := `if (echo x > README.md) 2>/dev/null; then echo write=ok; else echo write=refused; fi
git add -A && git ` + id + ` commit -qm "agents' work" && echo commit=ok`
	c := fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--serialized", "--", "sh", "-c", commit).want(t, ExitOK)
	if got := strings.Join(strings.Fields(c.stdout), " "); got != "write=refused commit=ok" {
		t.Errorf("serialized capacity: %s, want write=refused commit=ok\n%s", got, c.stderr)
	}
	mustContain(t, "commit capacity", c.stderr, "workspace shard-1/commit (exclusive)", "git dir writable")
	v := poolJSON(t, url, co)
	if out := mustGitRun(t, v.Shards[0].Path, nil, "show", "--stat", "--format=%s", "HEAD"); !strings.Contains(out, "agents' work") || !strings.Contains(out, "in/work") {
		t.Errorf("shard HEAD after the commit: %s", out)
	}

	// Exclusive capacity waits for the path lease to end.
	ex := startRunCmd(t, url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--exclusive", "--wait", "30s", "--", "sh", "-c", "echo x > README.md && echo ran")
	awaitWaiting(t, ex)
	if strings.Contains(ex.out.String(), "ran") {
		t.Fatalf("the exclusive capacity ran beside a path lease:\n%s", ex.errOut)
	}
	ctl.stop(t, "s")
	if code := shared.wait(t); code != 0 {
		t.Fatalf("path lease exited %d", code)
	}
	if code := ex.wait(t); code != 0 {
		t.Fatalf("exclusive capacity exited %d\n%s", code, ex.errOut)
	}
	mustContain(t, "exclusive capacity", ex.out.String(), "ran")
	grantedAfter(t, url, leaseOf(t, shared.errOut.String()), leaseOf(t, ex.errOut.String()))

	// Serialized capacity is refused while an exclusive attempt owns the shard.
	excl := startRun(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", ctl.waiter("x", ""))
	ctl.awaitReady(t, excl, "x")
	r := fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--serialized", "--", "touch", "ran").want(t, ExitConflict)
	exclLease := leaseOf(t, excl.errOut.String())
	mustContain(t, "serialized beside exclusive", r.stderr, exclLease, "workspace shard-1 is held exclusively, and shard-1/commit lies in it")
	// The lease service refused it (in one step with its overlap check)
	// and audited the refusal.
	_, nc := busClient(t, url)
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(context.Background(), nc, "", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && strings.Contains(ev.Message, exclLease) && strings.Contains(ev.Message, "shard-1/commit") {
				return nil
			}
		}
		return fmt.Errorf("no refusal naming %s among %d audit events", exclLease, len(evs))
	})
	ctl.stop(t, "x")
	excl.wait(t)
}

// TestShardCrashRecovery: a runner killed outright leaves its attempt
// running; once its lease is reclaimed, shard list marks the attempt
// unknown and the shard dirty (audited), and the next exclusive attempt
// cleans the shard before it starts.
func TestShardCrashRecovery(t *testing.T) {
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newPool(t, url, 1, 0)
	ctl := newCtl(t)
	cmd, logPath := startRunnerProcess(t, "--nats", url, "run", "--checkout", co, "--ttl", "2s", "--allow-write", string(ctl), "--",
		"sh", "-c", `echo crashed > leftover; echo $$ > `+ctl.path("agent.pid")+`; while [ ! -e `+ctl.path("stop")+` ]; do sleep 0.05; done`)
	var agent int
	// The crashed runner's agent lives on (its writes refused); it was
	// re-parented to this process, a subreaper: end and reap it.
	endAgent := func() {
		os.WriteFile(ctl.path("stop"), nil, 0o644)
		if agent > 0 {
			unix.Kill(-agent, unix.SIGKILL)
			checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
				if pid, err := unix.Wait4(agent, nil, unix.WNOHANG, nil); pid == 0 && err == nil {
					return errors.New("the agent has not exited")
				}
				return nil
			})
			agent = 0
		}
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		endAgent()
	})
	var id, att string
	checkFor(t, 15*time.Second, 10*time.Millisecond, func() error {
		b, _ := os.ReadFile(ctl.path("agent.pid"))
		log, _ := os.ReadFile(logPath)
		if _, err := fmt.Sscan(string(b), &agent); err != nil {
			return fmt.Errorf("agent not started: %s", log)
		}
		m := leaseIDRE.FindSubmatch(log)
		p := placedRE.FindSubmatch(log)
		if m == nil || p == nil {
			return errors.New("no lease or placement announced")
		}
		id, att = string(m[1]), string(p[1])
		return nil
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	checkFor(t, 15*time.Second, 50*time.Millisecond, func() error {
		l, err := client.Get(context.Background(), id)
		if err != nil {
			return err
		}
		if l.Active() {
			return fmt.Errorf("lease %s still active", id)
		}
		return nil
	})
	v := poolJSON(t, url, co)
	if a := attemptIn(v, att); a == nil || a.Status != shard.StatusUnknown || !strings.Contains(a.Note, id) {
		t.Fatalf("crashed attempt after recovery: %+v, want unknown naming %s", a, id)
	}
	if v.Shards[0].State != shard.StateDirty {
		t.Fatalf("shard after the crash: %s, want dirty", v.Shards[0].State)
	}
	awaitShardEvent(t, url, co, func(ev lease.AuditEvent) bool {
		return ev.Type == shard.EventRecovered && ev.Owner.AttemptID == att && ev.LeaseID == id
	})
	endAgent()
	r := runFL(t, url, "--checkout", co, "--", "sh", "-c", "ls").want(t, ExitOK)
	mustContain(t, "next exclusive", r.stderr, "cleaned first", "refs/fenceline/attempts/"+att+"-worktree")
	if strings.Contains(r.stdout, "leftover") {
		t.Errorf("the next attempt sees the crashed attempt's file:\n%s", r.stdout)
	}
}

// TestShardStress: 20 concurrent runs on a pool of 3 (max sharers 3),
// path leases with overlapping and disjoint claims and exclusive ones,
// all queueing with --wait. Each agent records its entry with an atomic
// mkdir of a marker per claim top and per shard (exclusive or one of the
// sharers) and checks the others: no overlap is ever observed.
func TestShardStress(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 3, 3)
	ctl := newCtl(t)
	m := string(ctl)
	// Claims under one top overlap (a ⟷ a/x); different tops are disjoint.
	claims := []string{"a", "a/x", "b", "b/y", "c", "", "d", "a", "e", "",
		"b", "c/z", "f", "", "a/x", "g", "d/w", "", "e", "c"}
	shared := `sh=$(basename "$PWD"); me=$$
bad() { echo "$1" > ` + m + `/violation-$me; }
mkdir ` + m + `/top-$TOP 2>/dev/null || bad "claim $TOP overlaps a running attempt"
mkdir ` + m + `/$sh.s.$me || bad "marker"
[ -e ` + m + `/$sh.x ] && bad "shared beside an exclusive attempt in $sh"
n=$(ls -d ` + m + `/$sh.s.* | wc -l); [ "$n" -gt 3 ] && bad "$n sharers in $sh"
sleep 0.1
rmdir ` + m + `/$sh.s.$me ` + m + `/top-$TOP`
	exclusive := `sh=$(basename "$PWD"); me=$$
bad() { echo "$1" > ` + m + `/violation-$me; }
mkdir ` + m + `/$sh.x 2>/dev/null || bad "two exclusive attempts in $sh"
ls -d ` + m + `/$sh.s.* >/dev/null 2>&1 && bad "exclusive beside sharers in $sh"
[ -n "$(ls -A | grep -v -e '^README.md$' -e '^in$' -e '^out$' -e '^.git$')" ] && bad "leftovers in $sh: $(ls -A)"
echo junk > junk-$me
sleep 0.1
rmdir ` + m + `/$sh.x`
	var wg sync.WaitGroup
	results := make([]result, len(claims))
	start := time.Now()
	cfg := cfgOf(t)
	for i, c := range claims {
		args := []string{"--checkout", co, "--wait", "2m", "--allow-write", m, "--agent", fmt.Sprint("stress-", i)}
		script := exclusive
		if c != "" {
			top, _, _ := strings.Cut(c, "/")
			args = append(args, "--scope", c)
			script = "TOP=" + top + "\n" + shared
		}
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			var out, errOut syncBuffer
			code := run(ctx, append([]string{"--nats", url, "run"}, append(args, "--", "sh", "-c", script)...), &out, &errOut, url, cfg)
			results[i] = result{code: code, stdout: out.String(), stderr: errOut.String()}
		})
	}
	wg.Wait()
	t.Logf("20 runs on a pool of 3 took %s", time.Since(start))
	used := map[string]int{}
	for i, r := range results {
		if r.code != 0 {
			t.Errorf("run %d (%q) exited %d\n%s", i, claims[i], r.code, r.stderr)
			continue
		}
		_, sh := placed(t, r.stderr)
		used[sh]++
	}
	ents, _ := os.ReadDir(m)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "violation-") {
			b, _ := os.ReadFile(filepath.Join(m, e.Name()))
			t.Errorf("overlap observed: %s", b)
		}
	}
	if len(used) < 2 {
		t.Errorf("shards used: %v, want the pool spread", used)
	}
	v := poolJSON(t, url, co)
	for _, a := range v.Attempts {
		if a.Status != shard.StatusSucceeded {
			t.Errorf("attempt %s is %s", a.AttemptID, a.Status)
		}
	}
	if len(v.Attempts) != len(claims) {
		t.Errorf("%d attempts recorded, want %d", len(v.Attempts), len(claims))
	}
}

// TestShardExclusiveTakesEmptyShard: an exclusive run goes to an empty
// shard beside a path lease, writes everything there and commits; its
// commit is kept as a ref and the shard is clean after it.
func TestShardExclusiveTakesEmptyShard(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 2, 0)
	ctl := newCtl(t)
	shared := startRun(t, url, "--checkout", co, "--scope", "in", "--allow-write", string(ctl), "--", "sh", "-c", ctl.waiter("s", ""))
	ctl.awaitReady(t, shared, "s")
	script := `echo x > out/new && echo y > top && git add -A && git -c user.name=a -c user.email=a@a commit -qm excl && echo committed`
	r := runFL(t, url, "--checkout", co, "--", "sh", "-c", script).want(t, ExitOK)
	att, sh := placed(t, r.stderr)
	if _, s1 := placed(t, shared.errOut.String()); s1 != "shard-1" || sh != "shard-2" {
		t.Fatalf("shared in %s, exclusive in %s; want shard-1 and shard-2", s1, sh)
	}
	mustContain(t, "exclusive run", r.stdout, "committed")
	mustContain(t, "exclusive run", r.stderr, "created (a repository of its own", "shard-2 cleaned for the next attempt", "refs/fenceline/attempts/"+att)
	if out := mustGitRun(t, co, nil, "log", "-1", "--format=%s", "refs/fenceline/attempts/"+att); strings.TrimSpace(out) != "excl" {
		t.Errorf("kept ref: %q", out)
	}
	v := poolJSON(t, url, co)
	if v.Shards[1].State != shard.StateClean {
		t.Errorf("shard-2 after the exclusive attempt: %s, want clean", v.Shards[1].State)
	}
	for _, f := range []string{"top", "out/new"} {
		if exists(filepath.Join(v.Shards[1].Path, f)) == nil {
			t.Errorf("%s left in shard-2", f)
		}
	}
	ctl.stop(t, "s")
	shared.wait(t)
}

// TestShardCleanupBetweenAttempts: the next exclusive attempt sees no
// leftovers of the previous one, nor of a path lease before it; their
// work is kept as refs/fenceline/attempts/..., each cleaning audited.
func TestShardCleanupBetweenAttempts(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	base := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "HEAD"))
	dirty := `echo junk > junk; echo edit >> README.md; mkdir -p build; echo o > build/x.o
git -c user.name=a -c user.email=a@a commit -qm c1 --allow-empty; echo more > later`
	r1 := runFL(t, url, "--checkout", co, "--", "sh", "-c", dirty).want(t, ExitOK)
	att1, _ := placed(t, r1.stderr)
	look := `git status --porcelain --ignored; ls; git rev-parse HEAD`
	r2 := runFL(t, url, "--checkout", co, "--", "sh", "-c", look).want(t, ExitOK)
	if got, want := strings.Fields(r2.stdout), []string{"README.md", "in", "out", base}; strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("the second attempt sees %v, want a clean shard: %v", got, want)
	}
	if out := mustGitRun(t, co, nil, "show", "refs/fenceline/attempts/"+att1+"-worktree:later"); strings.TrimSpace(out) != "more" {
		t.Errorf("kept worktree of %s: %q", att1, out)
	}
	if out := mustGitRun(t, co, nil, "log", "-1", "--format=%s", "refs/fenceline/attempts/"+att1); strings.TrimSpace(out) != "c1" {
		t.Errorf("kept commit of %s: %q", att1, out)
	}
	// A path lease leaves its claim for the coordinator; the next
	// exclusive attempt cleans the shard first, keeping it.
	r3 := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", "echo draft > in/draft").want(t, ExitOK)
	att3, _ := placed(t, r3.stderr)
	mustContain(t, "path lease", r3.stderr, "stay as they are for the coordinator")
	r4 := runFL(t, url, "--checkout", co, "--", "sh", "-c", "ls in").want(t, ExitOK)
	mustContain(t, "exclusive after a path lease", r4.stderr, "cleaned first", "refs/fenceline/attempts/"+att3+"-worktree")
	if strings.Contains(r4.stdout, "draft") {
		t.Errorf("the exclusive attempt sees the path lease's draft: %s", r4.stdout)
	}
	awaitShardEvent(t, url, co, func(ev lease.AuditEvent) bool {
		return ev.Type == shard.EventCleaned && strings.Contains(ev.Message, "refs/fenceline/attempts/"+att3+"-worktree")
	})
}

// TestShardExhaustionWait: with the one shard busy, a run without --wait
// exits 3 at once naming the pool size and the holder; one with --wait
// queues and runs once the shard is free.
func TestShardExhaustionWait(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 1, 0)
	ctl := newCtl(t)
	first := startRun(t, url, "--checkout", co, "--agent", "first-agent", "--allow-write", string(ctl), "--", "sh", "-c", ctl.waiter("a", ""))
	ctl.awaitReady(t, first, "a")
	start := time.Now()
	r := runFL(t, url, "--checkout", co, "--", "touch", "ran").want(t, ExitConflict)
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("fail-fast took %s", took)
	}
	mustContain(t, "fail-fast", r.stderr, "pool size 1", "shard-1:", leaseOf(t, first.errOut.String()), "first-agent", "expires ")
	waiting := startRun(t, url, "--checkout", co, "--wait", "30s", "--", "sh", "-c", "echo ran")
	awaitWaiting(t, waiting)
	if strings.Contains(waiting.errOut.String(), "acquired") {
		t.Fatalf("the waiting run got a lease while the shard was busy:\n%s", waiting.errOut)
	}
	ctl.stop(t, "a")
	first.wait(t)
	if code := waiting.wait(t); code != 0 {
		t.Fatalf("waiting run exited %d\n%s", code, waiting.errOut)
	}
	mustContain(t, "waiting run", waiting.out.String(), "ran")
	mustContain(t, "waiting run", waiting.errOut.String(), "in shard-1 (exclusive, ready)")
	grantedAfter(t, url, leaseOf(t, first.errOut.String()), leaseOf(t, waiting.errOut.String()))
}

// TestShardCancelSettlesFirst: SIGTERM to run (its context cancelled)
// stops the agent; while its processes live the attempt stays running and
// the lease active; once they are gone the attempt is settled cancelled,
// before the lease is released.
func TestShardCancelSettlesFirst(t *testing.T) {
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newPool(t, url, 1, 0)
	ctl := newCtl(t)
	script := `trap '' TERM
(while [ ! -e ` + ctl.path("stop-a") + ` ]; do sleep 0.02; done) &
touch ` + ctl.path("ready-a") + `
wait`
	r := startRun(t, url, "--checkout", co, "--kill-grace", "1m", "--allow-write", string(ctl), "--", "sh", "-c", script)
	ctl.awaitReady(t, r, "a")
	att, _ := placed(t, r.errOut.String())
	id := leaseOf(t, r.errOut.String())
	r.cancel()
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(r.errOut.String(), "stopping: SIGTERM") {
			return errors.New("not stopping yet")
		}
		return nil
	})
	if a := attemptIn(poolJSON(t, url, co), att); a == nil || a.Status != shard.StatusRunning {
		t.Fatalf("attempt while its processes live: %+v, want running", a)
	}
	if l, err := client.Get(context.Background(), id); err != nil || !l.Active() {
		t.Fatalf("lease while the agent's processes live: %+v, %v", l, err)
	}
	ctl.stop(t, "a")
	r.wait(t)
	a := attemptIn(poolJSON(t, url, co), att)
	l, err := client.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if a == nil || a.Status != shard.StatusCancelled || a.SettledAt.IsZero() || l.Status != lease.StatusReleased || l.EndedAt.Before(a.SettledAt) {
		t.Fatalf("attempt %+v, lease %s ended %s: want cancelled, settled before the release", a, l.Status, l.EndedAt)
	}
}
