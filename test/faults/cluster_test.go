//go:build integration

package faults

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

const clusterRepo = "github.com/acme/faults"

// ledger is the load's own bookkeeping: the leases it was granted, which
// of them it abandoned, which are live (revoke candidates), and counts.
// What the clients were told (every acknowledged grant, release, revoke,
// refusal, and the abandoned leases) goes into the History too.
type ledger struct {
	h         *History
	mu        sync.Mutex
	granted   map[string]*lease.Lease // by lease id
	abandoned map[string]bool         // never renewed nor released: must be reclaimed
	live      []string                // granted, not yet ended by its client: revoke candidates
	notFound  []notFound              // requests about acknowledged leases answered "not found"
	ops       map[string]int
}

// notFound is a request about an acknowledged lease (an operator's
// revoke, or its holder's renewal or release) that the service answered
// with "lease not found", and when it was sent. A repo remembers an ended
// lease for a while (endedKeep, and at most its last maxEnded): one its
// holder could not reach the bus for
// (its node paused past the lease's TTL) ends, and may be forgotten by
// the time the holder asks again. Each is judged against the audit at the
// end: the lease must have ended before the request was sent.
type notFound struct {
	op  string
	id  string
	at  time.Time
	err error
}

// forgotten notes a request about an acknowledged lease answered "not
// found" (see notFound).
func (l *ledger) forgotten(t *testing.T, op, id string, sent time.Time, err error) {
	l.mu.Lock()
	l.notFound = append(l.notFound, notFound{op, id, sent, err})
	l.mu.Unlock()
	l.h.Incident(op + "-not-found")
	t.Logf("incident: %s %s: %v", op, id, err)
}

func newLedger(h *History) *ledger {
	return &ledger{h: h, granted: map[string]*lease.Lease{}, abandoned: map[string]bool{}, ops: map[string]int{}}
}

func (l *ledger) count(k string) {
	l.mu.Lock()
	l.ops[k]++
	l.mu.Unlock()
}

func (l *ledger) grants() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.granted)
}

