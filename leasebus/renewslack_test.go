package leasebus

import (
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// slackLog is a repo's lease log in memory, written as a primary that
// vouches for its view writes it (actor.process): a batch that only renews
// within renewSlack commits without a record.
type slackLog struct {
	t       *testing.T
	records []*logRecord // as stored: encoded and decoded again
}

func (l *slackLog) commit(tx *txn) (logged bool) {
	if !tx.dirty() {
		tx.commit(tx.base.seq)
		return false
	}
	data, err := json.Marshal(tx.record())
	if err != nil {
		l.t.Fatal(err)
	}
	var rec logRecord
	if err := json.Unmarshal(data, &rec); err != nil {
		l.t.Fatal(err)
	}
	l.records = append(l.records, &rec)
	tx.commit(uint64(len(l.records)))
	return true
}

// load is what a primary taking over reads: every record, into a view
// that sets active leases past their records.
func (l *slackLog) load(now time.Time) *repoState {
	s := newRepoState("")
	s.slack = renewSlack
	for i, rec := range l.records {
		data, _ := json.Marshal(rec)
		var fresh logRecord
		if err := json.Unmarshal(data, &fresh); err != nil {
			l.t.Fatal(err)
		}
		s.observe(&fresh, uint64(i+1), now)
	}
	s.repo = "github.com/acme/slack"
	return s
}

// grantLogged grants one lease in s, logged, to the holder of cred.
func (l *slackLog) grantLogged(s *repoState, cred Credential, now time.Time) *entry {
	l.t.Helper()
	cl, err := scope.New([]string{"src/"}, false, nil)
	if err != nil {
		l.t.Fatal(err)
	}
	tx := s.begin(now)
	e := tx.grant(&AcquireRequest{Repo: s.repo, Scope: cl, TTL: lease.Duration(time.Minute), RequestID: NewRequestID(),
		CredentialHash: cred.hash(), by: "runner"}, claimRequest{scope: cl})
	if !l.commit(tx) {
		l.t.Fatal("a grant was not logged")
	}
	return e
}

// renewUnlogged renews the lease id in s n times from version 1, each
// committed as a primary that vouches for its view commits it, and
// returns the version held after them.
func (l *slackLog) renewUnlogged(s *repoState, id string, cred Credential, now time.Time, n uint64) uint64 {
	l.t.Helper()
	for v := uint64(1); v <= n; v++ {
		tx := s.begin(now)
		if _, err := tx.renew(renewal(id, cred, v)); err != nil {
			l.t.Fatal(err)
		}
		l.commit(tx)
	}
	return s.leases[id].Version
}

func renewal(id string, cred Credential, version uint64) *RenewRequest {
	r := &RenewRequest{LeaseID: id, Version: version, RenewID: NewRequestID(), by: "runner"}
	r.Proof = renewProof(cred.hash(), id, version, r.RenewID)
	return r
}

// TestRenewalsWithinRenewSlackAreNotLogged: a primary answers a lease's
// renewals from memory, one record every renewSlack of them, versions
// still rising by one per renewal.
func TestRenewalsWithinRenewSlackAreNotLogged(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/slack"
	log := &slackLog{t: t}
	w := newRepoState(repo)
	cred := NewCredential()
	now := time.Now()
	e := log.grantLogged(w, cred, now)
	var loggedAt []uint64
	for v := uint64(1); v <= 40; v++ {
		now = now.Add(time.Second)
		tx := w.begin(now)
		n, err := tx.renew(renewal(e.LeaseID, cred, v))
		if err != nil || n.Version != v+1 {
			t.Fatalf("renewal of v%d: %+v, %v; want v%d", v, n, err, v+1)
		}
		if log.commit(tx) {
			loggedAt = append(loggedAt, n.Version)
		}
		if got := w.leases[e.LeaseID]; got.Version != v+1 || !got.deadline.Equal(now.Add(time.Minute)) {
			t.Fatalf("after renewing v%d the view has v%d, deadline %v; want v%d, %v", v, got.Version, got.deadline, v+1, now.Add(time.Minute))
		}
	}
	if want := []uint64{1 + renewSlack, 1 + 2*renewSlack}; len(loggedAt) != len(want) || loggedAt[0] != want[0] || loggedAt[1] != want[1] {
		t.Fatalf("40 renewals logged at versions %v; want %v (one in renewSlack = %d)", loggedAt, want, renewSlack)
	}

	// Renewed, then released in the same batch: logged.
	tx := w.begin(now)
	if _, err := tx.renew(renewal(e.LeaseID, cred, 41)); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.release(&ReleaseRequest{LeaseID: e.LeaseID, Credential: cred, by: "runner"}); err != nil {
		t.Fatal(err)
	}
	if !tx.dirty() {
		t.Fatal("a batch that renewed a lease and then released it is not to be logged")
	}
}

// TestTakeoverSetsVersionsPastTheLog: the primary that takes over reads a
// lease whose renewals its predecessor answered without a record; it sets
// the lease renewSlack past its record, above any version answered, so the
// versions it answers and logs never go back. The holder, at a version the
// old primary answered, is told to renew the current version instead,
// which it proves afresh; a captured renewal replayed gets nothing more,
// and a version older than the record is refused as before.
func TestTakeoverSetsVersionsPastTheLog(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/slack"
	log := &slackLog{t: t}
	w := newRepoState(repo)
	cred := NewCredential()
	now := time.Now()
	e := log.grantLogged(w, cred, now)
	var captured *RenewRequest
	for v := uint64(1); v <= 5; v++ { // v2..v6, none logged
		r := renewal(e.LeaseID, cred, v)
		if v == 3 {
			captured = r
		}
		tx := w.begin(now)
		if _, err := tx.renew(r); err != nil {
			t.Fatal(err)
		}
		if log.commit(tx) {
			t.Fatalf("renewal of v%d logged", v)
		}
	}
	held := w.leases[e.LeaseID].Version // 6: what the holder holds

	later := now.Add(10 * time.Second)
	s := log.load(later)
	got := s.leases[e.LeaseID]
	if got.logged != 1 || got.Version != 1+renewSlack || !got.jumped || got.Version <= held {
		t.Fatalf("the new primary's view: v%d (record v%d, set past it: %v); want v%d, above the v%d answered", got.Version, got.logged, got.jumped, 1+renewSlack, held)
	}
	if !got.atVersion(held) || !got.atVersion(1) || got.atVersion(got.Version+1) {
		t.Fatal("atVersion: a keepalive at a version the old primary answered is not vouched for, or one past the current is")
	}

	// The holder's renewal: renew the current version instead.
	tx := s.begin(later)
	cur, err := tx.renew(renewal(e.LeaseID, cred, held))
	if !errors.Is(err, errRenewAgain) || lease.IsFenced(err) || cur == nil || cur.Version != got.Version || tx.dirty() {
		t.Fatalf("renewal at v%d after the takeover: %+v, %v; want renew again at v%d, nothing ended or logged", held, cur, err, got.Version)
	}
	if w := toWire(err).err(); !errors.Is(w, errRenewAgain) {
		t.Fatalf("on the wire: %v; want errRenewAgain", w)
	}
	// A replayed capture gets the same answer and no more: its proof is
	// over its own version.
	tx = s.begin(later)
	if _, err := tx.renew(captured); !errors.Is(err, errRenewAgain) {
		t.Fatalf("a captured renewal replayed: %v; want renew again (it cannot prove the current version)", err)
	}
	forged := renewal(e.LeaseID, NewCredential(), got.Version)
	tx = s.begin(later)
	if _, err := tx.renew(forged); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("a renewal of the current version without the credential: %v; want not the owner", err)
	}
	// The holder proves the current version: granted, and logged.
	tx = s.begin(later)
	n, err := tx.renew(renewal(e.LeaseID, cred, got.Version))
	if err != nil || n.Version != got.Version+1 {
		t.Fatalf("renewal of the current version: %+v, %v", n, err)
	}
	if !log.commit(tx) {
		t.Fatal("the first renewal after a takeover was not logged")
	}
	if after := s.leases[e.LeaseID]; after.jumped || after.logged != after.Version {
		t.Fatalf("after a logged renewal: record v%d, set past it %v; want its own record", after.logged, after.jumped)
	}

	// Another takeover: the record is that renewal's. A version older
	// than the record but its renewal's own is one no primary answered
	// since: refused as ever.
	s2 := log.load(later)
	if e2 := s2.leases[e.LeaseID]; e2.logged != n.Version || e2.Version != n.Version+renewSlack {
		t.Fatalf("after a second takeover: v%d, record v%d; want v%d, record v%d", e2.Version, e2.logged, n.Version+renewSlack, n.Version)
	}
	tx = s2.begin(later)
	if _, err := tx.renew(renewal(e.LeaseID, cred, held)); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("a renewal of v%d, older than the record v%d: %v; want lost", held, n.Version, err)
	}
	tx = s2.begin(later)
	if _, err := tx.renew(renewal(e.LeaseID, cred, n.Version-1)); !errors.Is(err, errRenewAgain) {
		t.Fatalf("a retry of the renewal the record holds: %v; want renew again", err)
	}

	// Retried as last sent, after the answer to that renewal was lost:
	// recognised, not refused (Holder.renew keeps the re-proved version
	// and id for its retries).
	tx = s.begin(later)
	again, err := tx.renew(&RenewRequest{LeaseID: e.LeaseID, Version: got.Version, RenewID: n.RenewID, Proof: renewProof(cred.hash(), e.LeaseID, got.Version, n.RenewID), by: "runner"})
	if err != nil || again.Version != n.Version {
		t.Fatalf("a retry of the re-proved renewal: %+v, %v; want v%d back", again, err, n.Version)
	}
}

