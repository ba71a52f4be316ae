package leasebus

// Shared invariant checkers for the property, linearizability, cluster and
// restart tests. They restate the design's invariants independently of the
// service's own conflict code: claim overlap comes from scope.Claim.Overlaps
// (not the Overlap the service uses) and workspace occupancy is written out
// here from docs/design.md, invariant 1.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// clash reports why two active leases of one repo may not coexist, or "".
// Invariant 1: claims never overlap; a workspace holds one exclusive lease,
// or shared leases only.
func clash(aScope scope.Claim, aWS string, aMode lease.WorkspaceMode, bScope scope.Claim, bWS string, bMode lease.WorkspaceMode) string {
	if aScope.Overlaps(bScope) {
		return fmt.Sprintf("claims %s and %s overlap", aScope, bScope)
	}
	if aWS == bWS && (aMode == lease.WorkspaceExclusive || bMode == lease.WorkspaceExclusive) {
		return fmt.Sprintf("workspace %s holds an exclusive lease and another lease", aWS)
	}
	// A workspace named parent/x lies in parent: an exclusive lease on
	// parent and any lease in parent/x never coexist.
	if strings.HasPrefix(bWS, aWS+"/") && aMode == lease.WorkspaceExclusive || strings.HasPrefix(aWS, bWS+"/") && bMode == lease.WorkspaceExclusive {
		return fmt.Sprintf("workspaces %s and %s nest, and the outer one is held exclusively", aWS, bWS)
	}
	return ""
}

func leaseClash(a, b *lease.Lease) string {
	return clash(a.Scope, a.WorkspaceID, a.WorkspaceMode, b.Scope, b.WorkspaceID, b.WorkspaceMode)
}

// checkActiveSet checks invariant 1 over a set of leases that a single
// answer of the service reports active together (a List reply). maxSharers
// > 0 bounds the shared leases of each workspace (all requests of the test
// must use that bound).
func checkActiveSet(ls []*lease.Lease, maxSharers int) error {
	sharers := map[string]int{}
	seen := map[string]bool{}
	for i, a := range ls {
		if !a.Active() {
			return fmt.Errorf("list of active leases holds %s with status %s", a.LeaseID, a.Status)
		}
		if seen[a.LeaseID] {
			return fmt.Errorf("lease %s listed twice", a.LeaseID)
		}
		seen[a.LeaseID] = true
		if a.WorkspaceMode == lease.WorkspaceShared {
			sharers[a.Repo+"\x00"+a.WorkspaceID]++
		}
		for _, b := range ls[i+1:] {
			if a.Repo != b.Repo {
				continue
			}
			if why := leaseClash(a, b); why != "" {
				return fmt.Errorf("active together in %s: %s (fence %d, %s %s) and %s (fence %d, %s %s): %s",
					a.Repo, a.LeaseID, a.Fence, a.WorkspaceID, a.WorkspaceMode, b.LeaseID, b.Fence, b.WorkspaceID, b.WorkspaceMode, why)
			}
			if a.Fence == b.Fence {
				return fmt.Errorf("active leases %s and %s share fence %d", a.LeaseID, b.LeaseID, a.Fence)
			}
		}
	}
	for k, n := range sharers {
		if maxSharers > 0 && n > maxSharers {
			return fmt.Errorf("workspace %q has %d shared leases, max-sharers is %d", k, n, maxSharers)
		}
	}
	return nil
}

// commitChecker folds committed lease records, in commit order per repo,
// and checks invariants 1 and 2 on every step: a grant (version 1) never
// clashes with a lease still active, its fence is above every fence issued
// before in the repo and was never issued to another lease; versions only
// rise; an ended lease never comes back.
type commitChecker struct {
	maxSharers int

	mu     sync.Mutex
	repos  map[string]*repoCheck
	errs   []string
	grants map[string]*lease.Lease // every lease seen granted, by id
}

type repoCheck struct {
	active    map[string]*lease.Lease
	ended     map[string]*lease.Lease
	lastFence uint64
	fences    map[uint64]string // fence -> lease id
	records   int
}

func newCommitChecker(maxSharers int) *commitChecker {
	return &commitChecker{maxSharers: maxSharers, repos: map[string]*repoCheck{}, grants: map[string]*lease.Lease{}}
}

