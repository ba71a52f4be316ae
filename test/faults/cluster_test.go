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

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/leasebus"
)

const clusterRepo = "github.com/acme/faults"

// ledger is what the clients were told: every acknowledged grant, release,
// revoke and refusal, and the leases abandoned to the sweeper.
type ledger struct {
	mu        sync.Mutex
	granted   map[string]*leasebus.Lease // by lease id
	released  map[string]bool
	revoked   map[string]bool
	abandoned map[string]bool // never renewed nor released: must be reclaimed
	refused   map[string]bool // attempt ids whose acquire was refused for a conflict
	live      []string        // granted, not yet ended by its client: revoke candidates
	faults    map[string]int
	ops       map[string]int
}

func newLedger() *ledger {
	return &ledger{granted: map[string]*leasebus.Lease{}, released: map[string]bool{}, revoked: map[string]bool{},
		abandoned: map[string]bool{}, refused: map[string]bool{}, faults: map[string]int{}, ops: map[string]int{}}
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
		if !errors.Is(err, leasebus.ErrUnavailable) || time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		stats.Add(1)
		select { // spacing retries
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// TestClusterAuditThroughFaults runs lease traffic against a 3-node
// cluster of real fenceline processes, each with its lease service, plus a
// lease service process of its own, while it pauses (SIGSTOP) the lease
// log's stream leader and the audit stream's leader, and kills (SIGKILL)
// the extra service and a node, then restarts them. Then every
// acknowledged grant, release, revoke and refusal, and every reclaim of an
// abandoned lease, must be in the audit stream exactly once; replayed in
// its order the audit must show fences unique and rising and never two
// overlapping leases active at once.
//
// Environment: FENCELINE_FAULTS_CLUSTER_ROUNDS (default 1) repeats the
// fault sequence, FENCELINE_FAULTS_SEED fixes the load's randomness,
// FENCELINE_FAULTS_BIN runs a fenceline binary built elsewhere (another
// version) instead of building this one. scripts/faults-cluster.sh runs the
// long form.
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
	t.Logf("seed %d (FENCELINE_FAULTS_SEED=%d repeats the load's choices), %d rounds", seed, seed, rounds)
	started := time.Now()

	bin := os.Getenv("FENCELINE_FAULTS_BIN")
	if bin == "" {
		bin = BuildBinary(t)
	}
	cl := StartCluster(t, bin, 3)
	svc := cl.AddService("svc")
	ready := time.Since(started)
	t.Logf("binary built, cluster and services ready after %s", ready.Round(time.Millisecond))

	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rounds)*2*time.Minute+time.Minute)
	defer cancel()
	opNC := bustest.Connect(t, cl.URLs())
	js, err := jetstream.New(opNC)
	if err != nil {
		t.Fatal(err)
	}

	led := newLedger()
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
				req := leasebus.AcquireRequest{Repo: clusterRepo, Scope: claim, TTL: leasebus.Duration(ttl),
					Owner:     leasebus.Owner{TaskID: "faults", AgentID: fmt.Sprintf("agent-%d", w), AttemptID: att},
					RequestID: leasebus.NewRequestID()}
				cred := leasebus.NewCredential()
				var l *leasebus.Lease
				err = retryUnavailable(ctx, &unavailable, func() (err error) {
					l, err = c.Acquire(ctx, req, cred)
					return err
				})
				switch {
				case errors.Is(err, leasebus.ErrConflict):
					led.mu.Lock()
					led.refused[att] = true
					led.mu.Unlock()
					led.count("refused")
					continue
				case errors.Is(err, leasebus.ErrUnavailable) || ctx.Err() != nil:
					led.count("gave-up")
					continue // its outcome is unknown: not acknowledged
				case err != nil:
					t.Errorf("acquire %s: %v", claim, err)
					return
				}
				led.mu.Lock()
				led.granted[l.LeaseID] = l
				if abandon {
					led.abandoned[l.LeaseID] = true
				} else {
					led.live = append(led.live, l.LeaseID)
				}
				led.mu.Unlock()
				led.count("grant")
				if abandon {
					continue // the sweeper must reclaim it
				}
				if rng.IntN(2) == 0 {
					err := retryUnavailable(ctx, &unavailable, func() error {
						r, err := c.Renew(ctx, leasebus.RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version, RenewID: "renew-" + l.LeaseID})
						if err == nil {
							l = r
						}
						return err
					})
					if err == nil {
						led.count("renew")
					} else if !errors.Is(err, leasebus.ErrLeaseLost) && !errors.Is(err, leasebus.ErrUnavailable) {
						t.Errorf("renew %s: %v", l.LeaseID, err)
						return
					}
				}
				var r *leasebus.Lease
				err = retryUnavailable(ctx, &unavailable, func() (err error) {
					r, err = c.Release(ctx, l.LeaseID, cred)
					return err
				})
				led.mu.Lock()
				if i := slices.Index(led.live, l.LeaseID); i >= 0 {
					led.live = slices.Delete(led.live, i, i+1)
				}
				if err == nil && r.Status == leasebus.StatusReleased {
					led.released[l.LeaseID] = true
				}
				led.mu.Unlock()
				if err == nil {
					led.count("release")
				} else if !errors.Is(err, leasebus.ErrUnavailable) {
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
			var r *leasebus.Lease
			err := retryUnavailable(ctx, &unavailable, func() (err error) {
				r, err = c.Revoke(ctx, id, "fault harness")
				return err
			})
			if err != nil {
				if !errors.Is(err, leasebus.ErrUnavailable) {
					t.Errorf("revoke %s: %v", id, err)
				}
				continue
			}
			if r.Status == leasebus.StatusRevoked {
				led.mu.Lock()
				led.revoked[id] = true
				led.mu.Unlock()
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
	fault := func(k string) {
		led.mu.Lock()
		led.faults[k]++
		led.mu.Unlock()
	}

	progress(40, 30*time.Second)
	for round := range rounds {
		p := leader(leasebus.LogStream)
		t.Logf("round %d: SIGSTOP %s, leader of %s, at %d grants", round, p.Name, leasebus.LogStream, led.grants())
		cl.Pause(p)
		fault("pause-log-leader")
		hold(3 * time.Second)
		cl.Resume(p)
		progress(30, 45*time.Second)

		p = leader(leasebus.AuditStream)
		t.Logf("round %d: SIGSTOP %s, leader of %s, at %d grants", round, p.Name, leasebus.AuditStream, led.grants())
		cl.Pause(p)
		fault("pause-audit-leader")
		hold(3 * time.Second)
		cl.Resume(p)
		progress(30, 45*time.Second)

		t.Logf("round %d: SIGKILL service process %s", round, svc.Name)
		cl.Kill(svc)
		fault("kill-service")
		p = leader(leasebus.LogStream)
		t.Logf("round %d: SIGKILL %s, leader of %s", round, p.Name, leasebus.LogStream)
		cl.Kill(p)
		fault("kill-node")
		progress(20, 45*time.Second)
		cl.Restart(p, 60*time.Second)
		cl.Restart(svc, 60*time.Second)
		progress(20, 45*time.Second)
	}
	stop.Store(true)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	loadDone := time.Since(started) - ready

	// The abandoned leases must be reclaimed (TTL 2 s); then the audit must
	// be complete. Poll: a reclaim waits for its deadline, and audit reads
	// may be served by a follower that lags.
	var evs []leasebus.AuditEvent
	var lastErr error
	deadline := time.Now().Add(30 * time.Second)
	for {
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		evs, err = readAuditFromLeader(rctx, opNC, clusterRepo)
		rcancel()
		if err == nil {
			lastErr = checkAudit(led, evs)
			if lastErr == nil {
				break
			}
		} else {
			lastErr = err
		}
		if time.Now().After(deadline) {
			break
		}
		select { // polling the audit stream
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
	types := map[string]int{}
	for _, ev := range evs {
		types[ev.Type]++
	}
	led.mu.Lock()
	t.Logf("%s of load under faults, %s in all: acknowledged %v; faults %v; %d unavailable answers retried; audit events %v",
		loadDone.Round(time.Millisecond), time.Since(started).Round(time.Millisecond), led.ops, led.faults, unavailable.Load(), types)
	led.mu.Unlock()
	if lastErr != nil {
		// Tell a lost event from an operation that never happened: ask
		// the service what became of each abandoned lease.
		c := leasebus.NewClient(opNC)
		led.mu.Lock()
		for id := range led.abandoned {
			if l, err := c.Get(ctx, id); err != nil || l.Active() {
				t.Logf("abandoned %s: %+v %v", id, l, err)
			}
		}
		led.mu.Unlock()
		t.Fatalf("audit incomplete:\n%v", lastErr)
	}
	if err := checkDuplicates(evs); err != nil {
		t.Errorf("audit has duplicates:\n%v", err)
	}
	if err := checkReplay(evs); err != nil {
		t.Errorf("audit replay:\n%v", err)
	}
	n, err := checkChain(ctx, js, clusterRepo)
	if err != nil {
		t.Errorf("audit chain: %v", err)
	}
	t.Logf("the lease service's audit of the repo is a chain of %d messages", n)
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
	subj := leasebus.AuditSubject + "." + leasebus.RepoKey(repo) + "." + leasebus.BoundaryLease
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

// readAuditFromLeader reads a repo's audit events as leasebus.ReadAudit
// does, but from the audit stream's leader: a direct get may be answered by
// a follower still catching up (a node just restarted), which would show
// only a prefix of the stream.
func readAuditFromLeader(ctx context.Context, nc *nats.Conn, repo string) ([]leasebus.AuditEvent, error) {
	filter := leasebus.AuditSubject + "." + leasebus.RepoKey(repo) + ".*"
	var out []leasebus.AuditEvent
	for seq := uint64(1); ; {
		req, err := json.Marshal(map[string]any{"seq": seq, "next_by_subj": filter})
		if err != nil {
			return nil, err
		}
		resp, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+leasebus.AuditStream, req)
		if err != nil {
			return out, fmt.Errorf("read audit stream at %d: %w", seq, err)
		}
		var r struct {
			Error *struct {
				Code    int    `json:"code"`
				ErrCode int    `json:"err_code"`
				Desc    string `json:"description"`
			} `json:"error"`
			Message *struct {
				Seq  uint64 `json:"seq"`
				Data []byte `json:"data"`
			} `json:"message"`
		}
		if err := json.Unmarshal(resp.Data, &r); err != nil {
			return out, fmt.Errorf("read audit stream at %d: %w", seq, err)
		}
		if r.Error != nil {
			if r.Error.Code == 404 {
				return out, nil
			}
			return out, fmt.Errorf("read audit stream at %d: %s (%d)", seq, r.Error.Desc, r.Error.ErrCode)
		}
		if r.Message == nil {
			return out, fmt.Errorf("read audit stream at %d: no message in the answer", seq)
		}
		var b struct {
			Events []leasebus.AuditEvent `json:"events"`
		}
		if err := json.Unmarshal(r.Message.Data, &b); err != nil {
			return out, fmt.Errorf("decode audit message %d: %w", r.Message.Seq, err)
		}
		out = append(out, b.Events...)
		seq = r.Message.Seq + 1
	}
}

// checkAudit reports what the clients were told that the audit stream
// does not show.
func checkAudit(led *ledger, evs []leasebus.AuditEvent) error {
	led.mu.Lock()
	defer led.mu.Unlock()
	has := map[string]bool{}
	refused := map[string]bool{}
	fence := map[string]uint64{} // lease id -> fence of its grant event
	for _, ev := range evs {
		has[ev.Type+" "+ev.LeaseID] = true
		if ev.Type == leasebus.EventGrant {
			fence[ev.LeaseID] = ev.Fence
		}
		if ev.Type == leasebus.EventRefused && ev.LeaseID == "" {
			refused[ev.Owner.AttemptID] = true
		}
	}
	var missing []string
	miss := func(typ, id string) {
		if !has[typ+" "+id] {
			missing = append(missing, typ+" "+id)
		}
	}
	for id, l := range led.granted {
		miss(leasebus.EventGrant, id)
		if f, ok := fence[id]; ok && f != l.Fence {
			missing = append(missing, fmt.Sprintf("grant %s: the client got fence %d, the audit says %d", id, l.Fence, f))
		}
	}
	for id := range led.released {
		miss(leasebus.EventRelease, id)
	}
	for id := range led.revoked {
		miss(leasebus.EventRevoked, id)
	}
	for id := range led.abandoned {
		if !has[leasebus.EventReclaimed+" "+id] && !has[leasebus.EventRevoked+" "+id] && !has[leasebus.EventExpired+" "+id] {
			missing = append(missing, "end of abandoned "+id)
		}
	}
	for att := range led.refused {
		if !refused[att] {
			missing = append(missing, "refusal of "+att)
		}
	}
	if len(missing) > 0 {
		slices.Sort(missing)
		if len(missing) > 20 {
			missing = append(missing[:20], fmt.Sprintf("… %d more", len(missing)-20))
		}
		return fmt.Errorf("%d acknowledged operations missing from %d audit events:\n%s", len(missing), len(evs), strings.Join(missing, "\n"))
	}
	return nil
}

// checkDuplicates reports a lease event written more than once: a lease is
// granted once and ends once.
func checkDuplicates(evs []leasebus.AuditEvent) error {
	seen := map[string]int{}
	ends := map[string]int{}
	var out []string
	for _, ev := range evs {
		if ev.LeaseID == "" {
			continue
		}
		switch ev.Type {
		case leasebus.EventGrant, leasebus.EventRelease, leasebus.EventRevoked, leasebus.EventReclaimed, leasebus.EventExpired:
			k := ev.Type + " " + ev.LeaseID
			if seen[k]++; seen[k] == 2 {
				out = append(out, k)
			}
			if ev.Type != leasebus.EventGrant {
				if ends[ev.LeaseID]++; ends[ev.LeaseID] == 2 {
					out = append(out, "two ends of "+ev.LeaseID)
				}
			}
		}
	}
	if len(out) > 0 {
		return errors.New(strings.Join(out, "\n"))
	}
	return nil
}

// checkReplay replays the service's events in audit order: fences of
// grants strictly rise, and no grant overlaps a lease still active.
func checkReplay(evs []leasebus.AuditEvent) error {
	active := map[string]scope.Claim{}
	var last uint64
	var out []string
	for _, ev := range evs {
		if ev.Boundary != leasebus.BoundaryLease || ev.LeaseID == "" {
			continue
		}
		switch ev.Type {
		case leasebus.EventGrant:
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
		case leasebus.EventRelease, leasebus.EventRevoked, leasebus.EventReclaimed, leasebus.EventExpired:
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