// TestVersionsNeverGoBackAcrossTakeovers: a primary that took over shows a
// lease past its record; a snapshot it writes keeps the record's version
// (the ones past it were never answered), so a second takeover sets it no
// further than the first, and a holder still at a version the first
// primary answered renews; a primary that serves again a view it kept from
// an earlier term sets it past its record too (enterTerm), never below what
// the primary in between showed.
func TestVersionsNeverGoBackAcrossTakeovers(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/slack"
	log := &slackLog{t: t}
	a := newRepoState(repo)
	a.slack = renewSlack
	cred := NewCredential()
	now := time.Now()
	e := log.grantLogged(a, cred, now)
	held := log.renewUnlogged(a, e.LeaseID, cred, now, 5) // 6, unlogged

	// B takes over and snapshots the repo without the holder renewing.
	b := log.load(now)
	shown := b.leases[e.LeaseID].Version
	snap := b.snapshot()
	for _, s := range snap.Leases {
		if s.LeaseID == e.LeaseID && s.Version != 1 {
			t.Fatalf("the snapshot writes the lease at v%d: want its record's v1, not the versions set past it", s.Version)
		}
	}
	if b.leases[e.LeaseID].Version != shown {
		t.Fatal("writing a snapshot changed the view")
	}
	log.records = append(log.records, snap)

	// C takes over from the snapshot: no further than B.
	c := log.load(now)
	if v := c.leases[e.LeaseID].Version; v != shown {
		t.Fatalf("after a second takeover: v%d, after the first v%d; want the same", v, shown)
	}
	tx := c.begin(now)
	if _, err := tx.renew(renewal(e.LeaseID, cred, held)); !errors.Is(err, errRenewAgain) {
		t.Fatalf("the holder at v%d after two takeovers: %v; want renew again", held, err)
	}

	// A serves again the view it kept: past what B showed, at least.
	moved := a.enterTerm(now)
	got := a.leases[e.LeaseID]
	if len(moved) != 1 || moved[0] != got || got.Version < shown || !got.jumped {
		t.Fatalf("A's view in a new term: v%d (set past its record: %v, %d moved); want at least v%d, what B showed", got.Version, got.jumped, len(moved), shown)
	}
	if again := a.enterTerm(now); len(again) != 0 {
		t.Fatalf("a second enterTerm moved %d leases: want none", len(again))
	}
	tx = a.begin(now)
	if _, err := tx.renew(renewal(e.LeaseID, cred, held)); !errors.Is(err, errRenewAgain) {
		t.Fatalf("the holder at v%d, with A again: %v; want renew again", held, err)
	}
}

