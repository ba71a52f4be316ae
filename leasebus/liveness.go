package leasebus

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// The lease service's side of sessions (see session.go): it answers each
// keepalive with its word on every lease asked after, notes that the
// session lives, and reclaims the leases of a session that has gone
// silent. Instances share what they heard: each publishes, every
// digestEvery, the sessions that kept alive through it, so any of them
// may reclaim, and none reclaims while it is not hearing every other.

// DefaultSessionGrace is how long a session may send no keepalive before
// the service reclaims its leases: many heartbeats (a holder stops writing
// after DefaultSilence without an answer), well above a reconnect or a
// leader election, and short enough that a killed runner's scope is back
// in seconds, not at the end of its TTL.
const DefaultSessionGrace = 10 * time.Second

const (
	// sessionsSubject carries the instances' digests of the sessions they
	// heard (core NATS, between instances; not a request subject).
	sessionsSubject = apiPrefix + ".sessions"
	// digestEvery is how often an instance publishes its digest, and
	// reapEvery how often it looks for sessions gone silent.
	digestEvery = time.Second
	reapEvery   = time.Second
	// peerLate is how long after another instance's last digest this one
	// stops reclaiming (it may be missing what that one heard); peerGone,
	// how long before it counts that instance as gone.
	peerLate = 3 * digestEvery
)

// liveness is what one instance knows of sessions' keepalives.
type liveness struct {
	grace time.Duration
	since time.Time // when this instance started listening: the grace of a session never heard runs from here

	mu   sync.Mutex
	seen map[string]time.Time // session key (identity.session) -> last keepalive heard; guarded by mu
	// byIdentity is the last keepalive heard of any session of each
	// identity (idle); guarded by mu.
	byIdentity map[string]time.Time
	fresh      map[string]struct{}  // heard since the last digest; guarded by mu
	peers      map[string]time.Time // other instance -> its last digest; guarded by mu
	// sessions counts the keys in seen by identity; guarded by mu.
	sessions map[string]int
}

// maxSessionsEach bounds the sessions of one identity an instance keeps:
// those it heard of, through its own keepalives or in another instance's
// digest, within the last massGraces+1 graces (so in effect per identity
// across the service, the silent of the last four graces counted). A
// process keeps one session; an identity shared by many processes (a
// host's by-hand holder.nk) starts new ones at most about a hundred a
// second before it meets the bound. A runner making up sessions by the
// thousand would grow every instance's memory and digest without bound.
const maxSessionsEach = 4096

func newLiveness(grace time.Duration, now time.Time) *liveness {
	return &liveness{grace: grace, since: now, seen: map[string]time.Time{}, byIdentity: map[string]time.Time{}, fresh: map[string]struct{}{}, peers: map[string]time.Time{}, sessions: map[string]int{}}
}

// sessionKey names a session: its id within the identity that keeps it
// alive (no identity keeps another's session alive).
func sessionKey(identity, session string) string { return identity + "." + session }

// heard notes a keepalive of session key; false, noting nothing, when the
// session is new and its identity has maxSessionsEach sessions already.
func (l *liveness) heard(key string, now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if _, ok := l.seen[key]; !ok {
		id := identityOfKey(key)
		if l.sessions[id] >= maxSessionsEach {
			return false
		}
		l.sessions[id]++
	}
	l.seen[key] = now
	l.fresh[key] = struct{}{}
	l.heardIdentity(key, now)
	return true
}

// admits reports whether a keepalive of session key would be noted (see
// heard), and how many sessions its identity has: an acquire bound to a
// session past the bound is refused before it is granted, rather than
// granted to a session whose keepalives are refused.
func (l *liveness) admits(key string) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := l.sessions[identityOfKey(key)]
	if _, ok := l.seen[key]; ok {
		return true, n
	}
	return n < maxSessionsEach, n
}

// identityOfKey is the identity of session key.
func identityOfKey(key string) string {
	id, _, _ := strings.Cut(key, ".")
	return id
}

// heardIdentity notes that the identity of session key was heard at t;
// l.mu is held.
func (l *liveness) heardIdentity(key string, t time.Time) {
	id := identityOfKey(key)
	if t.After(l.byIdentity[id]) {
		l.byIdentity[id] = t
	}
}

