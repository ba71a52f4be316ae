package leasebus

// A rapid property test of the pure lease state machine (state.go and the
// actor's apply/serve logic) without a network: random batches of acquire
// (with and without wait, and retries), renew, release, revoke, cancel, get
// and list, on a monotonic fake clock, each batch run the way actor.process
// runs it (sweep, apply, serve queue, commit or fail). Every outcome is
// compared with an independent reference model, and after every batch:
//
//   - invariant 1: active leases pairwise disjoint, workspace occupancy;
//   - invariant 2: each grant's fence is the previous fence + 1, never reused;
//   - invariant 3: renew/release only with the owner's credential;
//   - expiry: a lease is swept exactly when the service's own deadline
//     (the moment it processed the grant or last renewal, plus the TTL) has
//     passed, never before;
//   - a failed append leaves the committed state untouched;
//   - replaying the batch's log record (as JSON) on a second state, and
//     loading a snapshot, reproduces the state; a loader's deadlines are
//     never earlier than the writer's.

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"pgregory.net/rapid"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

type mLease struct {
	id        string
	repo      string
	scope     scope.Claim
	ws        string
	mode      lease.WorkspaceMode
	fence     uint64
	version   uint64
	deadline  time.Time
	credHash  string
	requestID string
	renewID   string
	// logged and jumped: a primary that took over set the lease past its
	// record at logged (renewSlack); a holder renewing a version from
	// logged-1 up is told to renew the current one.
	logged uint64
	jumped bool
	// told is the deadline the holder was last answered (a grant's or a
	// renewal's); deadline is the service's, later after a takeover.
	told       time.Time
	status     lease.Status
	ttl        time.Duration
	acquiredAt time.Time
}

func (m *mLease) active() bool { return m.status == lease.StatusActive }

type model struct {
	leases    map[string]*mLease // every lease ever granted
	lastFence uint64
}

func (m *model) clone() *model {
	c := &model{leases: make(map[string]*mLease, len(m.leases)), lastFence: m.lastFence}
	for id, l := range m.leases {
		cp := *l
		c.leases[id] = &cp
	}
	return c
}

// blockers lists the active leases that keep a request from a grant now.
func (m *model) blockers(r *AcquireRequest) []string {
	var out, sharers []string
	for _, l := range m.leases {
		if !l.active() {
			continue
		}
		if clash(r.Scope, r.WorkspaceID, r.WorkspaceMode, l.scope, l.ws, l.mode) != "" {
			out = append(out, l.id)
		}
		if l.ws == r.WorkspaceID && l.mode == lease.WorkspaceShared {
			sharers = append(sharers, l.id)
		}
	}
	if len(out) == 0 && r.WorkspaceMode == lease.WorkspaceShared && r.MaxSharers > 0 && len(sharers) >= r.MaxSharers {
		out = sharers
	}
	slices.Sort(out)
	return out
}

func (m *model) activeByRequest(r *AcquireRequest) *mLease {
	for _, l := range m.leases {
		if l.active() && l.requestID == r.RequestID && l.credHash == r.CredentialHash {
			return l
		}
	}
	return nil
}

func (m *model) activeIDs() []string {
	var out []string
	for id, l := range m.leases {
		if l.active() {
			out = append(out, id)
		}
	}
	slices.Sort(out)
	return out
}

type pureSim struct {
	t       *rapid.T
	st      *repoState
	replica *repoState
	// prev is the view of the primary the last takeover replaced, kept
	// as a primary that lost its term keeps it; log holds every record
	// appended (JSON), for it to read when it takes the claim back.
	prev  *repoState
	log   [][]byte
	a     *actor
	m     *model
	now   time.Time
	seq   uint64
	creds []Credential
	reqs  []*AcquireRequest // every acquire sent, for retries
	ids   []string          // every lease granted, in grant order
	calls map[*call]*AcquireRequest
	stats map[string]int
	// cancelHit is the waiter the call being checked withdrew, if any.
	cancelHit *waiter
}

const pureRepo = "github.com/acme/pure"

func newPureSim(t *rapid.T) *pureSim {
	st, replica := newRepoState(pureRepo), newRepoState(pureRepo)
	st.slack = renewSlack      // a primary's view
	replica.slack = renewSlack // a standby's warm view, to become a primary's
	return &pureSim{t: t, st: st, replica: replica,
		a: &actor{}, m: &model{leases: map[string]*mLease{}}, now: time.Now(),
		creds: []Credential{NewCredential(), NewCredential(), NewCredential()},
		calls: map[*call]*AcquireRequest{}, stats: map[string]int{}}
}

