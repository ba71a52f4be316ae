package leasebus

import (
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// A repo remembers an ended lease for endedKeep after this service saw it
// end, and at most maxEnded of them, so that a repeated release (a hedged
// copy, a retry) stays idempotent, a renewal due a third of a TTL after
// the end learns why it was refused, and `lease get` shows a lease that
// just ended. The audit stream keeps every end for good; what the repo
// keeps is in every snapshot and in every instance's memory, so it must
// not grow with a repo's history: kept by count alone, a fleet's churn
// filled the 256 of every repo for over an hour, each node's heap growing
// by about 2 KB an ended lease all the while (256,000 ended leases over
// 1,000 repos), and every snapshot of a repo carried up to 256 of them.
const (
	endedKeep = 5 * time.Minute
	maxEnded  = 256
)

// EndedKept and MaxEndedKept say how long, and how many per repo, ended
// leases stay listed (endedKeep, maxEnded): for what the CLI tells users.
const (
	EndedKept    = endedKeep
	MaxEndedKept = maxEnded
)

// forgottenHint ends the refusal of a request about a lease the repo does
// not know: its holder may have been cut off past the lease's end.
var forgottenHint = fmt.Sprintf(" (no such lease, or one that ended over %s ago or before the last %d this repo remembers)", endedKeep, maxEnded)

// Limits on what a lease may ask for.
const (
	MinTTL = time.Second
	MaxTTL = 24 * time.Hour
)

// entry is a lease as the service keeps it: the public record plus what
// proves and identifies its owner. Everything but deadline is persisted.
type entry struct {
	lease.Lease
	SecretHash string `json:"secretHash"`
	RequestID  string `json:"requestId"`
	RenewID    string `json:"renewId,omitempty"`
	// Holder is the bus identity that acquired the lease (its public
	// nkey): only it may renew, release or cancel it (operators revoke).
	// Empty in records written before leases were bound to identities.
	Holder string `json:"holder,omitempty"`
	// Session is the holder's session the lease is bound to (see
	// AcquireRequest.Session); empty when none.
	Session string `json:"session,omitempty"`

	// logged is the version of the lease's last record in the log, as
	// this service appended or read it; never persisted. A primary answers
	// renewals from memory, so Version runs ahead of it by those renewals,
	// fewer than renewSlack.
	logged uint64
	// jumped: read from the log by a primary's view, and not renewed since,
	// so its Version is set renewSlack past logged (see renewSlack).
	jumped bool
	// deadline is when this service may consider the lease expired, read
	// from its own monotonic clock: the moment it observed the current
	// version plus the TTL. Never persisted: a service that loads the
	// lease observes it anew, so wall clocks never decide expiry.
	deadline time.Time
	// pub and stored cache the public record's JSON and the entry's own
	// (an entry never changes once written; a change is a new entry), so a
	// change is encoded once for the log, the reply, watchers and every
	// snapshot after it. Not persisted.
	pub, stored []byte
}

// publicJSON is the lease record as replies and watchers see it.
func (e *entry) publicJSON() []byte {
	if e.pub == nil {
		if b, ok := appendLease(&e.Lease, make([]byte, 0, 512)); ok {
			e.pub = b
		} else {
			e.pub, _ = json.Marshal(&e.Lease) // a time Marshal refuses: nil, as before
		}
	}
	return e.pub
}

// storedJSON is the entry as the log stores it: the public record's fields
// and the owner's proof, exactly what json.Marshal(e) writes.
func (e *entry) storedJSON() []byte {
	if e.stored == nil {
		pub := e.publicJSON()
		b := append(make([]byte, 0, len(pub)+160), pub[:len(pub)-1]...)
		b = appendField(b, "secretHash", e.SecretHash)
		b = appendField(b, "requestId", e.RequestID)
		if e.RenewID != "" {
			b = appendField(b, "renewId", e.RenewID)
		}
		if e.Holder != "" {
			b = appendField(b, "holder", e.Holder)
		}
		if e.Session != "" {
			b = appendField(b, "session", e.Session)
		}
		e.stored = append(b, '}')
	}
	return e.stored
}

func appendField(b []byte, name, value string) []byte {
	return appendString(append(append(append(b, ',', '"'), name...), '"', ':'), value)
}

func (e *entry) clone() *entry {
	c := *e
	c.pub, c.stored = nil, nil
	c.Scope.Paths = slices.Clone(e.Scope.Paths)
	c.Scope.Tables = slices.Clone(e.Scope.Tables)
	return &c
}

// atVersion reports whether a holder at version v holds e as it is: v is
// e's version or, for a lease a new primary set past its record, a version
// the old primary may have answered, or the record's own (renewSlack).
func (e *entry) atVersion(v uint64) bool {
	return v == e.Version || e.jumped && v < e.Version && v+1 >= e.logged
}

func (e *entry) conflict(why string) lease.Conflict {
	return lease.Conflict{LeaseID: e.LeaseID, Owner: e.Owner, Scope: e.Scope,
		WorkspaceID: e.WorkspaceID, ExpiresAt: e.ExpiresAt, Fence: e.Fence, Why: why}
}

// repoState is the committed lease state of one repo: the fold of its log.
type repoState struct {
	repo      string
	fence     uint64            // last fence issued in this repo
	leases    map[string]*entry // active leases by id
	index     *claimIndex       // the active leases, by what they claim
	byRequest map[string]string // requestKey(holder, acquire request id) -> active lease id
	ended     map[string]*entry // recently ended leases by id
	endedFIFO []endedAt         // ended ids, oldest first
	seq       uint64            // log subject sequence this state reflects (0: none)
	evicted   []string          // ended ids dropped since the owner last looked
	// earliest is a lower bound on the deadlines of the active leases
	// (zero: none), so a batch sweeps only when something may be due.
	// Renewals only push deadlines later, so the bound stays valid; a sweep
	// makes it exact again.
	earliest time.Time
	// slack is how far past its logged version an active lease read from
	// the log is set (renewSlack in a primary's views, where renewals are
	// answered from memory; 0 where every renewal is logged).
	slack uint64
	// room bounds what the repo's leases take (0: no bound; see
	// repoRoom): bytes is what its active and remembered ended leases take
	// (entrySize), active the active ones', heldBy theirs by holder.
	room, bytes, active int
	heldBy              map[string]int
}

// A repo's whole state, its active leases and the ended ones it
// remembers, is one log record (its snapshot) and one answer (a list of
// the repo, which the git fence asks before each push), and neither can
// be larger than the largest message the bus takes: 1 MB on a NATS
// server's defaults, 8 MB on the embedded one. A runner that held ever
// more leases of large claims in one repo made its snapshot too large to
// write and its list too large to answer, for every runner of the repo,
// and once the stream had dropped the repo's last snapshot no instance
// could load it again. So a repo's leases take at most its room, each
// identity's active ones at most a share of it (roomShare), and the ended
// leases it remembers are forgotten, oldest first, past it. A grant past
// either is refused, naming which, as unavailable: a release makes room.
const (
	// roomMargin is what a snapshot's record and message carry beside
	// its leases: its own fields (a repo name of up to 1 KB) and headers.
	roomMargin = 16 << 10
	// roomShare: an identity's active leases in a repo take at most
	// 1/roomShare of its room, so that one runner (or three together)
	// cannot take it all.
	roomShare = 4
)

// repoRoom is the room of a repo whose state must fit in messages of at
// most largest bytes (0: no bound).
func repoRoom(largest int) int {
	if largest <= 0 {
		return 0
	}
	return max(largest-roomMargin, largest/2)
}

// count adds e's bytes to what the state's leases take (sign 1) or takes
// them away (-1).
func (s *repoState) count(e *entry, sign int) {
	n := sign * entrySize(e)
	s.bytes += n
	if !e.Active() {
		return
	}
	s.active += n
	if h := s.heldBy[e.Holder] + n; h > 0 {
		s.heldBy[e.Holder] = h
	} else {
		delete(s.heldBy, e.Holder)
	}
}

// renewSlack bounds the renewals of one lease a primary answers from
// memory, without a record in the log: a renewal that would take a lease
// renewSlack versions past its last record is appended, as every other
// change is. A renewal needs no record for safety — a lease never ends
// before its holder stops counting, because a new primary counts every TTL
// afresh from its takeover, which comes after the old primary's term ends
// (restart) — and answered from memory it costs the cluster no replicated
// write: at 10,000 leases renewals were a third of the appends.
//
// Versions still rise by one per renewal, so a captured renewal's proof,
// made over its version, replays into nothing. What the log lacks is made
// up at a takeover: the new primary sets each active lease renewSlack
// versions past its record, above any version the old primary answered
// (versions never go back, and a record of the lease's end always
// outnumbers what its holder holds), and the holder's next renewal is
// answered errRenewAgain with the current version, which the client proves
// afresh (Client.Renew) and which is logged. So does a primary serving again
// a view it kept from before another instance's term (enterTerm, at the
// view's first batch of a new epoch: primacy.epoch); a snapshot writes
// every lease at the version of its last record.
//
// A renewal answered from memory needs the view vouched for in this term
// (Service.vouches), nothing else: while the log cannot be written (the
// store full, its leader out of reach), a primary still within its term
// keeps its holders' leases alive for up to renewSlack renewals each,
// which is as safe as any other renewal it answers.
const renewSlack = 16

// endedAt is an ended lease's id and when this service saw it end (its
// own monotonic clock, as deadlines are).
type endedAt struct {
	id string
	at time.Time
}

func newRepoState(repo string) *repoState {
	return &repoState{repo: repo, leases: map[string]*entry{}, index: newClaimIndex(),
		byRequest: map[string]string{}, ended: map[string]*entry{}, heldBy: map[string]int{}}
}

// put installs e, as seen at now, as the committed version of its lease,
// and forgets the ended leases past endedKeep.
func (s *repoState) put(e *entry, now time.Time) {
	defer s.forget(now)
	if old, ok := s.leases[e.LeaseID]; ok {
		s.index.remove(old)
		s.count(old, -1)
		// Another lease may carry the same request id (a retry with another
		// credential is a new request): only forget the id if it is ours.
		if k := requestKey(old.Holder, old.RequestID); old.RequestID != "" && s.byRequest[k] == old.LeaseID {
			delete(s.byRequest, k)
		}
	}
	if e.Active() {
		s.index.add(e)
		if s.earliest.IsZero() || e.deadline.Before(s.earliest) {
			s.earliest = e.deadline
		}
		s.leases[e.LeaseID] = e
		s.count(e, 1)
		if e.RequestID != "" {
			s.byRequest[requestKey(e.Holder, e.RequestID)] = e.LeaseID
		}
		return
	}
	delete(s.leases, e.LeaseID)
	if old, seen := s.ended[e.LeaseID]; !seen {
		s.endedFIFO = append(s.endedFIFO, endedAt{e.LeaseID, now})
	} else {
		s.count(old, -1)
	}
	s.ended[e.LeaseID] = e
	s.count(e, 1)
}

// forget drops the ended leases seen ending more than endedKeep before
// now, and the oldest past maxEnded or past the repo's room.
func (s *repoState) forget(now time.Time) {
	for len(s.endedFIFO) > maxEnded || len(s.endedFIFO) > 0 && (now.Sub(s.endedFIFO[0].at) > endedKeep || s.room > 0 && s.bytes > s.room) {
		id := s.endedFIFO[0].id
		s.evicted = append(s.evicted, id)
		if e, ok := s.ended[id]; ok {
			s.count(e, -1)
		}
		delete(s.ended, id)
		s.endedFIFO[0] = endedAt{}
		s.endedFIFO = s.endedFIFO[1:]
	}
}

// observe applies a record read from the log. Leases whose version is new
// to this service get a fresh deadline from now.
func (s *repoState) observe(rec *logRecord, seq uint64, now time.Time) {
	if rec.Kind == recordSnapshot {
		prev := *s
		*s = *newRepoState(s.repo)
		s.evicted = prev.evicted // still to be dropped from the service's lease index
		s.slack, s.room = prev.slack, prev.room
		for _, e := range rec.Leases {
			if old, ok := prev.leases[e.LeaseID]; ok && old.logged == e.Version {
				s.put(old, now) // the record this view has: kept, renewals answered since included
				continue
			}
			s.observeEntry(e, now)
		}
		s.evicted = append(s.evicted, s.dropped(&prev)...)
	} else {
		for _, e := range rec.Leases {
			if old, ok := s.leases[e.LeaseID]; ok && old.logged == e.Version {
				continue
			}
			s.observeEntry(e, now)
		}
	}
	s.fence = max(s.fence, rec.Fence)
	s.seq = seq
}

// ids are the ids of s's leases, active and recently ended.
func (s *repoState) ids() []string {
	out := make([]string, 0, len(s.leases)+len(s.ended))
	for _, m := range []map[string]*entry{s.leases, s.ended} {
		for id := range m {
			out = append(out, id)
		}
	}
	return out
}

// dropped lists the leases old had, active or recently ended, that s has
// not: a snapshot that replaces a view leaves out the ended leases it no
// longer keeps, some of which the view may still have held active (it
// missed their end), and the service's lease index must not keep them.
func (s *repoState) dropped(old *repoState) []string {
	var out []string
	for _, m := range []map[string]*entry{old.leases, old.ended} {
		for id := range m {
			if _, ok := s.leases[id]; !ok {
				if _, ok := s.ended[id]; !ok {
					out = append(out, id)
				}
			}
		}
	}
	return out
}

// restart counts every active lease's TTL afresh from now, as a load
// does: what a new primary does with a warm view at its takeover, during
// which no holder could renew (etcd restarts its leases' TTLs at a leader
// change too). A deadline only moves later: the service never ends a lease
// before its holder, counting from when it sent its last renewal, stops.
func (s *repoState) restart(now time.Time) {
	s.earliest = time.Time{}
	for _, e := range s.leases {
		if d := now.Add(time.Duration(e.TTL)); d.After(e.deadline) {
			e.deadline = d
		}
		if s.earliest.IsZero() || e.deadline.Before(s.earliest) {
			s.earliest = e.deadline
		}
	}
}

func (s *repoState) observeEntry(e *entry, now time.Time) {
	e.logged = e.Version
	if s.slack > 0 && e.Active() {
		e.Version += s.slack
		e.jumped = true
		e.pub, e.stored = nil, nil
	}
	if e.deadline.IsZero() {
		e.deadline = now.Add(time.Duration(e.TTL))
	}
	s.put(e, now)
}

// snapshot is the repo's whole state as one record: its ended leases in
// the order they ended, so that an instance that reads it forgets them in
// the order this one does (by id, a standby that took over forgot a lease
// that had just ended before ones long over), then its active leases by
// id.
func (s *repoState) snapshot() *logRecord {
	rec := &logRecord{Kind: recordSnapshot, Repo: s.repo, Fence: s.fence}
	for _, x := range s.endedFIFO {
		rec.Leases = append(rec.Leases, s.ended[x.id])
	}
	ended := len(rec.Leases)
	for _, e := range s.leases {
		if e.Version != e.logged {
			// At the version of its last record: the renewals answered
			// from memory since, or the versions a takeover set it past,
			// stay out of the log, and whoever reads it sets the lease
			// past them again (renewSlack). Written at its current
			// version, the next takeover would count past that from a
			// record this view does not know it logged.
			r := e.clone()
			r.Version, r.jumped = e.logged, false
			e = r
		}
		rec.Leases = append(rec.Leases, e)
	}
	slices.SortFunc(rec.Leases[ended:], func(a, b *entry) int { return strings.Compare(a.LeaseID, b.LeaseID) })
	return rec
}

// enterTerm sets every active lease of a view this instance serves in a new
// epoch (a term begun over another instance's claim: primacy.epoch)
// renewSlack versions past its record, as observeEntry sets those it reads,
// and returns the leases it changed: a view kept from an earlier term may
// hold versions another primary went past meanwhile (a lease it read and
// never renewed, shown at its record's version plus renewSlack), with
// nothing logged, and versions must not go back.
func (s *repoState) enterTerm(now time.Time) []*entry {
	if s.slack == 0 {
		return nil
	}
	var moved []*entry
	for _, e := range s.leases {
		if e.jumped {
			continue
		}
		n := e.clone()
		n.Version, n.jumped = e.logged+s.slack, true
		moved = append(moved, n)
	}
	for _, n := range moved {
		s.put(n, now)
	}
	return moved
}

// held is the lease id as the view holds it, active or recently ended, or
// nil.
func (s *repoState) held(id string) *entry {
	if e, ok := s.leases[id]; ok {
		return e
	}
	return s.ended[id]
}

// txn is a batch of changes on top of a committed repoState. Nothing in the
// base is modified until the batch's log record is durably written.
type txn struct {
	base    *repoState
	fence   uint64
	changed map[string]*entry
	order   []string // ids in the order they first changed
	events  []lease.AuditEvent
	// renewed are the leases the batch only renewed, within renewSlack
	// of their record: they need not be logged.
	renewed map[string]bool
	swept   bool      // sweep scanned the base: recompute earliest on commit
	now     time.Time // monotonic: deadlines
	wall    time.Time // wall clock: informational times only
	// size estimates the bytes of the record the batch appends (its
	// leases' and events' claims and texts, and each one's fields);
	// budget bounds it (0: no bound). See full.
	size, budget int
	// added is what the batch's grants take of the repo's room, addedBy
	// by holder (roomFor): its ends are not counted back, to be safe.
	added   int
	addedBy map[string]int
	// reservedBy and parkingBy are what the batch reserved across repos
	// by identity (actor.reserveHeld, actor.reserveWait).
	reservedBy, parkingBy map[string]int
	// withdrawn are the waiters the batch's cancels withdrew (actor.cancel).
	withdrawn []*waiter
}

// Estimates of a lease's and an event's bytes in a log record beyond
// their claims and texts (ids, owner, times, hashes; JSON's names and
// quotes): generous, so that an estimate within the budget is a record
// within it.
const (
	entryBytes = 1 << 10
	eventBytes = 512
)

// full reports whether the batch's record has reached its budget: the
// batch serves no more waiters (the next batch, at once, does), so that
// no record is too large to append — which failed every request of the
// batch, whoever sent it. Its calls stop at half of it (callsFull). A
// batch always takes its first call and serves its first waiter.
func (t *txn) full() bool { return t.budget > 0 && t.size >= t.budget }

// callsFull reports whether the batch's calls have taken their half of
// the record's budget; the rest is the waiters' (serve).
func (t *txn) callsFull() bool { return t.budget > 0 && t.size >= t.budget/2 }

// claimBytes bounds c's bytes in a record.
func claimBytes(c scope.Claim) int {
	n := 0
	for _, list := range [][]string{c.Paths, c.Tables} {
		for _, it := range list {
			n += jsonLen(it) + 3 // its quotes and comma
		}
	}
	return n
}

// entrySize bounds e's bytes in a record.
func entrySize(e *entry) int {
	n := entryBytes + claimBytes(e.Scope)
	for _, f := range [...]string{e.Owner.TaskID, e.Owner.AgentID, e.Owner.AttemptID, e.Owner.HostID, e.WorkspaceID, e.Reason, e.RequestID, e.RenewID, e.Session, e.Repo, e.Holder} {
		n += jsonLen(f)
	}
	return n
}

// jsonLen bounds the length of s inside a JSON string as the records'
// encoder writes it: it escapes <, >, & and control bytes as \u00XX, "
// and \ with a backslash, and an invalid byte or U+2028/U+2029 as a
// six-byte escape; any byte past ASCII is counted as such. (Counted raw,
// a claim of '&'s was a sixth of its record: an attacker's review.)
func jsonLen(s string) int {
	n := len(s)
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case c < 0x20 || c >= 0x7f || c == '<' || c == '>' || c == '&':
			n += 5
		case c == '"' || c == '\\':
			n++
		}
	}
	return n
}