// from makes every session's silence count from no earlier than now. A
// new primary calls it: it heard none of the keepalives its predecessor
// answered, and those sent while no instance was primary were answered by
// none — forwarded to a primary that was gone. Counted from before, the
// sessions of a whole fleet, alive and beating, looked silent past their
// grace after a failover, and lost their leases.
func (l *liveness) from(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.After(l.since) {
		l.since = now
	}
}

// pause forgives every session d of silence: this instance did not run
// for d (a pause of its process or machine), and heard nothing then that
// it would have. Silence counts only while the instance listens.
func (l *liveness) pause(d time.Duration, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.since = minTime(l.since.Add(d), now)
	for k, t := range l.seen {
		l.seen[k] = minTime(t.Add(d), now)
	}
	for id, t := range l.byIdentity {
		l.byIdentity[id] = minTime(t.Add(d), now)
	}
}

// silent is how long the session has sent nothing this instance knows of.
func (l *liveness) silent(key string, now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	last := l.seen[key]
	if last.Before(l.since) {
		last = l.since
	}
	return now.Sub(last)
}

// idle is how long no session of identity has sent anything this instance
// knows of.
func (l *liveness) idle(identity string, now time.Time) time.Duration {
	l.mu.Lock()
	defer l.mu.Unlock()
	last := l.since
	if t := l.byIdentity[identity]; t.After(last) {
		last = t
	}
	return now.Sub(last)
}

// current reports whether this instance hears every other instance's
// digests: reclaiming on its own view is safe only then. An instance
// silent for the grace is counted gone (it no longer answers keepalives
// either).
func (l *liveness) current(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	ok := true
	for p, last := range l.peers {
		switch age := now.Sub(last); {
		case age > l.grace:
			delete(l.peers, p)
		case age > peerLate:
			ok = false
		}
	}
	return ok
}

// digest takes the sessions heard since the last digest, and forgets
// those silent for longer than the longest grace (their leases are
// reclaimed by then: see massGraces).
func (l *liveness) digest(now time.Time) []byte {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b bytes.Buffer
	for k := range l.fresh {
		b.WriteString(k)
		b.WriteByte('\n')
	}
	clear(l.fresh)
	for k, t := range l.seen {
		if now.Sub(t) > (massGraces+1)*l.grace {
			delete(l.seen, k)
			id := identityOfKey(k)
			if l.sessions[id]--; l.sessions[id] <= 0 {
				delete(l.sessions, id)
			}
		}
	}
	for id, t := range l.byIdentity {
		if now.Sub(t) > maxIdleKept*l.grace {
			delete(l.byIdentity, id) // idle counts from since after that: no shorter
		}
	}
	return b.Bytes()
}

// learn applies another instance's digest.
func (l *liveness) learn(peer string, data []byte, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.peers[peer] = now
	for line := range strings.Lines(string(data)) {
		if k := strings.TrimSuffix(line, "\n"); k != "" && len(k) <= 128 {
			if _, ok := l.seen[k]; !ok {
				l.sessions[identityOfKey(k)]++ // another instance's word: counted, never refused
			}
			l.seen[k] = now
			l.heardIdentity(k, now)
		}
	}
}

// keepalive answers a session's keepalive from identity id: from this
// instance's recent view of each lease (cachedLease) where it has one,
// else from its repo's actor, which reads the log.
//
// Its answer carries this instance's beat anchor (beat.go), read before the
// views, when this instance beats.
func (s *Service) keepalive(c *call, id string, r *keepaliveRequest) {
	now := s.cfg.Now()
	if !s.live.heard(sessionKey(id, r.Session), now) {
		s.refuseSession(c, id, "keepalive")
		return
	}
	anchor := s.beatAnchor(s.viewing())
	answers := make([]keptAnswer, len(r.Leases))
	ask := s.keptFromViews(r.Leases, answers)
	if len(ask) == 0 {
		respondKept(c, answers, r.Compact, anchor)
		return
	}
	if !s.takeKeptReader(id) {
		// As many keepalives read logs already as may (or as this
		// identity's may): the rest stay Unknown this beat, as those
		// past maxKeptReads do.
		respondKept(c, answers, r.Compact, anchor)
		return
	}
	read := s.goTracked(c, func() {
		defer s.doneKeptReader(id)
		for n, i := range ask {
			if n == maxKeptReads {
				break // the rest stay Unknown: their views are being refreshed meanwhile
			}
			answers[i] = s.keptFromLog(id, r.Leases[i])
		}
		respondKept(c, answers, r.Compact, anchor)
	})
	if !read {
		s.doneKeptReader(id) // (stopping or overloaded: answered so)
	}
}