var (
	smPaths  = []string{"a", "a/b", "a/b/c", "b", "b/c", "c"}
	smTables = []string{"public.x", "public.*", "public.y", "other.x"}
)

func drawClaim(t *rapid.T) (scope.Claim, lease.WorkspaceMode) {
	var tables []string
	if rapid.IntRange(0, 2).Draw(t, "withTables") == 0 {
		tables = []string{rapid.SampledFrom(smTables).Draw(t, "table")}
	}
	var c scope.Claim
	var err error
	mode := lease.WorkspaceExclusive
	switch k := rapid.IntRange(0, 9).Draw(t, "kind"); {
	case k < 7:
		paths := []string{rapid.SampledFrom(smPaths).Draw(t, "path")}
		if rapid.IntRange(0, 3).Draw(t, "twoPaths") == 0 {
			paths = append(paths, rapid.SampledFrom(smPaths).Draw(t, "path2"))
		}
		c, err = scope.New(paths, false, tables)
		if rapid.IntRange(0, 3).Draw(t, "exclusive") != 0 {
			mode = lease.WorkspaceShared
		}
	case k == 7:
		c, err = scope.New(nil, true, tables)
	default:
		c, err = scope.New(nil, false, tables)
	}
	if err != nil {
		t.Fatal(err)
	}
	return c, mode
}

func (s *pureSim) drawAcquire() *AcquireRequest {
	t := s.t
	if len(s.reqs) > 0 && rapid.IntRange(0, 5).Draw(t, "retry") == 0 {
		r := *s.reqs[rapid.IntRange(0, len(s.reqs)-1).Draw(t, "retryOf")]
		if rapid.IntRange(0, 4).Draw(t, "retryOtherCred") == 0 {
			r.CredentialHash = rapid.SampledFrom(s.creds).Draw(t, "cred").hash()
		}
		return &r
	}
	c, mode := drawClaim(t)
	r := &AcquireRequest{
		Repo:           pureRepo,
		Scope:          c,
		WorkspaceID:    rapid.SampledFrom([]string{lease.DefaultWorkspace, "wt-1", "wt-2"}).Draw(t, "ws"),
		WorkspaceMode:  mode,
		MaxSharers:     rapid.SampledFrom([]int{0, 0, 2}).Draw(t, "maxSharers"),
		Owner:          owner(rapid.IntRange(1, 4).Draw(t, "owner")),
		TTL:            lease.Duration(time.Duration(rapid.IntRange(1000, 2000).Draw(t, "ttlMs")) * time.Millisecond),
		RequestID:      NewRequestID(),
		CredentialHash: rapid.SampledFrom(s.creds).Draw(t, "cred").hash(),
	}
	if rapid.IntRange(0, 3).Draw(t, "waits") == 0 {
		r.Wait = lease.Duration(time.Duration(rapid.IntRange(100, 3000).Draw(t, "waitMs")) * time.Millisecond)
	}
	if err := r.normalize(); err != nil {
		t.Fatalf("normalize %+v: %v", r, err)
	}
	s.reqs = append(s.reqs, r)
	return r
}

// credFor returns the owner's credential of a lease (mostly) or another.
func (s *pureSim) credFor(id string) Credential {
	l := s.m.leases[id]
	if rapid.IntRange(0, 6).Draw(s.t, "forge") == 0 {
		return rapid.SampledFrom(append(slices.Clone(s.creds), "")).Draw(s.t, "forged")
	}
	for _, c := range s.creds {
		if l != nil && c.hash() == l.credHash {
			return c
		}
	}
	return s.creds[0]
}

func (s *pureSim) pickLease() string {
	if act := s.m.activeIDs(); len(act) > 0 && rapid.IntRange(0, 3).Draw(s.t, "pickActive") != 0 {
		return act[rapid.IntRange(0, len(act)-1).Draw(s.t, "activeLease")]
	}
	if len(s.ids) == 0 || rapid.IntRange(0, 15).Draw(s.t, "unknownLease") == 0 {
		return "lease_0000000000000000"
	}
	// Prefer recent leases: they are more likely active.
	lo := max(0, len(s.ids)-8)
	if rapid.IntRange(0, 3).Draw(s.t, "old") == 0 {
		lo = 0
	}
	return s.ids[rapid.IntRange(lo, len(s.ids)-1).Draw(s.t, "lease")]
}