// retryUnavailable runs op until it is not ErrUnavailable (the service
// could not write or answer during a fault; every request is idempotent
// or carries its request id), for at most 45 s.
func retryUnavailable(ctx context.Context, stats *atomic.Int64, op func() error) error {
	deadline := time.Now().Add(45 * time.Second)
	for {
		err := op()
		if !errors.Is(err, lease.ErrUnavailable) || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		stats.Add(1)
		select { // spacing retries
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestClusterAuditThroughFaults runs lease traffic and guarded agents
// against a 3-node cluster of real fenceline processes, each with its lease
// service, plus a lease service process of its own. Each round it pauses
// (SIGSTOP, 3 s, SIGCONT) the lease log's stream leader, then the audit
// stream's leader, then kills (SIGKILL) the extra service and the log's
// leader, then restarts them; right after each of the four faults (the
// SIGCONT, the kills, the restarts) it revokes each current agent's lease
// with "fenceline lease revoke" and grants the same claim to a new agent
// at once (every second round once the agents' writes land again after
// the fault, so the revokes reach the holders as change notices), while the
// revoked agents go on trying to write for 3 s.
//
// The agents are "fenceline run" processes on the cluster (every node's
// URL, the cluster's credentials) in two lineages, as in the single-bus
// run: one runs a child that appends to a file through the file guard and
// inserts rows through the Postgres fence, the other (an exclusive
// workspace) pushes a commit about every 20 ms through the git fence.
// The load is 4 clients acquiring, renewing, releasing and abandoning
// leases on 15 overlapping claims, and an operator revoking live ones.
//
// Then every write that landed is read back from the file and the table,
// the audit stream is read from its leader, and the checks run over every
// acknowledged grant: no two overlapping grants valid at once; no write
// landed more than 1 s after its lease's revoke returned or the next grant
// of its claim; fences unique and rising, and each write carrying its
// lease's; every acknowledged grant, release, revoke and refusal, and the
// end of every abandoned lease, in the audit exactly once (AuditCheck). The
// audit, replayed in its order per repo, must show fences rising and no
// overlapping leases active at once, and form one chain over the lease log.
//
// Environment: FENCELINE_FAULTS_CLUSTER_ROUNDS (default 1) repeats the
// fault sequence, FENCELINE_FAULTS_PAUSE_HOLDER=0 leaves out the fifth
// and sixth faults of each round (SIGSTOP of the node the run agent's
// holder is connected to, the revokes sent during the pause, SIGCONT after
// 3 s at the earliest; then that node cut off from the others the same
// way), FENCELINE_FAULTS_SEED fixes the load's randomness,
// FENCELINE_FAULTS_BIN runs a fenceline binary built elsewhere (another
// version) instead of building this one, FENCELINE_FAULTS_LOGDIR names a
// directory that keeps everything each process printed (a failure logs
// heads and tails, then every process's warnings merged in time order).
// scripts/faults-cluster.sh runs the long form.
func TestClusterAuditThroughFaults(t *testing.T) {
	rounds := 1
	if v := os.Getenv("FENCELINE_FAULTS_CLUSTER_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 1000 {
			t.Fatalf("FENCELINE_FAULTS_CLUSTER_ROUNDS=%q: want 1 to 1000", v)
		}
		rounds = n
	}
	seed := uint64(time.Now().UnixNano())
	if v := os.Getenv("FENCELINE_FAULTS_SEED"); v != "" {
		s, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			t.Fatalf("FENCELINE_FAULTS_SEED=%q: %v", v, err)
		}
		seed = s
	}
	pauseHolder := os.Getenv("FENCELINE_FAULTS_PAUSE_HOLDER") != "0"
	t.Logf("seed %d (FENCELINE_FAULTS_SEED=%d repeats the load's choices), %d rounds", seed, seed, rounds)
	started := time.Now()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rounds)*3*time.Minute+5*time.Minute)
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
	bin := os.Getenv("FENCELINE_FAULTS_BIN")
	if bin == "" {
		bin = BuildBinary(t)
	}
	cl := StartCluster(t, bin, 3)
	svc := cl.AddService("svc")
	ready := time.Since(started)
	t.Logf("binary built, cluster and services ready after %s", ready.Round(time.Millisecond))
	opNC := bustest.Connect(t, cl.URLs())
	js, err := leasebus.JetStream(context.Background(), opNC)
	if err != nil {
		t.Fatal(err)
	}

	h := NewHistory()
	led := newLedger(h)
	var unavailable atomic.Int64
	var stop atomic.Bool
	var wg sync.WaitGroup
	paths := []string{"a", "b", "c", "d", "e", "f", "g", "h", "i", "j", "k", "l", "a/x", "b/y", "c/z"}
	newClient := func() *leasebus.Client {
		c := leasebus.NewClient(bustest.Connect(t, cl.URLs()))
		c.Timeout = 2 * time.Second
		return c
	}
	const workers = 4
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			c := newClient()
			for op := 0; !stop.Load() && ctx.Err() == nil; op++ {
				claim, err := scope.New([]string{paths[rng.IntN(len(paths))]}, false, nil)
				if err != nil {
					t.Error(err)
					return
				}
				abandon := rng.IntN(10) == 0
				ttl := 15 * time.Second
				if abandon {
					ttl = 2 * time.Second
				}
				att := fmt.Sprintf("att-%d-%d", w, op)
				req := leasebus.AcquireRequest{Repo: clusterRepo, Scope: claim, TTL: lease.Duration(ttl),
					Owner:     lease.Owner{TaskID: "faults", AgentID: fmt.Sprintf("agent-%d", w), AttemptID: att},
					RequestID: leasebus.NewRequestID()}
				cred := leasebus.NewCredential()
				var l *lease.Lease
				err = retryUnavailable(ctx, &unavailable, func() (err error) {
					l, err = c.Acquire(ctx, req, cred)
					return err
				})
				switch {
				case errors.Is(err, lease.ErrConflict):
					led.h.Refused(att)
					led.count("refused")
					continue
				case errors.Is(err, lease.ErrUnavailable) || ctx.Err() != nil:
					led.count("gave-up")
					continue // its outcome is unknown: not acknowledged
				case err != nil:
					t.Errorf("acquire %s: %v", claim, err)
					return
				}
				led.h.Grant(Grant{LeaseID: l.LeaseID, Repo: l.Repo, Claim: l.Scope, Fence: l.Fence, GrantedAt: l.AcquiredAt})
				led.mu.Lock()
				led.granted[l.LeaseID] = l
				if abandon {
					led.abandoned[l.LeaseID] = true
					led.h.Abandoned(l.LeaseID)
				} else {
					led.live = append(led.live, l.LeaseID)
				}
				led.mu.Unlock()
				led.count("grant")
				if abandon {
					continue // the sweeper must reclaim it
				}
				if rng.IntN(2) == 0 {
					var sent time.Time
					err := retryUnavailable(ctx, &unavailable, func() error {
						sent = time.Now()
						r, err := c.Renew(ctx, leasebus.RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version, RenewID: "renew-" + l.LeaseID})
						if err == nil {
							l = r
						}
						return err
					})
					switch {
					case err == nil:
						led.count("renew")
					case errors.Is(err, lease.ErrNotFound):
						led.forgotten(t, "renew", l.LeaseID, sent, err)
					case !errors.Is(err, lease.ErrLeaseLost) && !errors.Is(err, lease.ErrUnavailable):
						t.Errorf("renew %s: %v", l.LeaseID, err)
						return
					}
				}
				var r *lease.Lease
				var sent time.Time
				err = retryUnavailable(ctx, &unavailable, func() (err error) {
					sent = time.Now()
					r, err = c.Release(ctx, l.LeaseID, cred)
					return err
				})
				led.mu.Lock()
				if i := slices.Index(led.live, l.LeaseID); i >= 0 {
					led.live = slices.Delete(led.live, i, i+1)
				}
				led.mu.Unlock()
				switch {
				case err == nil && r.Status == lease.StatusReleased:
					led.h.Released(l.LeaseID, r.EndedAt)
				case err == nil:
					led.h.Ended(l.LeaseID, r.EndedAt) // revoked meanwhile
				}
				switch {
				case err == nil:
					led.count("release")
				case errors.Is(err, lease.ErrNotFound):
					led.forgotten(t, "release", l.LeaseID, sent, err)
				case !errors.Is(err, lease.ErrUnavailable):
					t.Errorf("release %s: %v", l.LeaseID, err)
					return
				}
			}
		})
	}
	// An operator revoking live leases now and then.
	wg.Go(func() {
		rng := rand.New(rand.NewPCG(seed, 99))
		c := newClient()
		for !stop.Load() && ctx.Err() == nil {
			select {
			case <-ctx.Done():
			case <-time.After(time.Duration(50+rng.IntN(100)) * time.Millisecond): // spacing revokes
			}
			led.mu.Lock()
			var id string
			if len(led.live) > 0 {
				id = led.live[rng.IntN(len(led.live))]
			}
			led.mu.Unlock()
			if id == "" {
				continue
			}
			var r *lease.Lease
			var sent time.Time
			err := retryUnavailable(ctx, &unavailable, func() (err error) {
				sent = time.Now()
				r, err = c.Revoke(ctx, id, "fault harness")
				return err
			})
			switch {
			case errors.Is(err, lease.ErrNotFound):
				led.forgotten(t, "revoke", id, sent, err) // judged against the audit at the end
				continue
			case err != nil:
				if !errors.Is(err, lease.ErrUnavailable) {
					t.Errorf("revoke %s: %v", id, err)
				}
				continue
			}
			if r.Status == lease.StatusRevoked {
				led.h.Revoked(id, time.Now(), r.EndedAt)
				led.count("revoke")
			}
		}
	})

	progress := func(n int, within time.Duration) {
		t.Helper()
		want := led.grants() + n
		testutil.CheckFor(t, within, 20*time.Millisecond, func() error {
			if g := led.grants(); g < want {
				return fmt.Errorf("%d acknowledged grants, waiting for %d", g, want)
			}
			return nil
		})
	}
	hold := func(d time.Duration) { // a fault's duration, not a wait for state
		select {
		case <-ctx.Done():
		case <-time.After(d):
		}
	}
	leader := func(stream string) *Node {
		t.Helper()
		var p *Node
		testutil.CheckFor(t, 20*time.Second, 50*time.Millisecond, func() error {
			sctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			var err error
			p, err = cl.StreamLeader(sctx, js, stream)
			return err
		})
		return p
	}

	// The guarded agents: "fenceline run" on the cluster (every node's
	// URL, the cluster's credentials), a child appending to a file through
	// the file guard and inserting rows through the Postgres fence.
	env := &Env{Bin: bin, StateHome: t.TempDir(), BusURL: cl.URLs(), Extra: []string{"FENCELINE_CREDS=" + cl.creds}, FenceSecrets: cl.FenceSecrets}
	secret := preparePG(ctx, t, env, pg, runTable)
	crew := newCrew(ctx, t, env, h, runLineage(ctx, t, env, h, pg, secret, newCheckout(t, "data"), "run", "data", runTable),
		gitLineage(ctx, t, env, h))

	progress(40, 30*time.Second)
	for round := range rounds {
		// Every second round the revokes wait until the agents' writes
		// land again after the fault; otherwise they go at once.
		settle := func(p *Node) {
			t.Helper()
			if round%2 == 1 {
				since := time.Now()
				crew.waitLanded(since)
				t.Logf("round %d: the agents write again after the fault on %s", round, p.Name)
			}
		}
		crew.waitLanded(time.Time{})
		p := leader(leasebus.LogStream)
		t.Logf("round %d: SIGSTOP %s, leader of %s, at %d grants", round, p.Name, leasebus.LogStream, led.grants())
		cl.Pause(p)
		h.Fault("pause-log-leader")
		hold(3 * time.Second)
		cl.Resume(p)
		at := time.Now()
		settle(p)
		crew.revokeAll("pause-log-leader", fmt.Sprintf("round %d, right after SIGCONT of %s (log leader)", round, p.Name), at)
		progress(30, 45*time.Second)
		cl.WaitWhole(p, 60*time.Second) // one fault at a time

		crew.waitLanded(time.Time{})
		p = leader(leasebus.AuditStream)
		t.Logf("round %d: SIGSTOP %s, leader of %s, at %d grants", round, p.Name, leasebus.AuditStream, led.grants())
		cl.Pause(p)
		h.Fault("pause-audit-leader")
		hold(3 * time.Second)
		cl.Resume(p)
		at = time.Now()
		settle(p)
		crew.revokeAll("pause-audit-leader", fmt.Sprintf("round %d, right after SIGCONT of %s (audit leader)", round, p.Name), at)
		progress(30, 45*time.Second)
		cl.WaitWhole(p, 60*time.Second)

		crew.waitLanded(time.Time{})
		t.Logf("round %d: SIGKILL service process %s", round, svc.Name)
		cl.Kill(svc)
		h.Fault("kill-service")
		p = leader(leasebus.LogStream)
		t.Logf("round %d: SIGKILL %s, leader of %s", round, p.Name, leasebus.LogStream)
		cl.Kill(p)
		h.Fault("kill-node")
		at = time.Now()
		settle(p)
		crew.revokeAll("kill-node", fmt.Sprintf("round %d, right after SIGKILL of %s and of %s (log leader)", round, svc.Name, p.Name), at)
		progress(20, 45*time.Second)
		crew.waitLanded(time.Time{})
		cl.Restart(p, 60*time.Second)
		cl.Restart(svc, 60*time.Second)
		at = time.Now()
		settle(p)
		crew.revokeAll("restart", fmt.Sprintf("round %d, right after %s and %s restarted", round, p.Name, svc.Name), at)
		progress(20, 45*time.Second)
		// The restarted node catches up before the next fault: pausing
		// another while it still does leaves streams with one current
		// replica of three, which no R3 cluster serves on.
		cl.WaitWhole(p, 60*time.Second)

		if pauseHolder {
			crew.waitLanded(time.Time{})
			run := crew.cur[0].procs[0]
			p, err := cl.NodeOf(run.Pid())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("round %d: SIGSTOP %s, the node %s hears the bus through", round, p.Name, run.Name)
			cl.Pause(p)
			paused := time.Now()
			h.Fault("pause-holder-node")
			// The revokes go out during the pause; the claims are granted
			// again after it (a run started now may dial the paused node).
			crew.revoke("pause-holder-node", fmt.Sprintf("round %d, right after SIGSTOP of %s (%s's node)", round, p.Name, run.Name), paused)
			hold(3*time.Second - time.Since(paused))
			cl.Resume(p)
			t.Logf("round %d: SIGCONT %s after %s", round, p.Name, time.Since(paused).Round(time.Millisecond))
			crew.regrant()
			progress(20, 45*time.Second)
			cl.WaitWhole(p, 60*time.Second)

			// The same node cut off from the others instead of paused: its
			// server goes on answering the run's pings, the revokes go
			// through on the other side, and only the lease service's
			// silence can stop the run in time.
			crew.waitLanded(time.Time{})
			run = crew.cur[0].procs[0]
			if p, err = cl.NodeOf(run.Pid()); err != nil {
				t.Fatal(err)
			}
			t.Logf("round %d: partition %s, the node %s hears the bus through, from the others", round, p.Name, run.Name)
			cl.Isolate(p, true)
			cut := time.Now()
			h.Fault("partition-holder-node")
			// The operator revokes on the other side (a CLI that dialled the
			// cut-off node would wait there for a service that cannot write).
			majority := *env
			majority.BusURL = cl.URLsBut(p)
			crew.env = &majority
			crew.revoke("partition-holder-node", fmt.Sprintf("round %d, right after %s (%s's node) was cut off", round, p.Name, run.Name), cut)
			crew.env = env
			hold(3*time.Second - time.Since(cut))
			cl.Isolate(p, false)
			t.Logf("round %d: healed %s after %s", round, p.Name, time.Since(cut).Round(time.Millisecond))
			cl.WaitStreams(p, 60*time.Second)
			crew.regrant()
			progress(20, 45*time.Second)
			cl.WaitWhole(p, 60*time.Second)
		}
	}
	stop.Store(true)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	loadDone := time.Since(started) - ready
	crew.finish()

	// The abandoned leases must be reclaimed (TTL 2 s); then the audit must
	// be complete. AwaitAudit polls: a reclaim waits for its deadline.
	repos := map[string]bool{}
	for _, g := range h.Grants() {
		repos[g.Repo] = true
	}
	readAll := func(ctx context.Context) ([]lease.AuditEvent, error) {
		var all []lease.AuditEvent
		for _, repo := range sortedKeys(repos) {
			evs, err := readAuditFromLeader(ctx, opNC, repo)
			if err != nil {
				return nil, err
			}
			all = append(all, evs...)
		}
		return all, nil
	}
	if err := AwaitAudit(ctx, h, 30*time.Second, readAll); err != nil {
		t.Errorf("read the audit from the stream leader: %v", err)
	}
	// When the leases nobody saw end (the abandoned ones, reclaimed by a
	// sweeper) ended, for the overlap check: the service's time on the
	// audit event that ends them.
	h.EndsFromAudit()
	c := leasebus.NewClient(opNC)
	rep := Verify(h, append(StandardChecks(bound), AuditCheck())...)
	led.mu.Lock()
	for _, nf := range led.notFound {
		if msg, live := liveAt(h, nf.id, nf.at); live {
			t.Errorf("a %s of %s sent at %s was answered %q, while %s", nf.op, nf.id, stamp(nf.at), nf.err, msg)
		} else {
			t.Logf("a %s of %s sent at %s was answered %q: %s", nf.op, nf.id, stamp(nf.at), nf.err, msg)
		}
	}
	t.Logf("%s of load under faults, %s in all: acknowledged %v; %d unavailable answers retried; revokes right after faults %v",
		loadDone.Round(time.Millisecond), time.Since(started).Round(time.Millisecond), led.ops, unavailable.Load(), crew.revokes)
	led.mu.Unlock()
	t.Logf("faults: %s", rep)
	for _, v := range rep.Violations {
		t.Error(v)
	}
	if len(rep.Violations) > 0 {
		// Tell a lost event from an operation that never happened: ask
		// the service what became of each abandoned lease.
		led.mu.Lock()
		for id := range led.abandoned {
			if l, err := c.Get(ctx, id); err != nil || l.Active() {
				t.Logf("abandoned %s: %+v %v", id, l, err)
			}
		}
		led.mu.Unlock()
	}
	want := 4 * rounds * len(crew.lines)
	for _, b := range []string{"run/file", "run/postgres", "git/push"} {
		if rep.Writes[b] == 0 {
			t.Errorf("no %s writes recorded: %s", b, rep)
		}
	}
	if pauseHolder {
		want += 2 * rounds * len(crew.lines)
	}
	if got := crew.revokes["pause-log-leader"] + crew.revokes["pause-audit-leader"] + crew.revokes["kill-node"] + crew.revokes["restart"] + crew.revokes["pause-holder-node"] + crew.revokes["partition-holder-node"]; got != want {
		t.Errorf("want %d revokes right after faults, got %v", want, crew.revokes)
	}
	for _, repo := range sortedKeys(repos) {
		// Fences are per repo: replay each repo's events on their own.
		evs, err := readAuditFromLeader(ctx, opNC, repo)
		if err != nil {
			t.Fatal(err)
		}
		if err := checkReplay(evs); err != nil {
			t.Errorf("audit replay of %s:\n%v", repo, err)
		}
		n, err := checkChain(ctx, js, repo)
		if err != nil {
			t.Errorf("audit chain of %s: %v", repo, err)
		}
		t.Logf("the lease service's audit of %s is a chain of %d messages", repo, n)
	}
}