func (s *repoState) begin(now time.Time) *txn {
	return &txn{base: s, fence: s.fence, changed: map[string]*entry{}, now: now, wall: now.UTC().Round(time.Millisecond)}
}

// dirty reports whether the batch must be logged: it changed a lease other
// than by a renewal within renewSlack, or has audit events (a refusal is
// logged too, so no event is ever lost). Its renewals alone are logged
// where no primary vouches for the view (process).
func (t *txn) dirty() bool { return len(t.changed) > len(t.renewed) || len(t.events) > 0 }

func (t *txn) lookup(id string) *entry {
	if e, ok := t.changed[id]; ok {
		return e
	}
	if e, ok := t.base.leases[id]; ok {
		return e
	}
	return t.base.ended[id]
}

func (t *txn) write(e *entry) {
	e.jumped = false // changed: versions below it are past, whoever answered them
	delete(t.renewed, e.LeaseID)
	if _, ok := t.changed[e.LeaseID]; !ok {
		t.order = append(t.order, e.LeaseID)
		t.size += entrySize(e)
	}
	t.changed[e.LeaseID] = e
}

// active calls f for each lease active in the transaction, in a stable order.
func (t *txn) active(f func(*entry) bool) {
	for _, e := range t.base.leases {
		if _, ok := t.changed[e.LeaseID]; ok {
			continue
		}
		if !f(e) {
			return
		}
	}
	for _, id := range t.order {
		if e := t.changed[id]; e.Active() && !f(e) {
			return
		}
	}
}