func (s *pureSim) drawCall() *call {
	t := s.t
	c := &call{at: s.now, reply: make(chan reply, 1)}
	switch op := rapid.IntRange(0, 19).Draw(t, "op"); {
	case op < 8:
		c.op = "acquire"
		r := s.drawAcquire()
		c.req = r
		s.calls[c] = r
	case op < 12:
		c.op = "renew"
		id := s.pickLease()
		r := &RenewRequest{LeaseID: id, Credential: s.credFor(id), RenewID: NewRequestID()}
		if l := s.m.leases[id]; l != nil {
			r.Version = l.version
			switch rapid.IntRange(0, 5).Draw(t, "renewKind") {
			case 0:
				r.Version = l.version - 1 // stale
			case 1:
				r.Version = 0 // no version: refused (the service rejects it even earlier)
			case 2, 3:
				if l.renewID != "" {
					r.RenewID, r.Version = l.renewID, l.version-1 // retry of the last renewal
				}
			case 4:
				if l.jumped { // a version the primary before the takeover may have answered
					r.Version = l.logged - 1 + uint64(rapid.IntRange(0, int(l.version-l.logged)).Draw(t, "answered"))
				}
			}
		}
		r.Proof = renewProof(r.Credential.hash(), r.LeaseID, r.Version, r.RenewID) // as Client.Renew sends it
		c.req = r
	case op < 15:
		c.op = "release"
		id := s.pickLease()
		c.req = &ReleaseRequest{LeaseID: id, Credential: s.credFor(id)}
	case op < 16:
		c.op = "revoke"
		c.req = &RevokeRequest{LeaseID: s.pickLease(), Reason: "test"}
	case op < 17:
		c.op = "cancel"
		var r cancelRequest
		if len(s.a.waiters) > 0 && rapid.Bool().Draw(t, "cancelWaiter") {
			w := s.a.waiters[rapid.IntRange(0, len(s.a.waiters)-1).Draw(t, "waiter")]
			r = cancelRequest{Repo: pureRepo, RequestID: w.req.RequestID}
			for _, cr := range s.creds {
				if cr.hash() == w.req.CredentialHash {
					r.Credential = cr
				}
			}
		} else if len(s.reqs) > 0 {
			q := s.reqs[rapid.IntRange(0, len(s.reqs)-1).Draw(t, "cancelReq")]
			r = cancelRequest{Repo: pureRepo, RequestID: q.RequestID, Credential: rapid.SampledFrom(s.creds).Draw(t, "cancelCred")}
		}
		c.req = &r
	case op < 18:
		c.op = "get"
		c.req = &getRequest{LeaseID: s.pickLease()}
	default:
		c.op = "list"
		c.req = &listRequest{Repo: pureRepo, All: rapid.Bool().Draw(t, "all")}
	}
	return c
}

func leaseIDs(ls []*lease.Lease) []string {
	out := make([]string, len(ls))
	for i, l := range ls {
		out[i] = l.LeaseID
	}
	slices.Sort(out)
	return out
}

func conflictIDs(err error) ([]string, bool) {
	var ce *lease.ConflictError
	if !errors.As(err, &ce) {
		return nil, false
	}
	var ids []string
	for _, c := range ce.Conflicts {
		ids = append(ids, c.LeaseID)
	}
	slices.Sort(ids)
	return ids, true
}

// grantInModel checks a fresh grant against the model and records it.
func (s *pureSim) grantInModel(m *model, r *AcquireRequest, e *entry, how string) {
	t := s.t
	if b := m.blockers(r); len(b) > 0 {
		t.Fatalf("%s granted %s (%s %s %s) over active %v", how, e.LeaseID, e.Scope, e.WorkspaceID, e.WorkspaceMode, b)
	}
	if e.Fence != m.lastFence+1 {
		t.Fatalf("%s granted fence %d, want %d (last fence + 1)", how, e.Fence, m.lastFence+1)
	}
	if _, dup := m.leases[e.LeaseID]; dup {
		t.Fatalf("lease id %s issued twice", e.LeaseID)
	}
	if e.Version != 1 || !e.Active() || e.Scope.String() != r.Scope.String() || e.WorkspaceID != r.WorkspaceID ||
		e.WorkspaceMode != r.WorkspaceMode || e.Owner != r.Owner || e.TTL != r.TTL || e.SecretHash != r.CredentialHash {
		t.Fatalf("%s grant does not match its request: %+v for %+v", how, e, r)
	}
	m.lastFence = e.Fence
	m.leases[e.LeaseID] = &mLease{id: e.LeaseID, repo: e.Repo, scope: r.Scope, ws: r.WorkspaceID, mode: r.WorkspaceMode,
		fence: e.Fence, version: 1, deadline: s.now.Add(time.Duration(r.TTL)), told: s.now.Add(time.Duration(r.TTL)), credHash: r.CredentialHash,
		requestID: r.RequestID, status: lease.StatusActive, ttl: time.Duration(r.TTL), acquiredAt: s.now}
	s.ids = append(s.ids, e.LeaseID)
	s.stats["grant"]++
}