func (c *commitChecker) repo(r string) *repoCheck {
	rc := c.repos[r]
	if rc == nil {
		rc = &repoCheck{active: map[string]*lease.Lease{}, ended: map[string]*lease.Lease{}, fences: map[uint64]string{}}
		c.repos[r] = rc
	}
	return rc
}

func (c *commitChecker) failf(format string, args ...any) {
	if len(c.errs) < 20 {
		c.errs = append(c.errs, fmt.Sprintf(format, args...))
	}
}

// record applies one committed lease record.
func (c *commitChecker) record(l *lease.Lease) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.recordLocked(l)
}

func (c *commitChecker) recordLocked(l *lease.Lease) {
	l = cloneLease(l)
	rc := c.repo(l.Repo)
	rc.records++
	if e, ok := rc.ended[l.LeaseID]; ok {
		c.failf("record for %s (status %s v%d) after it ended (%s v%d)", l.LeaseID, l.Status, l.Version, e.Status, e.Version)
		return
	}
	if l.Fence == 0 {
		c.failf("lease %s has fence 0", l.LeaseID)
	}
	if id, ok := rc.fences[l.Fence]; ok && id != l.LeaseID {
		c.failf("fence %d reissued: %s and %s", l.Fence, id, l.LeaseID)
	}
	old, known := rc.active[l.LeaseID]
	switch {
	case !known && l.Active():
		if l.Version != 1 {
			c.failf("active record %s v%d of a lease never seen granted", l.LeaseID, l.Version)
		}
		if l.Fence <= rc.lastFence {
			c.failf("grant %s has fence %d, not above the last fence %d of %s", l.LeaseID, l.Fence, rc.lastFence, l.Repo)
		}
		sharers := 0
		for _, a := range rc.active {
			if why := leaseClash(a, l); why != "" {
				c.failf("granted %s (fence %d, %s, %s %s) while %s (fence %d, %s, %s %s) is active: %s",
					l.LeaseID, l.Fence, l.Scope, l.WorkspaceID, l.WorkspaceMode, a.LeaseID, a.Fence, a.Scope, a.WorkspaceID, a.WorkspaceMode, why)
			}
			if a.WorkspaceID == l.WorkspaceID && a.WorkspaceMode == lease.WorkspaceShared {
				sharers++
			}
		}
		if l.WorkspaceMode == lease.WorkspaceShared && c.maxSharers > 0 && sharers+1 > c.maxSharers {
			c.failf("granted %s as sharer %d of workspace %s, max-sharers %d", l.LeaseID, sharers+1, l.WorkspaceID, c.maxSharers)
		}
		rc.active[l.LeaseID] = l
		rc.fences[l.Fence] = l.LeaseID
		rc.lastFence = max(rc.lastFence, l.Fence)
		c.grants[l.LeaseID] = l
	case !known:
		// The end of a lease whose grant this checker did not see (it
		// started later, or its source has a gap).
		rc.ended[l.LeaseID] = l
		rc.fences[l.Fence] = l.LeaseID
	default:
		if l.Version <= old.Version {
			c.failf("lease %s: version went from %d to %d", l.LeaseID, old.Version, l.Version)
		}
		if l.Fence != old.Fence || l.Scope.String() != old.Scope.String() || l.WorkspaceID != old.WorkspaceID || l.Owner != old.Owner {
			c.failf("lease %s changed fence, scope, workspace or owner: %+v -> %+v", l.LeaseID, old, l)
		}
		if l.Active() {
			rc.active[l.LeaseID] = l
		} else {
			delete(rc.active, l.LeaseID)
			rc.ended[l.LeaseID] = l
		}
	}
}

