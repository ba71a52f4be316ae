package leasebus

import (
	"errors"
	"fmt"
	"testing"
	"time"

	promtest "github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/fenceline/fenceline/lease"
)

// viewSeq is the log sequence svc's view of repo key reflects (0: none).
func viewSeq(svc *Service, key string) uint64 {
	a, ok := svc.existing(key)
	if !ok {
		return 0
	}
	a.busy.Lock()
	defer a.busy.Unlock()
	return a.state.seq
}

// TestWarmStandbyTakesOverWithoutLoading: a standby keeps a view of every
// repo from the primary's announcements, reading no log to do so, and a
// takeover confirms each view with one read of its log's last record
// instead of reading the log back to a snapshot. The events of a grant
// the old primary appended but never audited (it died first) reach the
// audit stream through the new primary, once.
func TestWarmStandbyTakesOverWithoutLoading(t *testing.T) {
	t.Parallel()
	b, svcs, conns, ms := electing(t)
	p := primaryOf(t, svcs[:], 10*time.Second)
	s := 1 - p
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	c := NewClient(connect(t, url))
	const repos = 6
	name := func(i int) string { return fmt.Sprintf("github.com/acme/warm-%d", i) }
	var granted [repos][]*lease.Lease
	acquire := func(i, j int) (*lease.Lease, Credential) {
		t.Helper()
		cred := NewCredential()
		l, err := c.Acquire(ctx, AcquireRequest{Repo: name(i), Scope: claim(t, fmt.Sprint("p", j)), Owner: owner(j + 1), TTL: lease.Duration(time.Minute)}, cred)
		if err != nil {
			t.Fatal(err)
		}
		granted[i] = append(granted[i], l)
		return l, cred
	}
	for i := range repos {
		for j := range 3 {
			acquire(i, j)
		}
	}
	// An ended lease in a view, and a snapshot in another's log.
	l, cred := acquire(1, 3)
	if _, err := c.Release(ctx, l.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	a := svcs[p].actor(RepoKey(name(2)), name(2))
	a.busy.Lock()
	a.sinceSnap = logKeep / 2
	a.busy.Unlock()
	acquire(2, 4)
	// The primary dies right after this grant's append: its events are in
	// the log, never in the audit stream.
	svcs[p].audit.killed.Store(true)
	acquire(0, 5)

	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		for i := range repos {
			key := RepoKey(name(i))
			if want, got := viewSeq(svcs[p], key), viewSeq(svcs[s], key); got != want {
				return fmt.Errorf("%s: the standby's view is at %d, the primary's at %d", name(i), got, want)
			}
		}
		return nil
	})
	if n := logReads(t, ms[s]); n != 0 {
		t.Fatalf("the standby read the log %d times to keep its views: want none", n)
	}

	killed := time.Now()
	conns[p].Close()
	rest := []*Service{nil, nil}
	rest[s] = svcs[s]
	primaryOf(t, rest, 10*time.Second)
	for i := range repos {
		for j, l := range granted[i] {
			got, err := c.Get(ctx, l.LeaseID)
			if err != nil {
				t.Fatalf("%s lease %d: %v", name(i), j, err)
			}
			if got.Fence != l.Fence || got.Active() != (l.LeaseID != granted[1][3].LeaseID) {
				t.Fatalf("%s lease %d: the new primary has %s fence %d, want fence %d as granted (the released one ended)", name(i), j, got.Status, got.Fence, l.Fence)
			}
		}
	}
	// The leases' TTLs count from the takeover, as after a load: their
	// holders could not renew meanwhile.
	a = svcs[s].actor(RepoKey(name(3)), name(3))
	a.busy.Lock()
	for _, e := range a.state.leases {
		if e.deadline.Before(killed.Add(time.Minute)) {
			t.Errorf("lease %s ends %s after the old primary died: its TTL (1m) was not counted from the takeover", e.LeaseID, e.deadline.Sub(killed).Round(time.Millisecond))
		}
	}
	a.busy.Unlock()
	// A lease granted now gets a fence above every one before.
	top := granted[0][len(granted[0])-1].Fence
	if l, _ := acquire(0, 6); l.Fence <= top {
		t.Fatalf("a grant after the takeover has fence %d, not above %d", l.Fence, top)
	}
	if n := int(promtest.ToFloat64(ms[s].reads.WithLabelValues("record"))); n != 0 {
		t.Errorf("the new primary read %d log records back at its takeover: want none (each view is warm)", n)
	}
	if n := int(promtest.ToFloat64(ms[s].reads.WithLabelValues("last"))); n > 3*repos {
		t.Errorf("the new primary read the last record of a log %d times for %d repos", n, repos)
	}
	nc := connect(t, url)
	wantOnce(t, ctx, nc, name(0), granted[0]...)
	checkChain(t, ctx, nc, name(0))
	for i := 1; i < repos; i++ {
		wantOnce(t, ctx, nc, name(i), granted[i]...)
	}
}