// refuseSession refuses request op of identity id, for a new session past
// maxSessionsEach: audited, and answered as an overload.
func (s *Service) refuseSession(c *call, id, op string) {
	_, n := s.live.admits(sessionKey(id, ""))
	what := fmt.Sprintf("%s has %d sessions alive or silent for less than %d graces already (at most %d an identity)", s.name(id), n, massGraces+1, maxSessionsEach)
	s.refuse(ReasonBusOverload, id, "refused a "+op+" of a new session: "+what)
	c.fail(fmt.Errorf("%w: lease service overloaded: %s; a process keeps one session", lease.ErrUnavailable, what))
}

// takeKeptReader takes one of the maxKeptReaders places for a keepalive
// of identity id to read logs in, unless id has maxKeptReadersEach of them
// already: a runner whose keepalives name leases no view covers (made-up
// ones, in a repo kept busy) holds at most that many, and the others'
// keepalives still read.
func (s *Service) takeKeptReader(id string) bool {
	s.keptMu.Lock()
	defer s.keptMu.Unlock()
	if s.keptReaders[id] >= maxKeptReadersEach {
		return false
	}
	select {
	case s.keptReads <- struct{}{}:
	default:
		return false
	}
	s.keptReaders[id]++
	return true
}

// doneKeptReader gives back a place takeKeptReader took for id.
func (s *Service) doneKeptReader(id string) {
	s.keptMu.Lock()
	defer s.keptMu.Unlock()
	if s.keptReaders[id]--; s.keptReaders[id] <= 0 {
		delete(s.keptReaders, id)
	}
	<-s.keptReads
}

// respondKept answers a keepalive with answers, one per lease it asked
// after — or, to a compact one, with those that say more than "active at
// the version asked" and one KeptRest for the others, as of the oldest
// view among them. anchor, when not nil, is this instance's beat anchor.
func respondKept(c *call, answers []keptAnswer, compact bool, anchor *beatAnchor) {
	if !compact {
		c.respond(reply{Kept: answers, Beat: anchor})
		return
	}
	var rest lease.Duration
	var listed []keptAnswer
	for _, a := range answers {
		if a.Lease == nil && !a.Missing && !a.Unknown {
			rest = max(rest, a.Age)
			continue
		}
		listed = append(listed, a)
	}
	if len(listed) > 0 || anchor != nil || c.reply != nil || c.msg == nil {
		c.respond(reply{Kept: listed, KeptRest: &keptRest{Age: rest}, Beat: anchor})
		return
	}
	c.answered(nil)
	answer(c.msg, keptRestReply(rest))
}

// keptFromViews answers into answers, from this instance's views as
// cachedLease would, each lease of ks it can vouch for now, and returns the
// indexes of the others (marked Unknown): one hold of the service's lock
// for them all, and a lease's record copied only when it is not what the
// holder has. Thousands of keepalives a second come this way.
func (s *Service) keptFromViews(ks []keptLease, answers []keptAnswer) (ask []int) {
	v := s.viewing()
	views := make([]*indexed, len(ks))
	actors := make([]*actor, len(ks))
	s.mu.Lock()
	for i, k := range ks {
		views[i], actors[i] = s.viewOfLocked(k.LeaseID)
	}
	s.mu.Unlock()
	for i, k := range ks {
		answers[i].LeaseID = k.LeaseID
		var age time.Duration
		ok := actors[i] != nil
		if ok {
			age, ok = s.viewAge(actors[i], v)
		}
		if !ok {
			answers[i].Unknown = true
			ask = append(ask, i)
			continue
		}
		answers[i].Age = lease.Duration(age)
		if ix := views[i]; !ix.e.atVersion(k.Version) || ix.e.Status != lease.StatusActive {
			l := ix.e.Lease
			answers[i].Lease = &l
		}
	}
	return ask
}