// end marks a lease ended in the model.
func endModel(l *mLease, st lease.Status) {
	l.status = st
	l.version++
}

func wantErr(t *rapid.T, what string, err, sentinel error) {
	if !errors.Is(err, sentinel) {
		t.Fatalf("%s: want %v, got %v", what, sentinel, err)
	}
}

// check compares one call's outcome with the model at this point of the
// batch and advances the model. committed is the model as of the batch's
// start (the service reads byRequest from its committed state).
func (s *pureSim) check(m, committed *model, o outcome, queue []*waiter) {
	t := s.t
	switch r := o.c.req.(type) {
	case *AcquireRequest:
		if l := m.activeByRequest(r); l != nil {
			if o.err != nil || o.lease == nil || o.lease.LeaseID != l.id {
				t.Fatalf("retried acquire %s: want lease %s again, got %+v %v", r.RequestID, l.id, o.lease, o.err)
			}
			s.stats["acquire-retry"]++
			return
		}
		b := m.blockers(r)
		// Strict FIFO: with nothing active in the way, an earlier queued
		// request for an overlapping claim still goes first.
		var queuedFirst string
		for _, w := range queue {
			if !w.cancelled && clash(r.Scope, r.WorkspaceID, r.WorkspaceMode, w.claim.scope, w.claim.workspaceID, w.claim.mode) != "" {
				queuedFirst = w.req.RequestID
				break
			}
		}
		switch {
		case o.lease != nil:
			if queuedFirst != "" {
				t.Fatalf("acquire %s granted ahead of queued overlapping request %s", r.Scope, queuedFirst)
			}
			s.grantInModel(m, r, o.lease, "acquire")
		case o.park != nil:
			if r.Wait == 0 {
				t.Fatalf("acquire without wait was queued")
			}
			if len(b) == 0 && queuedFirst == "" {
				t.Fatalf("acquire %s queued although nothing active or queued blocks it", r.Scope)
			}
			s.stats["parked"]++
		default:
			if r.Wait > 0 {
				t.Fatalf("waiting acquire answered at once: %v", o.err)
			}
			ids, ok := conflictIDs(o.err)
			if !ok {
				t.Fatalf("acquire %s: want a grant or a conflict, got %v", r.Scope, o.err)
			}
			if len(b) == 0 && queuedFirst != "" {
				var ce *lease.ConflictError
				errors.As(o.err, &ce)
				if len(ce.Conflicts) != 1 || ce.Conflicts[0].RequestID != queuedFirst || ce.Conflicts[0].LeaseID != "" {
					t.Fatalf("acquire %s: want a conflict naming queued request %s, got %v", r.Scope, queuedFirst, o.err)
				}
				s.stats["conflict-queued"]++
				return
			}
			if len(b) == 0 || !slices.Equal(ids, b) {
				t.Fatalf("acquire %s %s %s: conflicts %v, model says blockers %v", r.Scope, r.WorkspaceID, r.WorkspaceMode, ids, b)
			}
			s.stats["conflict"]++
		}
	case *RenewRequest:
		l := m.leases[r.LeaseID]
		switch {
		case l == nil:
			wantErr(t, "renew of unknown lease", o.err, lease.ErrNotFound)
		case !r.Credential.matches(l.credHash):
			wantErr(t, "forged renew", o.err, lease.ErrNotOwner)
			s.stats["forged"]++
		case !l.active():
			wantErr(t, "renew of an ended lease", o.err, lease.ErrLeaseLost)
		case r.RenewID != "" && r.RenewID == l.renewID && r.Version+1 == l.version && !l.jumped:
			if o.err != nil || o.lease.Version != l.version {
				t.Fatalf("retried renewal: want v%d back, got %+v %v", l.version, o.lease, o.err)
			}
			s.stats["renew-retry"]++
		case l.jumped && r.Version < l.version && r.Version+1 >= l.logged:
			wantErr(t, "renew at a version answered before the takeover", o.err, errRenewAgain)
			if o.lease == nil || o.lease.Version != l.version {
				t.Fatalf("renew again: want the current v%d with it, got %+v", l.version, o.lease)
			}
			s.stats["renew-again"]++
		case r.Version != l.version:
			wantErr(t, fmt.Sprintf("renew with a stale or missing version (model %+v)", *l), o.err, lease.ErrLeaseLost)
		case !s.now.Before(l.deadline):
			wantErr(t, "renew after the deadline", o.err, lease.ErrLeaseLost)
			endModel(l, lease.StatusExpired)
		default:
			if o.err != nil {
				t.Fatalf("renew of %s v%d refused: %v", l.id, l.version, o.err)
			}
			l.version++
			l.renewID = r.RenewID
			l.deadline = s.now.Add(l.ttl)
			l.told = l.deadline
			if l.jumped {
				l.jumped, l.logged = false, l.version // logged with its batch
			}
			if o.lease.Version != l.version || !o.lease.deadline.Equal(l.deadline) {
				t.Fatalf("renew: got v%d deadline %v, want v%d %v", o.lease.Version, o.lease.deadline, l.version, l.deadline)
			}
			s.stats["renew"]++
		}
	case *ReleaseRequest:
		l := m.leases[r.LeaseID]
		switch {
		case l == nil:
			wantErr(t, "release of unknown lease", o.err, lease.ErrNotFound)
		case !r.Credential.matches(l.credHash):
			wantErr(t, "forged release", o.err, lease.ErrNotOwner)
		case !l.active():
			if o.err != nil || o.lease.Status != l.status {
				t.Fatalf("repeated release: want %s, got %+v %v", l.status, o.lease, o.err)
			}
		default:
			if o.err != nil || o.lease.Status != lease.StatusReleased {
				t.Fatalf("release: %+v %v", o.lease, o.err)
			}
			endModel(l, lease.StatusReleased)
			s.stats["release"]++
		}
	case *RevokeRequest:
		l := m.leases[r.LeaseID]
		switch {
		case l == nil:
			wantErr(t, "revoke of unknown lease", o.err, lease.ErrNotFound)
		case !l.active():
			if o.err != nil || o.lease.Status != l.status {
				t.Fatalf("repeated revoke: %+v %v", o.lease, o.err)
			}
		default:
			if o.err != nil || o.lease.Status != lease.StatusRevoked {
				t.Fatalf("revoke: %+v %v", o.lease, o.err)
			}
			endModel(l, lease.StatusRevoked)
		}
	case *cancelRequest:
		if s.cancelHit != nil {
			if s.cancelHit.req.RequestID != r.RequestID || !r.Credential.matches(s.cancelHit.req.CredentialHash) {
				t.Fatalf("cancel %s withdrew waiter %s", r.RequestID, s.cancelHit.req.RequestID)
			}
			if o.err != nil {
				t.Fatalf("cancel of a waiter: %v", o.err)
			}
			s.stats["cancel-waiter"]++
			return
		}
		for _, w := range queue {
			if !w.cancelled && w.req.RequestID == r.RequestID && r.Credential.matches(w.req.CredentialHash) {
				t.Fatalf("cancel %s did not withdraw its queued acquire", r.RequestID)
			}
		}
		// The cancel finds a grant of its request made before the batch or
		// earlier in it.
		var id string
		for _, l := range m.leases {
			if l.active() && l.requestID == r.RequestID {
				id = l.id
			}
		}
		l := m.leases[id]
		switch {
		case id == "":
			if o.err != nil {
				t.Fatalf("cancel of nothing: %v", o.err)
			}
		case !r.Credential.matches(l.credHash):
			wantErr(t, "forged cancel", o.err, lease.ErrNotOwner)
		case l.active():
			if o.err != nil {
				t.Fatalf("cancel releasing %s: %v", id, o.err)
			}
			endModel(l, lease.StatusReleased)
			s.stats["cancel-release"]++
		default:
			if o.err != nil {
				t.Fatalf("cancel of an ended lease's request: %v", o.err)
			}
		}
	case *getRequest:
		l := m.leases[r.LeaseID]
		if l == nil {
			wantErr(t, "get of unknown lease", o.err, lease.ErrNotFound)
			return
		}
		if o.err != nil || o.lease.Version != l.version || o.lease.Status != l.status || o.lease.Fence != l.fence {
			t.Fatalf("get %s: got %+v %v, model v%d %s fence %d", r.LeaseID, o.lease, o.err, l.version, l.status, l.fence)
		}
	case *listRequest:
		var got, want []string
		for _, l := range o.leases {
			if r.All || l.Active() {
				got = append(got, fmt.Sprintf("%s v%d %s", l.LeaseID, l.Version, l.Status))
			}
			if !r.All && !l.Active() {
				t.Fatalf("list of active leases holds %s %s", l.LeaseID, l.Status)
			}
		}
		for _, l := range m.leases {
			if r.All || l.active() {
				want = append(want, fmt.Sprintf("%s v%d %s", l.id, l.version, l.status))
			}
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("list (all=%v):\n got %v\nwant %v", r.All, got, want)
		}
		if err := checkActiveSet(o.leases, 0); !r.All && err != nil {
			t.Fatal(err)
		}
	}
}