// TestWarmViewMissesARecord: a standby that misses an announcement folds
// nothing more of that repo until a snapshot, which carries the whole
// state; a takeover before the snapshot reads that repo afresh (and its
// audit with it), and one whose view dropped audit events the chain does
// not cover yet does too.
func TestWarmViewMissesARecord(t *testing.T) {
	t.Parallel()
	s := &Service{cfg: ServiceConfig{Now: time.Now}}
	a := s.newActor("k", "github.com/acme/warm")
	a.stale = false
	e := func(id string, v uint64) *entry {
		return &entry{Lease: lease.Lease{LeaseID: id, Repo: "github.com/acme/warm", Status: lease.StatusActive, Version: v, TTL: lease.Duration(time.Minute)}}
	}
	ev := []lease.AuditEvent{{Type: lease.EventGrant}}
	delta := func(prev uint64, es ...*entry) *logRecord {
		return &logRecord{Kind: recordDelta, Repo: "github.com/acme/warm", Prev: prev, Leases: es, Events: ev}
	}
	if !a.foldWarm(3, delta(0, e("a", 1))) || a.state.seq != 3 || a.warm.lost != 0 {
		t.Fatalf("the repo's first record did not fold: seq %d, lost %d", a.state.seq, a.warm.lost)
	}
	if !a.foldWarm(7, delta(3, e("b", 1))) || a.state.seq != 7 {
		t.Fatal("the next record did not fold")
	}
	if a.foldWarm(7, delta(3, e("b", 1))) {
		t.Fatal("a record folded twice")
	}
	// Record 9 (on top of 7) is missed; 12 follows it.
	if a.foldWarm(12, delta(9, e("c", 1))) || !a.warm.broken || a.state.seq != 7 {
		t.Fatalf("a record after a missed one folded (seq %d, broken %v)", a.state.seq, a.warm.broken)
	}
	if a.foldWarm(15, delta(12, e("d", 1))) {
		t.Fatal("a broken view folded a delta")
	}
	snap := &logRecord{Kind: recordSnapshot, Repo: "github.com/acme/warm", Prev: 15, Leases: []*entry{e("a", 1), e("b", 1), e("c", 1), e("d", 1)}}
	if !a.foldWarm(20, snap) || a.warm.broken || a.state.seq != 20 || len(a.state.leases) != 4 {
		t.Fatalf("the snapshot did not mend the view: seq %d, broken %v, %d leases", a.state.seq, a.warm.broken, len(a.state.leases))
	}
	if a.warm.lost != 15 {
		t.Fatalf("the events of records up to 15 went unseen, the view says %d", a.warm.lost)
	}
	// Past warmKeep records with events, the oldest events are dropped,
	// and said so.
	seq := uint64(20)
	for i := range warmKeep + 2 {
		if !a.foldWarm(seq+1, delta(seq, e("a", uint64(i+2)))) {
			t.Fatalf("record %d did not fold", seq+1)
		}
		seq++
	}
	if len(a.warm.recs) != warmKeep || a.warm.lost != 22 || a.warm.recs[0].seq != 23 {
		t.Fatalf("kept %d records' events from %d, lost up to %d: want %d from 23, lost up to 22", len(a.warm.recs), a.warm.recs[0].seq, a.warm.lost, warmKeep)
	}
}

// TestLateStandbyWarmsUp: a standby started after the primary granted
// leases (a node restarted) hears appends to repos it has no view of and
// loads those views in the background, so a takeover then reads no log
// back to a snapshot either; the events of a grant the old primary never
// audited still reach the audit stream once.
func TestLateStandbyWarmsUp(t *testing.T) {
	t.Parallel()
	ms := [2]*ServiceMetrics{NewServiceMetrics(), NewServiceMetrics()}
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Primary: true, PrimaryTerm: testTerm, Metrics: ms[0]}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	primaryOf(t, []*Service{b.svc}, 10*time.Second)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	c := NewClient(connect(t, url))
	const repos = 4
	name := func(i int) string { return fmt.Sprintf("github.com/acme/late-%d", i) }
	var granted [repos][]*lease.Lease
	acquire := func(i, j int) {
		t.Helper()
		l, err := c.Acquire(ctx, AcquireRequest{Repo: name(i), Scope: claim(t, fmt.Sprint("p", j)), Owner: owner(j + 1), TTL: lease.Duration(time.Minute)}, NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		granted[i] = append(granted[i], l)
	}
	for i := range repos {
		acquire(i, 0)
		acquire(i, 1)
	}
	late, err := StartService(ctx, connect(t, url), ServiceConfig{Primary: true, PrimaryTerm: testTerm, Metrics: ms[1]})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(late.Stop)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !late.tailing.Load() || !b.svc.tailing.Load() {
			return errors.New("the instances have not met yet")
		}
		return nil
	})
	// Appends to every repo after the standby started; the last one's
	// events the primary never writes.
	for i := range repos {
		acquire(i, 2)
	}
	b.svc.audit.killed.Store(true)
	acquire(0, 3)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		for i := range repos {
			key := RepoKey(name(i))
			if want, got := viewSeq(b.svc, key), viewSeq(late, key); got != want {
				return fmt.Errorf("%s: the late standby's view is at %d, the primary's at %d", name(i), got, want)
			}
		}
		return nil
	})
	before := int(promtest.ToFloat64(ms[1].reads.WithLabelValues("record")))
	if before == 0 {
		t.Fatal("the late standby read no log record: its views cannot have been loaded")
	}
	b.nc.Close()
	primaryOf(t, []*Service{nil, late}, 10*time.Second)
	for i := range repos {
		for j, l := range granted[i] {
			got, err := c.Get(ctx, l.LeaseID)
			if err != nil || got.Fence != l.Fence || !got.Active() {
				t.Fatalf("%s lease %d: the new primary has %+v, %v: want it as granted", name(i), j, got, err)
			}
		}
	}
	if n := int(promtest.ToFloat64(ms[1].reads.WithLabelValues("record"))) - before; n != 0 {
		t.Errorf("the new primary read %d log records back at its takeover: want none (each view was warmed)", n)
	}
	nc := connect(t, url)
	for i := range repos {
		wantOnce(t, ctx, nc, name(i), granted[i]...)
	}
	checkChain(t, ctx, nc, name(0))
}