// maxKeptReads bounds the log reads one keepalive may cause: a request
// naming a thousand leases no view covers must not cost a thousand reads.
// A lease left Unknown is answered from its refreshed view a beat later.
// maxKeptReaders bounds the keepalives reading logs at once, each on a
// goroutine of its own: a runner sending keepalives that name made-up
// leases as fast as it can must not start goroutines as fast.
// maxKeptReadersEach bounds those of one identity.
const (
	maxKeptReads       = 16
	maxKeptReaders     = 64
	maxKeptReadersEach = 8
)

// keptFromLog answers for one lease from a read of its repo's log: the
// repo its id names (loading it if this instance has not yet), else one
// this instance already has an actor for. A lease no log is found for is
// Unknown, not Missing: an old-form id may be in a repo not loaded yet.
// by is the asking identity: the read queues at the repo in its turn.
func (s *Service) keptFromLog(by string, k keptLease) keptAnswer {
	out := keptAnswer{LeaseID: k.LeaseID, Unknown: true}
	ctx, cancel := context.WithTimeout(s.ctx, maxKeptWait)
	defer cancel()
	var a *actor
	if key, ok := LeaseRepoKey(k.LeaseID); ok {
		a, _ = s.loadedActor(ctx, key)
	} else if a, ok = s.existing(RepoKey(k.Repo)); !ok || k.Repo == "" {
		a, _ = s.actorForLease(k.LeaseID)
	}
	if a == nil {
		return out
	}
	r := a.ask(ctx, &call{op: "get", by: by, req: &getRequest{LeaseID: k.LeaseID, Repo: k.Repo}})
	switch err := r.Error.err(); {
	case errors.Is(err, lease.ErrNotFound):
		out.Unknown, out.Missing = false, true
	case err != nil || r.Lease == nil:
	default:
		out.Unknown = false
		if r.Lease.Status != lease.StatusActive || !s.heldAt(k.LeaseID, r.Lease.Version, k.Version) {
			out.Lease = r.Lease
		}
	}
	return out
}

// heldAt reports whether a holder at version held holds lease id, which
// the service has at version current: the same version, or one of those
// the lease was set past at a takeover (entry.atVersion).
func (s *Service) heldAt(id string, current, held uint64) bool {
	if current == held {
		return true
	}
	s.mu.Lock()
	ix := s.index[id]
	s.mu.Unlock()
	return ix != nil && ix.e.Version == current && ix.e.atVersion(held)
}

// maxKeptWait bounds a keepalive's read of one lease's log: its holder
// stops waiting after its silence anyway.
const maxKeptWait = 500 * time.Millisecond

// checkKeepalive validates a keepalive request.
func checkKeepalive(r *keepaliveRequest) error {
	if !validSession(r.Session) {
		return fmt.Errorf("%w: keepalive of session %q: want %s followed by 32 hex digits", lease.ErrInvalid, clip(r.Session, 80), sessionPrefix)
	}
	if len(r.Leases) > maxKept {
		return fmt.Errorf("%w: keepalive asks after %d leases: at most %d per request (send several)", lease.ErrInvalid, len(r.Leases), maxKept)
	}
	for _, k := range r.Leases {
		if !lease.ValidLeaseID(k.LeaseID) {
			return fmt.Errorf("%w: keepalive asks after %q, which is not a lease id", lease.ErrInvalid, clip(k.LeaseID, 80))
		}
	}
	return nil
}