func (t *txn) audit(typ string, e *entry, reason, msg string) {
	ev := lease.AuditEvent{Time: t.wall, Type: typ, Boundary: lease.BoundaryLease, Repo: t.base.repo, Reason: reason, Message: msg}
	if e != nil {
		ev.LeaseID, ev.Owner, ev.Scope, ev.Fence = e.LeaseID, e.Owner, e.Scope, e.Fence
	}
	t.addEvent(ev)
}

// refusal audits a refused request that names no lease: who asked (by,
// as the audit names them) for what. Its texts are clipped as a
// boundary's event is (boundEvent): a refusal quotes claims and
// conflicts the asker chose.
func (t *txn) refusal(by string, o lease.Owner, c scope.Claim, reason, msg string) {
	ev := lease.AuditEvent{Time: t.wall, Type: lease.EventRefused, Boundary: lease.BoundaryLease,
		Repo: t.base.repo, Owner: o, Scope: c, Reason: reason, Message: msg, RequestedBy: by}
	boundEvent(&ev)
	t.addEvent(ev)
}

// addEvent adds ev to the batch's record.
func (t *txn) addEvent(ev lease.AuditEvent) {
	t.events = append(t.events, ev)
	t.size += eventBytes + jsonLen(ev.Message) + jsonLen(ev.Reason) + claimBytes(ev.Scope)
}

