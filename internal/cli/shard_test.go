package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
)

// newPool makes a checkout with a declared pool of size shards.
func newPool(t *testing.T, url string, size, sharers int) string {
	t.Helper()
	co := newCheckout(t, "")
	fl(t, "--nats", url, "shard", "pool", "--checkout", co, "--size", strconv.Itoa(size), "--max-sharers", strconv.Itoa(sharers)).want(t, ExitOK)
	return co
}

// ctlDir is a directory agents may write (--allow-write) to say they are
// ready and where the test says stop.
type ctlDir string

func newCtl(t *testing.T) ctlDir {
	d, err := filepath.EvalSymlinks(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return ctlDir(d)
}

func (c ctlDir) path(name string) string { return filepath.Join(string(c), name) }

// waiter is an agent script that says it is ready, runs more, then waits
// for stop-<name>.
func (c ctlDir) waiter(name, more string) string {
	return fmt.Sprintf("touch %s; %s\nwhile [ ! -e %s ]; do sleep 0.02; done", c.path("ready-"+name), more, c.path("stop-"+name))
}

func (c ctlDir) stop(t *testing.T, name string) {
	t.Helper()
	if err := os.WriteFile(c.path("stop-"+name), nil, 0o644); err != nil {
		t.Fatal(err)
	}
}

func (c ctlDir) awaitReady(t *testing.T, r *aRun, name string) {
	t.Helper()
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		return exists(c.path("ready-" + name))
	})
}

var placedRE = regexp.MustCompile(`attempt (att_[a-z0-9]+) in (shard-\d+) `)

// placed returns the attempt id and shard a run announced.
func placed(t *testing.T, stderr string) (attempt, shardID string) {
	t.Helper()
	m := placedRE.FindStringSubmatch(stderr)
	if m == nil {
		t.Fatalf("no placement announced:\n%s", stderr)
	}
	return m[1], m[2]
}

// poolJSON is shard list --json for one repo.
func poolJSON(t *testing.T, url, co string) shard.View {
	t.Helper()
	r := fl(t, "--nats", url, "shard", "list", "--repo", co, "--json").want(t, ExitOK)
	var vs []shard.View
	if err := json.Unmarshal([]byte(r.stdout), &vs); err != nil || len(vs) != 1 {
		t.Fatalf("decode shard list --json: %v\n%s", err, r.stdout)
	}
	return vs[0]
}

func attemptIn(v shard.View, id string) *shard.Attempt {
	for _, a := range v.Attempts {
		if a.AttemptID == id {
			return a
		}
	}
	return nil
}

// awaitShardEvent waits for an audit event at the shard boundary.
func awaitShardEvent(t *testing.T, url, repo string, match func(lease.AuditEvent) bool) lease.AuditEvent {
	t.Helper()
	_, nc := busClient(t, url)
	var found lease.AuditEvent
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(context.Background(), nc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Boundary == shard.BoundaryShard && match(ev) {
				found = ev
				return nil
			}
		}
		return fmt.Errorf("no matching shard event among %d", len(evs))
	})
	return found
}

// TestShardPathLeasesShareAShard: disjoint path leases share one shard
// (sharers go where sharers are), --max-sharers sends the next to another
// shard, and with every shard busy an exclusive run fails fast with exit 3
// naming the pool size and who holds each shard.
func TestShardPathLeasesShareAShard(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newPool(t, url, 2, 3)
	ctl := newCtl(t)
	runs := map[string]*aRun{}
	for _, name := range []string{"a", "b", "c", "d"} {
		runs[name] = startRun(t, url, "--checkout", co, "--scope", "in/"+name, "--allow-write", string(ctl), "--", "sh", "-c", ctl.waiter(name, ""))
		ctl.awaitReady(t, runs[name], name) // one at a time: placement order is then known
	}
	shards := map[string]string{}
	for name, r := range runs {
		_, shards[name] = placed(t, r.errOut.String())
	}
	if shards["a"] != "shard-1" || shards["b"] != "shard-1" || shards["c"] != "shard-1" || shards["d"] != "shard-2" {
		t.Fatalf("placements %v: want a, b, c sharing shard-1 (max sharers 3) and d in shard-2", shards)
	}
	r := runFL(t, url, "--checkout", co, "--", "sh", "-c", "touch ran").want(t, ExitConflict)
	mustContain(t, "exhausted run", r.stderr, "no shard of the pool of "+co, "pool size 2", "max sharers 3", "shard-1:", "shard-2:",
		leaseOf(t, runs["a"].errOut.String()), leaseOf(t, runs["d"].errOut.String()), "expires ", "--wait")
	// An overlapping claim never runs beside a, in any shard.
	r = runFL(t, url, "--checkout", co, "--scope", "in/a/deeper", "--", "touch", "ran").want(t, ExitConflict)
	mustContain(t, "overlapping run", r.stderr, leaseOf(t, runs["a"].errOut.String()), "in/a")
	// The pool does not shrink below an occupied shard.
	r = fl(t, "--nats", url, "shard", "pool", "--checkout", co, "--size", "1").want(t, ExitConflict)
	mustContain(t, "shrink", r.stderr, "shard-2", leaseOf(t, runs["d"].errOut.String()))
	v := poolJSON(t, url, co)
	if n := len(v.Shards[0].Occupants); n != 3 {
		t.Errorf("shard-1 has %d occupants, want 3", n)
	}
	for name := range runs {
		ctl.stop(t, name)
		if code := runs[name].wait(t); code != 0 {
			t.Fatalf("run %s exited %d\n%s", name, code, runs[name].errOut)
		}
	}
	v = poolJSON(t, url, co)
	if len(v.Attempts) != 4 {
		t.Fatalf("%d attempts, want 4", len(v.Attempts))
	}
	for _, a := range v.Attempts {
		if a.Status != shard.StatusSucceeded || a.Mode != shard.ModeShared || a.ExitCode == nil || *a.ExitCode != 0 || len(a.Leases) != 1 {
			t.Errorf("attempt %+v", a)
		}
	}
	if v.Shards[0].State != shard.StateDirty || len(v.Shards[0].Occupants) != 0 {
		t.Errorf("shard-1 after its sharers: %+v, want dirty and empty", v.Shards[0])
	}
	if _, err := os.Stat(filepath.Join(v.Shards[0].Path, "in", "a")); err != nil {
		t.Errorf("a sharer's claim is not in its shard: %v", err)
	}
	text := fl(t, "--nats", url, "shard", "list").want(t, ExitOK).stdout
	mustContain(t, "shard list", text, "pool "+co+": 2 shards", "shard-1  dirty", "succeeded")
}