// shareLiveness publishes this instance's digest every digestEvery and
// learns the others'. Alone on the bus it only listens: it hears every
// keepalive itself.
func (s *Service) shareLiveness() error {
	sub, err := s.nc.Subscribe(sessionsSubject, func(m *nats.Msg) {
		w := m.Header.Get(writerHeader)
		if !fromInstance(m) || w == s.store.writer {
			return // not an instance's (see fromInstance), or our own
		}
		s.live.learn(w, m.Data, s.cfg.Now())
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", sessionsSubject, err)
	}
	s.track(sub)
	s.every(digestEvery, func() {
		data := s.live.digest(s.cfg.Now())
		if !s.tailing.Load() {
			return
		}
		// In parts the server takes: 10,000 sessions are about 1 MB, a
		// NATS server's default limit for one message, and a digest the
		// server refused would leave the others counting this instance
		// late, and giving every silent session three graces.
		for _, part := range digestParts(data, digestPartMax(s.nc.MaxPayload())) {
			m := nats.NewMsg(sessionsSubject)
			m.Header.Set(writerHeader, s.store.writer)
			m.Data = part
			if err := s.nc.PublishMsg(m); err != nil {
				s.warns.warn(s.log, s.cfg.Now(), "publish the sessions digest", "bytes", len(part), "err", err)
				return
			}
		}
	})
	s.every(reapEvery, s.reapSilent)
	s.every(beatEvery, s.sendBeat)
	return nil
}

// maxDigestPart bounds one message of a digest.
const maxDigestPart = 256 << 10

// digestPartMax is the most a digest's message carries on a server that
// takes messages of at most payload bytes: maxDigestPart, less where the
// server takes less (room left for the headers).
func digestPartMax(payload int64) int {
	return int(max(min(payload-4096, maxDigestPart), 1024))
}

// digestParts splits a digest (session keys, one a line) into parts of at
// most max bytes, each of whole lines; an empty digest is one empty part
// (it still says this instance is there).
func digestParts(data []byte, max int) [][]byte {
	var parts [][]byte
	for len(data) > max {
		cut := bytes.LastIndexByte(data[:max], '\n') + 1
		if cut == 0 {
			cut = max // no line is that long (keys are at most 128 bytes)
		}
		parts = append(parts, data[:cut])
		data = data[cut:]
	}
	if len(data) > 0 || len(parts) == 0 {
		parts = append(parts, data)
	}
	return parts
}

// every runs f every d until the service stops.
func (s *Service) every(d time.Duration, f func()) {
	s.goBackground(func() {
		t := time.NewTicker(d)
		defer t.Stop()
		for {
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
				f()
			}
		}
	})
}