// requestKey keys an acquire request id by the identity that sent it.
func requestKey(holder, requestID string) string { return holder + " " + requestID }

// end moves a lease out of active with the given status.
func (t *txn) end(e *entry, st lease.Status, reason string) *entry {
	n := e.clone()
	n.Status = st
	n.Version++
	n.EndedAt = t.wall
	n.Reason = reason
	t.write(n)
	return n
}

// claimRequest is the part of an acquire request that decides conflicts.
type claimRequest struct {
	scope       scope.Claim
	workspaceID string   // where it is (to be) granted; "" for a pool request not yet placed
	pool        []string // candidate workspaces of a pool request
	mode        lease.WorkspaceMode
	maxSharers  int
}

// blocks reports why holder (an active lease or a queued request) keeps req
// from being granted, or "" when it does not.
func blocks(req claimRequest, hScope scope.Claim, hWorkspace string, hMode lease.WorkspaceMode) string {
	if req.scope.Overlaps(hScope) {
		return "claims overlap: " + strings.Join(req.scope.Overlap(hScope), ", ")
	}
	switch {
	case req.workspaceID == hWorkspace && hMode == lease.WorkspaceExclusive:
		return fmt.Sprintf("workspace %s is held exclusively", hWorkspace)
	case req.workspaceID == hWorkspace && req.mode == lease.WorkspaceExclusive:
		return fmt.Sprintf("workspace %s is occupied and an exclusive lease needs it empty", hWorkspace)
	case within(req.workspaceID, hWorkspace) && hMode == lease.WorkspaceExclusive:
		return fmt.Sprintf("workspace %s is held exclusively, and %s lies in it", hWorkspace, req.workspaceID)
	case within(hWorkspace, req.workspaceID) && req.mode == lease.WorkspaceExclusive:
		return fmt.Sprintf("workspace %s is occupied (%s lies in it) and an exclusive lease needs it empty", req.workspaceID, hWorkspace)
	}
	return ""
}