// dumpState renders everything a repoState holds, deadlines included.
func dumpState(s *repoState) string {
	var b strings.Builder
	fmt.Fprintf(&b, "repo=%s fence=%d seq=%d\n", s.repo, s.fence, s.seq)
	for _, id := range slices.Sorted(maps.Keys(s.leases)) {
		e := s.leases[id]
		fmt.Fprintf(&b, "active %s %+v deadline=%v\n", id, *e, e.deadline)
	}
	for _, x := range s.endedFIFO {
		e := s.ended[x.id]
		fmt.Fprintf(&b, "ended %s at %v %+v\n", x.id, x.at, *e)
	}
	for _, k := range slices.Sorted(maps.Keys(s.byRequest)) {
		fmt.Fprintf(&b, "req %s -> %s\n", k, s.byRequest[k])
	}
	return b.String()
}

// recordRoundTrip is a log record as a loader reads it back.
func recordRoundTrip(t *rapid.T, rec *logRecord) *logRecord {
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	var out logRecord
	if err := json.Unmarshal(data, &out); err != nil {
		t.Fatal(err)
	}
	return &out
}

// compareStates checks that a loaded state holds what the writer holds.
func compareStates(t *rapid.T, what string, writer, loaded *repoState) {
	if writer.fence != loaded.fence {
		t.Fatalf("%s: fence %d, writer has %d", what, loaded.fence, writer.fence)
	}
	w := slices.Sorted(maps.Keys(writer.leases))
	l := slices.Sorted(maps.Keys(loaded.leases))
	if !slices.Equal(w, l) {
		t.Fatalf("%s: active %v, writer has %v", what, l, w)
	}
	for _, id := range w {
		a, b := writer.leases[id], loaded.leases[id]
		if a.Fence != b.Fence || a.Status != b.Status || a.SecretHash != b.SecretHash || a.Scope.String() != b.Scope.String() {
			t.Fatalf("%s: lease %s differs: %+v vs %+v", what, id, b.Lease, a.Lease)
		}
		switch {
		case b.logged != a.logged:
			t.Fatalf("%s: lease %s read at v%d; the writer's last record of it has v%d", what, id, b.logged, a.logged)
		case b.jumped:
			// A primary's view: set past the record it read, above every
			// version the writer answered since without a record.
			if b.Version != b.logged+loaded.slack || b.Version < a.Version || b.Version == a.Version && !a.jumped {
				t.Fatalf("%s: lease %s at v%d (its record's v%d) in a primary's view, the writer at v%d (its record's v%d)", what, id, b.Version, b.logged, a.Version, a.logged)
			}
		case b.Version != a.logged:
			t.Fatalf("%s: lease %s at v%d, the writer's record at v%d", what, id, b.Version, a.logged)
		}
		// Renewals the writer answered without a record are not the
		// loader's to count from: a primary that takes over counts every
		// TTL afresh (restart, checked at the sim's takeovers).
		if b.logged == a.Version && b.deadline.Before(a.deadline) {
			t.Fatalf("%s: loader's deadline %v for %s is before the writer's %v: it could reclaim a lease its holder still renews", what, b.deadline, id, a.deadline)
		}
	}
	if !maps.Equal(writer.byRequest, loaded.byRequest) {
		t.Fatalf("%s: request index %v, writer has %v", what, loaded.byRequest, writer.byRequest)
	}
	for id, e := range writer.ended {
		if le, ok := loaded.ended[id]; !ok || le.Status != e.Status || le.Version != e.Version {
			t.Fatalf("%s: ended lease %s missing or different", what, id)
		}
	}
	for _, st := range []*repoState{writer, loaded} {
		for id := range st.ended {
			if st.leases[id] != nil {
				t.Fatalf("%s: lease %s is both active and ended", what, id)
			}
		}
	}
}