// checkChain reads the lease service's audit messages of a repo and checks
// that they form one chain over the lease log: each carries the events of
// the log records after the previous one's LogSeq up to its own, so no
// record's events can be in two messages.
func checkChain(ctx context.Context, js jetstream.JetStream, repo string) (int, error) {
	st, err := js.Stream(ctx, leasebus.AuditStream)
	if err != nil {
		return 0, err
	}
	subj := leasebus.AuditSubject + "." + leasebus.RepoKey(repo) + "." + lease.BoundaryLease
	var prev uint64
	n := 0
	for seq := uint64(1); ; {
		m, err := st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subj))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return n, nil
		}
		if err != nil {
			return n, err
		}
		var b struct {
			LogSeq uint64 `json:"logSeq"`
			From   uint64 `json:"from"`
		}
		if err := json.Unmarshal(m.Data, &b); err != nil {
			return n, fmt.Errorf("audit message %d: %w", m.Sequence, err)
		}
		if b.From != prev || b.LogSeq <= b.From {
			return n, fmt.Errorf("audit message %d covers log records (%d, %d], after a message up to %d", m.Sequence, b.From, b.LogSeq, prev)
		}
		prev = b.LogSeq
		n++
		seq = m.Sequence + 1
	}
}

// checkReplay replays the service's events in audit order: fences of
// grants strictly rise, and no grant overlaps a lease still active.
func checkReplay(evs []lease.AuditEvent) error {
	active := map[string]scope.Claim{}
	var last uint64
	var out []string
	for _, ev := range evs {
		if ev.Boundary != lease.BoundaryLease || ev.LeaseID == "" {
			continue
		}
		switch ev.Type {
		case lease.EventGrant:
			if ev.Fence <= last {
				out = append(out, fmt.Sprintf("grant %s fence %d after fence %d", ev.LeaseID, ev.Fence, last))
			}
			last = max(last, ev.Fence)
			for id, c := range active {
				if c.Overlaps(ev.Scope) {
					out = append(out, fmt.Sprintf("grant %s %s overlaps active %s %s", ev.LeaseID, ev.Scope, id, c))
				}
			}
			active[ev.LeaseID] = ev.Scope
		case lease.EventRelease, lease.EventRevoked, lease.EventReclaimed, lease.EventExpired:
			delete(active, ev.LeaseID)
		}
	}
	if len(out) > 0 {
		if len(out) > 20 {
			out = append(out[:20], fmt.Sprintf("… %d more", len(out)-20))
		}
		return errors.New(strings.Join(out, "\n"))
	}
	return nil
}

// liveAt says, from the audit recorded in h, whether lease id was granted
// before at and not ended by then, and what the audit shows of it.
func liveAt(h *History, id string, at time.Time) (string, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	var granted, ended time.Time
	var end string
	for _, ev := range h.audit {
		if ev.LeaseID != id || ev.Boundary != lease.BoundaryLease {
			continue
		}
		switch {
		case ev.Type == lease.EventGrant:
			granted = ev.Time
		case slices.Contains(endEvents, ev.Type):
			ended, end = ev.Time, ev.Type
		}
	}
	msg := fmt.Sprintf("the audit shows it granted at %s, ended (%s) at %s", stamp(granted), end, stamp(ended))
	return msg, !granted.IsZero() && granted.Before(at) && (ended.IsZero() || ended.After(at))
}