// within reports whether workspace ws lies inside workspace parent, as a
// shard's commit capacity "shard-1/commit" lies in "shard-1": an exclusive
// lease on parent excludes every lease inside it, and the other way round.
func within(ws, parent string) bool {
	return len(ws) > len(parent) && ws[len(parent)] == '/' && ws[:len(parent)] == parent
}

// ancestors calls f with each workspace that ws lies in, outermost first.
func ancestors(ws string, f func(string)) {
	for i := 0; i < len(ws); i++ {
		if ws[i] == '/' && i > 0 {
			f(ws[:i])
		}
	}
}

// conflicts lists the active leases that keep req from being granted now.
func (t *txn) conflicts(req claimRequest) []lease.Conflict {
	var out []lease.Conflict
	check := func(e *entry) {
		if why := blocks(req, e.Scope, e.WorkspaceID, e.WorkspaceMode); why != "" {
			out = append(out, e.conflict(why))
		}
	}
	// Committed leases the index says could block, unless this batch
	// changed them; then the batch's own active leases.
	t.base.index.candidates(req, func(e *entry) {
		if _, changed := t.changed[e.LeaseID]; !changed {
			check(e)
		}
	})
	for _, id := range t.order {
		if e := t.changed[id]; e.Active() {
			check(e)
		}
	}
	if len(out) == 0 && req.mode == lease.WorkspaceShared && req.maxSharers > 0 {
		if sharers := t.sharers(req.workspaceID); len(sharers) >= req.maxSharers {
			for _, e := range sharers {
				out = append(out, e.conflict(fmt.Sprintf("workspace %s already has max-sharers %d", req.workspaceID, req.maxSharers)))
			}
		}
	}
	slices.SortFunc(out, func(a, b lease.Conflict) int { return strings.Compare(a.LeaseID, b.LeaseID) })
	return out
}

// An answer's conflicts are bounded: at most maxConflicts of them, each
// with at most maxConflictItems of its claim's paths and tables and
// maxConflictWhy bytes of why. Each quoted the other lease's whole claim
// (up to 32 KB) and every pair that overlaps: a runner holding a few
// dozen leases of long claims made a whole-repo acquire's refusal larger
// than the bus's largest message, for whoever asked.
const (
	maxConflicts     = 64
	maxConflictItems = 32
	maxConflictWhy   = 512
)

// conflictError is the refusal of a claim in repo for conflicts, bounded
// (maxConflicts).
func conflictError(repo string, conflicts []lease.Conflict, waited bool) *lease.ConflictError {
	ce := &lease.ConflictError{Repo: repo, Waited: waited}
	if n := len(conflicts); n > maxConflicts {
		ce.More = n - maxConflicts
		conflicts = conflicts[:maxConflicts]
	}
	for _, c := range conflicts {
		items := len(c.Scope.Paths) + len(c.Scope.Tables)
		if items > maxConflictItems {
			c.Scope.Paths = c.Scope.Paths[:min(len(c.Scope.Paths), maxConflictItems)]
			c.Scope.Tables = c.Scope.Tables[:min(len(c.Scope.Tables), maxConflictItems-len(c.Scope.Paths))]
			c.Why = fmt.Sprintf("%s (its claim: the first %d of %d paths and tables)", c.Why, maxConflictItems, items)
		}
		if len(c.Why) > maxConflictWhy {
			c.Why = clip(c.Why, maxConflictWhy)
		}
		ce.Conflicts = append(ce.Conflicts, c)
	}
	return ce
}