// takeover makes the standby's warm view the primary's, as handOver and
// the first batch of a term do: every TTL counted afresh from now, every
// lease set past its record. Renewals the old primary answered without a
// record are not in it.
func (s *pureSim) takeover() {
	st := s.replica
	st.restart(s.now)
	st.enterTerm(s.now)
	s.serveFrom(st, "takeover")
}

// retake has the primary the last takeover replaced take the claim back
// with the view it kept, as a primary whose term another's claim ended
// does: its first batch reads the records it lacks and sets every lease
// past its record (enterTerm).
func (s *pureSim) retake() {
	st := s.prev
	for seq := st.seq + 1; seq <= s.seq; seq++ {
		st.observe(s.record(seq), seq, s.now)
	}
	st.enterTerm(s.now)
	s.serveFrom(st, "retake")
}

// serveFrom makes st the primary's view: no lease may end before its
// holder stops counting, and no version it shows may be below one answered
// or shown before. The model follows it, and a new standby starts warm
// from its snapshot.
func (s *pureSim) serveFrom(st *repoState, how string) {
	t := s.t
	for id, l := range s.m.leases {
		if !l.active() {
			continue
		}
		e, shown := st.leases[id], s.st.leases[id]
		if e == nil || shown == nil {
			t.Fatalf("%s: active lease %s missing from a view", how, id)
		}
		if e.deadline.Before(l.told) {
			t.Fatalf("%s: lease %s's deadline %v is before %v, which its holder was told", how, id, e.deadline, l.told)
		}
		if e.Version < shown.Version || e.Version < l.version || !e.jumped {
			t.Fatalf("%s: lease %s at v%d (set past its record: %v); answered at v%d, shown at v%d before", how, id, e.Version, e.jumped, l.version, shown.Version)
		}
		l.version, l.logged, l.jumped, l.renewID, l.deadline = e.Version, e.logged, e.jumped, e.RenewID, e.deadline
	}
	if got, want := slices.Sorted(maps.Keys(st.leases)), s.m.activeIDs(); !slices.Equal(got, want) {
		t.Fatalf("%s: active %v, model %v", how, got, want)
	}
	s.prev, s.st = s.st, st
	s.a.waiters = nil // queued at the old primary: their clients ask again
	// A new standby, which reads the log.
	s.replica = newRepoState(pureRepo)
	s.replica.slack = renewSlack
	for seq := uint64(1); seq <= s.seq; seq++ {
		s.replica.observe(s.record(seq), seq, s.now)
	}
	compareStates(t, "a new standby's view after a "+how, s.st, s.replica)
	s.stats[how]++
}