// reapSilent has the actor of every repo with a lease whose session has
// been silent for the grace reclaim it (reapRequest): the actor decides on
// the log's latest word, and its compare-and-swap append settles a race
// with a renewal or another instance's reclaim.
//
// Silence is the sessions' only when this instance was listening, so the
// reaper holds off where the silence may be its own:
//   - after a stall of this instance (reapStalled): a process or a machine
//     that did not run heard nothing, and the time it did not run is no
//     session's silence;
//   - while its keepalive subscriptions are behind (keepalivesBehind): a
//     keepalive waiting there was sent, not missed;
//   - while many sessions of several identities fell silent at once
//     (massSilent): a fleet's runners do not die together, but a bus
//     hiccup — a reconnect storm, a partition of many runners from the
//     bus — silences them together, and reclaiming then turns a brief
//     outage into thousands of lost leases.
//
// Behind, missing another instance's digest (liveness.current) or facing
// many silent, it reclaims only sessions silent for massGraces times the
// grace; it does not stop reclaiming. A runner can push the bus into the
// first and the last (a flood of keepalives fills the subscriptions; its
// own sessions all fall silent at once), an instance slowed by a flood
// into the second, and a reaper that stopped would let one runner keep
// another's dead scope held for as long as it liked. One identity's
// sessions alone are never "many": that is one runner, or one runner's
// host, going away. A session silent among others that beat is reclaimed
// after the grace as ever. The holders of silent sessions stopped writing
// after their Silence either way: the longer grace costs only how soon
// their scopes come back.
func (s *Service) reapSilent() {
	now := s.cfg.Now()
	if s.reapStalled(now) {
		s.cfg.Metrics.reclaimsHeld("stall")
		return
	}
	if !s.Primary() {
		return // (a standby hears no keepalive: the primary reclaims)
	}
	base := s.live.grace
	grace := base
	if !s.live.current(now) {
		// Another instance's digest is late: it may have heard keepalives
		// this one has not. A late digest still arrives within the longer
		// grace (an instance silent for the grace is counted gone), and an
		// instance whose digests come late for good must not stop the
		// reclaims.
		s.cfg.Metrics.reclaimsHeld("peers")
		grace = massGraces * base
	}
	if n := s.keepalivesBehind(); n > 0 {
		s.cfg.Metrics.reclaimsHeld("backlog")
		if !s.behind {
			s.log.Warn("keepalives wait to be read: reclaiming only sessions silent for the longer grace until they are", "pending", n, "longer_grace", massGraces*base)
		}
		s.behind = true
		grace = massGraces * base
	} else if s.behind {
		s.log.Info("keepalives read: reclaiming silent sessions after the grace again")
		s.behind = false
	}
	// The sessions of active leases and their repos, taken under the
	// service's lock (which every keepalive takes too); their silence is
	// reckoned after. (The actor then counts a lease's own renewal as life
	// too, silentSession: its deadline is the actor's to read.)
	type bound struct{ repo, session string }
	var leases []bound
	s.mu.Lock()
	for _, ix := range s.index {
		if ix.e.Session != "" && ix.e.Holder != "" && ix.e.Status == lease.StatusActive {
			leases = append(leases, bound{ix.key, sessionKey(ix.e.Holder, ix.e.Session)})
		}
	}
	s.mu.Unlock()
	silent := map[string]time.Duration{} // session key -> its silence
	repos := map[string][]string{}       // repo key -> its sessions
	for _, l := range leases {
		if _, ok := silent[l.session]; !ok {
			silent[l.session] = s.live.silent(l.session, now)
		}
		repos[l.repo] = append(repos[l.repo], l.session)
	}
	// Sessions falling silent: past half the grace. A storm silences
	// them over a few seconds, not within one look.
	each := map[string]*silentCount{} // by identity
	for key, d := range silent {
		id, _, _ := strings.Cut(key, ".")
		c := each[id]
		if c == nil {
			c = &silentCount{}
			each[id] = c
		}
		c.sessions++
		if d >= base/2 {
			c.falling++
		}
	}
	if falling, identities, ok := massSilentBesides(each); ok {
		if !s.massSilence {
			s.log.Warn("many sessions fell silent at once: suspecting the bus, not the runners; reclaiming only those silent for the longer grace",
				"silent", falling, "identities", identities, "sessions", len(silent), "grace", base, "longer_grace", massGraces*base)
		}
		s.massSilence = true
		s.cfg.Metrics.reclaimsHeld("mass")
		grace = massGraces * base
	} else {
		s.massSilence = false
	}
	for key, sessions := range repos {
		if !slices.ContainsFunc(sessions, func(k string) bool { return silent[k] >= grace }) {
			continue
		}
		if a, ok := s.existing(key); ok {
			a.reap(grace, now)
		}
	}
}

// Silence shared by many sessions at once (massSilent): at least
// massSilentMin sessions, of at least massSilentIdentities identities, and
// more than 1/massSilentShare of those with a lease, silent for half the
// grace or more in one look, all of it without the identity with the most
// of them (massSilentBesides). Theirs is massGraces times the grace.
// (A host's runners dying together are a few sessions of a fleet; a
// reconnect storm at 10,000 leases silenced 20–66% of 1,000. One
// identity's sessions are one runner's: however many, never a storm.)
const (
	massSilentMin        = 16
	massSilentIdentities = 3
	massSilentShare      = 10
	massGraces           = 3
)

// massSilent reports whether silent of sessions falling silent, of that
// many identities, is many at once.
func massSilent(silent, sessions, identities int) bool {
	return identities >= massSilentIdentities && silent >= massSilentMin && silent*massSilentShare > sessions
}

// silentCount is one identity's sessions with active leases, and how many
// of them are falling silent.
type silentCount struct{ sessions, falling int }