// place decides where req can be granted now, given the requests queued
// before it: in its workspace, or — for a pool request — in the first
// candidate that fits, shared leases trying candidates with sharers first.
// It returns the claim with its workspace set, or the conflicts that keep
// every candidate from fitting (each blocking lease once).
func (t *txn) place(req claimRequest, queue []*waiter) (claimRequest, []lease.Conflict) {
	fits := func(c claimRequest) []lease.Conflict {
		if out := t.conflicts(c); len(out) > 0 {
			return out
		}
		return queuedConflict(c, queue)
	}
	if len(req.pool) == 0 {
		return req, fits(req)
	}
	order := req.pool
	if req.mode == lease.WorkspaceShared {
		shared := make(map[string]bool, len(order))
		for _, ws := range order {
			shared[ws] = len(t.sharers(ws)) > 0
		}
		order = slices.Clone(order)
		slices.SortStableFunc(order, func(a, b string) int {
			switch {
			case shared[a] == shared[b]:
				return 0
			case shared[a]:
				return -1
			}
			return 1
		})
	}
	var all []lease.Conflict
	seen := map[string]bool{}
	for _, ws := range order {
		c := req
		c.workspaceID = ws
		out := fits(c)
		if len(out) == 0 {
			return c, nil
		}
		for _, x := range out {
			if k := x.LeaseID + "\x00" + x.RequestID + "\x00" + x.Why; !seen[k] {
				seen[k] = true
				all = append(all, x)
			}
		}
	}
	return req, all
}

// sharers lists the active shared leases of a workspace.
func (t *txn) sharers(ws string) []*entry {
	var out []*entry
	for id, e := range t.base.index.shared[ws] {
		if _, changed := t.changed[id]; !changed {
			out = append(out, e)
		}
	}
	for _, id := range t.order {
		if e := t.changed[id]; e.Active() && e.WorkspaceID == ws && e.WorkspaceMode == lease.WorkspaceShared {
			out = append(out, e)
		}
	}
	return out
}

// grant creates a lease for a request that conflicts with nothing.
func (t *txn) grant(r *AcquireRequest, claim claimRequest) *entry {
	t.fence++
	e := &entry{
		Lease: lease.Lease{
			LeaseID:       newLeaseID(RepoKey(t.base.repo), t.wall),
			Repo:          t.base.repo,
			Scope:         claim.scope,
			WorkspaceID:   claim.workspaceID,
			WorkspaceMode: claim.mode,
			Owner:         r.Owner,
			Status:        lease.StatusActive,
			Version:       1,
			Fence:         t.fence,
			AcquiredAt:    t.wall,
			RenewedAt:     t.wall,
			ExpiresAt:     t.wall.Add(time.Duration(r.TTL)),
			TTL:           r.TTL,
		},
		SecretHash: r.CredentialHash,
		RequestID:  r.RequestID,
		Holder:     r.by,
		Session:    r.Session,
		deadline:   t.now.Add(time.Duration(r.TTL)),
	}
	t.write(e)
	if t.addedBy == nil {
		t.addedBy = map[string]int{}
	}
	n := entrySize(e)
	t.added += n
	t.addedBy[e.Holder] += n
	t.audit(lease.EventGrant, e, "", fmt.Sprintf("granted: %s %s owner=%s fence=%d ttl=%s", e.LeaseID, e.Scope, e.Owner, e.Fence, e.TTL))
	t.events[len(t.events)-1].RequestedBy = r.byName
	return e
}

// roomFor refuses to grant claim to r where the lease would take the
// repo's leases past its room, or r's identity's past its share of it
// (see repoRoom), or past the most its identity may hold across every
// repo, which reserve reserves for it (actor.reserveHeld), naming which
// and what to do.
func (t *txn) roomFor(r *AcquireRequest, claim claimRequest, reserve func(t *txn, identity string, n int) (held, most int, ok bool)) error {
	// As its record will be: with its holder, and the longest renewal
	// id a renewal may set (validRenewID), which no renewal checks again.
	n := entrySize(&entry{Lease: lease.Lease{Repo: t.base.repo, Scope: claim.scope, WorkspaceID: claim.workspaceID, Owner: r.Owner},
		RequestID: r.RequestID, Session: r.Session, Holder: r.by}) + maxRenewID
	if err := t.repoRoomFor(r, n); err != nil {
		return err
	}
	if held, most, ok := reserve(t, r.by, n); !ok {
		return fmt.Errorf("%w: the leases of %s take %d KB across its repos (those it released count until their repos forget them, within %s), and this one (%d KB) would take it past the %d KB an identity may hold (the lease service's max held bytes); release some, or wait",
			lease.ErrUnavailable, r.byName, held>>10, endedKeep, max(n>>10, 1), most>>10)
	}
	return nil
}

// repoRoomFor refuses a lease of n bytes to r past the repo's room or
// its identity's share of it (roomFor); an anonymous asker (every client
// of a bus without identities) has no share of its own.
func (t *txn) repoRoomFor(r *AcquireRequest, n int) error {
	room := t.base.room
	if room <= 0 {
		return nil
	}
	if held := t.base.heldBy[r.by] + t.addedBy[r.by]; r.by != Anonymous && held+n > room/roomShare {
		return fmt.Errorf("%w: %s holds leases taking %d KB in repo %s, and this one (%d KB) would take it past its share, %d KB: a quarter of what one repo's leases may take, since its whole state is one log record and one answer; release some of them first",
			lease.ErrUnavailable, r.byName, held>>10, t.base.repo, max(n>>10, 1), room/roomShare>>10)
	}
	if used := t.base.active + t.added; used+n > room {
		return fmt.Errorf("%w: the active leases of repo %s take %d KB of the %d KB its state may (one log record and one answer carry it whole); retry once some are released",
			lease.ErrUnavailable, t.base.repo, used>>10, room>>10)
	}
	return nil
}