// resync replaces a repo's active set with a snapshot record's, after a
// gap in the source. Fences it already knows must not have moved.
func (c *commitChecker) resync(repo string, fence uint64, leases []*lease.Lease) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rc := c.repo(repo)
	if fence < rc.lastFence {
		c.failf("snapshot of %s has fence counter %d below fence %d already issued", repo, fence, rc.lastFence)
	}
	rc.active = map[string]*lease.Lease{}
	for _, l := range leases {
		l = cloneLease(l)
		if id, ok := rc.fences[l.Fence]; ok && id != l.LeaseID {
			c.failf("snapshot: fence %d reissued: %s and %s", l.Fence, id, l.LeaseID)
		}
		if l.Fence > fence {
			c.failf("snapshot: lease %s has fence %d above the counter %d", l.LeaseID, l.Fence, fence)
		}
		rc.fences[l.Fence] = l.LeaseID
		if g, ok := c.grants[l.LeaseID]; ok && g.Fence != l.Fence {
			c.failf("snapshot: lease %s has fence %d, granted with %d", l.LeaseID, l.Fence, g.Fence)
		}
		if _, ok := c.grants[l.LeaseID]; !ok {
			c.grants[l.LeaseID] = l // granted in the gap: known to exist, overlap unchecked
		}
		if l.Active() {
			rc.active[l.LeaseID] = l
		} else {
			rc.ended[l.LeaseID] = l
		}
	}
	var act []*lease.Lease
	for _, l := range rc.active {
		act = append(act, l)
	}
	if err := checkActiveSet(act, c.maxSharers); err != nil {
		c.failf("snapshot of %s: %v", repo, err)
	}
	rc.lastFence = max(rc.lastFence, fence)
}

// compareActive checks that a snapshot's active set equals the folded one.
func (c *commitChecker) compareActive(repo string, leases []*lease.Lease) {
	c.mu.Lock()
	defer c.mu.Unlock()
	rc := c.repo(repo)
	got := map[string]uint64{}
	for _, l := range leases {
		if l.Active() {
			got[l.LeaseID] = l.Version
		}
	}
	want := map[string]uint64{}
	for id, l := range rc.active {
		want[id] = l.Version
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		c.failf("snapshot of %s disagrees with the folded deltas: snapshot %v, deltas %v", repo, got, want)
	}
}

func (c *commitChecker) err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.errs) == 0 {
		return nil
	}
	return errors.New(strings.Join(c.errs, "\n"))
}

func (c *commitChecker) grantCount() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.grants)
}

func (c *commitChecker) granted(id string) (*lease.Lease, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	l, ok := c.grants[id]
	return l, ok
}

func cloneLease(l *lease.Lease) *lease.Lease {
	c := *l
	c.Scope.Paths = slices.Clone(l.Scope.Paths)
	c.Scope.Tables = slices.Clone(l.Scope.Tables)
	return &c
}

// logFollower reads the lease log stream itself, in order, with an ordered
// consumer, and feeds every committed record to a commitChecker: the
// durable ground truth, unlike the best-effort Watch. A gap (records rolled
// up before they were read, a consumer reset) is detected through each
// record's Prev and bridged by the next snapshot.
type logFollower struct {
	chk  *commitChecker
	js   jetstream.JetStream
	cc   jetstream.ConsumeContext
	mu   sync.Mutex
	last map[string]uint64 // subject -> last record sequence applied
	gap  map[string]bool
	recs int
	snap int
	gaps int
}

func followLog(t testing.TB, nc *nats.Conn, chk *commitChecker) *logFollower {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cons, err := js.OrderedConsumer(ctx, LogStream, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{logSubject + ".>"}, DeliverPolicy: jetstream.DeliverAllPolicy})
	if err != nil {
		t.Fatal(err)
	}
	f := &logFollower{chk: chk, js: js, last: map[string]uint64{}, gap: map[string]bool{}}
	f.cc, err = cons.Consume(f.handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(f.cc.Stop)
	return f
}

func (f *logFollower) handle(m jetstream.Msg) {
	md, err := m.Metadata()
	if err != nil {
		f.chk.mu.Lock()
		f.chk.failf("log message without metadata: %v", err)
		f.chk.mu.Unlock()
		return
	}
	f.apply(m.Subject(), md.Sequence.Stream, m.Data())
}