func (s *pureSim) batch() {
	t := s.t
	s.now = s.now.Add(time.Duration(rapid.IntRange(0, 1500).Draw(t, "advanceMs")) * time.Millisecond)
	switch {
	case rapid.IntRange(0, 11).Draw(t, "takeover") == 0:
		s.takeover()
	case s.prev != nil && rapid.IntRange(0, 7).Draw(t, "retake") == 0:
		s.retake()
	}
	n := rapid.IntRange(0, 4).Draw(t, "batchSize")
	batch := make([]*call, n)
	for i := range batch {
		batch[i] = s.drawCall()
	}
	before := dumpState(s.st)
	committed := s.m
	m := s.m.clone()

	// As actor.process does it.
	tx := s.st.begin(s.now)
	swept := tx.sweep()
	var wantSwept []string
	for _, l := range m.leases {
		if l.active() && !s.now.Before(l.deadline) {
			wantSwept = append(wantSwept, l.id)
			endModel(l, lease.StatusReclaimed)
		}
	}
	slices.Sort(wantSwept)
	var gotSwept []string
	for _, e := range swept {
		gotSwept = append(gotSwept, e.LeaseID)
		if e.Status != lease.StatusReclaimed {
			t.Fatalf("swept %s has status %s", e.LeaseID, e.Status)
		}
	}
	slices.Sort(gotSwept)
	if !slices.Equal(gotSwept, wantSwept) {
		t.Fatalf("at %v swept %v, want %v (deadline passed)", s.now, gotSwept, wantSwept)
	}
	s.stats["swept"] += len(swept)

	queue := slices.Clone(s.a.waiters)
	for _, c := range batch {
		// A cancel may withdraw a waiter queued before the batch or one
		// parked earlier in it: queue holds both.
		was := map[*waiter]bool{}
		for _, w := range queue {
			was[w] = w.cancelled
		}
		o := s.a.apply(tx, c, queue)
		s.cancelHit = nil
		for _, w := range queue {
			if w.cancelled && !was[w] {
				if s.cancelHit != nil {
					t.Fatalf("one cancel withdrew two waiters")
				}
				s.cancelHit = w
				if o.withdrawn != w {
					t.Fatalf("cancel withdrew waiter %s and says it withdrew %v", w.req.RequestID, o.withdrawn)
				}
			}
		}
		s.check(m, committed, o, queue)
		if o.park != nil {
			queue = append(queue, o.park)
		}
	}
	served, remaining := s.a.serve(tx, queue)
	inServed := map[*waiter]bool{}
	for _, o := range served {
		r := s.calls[o.c]
		var w *waiter
		for _, q := range queue {
			if q.c == o.c {
				w = q
			}
		}
		inServed[w] = true
		switch {
		case o.lease != nil && m.activeByRequest(r) != nil && m.activeByRequest(r).id == o.lease.LeaseID:
		case o.lease != nil:
			s.grantInModel(m, r, o.lease, "queued acquire")
			s.stats["served"]++
		default:
			var ce *lease.ConflictError
			if !errors.As(o.err, &ce) || !ce.Waited {
				t.Fatalf("queued acquire answered with %v", o.err)
			}
			if s.now.Before(w.deadline) {
				t.Fatalf("queued acquire refused at %v before its wait ends at %v", s.now, w.deadline)
			}
			s.stats["wait-expired"]++
		}
	}
	for i, w := range remaining {
		inServed[w] = true
		if !s.now.Before(w.deadline) {
			t.Fatalf("waiter kept past its deadline")
		}
		if len(m.blockers(w.req)) > 0 {
			continue
		}
		blocked := false
		for _, e := range remaining[:i] {
			if clash(w.claim.scope, w.claim.workspaceID, w.claim.mode, e.claim.scope, e.claim.workspaceID, e.claim.mode) != "" {
				blocked = true
			}
		}
		if !blocked {
			t.Fatalf("waiter %s (%s) left queued although nothing blocks it", w.req.RequestID, w.claim.scope)
		}
	}
	for _, w := range queue {
		if !inServed[w] && !w.cancelled {
			t.Fatalf("waiter %s vanished from the queue without an answer", w.req.RequestID)
		}
	}

	if tx.dirty() && rapid.IntRange(0, 9).Draw(t, "appendFails") == 0 {
		// The append failed: nothing of the batch may have touched the
		// committed state. (The real actor then fails the batch and
		// keeps its queue.)
		if after := dumpState(s.st); after != before {
			t.Fatalf("an uncommitted batch changed the committed state:\nbefore:\n%s\nafter:\n%s", before, after)
		}
		s.stats["failed-append"]++
		return
	}
	// As process does: a dirty batch is appended, then every batch commits
	// (a clean one at the unchanged sequence).
	if tx.dirty() {
		s.appendRecord(tx.record())
		tx.commit(s.seq)
		lag := time.Duration(rapid.IntRange(0, 500).Draw(t, "replicaLagMs")) * time.Millisecond
		s.replica.observe(s.record(s.seq), s.seq, s.now.Add(lag))
		compareStates(t, "replica after delta", s.st, s.replica)
	} else {
		if len(tx.renewed) > 0 {
			s.stats["renewals-unlogged"]++
		}
		tx.commit(s.seq)
	}
	s.a.waiters = remaining
	s.m = m

	// The committed state against the model and the invariants.
	act := make([]*lease.Lease, 0, len(s.st.leases))
	for _, e := range s.st.leases {
		act = append(act, &e.Lease)
		ml := m.leases[e.LeaseID]
		if ml == nil || !ml.active() || ml.version != e.Version || ml.fence != e.Fence || !ml.deadline.Equal(e.deadline) {
			t.Fatalf("committed lease %s v%d deadline %v, model %+v", e.LeaseID, e.Version, e.deadline, ml)
		}
		if !s.now.Before(e.deadline) {
			t.Fatalf("lease %s active past its deadline", e.LeaseID)
		}
		if e.jumped && e.Version != e.logged+renewSlack || !e.jumped && e.Version-e.logged >= renewSlack {
			t.Fatalf("lease %s at v%d (set past its record: %v), its record at v%d: renewSlack is %d", e.LeaseID, e.Version, e.jumped, e.logged, renewSlack)
		}
	}
	if got, want := leaseIDs(act), m.activeIDs(); !slices.Equal(got, want) {
		t.Fatalf("committed active %v, model %v", got, want)
	}
	if err := checkActiveSet(act, 0); err != nil {
		t.Fatal(err)
	}
	if s.st.fence != m.lastFence {
		t.Fatalf("fence counter %d, model %d", s.st.fence, m.lastFence)
	}
	if rapid.IntRange(0, 7).Draw(t, "snapshot") == 0 {
		// Appended to the log, as maybeSnapshot does.
		s.appendRecord(s.st.snapshot())
		s.st.seq = s.seq
		fresh := newRepoState("")
		fresh.observe(s.record(s.seq), s.seq, s.now)
		compareStates(t, "fresh load of a snapshot", s.st, fresh)
		s.replica.observe(s.record(s.seq), s.seq, s.now)
		compareStates(t, "replica after snapshot", s.st, s.replica)
		s.stats["snapshot"]++
	}
}

// appendRecord appends rec to the sim's log at the next sequence.
func (s *pureSim) appendRecord(rec *logRecord) {
	data, err := json.Marshal(rec)
	if err != nil {
		s.t.Fatal(err)
	}
	s.seq++
	s.log = append(s.log, data)
}

// record is the log's record at seq, decoded afresh.
func (s *pureSim) record(seq uint64) *logRecord {
	var rec logRecord
	if err := json.Unmarshal(s.log[seq-1], &rec); err != nil {
		s.t.Fatal(err)
	}
	return &rec
}