// granted returns the lease already granted for this request id, if any:
// acquire is idempotent, so a retry after a lost reply gets the same lease.
func (t *txn) granted(r *AcquireRequest) *entry {
	if e := t.byRequest(r.by, r.RequestID); e != nil && e.SecretHash == r.CredentialHash {
		return e
	}
	return nil
}

// byRequest is the active lease identity holder's acquire request was
// granted, before this batch or earlier in it, or nil. Request ids are
// each identity's own: another identity's lease with the same id (which
// a runner can learn: a conflict names the queued request it waits
// behind) neither answers nor displaces it.
func (t *txn) byRequest(holder, requestID string) *entry {
	if requestID == "" {
		return nil
	}
	id, ok := t.base.byRequest[requestKey(holder, requestID)]
	for _, lid := range t.order {
		if e := t.changed[lid]; e.RequestID == requestID && e.Holder == holder {
			id, ok = lid, true
		}
	}
	if e := t.lookup(id); ok && e != nil && e.Active() {
		return e
	}
	return nil
}

// otherIdentity refuses op on e by identity by when another identity
// acquired it, auditing the refusal: a lease is bound to the identity
// that acquired it, whatever credential or proof comes with the request.
func (t *txn) otherIdentity(op string, e *entry, by string) error {
	if e.Holder == "" || e.Holder == by {
		return nil
	}
	t.audit(lease.EventRefused, e, "other-identity", fmt.Sprintf("refused %s of %s: asked by bus identity %s, acquired by %s (owner=%s fence=%d)", op, e.LeaseID, by, e.Holder, e.Owner, e.Fence))
	return fmt.Errorf("%s %s: %w: the lease belongs to the bus identity that acquired it, and this is another (each runner has its own; an operator may revoke it)", op, e.LeaseID, lease.ErrNotOwner)
}

// owned finds the lease and checks the identity and the credential,
// auditing refusals.
func (t *txn) owned(op, id, by string, cred Credential) (*entry, error) {
	e := t.lookup(id)
	if e == nil {
		return nil, fmt.Errorf("%s %s: %w in %s%s", op, id, lease.ErrNotFound, t.base.repo, forgottenHint)
	}
	if err := t.otherIdentity(op, e, by); err != nil {
		return nil, err
	}
	if !cred.matches(e.SecretHash) {
		t.audit(lease.EventRefused, e, "not-owner", fmt.Sprintf("refused %s of %s: credential does not match (owner=%s)", op, id, e.Owner))
		return nil, fmt.Errorf("%s %s: %w (the lease id alone is not enough; use the credential its acquirer received)", op, id, lease.ErrNotOwner)
	}
	return e, nil
}

func (t *txn) renew(r *RenewRequest) (*entry, error) {
	e := t.lookup(r.LeaseID)
	if e == nil {
		return nil, fmt.Errorf("renew %s: %w in %s%s", r.LeaseID, lease.ErrNotFound, t.base.repo, forgottenHint)
	}
	if err := t.otherIdentity("renew", e, r.by); err != nil {
		return nil, err
	}
	if !r.proves(e.SecretHash) {
		t.audit(lease.EventRefused, e, "not-owner", fmt.Sprintf("refused renew of %s: its proof does not match (owner=%s)", r.LeaseID, e.Owner))
		return nil, fmt.Errorf("renew %s: %w (a renewal proves the credential its acquirer received, over this lease, version and renewal id)", r.LeaseID, lease.ErrNotOwner)
	}
	if !e.Active() {
		t.audit(lease.EventRenewRefused, e, string(e.Status), fmt.Sprintf("renew refused: %s is %s (%s)", e.LeaseID, e.Status, e.Reason))
		return nil, fmt.Errorf("renew %s: %w: it is %s (%s)", e.LeaseID, lease.ErrLeaseLost, e.Status, e.Reason)
	}
	if r.RenewID != "" && r.RenewID == e.RenewID && r.Version+1 == e.Version && !e.jumped {
		return e, nil // a retry of the renewal that produced this version (set past it: renew again, below)
	}
	if r.Version != e.Version && e.atVersion(r.Version) {
		// A version the last primary may have answered (or the log's
		// own, a retry of its renewal among them): renew this one.
		return e, fmt.Errorf("renew %s: %w: version %d, holder had %d (the lease service changed hands)", e.LeaseID, errRenewAgain, e.Version, r.Version)
	}
	if r.Version != e.Version {
		t.audit(lease.EventRenewRefused, e, "version", fmt.Sprintf("renew refused: %s version %d, holder sent %d", e.LeaseID, e.Version, r.Version))
		return nil, fmt.Errorf("renew %s: %w: version is %d, holder had %d", e.LeaseID, lease.ErrLeaseLost, e.Version, r.Version)
	}
	if !t.now.Before(e.deadline) {
		late := t.now.Sub(e.deadline).Round(time.Second)
		n := t.end(e, lease.StatusExpired, "ttl lapsed before renewal")
		t.audit(lease.EventExpired, n, "ttl", fmt.Sprintf("expired: %s owner=%s renew arrived %s after its ttl", n.LeaseID, n.Owner, late))
		return nil, fmt.Errorf("renew %s: %w: its ttl of %s lapsed %s ago", e.LeaseID, lease.ErrLeaseLost, e.TTL, late)
	}
	n := e.clone()
	n.Version++
	n.RenewID = r.RenewID
	n.RenewedAt = t.wall
	n.ExpiresAt = t.wall.Add(time.Duration(n.TTL))
	n.deadline = t.now.Add(time.Duration(n.TTL))
	_, changed := t.changed[n.LeaseID]
	t.write(n)
	if !changed && !e.jumped && n.Version-n.logged < renewSlack {
		if t.renewed == nil {
			t.renewed = map[string]bool{}
		}
		t.renewed[n.LeaseID] = true
	}
	return n, nil
}