// awaitWaiting waits until a run says it queues for a lease.
func awaitWaiting(t *testing.T, r *aRun) {
	t.Helper()
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.errOut.String(), "waiting up to") {
			return errors.New("not waiting yet")
		}
		return nil
	})
}

// grantedAfter checks that lease later was granted only after lease
// earlier ended.
func grantedAfter(t *testing.T, url, earlier, later string) {
	t.Helper()
	client, _ := busClient(t, url)
	e, err := client.Get(context.Background(), earlier)
	if err != nil {
		t.Fatal(err)
	}
	l, err := client.Get(context.Background(), later)
	if err != nil {
		t.Fatal(err)
	}
	if e.Active() || l.AcquiredAt.Before(e.EndedAt) {
		t.Errorf("lease %s granted %s, but %s (%s) ended %s", later, l.AcquiredAt.Format(time.StampMicro), earlier, e.Status, e.EndedAt.Format(time.StampMicro))
	}
}

// startRunCmd starts "fenceline --nats url ARGS" in-process, for any
// subcommand; the test's end cancels it and waits for it to stop.
func startRunCmd(t *testing.T, url string, args ...string) *aRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &aRun{cancel: cancel, done: make(chan int, 1), out: &syncBuffer{}, errOut: &syncBuffer{}}
	cfg := cfgOf(t)
	go func() {
		r.done <- run(ctx, append([]string{"--nats", url}, args...), r.out, r.errOut, url, cfg)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			t.Errorf("fenceline %s did not stop", args[0])
		}
	})
	return r
}

// TestShardUsage: wrong shard command lines are exit 2, and commit
// capacity needs a pool and one of its shards.
func TestShardUsage(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"shard", "pool", "--size", "2"}, "--checkout is required"},
		{[]string{"shard", "pool", "--checkout", co}, "--size 0"},
		{[]string{"shard", "pool", "--checkout", co, "--size", "2", "--max-sharers", "-1"}, "negative"},
		{[]string{"shard", "commit", "--checkout", co, "--shard", "shard-1", "--", "true"}, "exactly one of --serialized"},
		{[]string{"shard", "commit", "--checkout", co, "--serialized", "--", "true"}, "--shard is required"},
		{[]string{"shard", "commit", "--checkout", co, "--shard", "shard-1", "--serialized", "--", "true"}, "no shard pool is declared"},
	} {
		r := fl(t, append([]string{"--nats", url}, tc.args...)...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("%s: exit %d %q, want %d mentioning %q", strings.Join(tc.args, " "), r.code, r.stderr, ExitUsage, tc.want)
		}
	}
	fl(t, "--nats", url, "shard", "pool", "--checkout", co, "--size", "1").want(t, ExitOK)
	r := fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-9", "--serialized", "--", "true").want(t, ExitUsage)
	mustContain(t, "unknown shard", r.stderr, "shard-9", "shard-1")
	r = fl(t, "--nats", url, "shard", "commit", "--checkout", co, "--shard", "shard-1", "--serialized", "--", "true").want(t, ExitError)
	mustContain(t, "absent shard", r.stderr, "no worktree yet")
	if out := fl(t, "--nats", url, "shard", "list", "--repo", co).want(t, ExitOK).stdout; !strings.Contains(out, "shard-1  absent") || !strings.Contains(out, "attempts: none") {
		t.Errorf("shard list after a failed commit attempt:\n%s", out)
	}
}