// massSilentBesides reports whether the sessions falling silent are many
// at once (massSilent) even without the identity with the most of them,
// and how many there are, of how many identities, in all. One identity's
// sessions are one runner's, and a runner chooses how many it keeps and
// lets fall silent: without this, one that let a few dozen go silent
// beside two runners that died made the silence "many", and every dead
// runner's scope came back only after the longer grace (an attacker's
// review found it). A storm's silence is many without any one of its
// identities.
func massSilentBesides(each map[string]*silentCount) (falling, identities int, many bool) {
	var sessions, most int
	for _, c := range each {
		sessions += c.sessions
		if c.falling > 0 {
			falling += c.falling
			identities++
			most = max(most, c.falling)
		}
	}
	if most == 0 {
		return 0, 0, false
	}
	// Without each identity that has the most (ties: every one of them,
	// so that the answer does not hang on which a map gives first).
	many = true
	for _, c := range each {
		if c.falling == most {
			many = many && massSilent(falling-c.falling, sessions-c.sessions, identities-1)
		}
	}
	return falling, identities, many
}

// reapStall is how long past reapEvery the reaper may run late before this
// instance counts itself stalled.
const reapStall = 2 * time.Second

// reapStalled reports whether this instance did not run for a while before
// this look (its process paused, or its machine: the reaper's tick came
// late, measured on the machine's monotonic clock), and if so forgives
// every session that much silence. It runs on the reaper's goroutine only.
func (s *Service) reapStalled(now time.Time) bool {
	mono := time.Now()
	last := s.lastReap
	s.lastReap = mono
	if last.IsZero() {
		return false
	}
	if late := mono.Sub(last) - reapEvery; late > reapStall {
		s.live.pause(late, now)
		s.log.Warn("the lease service did not run for a while (its process or machine paused): sessions' silence does not count that time", "late", late.Round(time.Millisecond))
		return true
	}
	return false
}

// keepaliveBacklog is how many keepalives may wait in this instance's
// subscriptions before it counts itself behind.
const keepaliveBacklog = 1024

// keepalivesBehind is how many keepalives wait in this instance's
// subscriptions, when that is more than keepaliveBacklog (else 0).
func (s *Service) keepalivesBehind() int {
	s.mu.Lock()
	subs := slices.Clone(s.keepaliveSubs)
	s.mu.Unlock()
	n := 0
	for _, sub := range subs {
		if msgs, _, err := sub.Pending(); err == nil {
			n += msgs
		}
	}
	if n <= keepaliveBacklog {
		return 0
	}
	return n
}

// maxIdleKept bounds, in session graces, how long an instance remembers
// when it last heard an identity: idle is exact up to that.
const maxIdleKept = 10

// IdentityIdle reports whether no session of identity (a public nkey) has
// kept alive through any instance this one hears for at least atLeast
// (at most maxIdleKept session graces), and for how long: sure only while
// this instance hears every other's digests, and never while the identity
// holds an active lease in its view (the lease's session grace reclaims
// that first). The embedded bus collects an ephemeral identity idle for
// long enough: its run was killed before it could leave.
func (s *Service) IdentityIdle(identity string, atLeast time.Duration) (time.Duration, bool) {
	now := s.cfg.Now()
	if !s.live.current(now) {
		return 0, false
	}
	idle := s.live.idle(identity, now)
	if idle < atLeast || atLeast > maxIdleKept*s.live.grace {
		return idle, false
	}
	s.mu.Lock()
	for _, ix := range s.index {
		if ix.e.Holder == identity && ix.e.Status == lease.StatusActive {
			s.mu.Unlock()
			return 0, false
		}
	}
	s.mu.Unlock()
	return idle, true
}

// silentSession is, for an active lease bound to a session, how long that
// session has been silent and whether it is past the grace — counted from
// no earlier than this instance last saw the lease renewed or granted, so
// a renewal also proves life.
func (s *Service) silentSession(e *entry, now time.Time, grace time.Duration) (time.Duration, bool) {
	if e.Session == "" || e.Holder == "" {
		return 0, false
	}
	silent := s.live.silent(sessionKey(e.Holder, e.Session), now)
	if seen := now.Sub(e.deadline.Add(-time.Duration(e.TTL))); seen < silent {
		silent = seen
	}
	if silent >= grace && s.keepalivesWaiting(e.Holder) {
		// Its identity's keepalives wait to be read here (its own flood,
		// or its many sessions at once): this one's may be among them.
		// The longer grace, for its sessions alone (not everyone's, as
		// a backlog on the subscriptions themselves gives).
		grace = max(grace, massGraces*s.live.grace)
	}
	return silent, silent >= grace
}