func (t *txn) release(r *ReleaseRequest) (*entry, error) {
	e, err := t.owned("release", r.LeaseID, r.by, r.Credential)
	if err != nil {
		return nil, err
	}
	if !e.Active() {
		return e, nil // idempotent for the owner
	}
	n := t.end(e, lease.StatusReleased, "released by owner")
	t.audit(lease.EventRelease, n, "", fmt.Sprintf("released: %s owner=%s fence=%d", n.LeaseID, n.Owner, n.Fence))
	return n, nil
}

func (t *txn) revoke(r *RevokeRequest) (*entry, error) {
	e := t.lookup(r.LeaseID)
	if e == nil {
		return nil, fmt.Errorf("revoke %s: %w", r.LeaseID, lease.ErrNotFound)
	}
	if !e.Active() {
		return e, nil
	}
	n := t.end(e, lease.StatusRevoked, "revoked: "+r.Reason)
	t.audit(lease.EventRevoked, n, r.Reason, fmt.Sprintf("revoked: %s owner=%s fence=%d reason=%q by=%s", n.LeaseID, n.Owner, n.Fence, r.Reason, r.by))
	t.events[len(t.events)-1].RequestedBy = r.by
	return n, nil
}

// sweep reclaims every active lease whose deadline has passed.
func (t *txn) sweep() []*entry {
	if t.base.earliest.IsZero() || t.now.Before(t.base.earliest) {
		return nil // nothing can be due: leases granted in this batch are fresh
	}
	t.swept = true
	var expired []*entry
	t.active(func(e *entry) bool {
		if !t.now.Before(e.deadline) {
			expired = append(expired, e)
		}
		return true
	})
	slices.SortFunc(expired, func(a, b *entry) int { return strings.Compare(a.LeaseID, b.LeaseID) })
	out := make([]*entry, 0, len(expired))
	for _, e := range expired {
		if t.full() && len(out) > 0 {
			break // the next batch, at once, reclaims the rest (wakeAt: their deadlines passed)
		}
		late := t.now.Sub(e.deadline).Round(time.Second)
		n := t.end(e, lease.StatusReclaimed, fmt.Sprintf("ttl %s lapsed without renewal", e.TTL))
		t.audit(lease.EventReclaimed, n, "expired", fmt.Sprintf("reclaimed: %s owner=%s expired=%ds", n.LeaseID, n.Owner, int(late.Seconds())))
		out = append(out, n)
	}
	return out
}

// reap reclaims every active lease whose session silent says has been
// silent past its grace (its process died, or has been cut off for far
// longer than it may write: a holder stops after its Silence).
func (t *txn) reap(silent func(e *entry, now time.Time) (time.Duration, bool)) {
	var dead []*entry
	t.active(func(e *entry) bool {
		if _, due := silent(e, t.now); due {
			dead = append(dead, e)
		}
		return true
	})
	slices.SortFunc(dead, func(a, b *entry) int { return strings.Compare(a.LeaseID, b.LeaseID) })
	for i, e := range dead {
		if t.full() && i > 0 {
			break // the reaper's next look reclaims the rest
		}
		quiet, _ := silent(e, t.now)
		quiet = quiet.Round(100 * time.Millisecond)
		n := t.end(e, lease.StatusReclaimed, fmt.Sprintf("session %s sent no keepalive for %s", e.Session, quiet))
		t.audit(lease.EventReclaimed, n, "session-lost", fmt.Sprintf("reclaimed: %s owner=%s fence=%d: its holder's session %s sent no keepalive for %s (the process holding it exited, or lost the bus)", n.LeaseID, n.Owner, n.Fence, e.Session, quiet))
	}
}

// commit installs the batch into the base state after its record landed at
// seq (the base's own sequence: nothing was logged, the batch only renewed
// or changed nothing).
func (t *txn) commit(seq uint64) {
	logged := seq != t.base.seq
	for _, id := range t.order {
		e := t.changed[id]
		if logged {
			e.logged, e.jumped = e.Version, false
		}
		t.base.put(e, t.now)
	}
	t.base.fence = t.fence
	t.base.seq = seq
	if t.swept {
		t.base.earliest = time.Time{}
		for _, e := range t.base.leases {
			if t.base.earliest.IsZero() || e.deadline.Before(t.base.earliest) {
				t.base.earliest = e.deadline
			}
		}
	}
}

func (t *txn) record() *logRecord {
	rec := &logRecord{Kind: recordDelta, Repo: t.base.repo, Fence: t.fence}
	for _, id := range t.order {
		rec.Leases = append(rec.Leases, t.changed[id])
	}
	// An event about a lease in this record leaves out what the lease
	// record says (owner, scope, fence); fillEvents puts it back on load.
	rec.Events = make([]lease.AuditEvent, len(t.events))
	for i, ev := range t.events {
		if e, ok := t.changed[ev.LeaseID]; ok && ev.Owner == e.Owner && ev.Fence == e.Fence {
			ev.Owner, ev.Scope, ev.Fence = lease.Owner{}, scope.Claim{}, 0
		}
		rec.Events[i] = ev
	}
	return rec
}

// fillEvents restores the owner, scope and fence that record() left out of
// events about leases in the same record.
func (rec *logRecord) fillEvents() {
	for i := range rec.Events {
		ev := &rec.Events[i]
		if ev.LeaseID == "" || ev.Fence != 0 {
			continue
		}
		for _, e := range rec.Leases {
			if e.LeaseID == ev.LeaseID {
				ev.Owner, ev.Scope, ev.Fence = e.Owner, e.Scope, e.Fence
				break
			}
		}
	}
}

// nextDeadline is when the next sweep may find something due (zero: never).
func (s *repoState) nextDeadline() time.Time { return s.earliest }