func (f *logFollower) apply(subj string, seq uint64, data []byte) {
	var rec logRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		f.chk.mu.Lock()
		f.chk.failf("log record %d does not decode: %v", seq, err)
		f.chk.mu.Unlock()
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if seq <= f.last[subj] {
		return // redelivery after a consumer reset
	}
	leases := make([]*lease.Lease, len(rec.Leases))
	for i, e := range rec.Leases {
		leases[i] = &e.Lease
	}
	contiguous := !f.gap[subj] && rec.Prev == f.last[subj]
	f.recs++
	switch {
	case rec.Kind == recordSnapshot && contiguous:
		f.snap++
		f.chk.compareActive(rec.Repo, leases)
		f.chk.resync(rec.Repo, rec.Fence, leases)
	case rec.Kind == recordSnapshot:
		// Records before it were purged before this follower read them:
		// resume from the snapshot's state.
		f.snap++
		if !f.gap[subj] {
			f.gaps++
		}
		f.gap[subj] = false
		f.chk.resync(rec.Repo, rec.Fence, leases)
	case contiguous:
		f.chk.mu.Lock()
		rc := f.chk.repo(rec.Repo)
		for _, l := range leases {
			f.chk.recordLocked(l)
			if l.Fence > rec.Fence {
				f.chk.failf("record %d: lease %s fence %d above the record's counter %d", seq, l.LeaseID, l.Fence, rec.Fence)
			}
		}
		if rec.Fence < rc.lastFence {
			f.chk.failf("record %d of %s: fence counter went back to %d from %d", seq, rec.Repo, rec.Fence, rc.lastFence)
		}
		rc.lastFence = max(rc.lastFence, rec.Fence)
		f.chk.mu.Unlock()
	default:
		f.gaps++
		f.gap[subj] = true
	}
	f.last[subj] = seq
}

// followLogPolling is followLog reading each repo's log record by record
// (as the service loads it), polling for the next one. Unlike a consumer it
// resumes at once when a stream leader fails over.
func followLogPolling(t testing.TB, nc *nats.Conn, chk *commitChecker, repos ...string) *logFollower {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	f := &logFollower{chk: chk, js: js, last: map[string]uint64{}, gap: map[string]bool{}}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	for _, repo := range repos {
		subj := logSubjectFor(RepoKey(repo))
		wg.Go(func() {
			next := uint64(1)
			var st jetstream.Stream
			for ctx.Err() == nil {
				gctx, gcancel := context.WithTimeout(ctx, 2*time.Second)
				var err error
				if st == nil {
					st, err = js.Stream(gctx, LogStream)
				}
				var m *jetstream.RawStreamMsg
				if err == nil {
					m, err = st.GetMsg(gctx, next, jetstream.WithGetMsgSubject(subj))
				}
				gcancel()
				switch {
				case err == nil:
					f.apply(subj, m.Sequence, m.Data)
					next = m.Sequence + 1
					continue
				case errors.Is(err, jetstream.ErrMsgNotFound):
					time.Sleep(2 * time.Millisecond) // polling interval
				default:
					time.Sleep(50 * time.Millisecond) // the stream is failing over
				}
			}
		})
	}
	return f
}

// waitCaughtUp waits until the follower has read every record of repo.
func (f *logFollower) waitCaughtUp(t testing.TB, repo string, timeout time.Duration) {
	t.Helper()
	subj := logSubjectFor(RepoKey(repo))
	checkFor(t, timeout, 20*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		st, err := f.js.Stream(ctx, LogStream)
		if err != nil {
			return err
		}
		m, err := st.GetLastMsgForSubject(ctx, subj)
		if err != nil {
			return err
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.last[subj] < m.Sequence {
			return fmt.Errorf("log follower at %d, log of %s at %d", f.last[subj], repo, m.Sequence)
		}
		return nil
	})
}

func (f *logFollower) stats() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return fmt.Sprintf("%d log records (%d snapshots, %d gaps)", f.recs, f.snap, f.gaps)
}

// watchChecker feeds a commitChecker from Client.Watch: per repo, the
// service publishes records in commit order from one actor.
func watchChecker(t testing.TB, c *Client, repo string, chk *commitChecker, onRecord func(*lease.Lease, time.Time)) {
	t.Helper()
	stop, err := c.Watch(repo, func(l *lease.Lease) {
		at := time.Now()
		chk.record(l)
		if onRecord != nil {
			onRecord(l, at)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stop() })
}

func mustClaim(t testing.TB, paths []string, whole bool, tables []string) scope.Claim {
	t.Helper()
	c, err := scope.New(paths, whole, tables)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