// TestRenewAgainOnlyForItsHolder: the answer that tells a holder to renew
// the current version carries that version; only the identity that
// acquired the lease, proving its credential, gets it. Another identity,
// even with the credential, and a renewal with another credential's proof
// or none, are refused as before a takeover, audited, and given no lease
// (the answer carries the lease txn.renew returns: with a refusal, none).
func TestRenewAgainOnlyForItsHolder(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/slack"
	log := &slackLog{t: t}
	w := newRepoState(repo)
	cred := NewCredential()
	now := time.Now()
	e := log.grantLogged(w, cred, now)
	held := log.renewUnlogged(w, e.LeaseID, cred, now, 3)
	s := log.load(now.Add(time.Second))
	if !s.leases[e.LeaseID].jumped {
		t.Fatal("the new primary's view did not set the lease past its record")
	}

	otherIdentity := renewal(e.LeaseID, cred, held)
	otherIdentity.by = "another-runner"
	wrongProof := renewal(e.LeaseID, NewCredential(), held)
	noProof := renewal(e.LeaseID, cred, held)
	noProof.Proof = ""
	for name, r := range map[string]*RenewRequest{"another identity with the credential": otherIdentity, "another credential's proof": wrongProof, "no proof": noProof} {
		tx := s.begin(now.Add(time.Second))
		got, err := tx.renew(r)
		if !errors.Is(err, lease.ErrNotOwner) || errors.Is(err, errRenewAgain) || got != nil {
			t.Fatalf("%s, at v%d after a takeover: %+v, %v; want not the owner, and no lease", name, held, got, err)
		}
		if len(tx.events) != 1 || tx.events[0].Type != lease.EventRefused || tx.events[0].LeaseID != e.LeaseID {
			t.Fatalf("%s: audited %+v; want one refusal naming the lease", name, tx.events)
		}
	}
	tx := s.begin(now.Add(time.Second))
	if got, err := tx.renew(renewal(e.LeaseID, cred, held)); !errors.Is(err, errRenewAgain) || got == nil {
		t.Fatalf("its holder: %+v, %v; want renew again with the current lease", got, err)
	}
}
