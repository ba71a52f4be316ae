package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// A client's session is what one process holding leases keeps alive on
// the bus, Chubby's way: one keepalive for all the leases its holders
// hold, not a heartbeat per lease. The keepalive is answered by the lease
// service (never by the client's own NATS server, which keeps answering
// while cut off from the service), with its word on each lease; a holder
// counts the service heard only through those answers, and stops vouching
// for its lease once they fall silent (HoldOptions.Silence).
//
// The service, for its part, learns from the keepalives that the process
// lives: a lease acquired in a session (AcquireRequest.Session) is
// reclaimed once the session has sent none for the service's SessionGrace
// — its process was killed, or cut off for longer than it can write
// anyway — instead of blocking its scope for the rest of its TTL.

// sessionPrefix starts every session id; 32 hex digits follow.
const sessionPrefix = "sess_"

// maxKept bounds the leases one keepalive asks after; a session holding
// more sends several.
const maxKept = 1024

// maxKeepaliveEvery bounds a session's keepalive interval whatever its
// holders' heartbeats: a session must be heard well within the service's
// grace (DefaultSessionGrace) or its leases are reclaimed.
const maxKeepaliveEvery = 2 * time.Second

// validSession reports whether id is a session id as a client makes them.
func validSession(id string) bool {
	if len(id) != len(sessionPrefix)+32 || id[:len(sessionPrefix)] != sessionPrefix {
		return false
	}
	for _, c := range id[len(sessionPrefix):] {
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return false
		}
	}
	return true
}

// session keeps one client's holders alive with one keepalive loop, which
// runs while the session has holders.
type session struct {
	c  *Client
	id string

	mu      sync.Mutex
	holders map[*Holder]struct{} // guarded by mu
	// roster is the holders as a list, with their shortest heartbeat and
	// silence: remade (never changed) under mu as one joins or leaves, so
	// the loop's every wake and every beat read it without a lock or a copy.
	roster atomic.Pointer[roster]
	cancel context.CancelFunc // stops the running loop; nil when none. Guarded by mu
	done   chan struct{}      // closed when the running loop returns. Guarded by mu
	// again asks the running loop for a keepalive now: a holder doubts
	// what the next one would settle (Holder.softDoubtLocked).
	again chan struct{}

	// watchMu guards the session's change notices: one subscription for
	// every lease bound to it (see sessionNotices), and who watches which.
	watchMu  sync.Mutex
	notices  *nats.Subscription              // made on the first watch; guarded by watchMu
	watchers map[string]map[*Holder]struct{} // lease id -> its holders; guarded by watchMu

	// beatMu guards what the session follows of the service's beats
	// (beat.go): the anchor its beats count from, and the last few beats.
	beatMu sync.Mutex
	beats  *nats.Subscription // made when the loop first runs; guarded by beatMu
	anchor *anchored          // nil: beats vouch for nothing now; guarded by beatMu
	recent []beat             // the last beatRecent beats heard; guarded by beatMu
}

// roster is a session's holders at one moment (see session.members).
type roster struct {
	hs             []*Holder // read-only
	every, silence time.Duration
}

// anchored is a keepalive's answer that beats vouch on from: the leases it
// found unchanged, as asked, and its anchor.
type anchored struct {
	beatAnchor                  // its Seq moves on with each beat applied
	now        func() time.Time // the holders' clock, which the times below are on
	sent       time.Time        // when the keepalive was sent
	at         time.Time        // when it was answered
	vouched    time.Time        // as of when a beat last vouched on it
	leases     map[string]keptLease
	buckets    map[uint16]struct{}
}

// sessionNotices is the subject the lease service sends the change notices
// of leases bound to a session on, besides the lease's public change
// subject: under the inbox of the identity that holds them, which only
// that identity hears (inbox, the identity's inbox prefix, see
// noticeInbox). One subscription covers every lease of a session: a
// subscription per held lease, each propagated to every server of a
// cluster and each clearing the servers' subject caches as it came and
// went, took about a quarter of the servers' CPU at fleet size.
func sessionNotices(inbox, session string) string { return inbox + "." + session + ".changed" }

// noticeInbox is the inbox prefix of identity's connections (see
// Creds.Options; nats.go's default for an anonymous one).
func noticeInbox(identity string) string {
	if identity == "" || identity == Anonymous {
		return nats.InboxPrefix[:len(nats.InboxPrefix)-1]
	}
	return inboxPrefix(identity)
}

// watch has the service's notices about leaseID reach h (Holder.observe)
// until the returned stop is called. The session's subscription is made
// on the first watch and lives as long as the client.
func (s *session) watch(leaseID string, h *Holder) (stop func() error, err error) {
	s.watchMu.Lock()
	defer s.watchMu.Unlock()
	if s.notices == nil {
		subj := sessionNotices(inboxBase(s.c.nc), s.id)
		sub, err := s.c.nc.Subscribe(subj, s.notice)
		if err != nil {
			return nil, fmt.Errorf("watch %s: %w", subj, err)
		}
		if err := s.c.nc.Flush(); err != nil {
			_ = sub.Unsubscribe()
			return nil, fmt.Errorf("watch %s: %w", subj, err)
		}
		s.notices, s.watchers = sub, map[string]map[*Holder]struct{}{}
	}
	hs := s.watchers[leaseID]
	if hs == nil {
		hs = map[*Holder]struct{}{}
		s.watchers[leaseID] = hs
	}
	hs[h] = struct{}{}
	return func() error {
		s.watchMu.Lock()
		defer s.watchMu.Unlock()
		delete(hs, h)
		if cur := s.watchers[leaseID]; len(cur) == 0 {
			delete(s.watchers, leaseID) // (a later watch's set is never empty)
		}
		return nil
	}, nil
}

// notice hands a change notice to the holders of the lease it is about;
// each checks that it is about its lease (Holder.observe).
func (s *session) notice(m *nats.Msg) {
	if !fromService(m) {
		return
	}
	var l lease.Lease
	if json.Unmarshal(m.Data, &l) != nil || l.LeaseID == "" {
		return // not a notice: an answer someone had the server send here
	}
	s.watchMu.Lock()
	hs := slices.Collect(maps.Keys(s.watchers[l.LeaseID]))
	s.watchMu.Unlock()
	for _, h := range hs {
		h.observe(&l)
	}
}

// session returns the client's session, made on first use.
func (c *Client) session() *session {
	c.sessOnce.Do(func() {
		c.sess = &session{c: c, id: sessionPrefix + randomToken(), holders: map[*Holder]struct{}{}, again: make(chan struct{}, 1)}
	})
	return c.sess
}

// SessionID is the id of the client's session: the one its AcquireAndHold
// binds leases to.
func (c *Client) SessionID() string { return c.session().id }

// KeepIdentity keeps the client's session heard by the lease service even
// while it holds no lease, until stop is called: the embedded bus collects
// an identity enrolled for one run (EnrollEphemeral) once none of its
// sessions has been heard for a while (the run was killed before it could
// leave), and a run waiting for its lease, or between two, must not look
// killed. One empty keepalive every maxKeepaliveEvery while the session's
// own loop is not running (it has no holders).
func (c *Client) KeepIdentity() (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		req := keepaliveRequest{Session: c.SessionID()}
		t := time.NewTimer(0)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if !c.session().running() { // while holders keep it, their loop is heard
				kctx, kcancel := context.WithTimeout(ctx, maxKeepaliveEvery)
				_, _ = c.keepalive(kctx, req) // unanswered: the next one tries again
				kcancel()
			}
			t.Reset(maxKeepaliveEvery)
		}
	}()
	return func() {
		cancel()
		<-done
	}
}

// keepalive is KeepIdentity's: it sends req, and sends it again each
// quarter of ctx's time (at least minKeepaliveTry, at most the client's
// timeout) while no instance has answered, up to maxKeepaliveTries at once; the first
// answer to any of them is the answer. A keepalive is asked of any
// instance of the service, and one sent to an instance that cannot
// answer — cut off behind a route the server still counts up, which it
// may for a while after a partition — is lost: waiting out the whole
// budget on it would leave the session unheard long enough for its
// run's identity to be collected while it is alive. A new try goes to an
// instance picked again; an earlier one merely slow is still heard. (The
// holders' session loop keeps one try per heartbeat: a lost keepalive
// costs its holders a doubt, never their lease, and is sent again at the
// next heartbeat even while beats vouch; re-sending there would multiply
// the load on a slow service.)
func (c *Client) keepalive(ctx context.Context, req keepaliveRequest) (*reply, error) {
	every := c.Timeout
	if d, ok := ctx.Deadline(); ok {
		every = min(every, max(time.Until(d)/4, minKeepaliveTry))
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // the tries still waiting end with it
	type answer struct {
		r   *reply
		err error
	}
	answers := make(chan answer, maxKeepaliveTries)
	send := func() {
		go func() {
			r, err := c.request(ctx, "keepalive", req, 0)
			answers <- answer{r, err}
		}()
	}
	send()
	sent, waiting := 1, 1
	again := time.NewTicker(every)
	defer again.Stop()
	var lastErr error
	for {
		select {
		case a := <-answers:
			waiting--
			if a.err == nil {
				return a.r, nil
			}
			lastErr = a.err
			if errors.Is(a.err, ErrForbidden) || ctx.Err() != nil && waiting == 0 {
				return nil, a.err
			}
		case <-again.C:
			if sent < maxKeepaliveTries {
				send()
				sent++
				waiting++
			} else if waiting == 0 {
				return nil, lastErr
			}
		case <-ctx.Done():
			if lastErr == nil {
				lastErr = fmt.Errorf("keepalive: %w%w", ctx.Err(), errNoAnswer)
			}
			return nil, lastErr
		}
	}
}

// minKeepaliveTry is the shortest a keepalive waits for an answer before
// it is sent again; maxKeepaliveTries bounds how often.
const (
	minKeepaliveTry   = 250 * time.Millisecond
	maxKeepaliveTries = 4
)

// kick asks the session's loop for a keepalive now; kicks while one is
// pending or under way make one more, not one each.
func (s *session) kick() {
	select {
	case s.again <- struct{}{}:
	default:
	}
}

// running reports whether the session's keepalive loop runs (it has
// holders).
func (s *session) running() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.cancel != nil
}

// join adds h to the session and starts the keepalive loop if it is not
// running.
func (s *session) join(h *Holder) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.holders[h] = struct{}{}
	s.remember()
	if s.cancel != nil {
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	s.cancel, s.done = cancel, done
	go s.run(ctx, done)
}

// leave removes h from the session; the last holder to leave stops the
// loop and waits for it. h hears nothing from the session once leave
// returns.
func (s *session) leave(h *Holder) {
	s.mu.Lock()
	delete(s.holders, h)
	s.remember()
	var done chan struct{}
	if len(s.holders) == 0 && s.cancel != nil {
		s.cancel()
		done = s.done
		s.cancel, s.done = nil, nil
	}
	s.mu.Unlock()
	if done != nil {
		<-done
	}
	// Should the loop go on for others, a keepalive in flight may still
	// answer h: kept applies nothing once h left.
	h.sessionMu.Lock()
	h.left = true
	h.sessionMu.Unlock()
}

// members returns the session's holders (a list the caller must not
// change) and the shortest heartbeat and silence among them.
func (s *session) members() (hs []*Holder, every, silence time.Duration) {
	if m := s.roster.Load(); m != nil {
		return m.hs, m.every, m.silence
	}
	return nil, 0, 0
}

// remember makes the holders' list members returns anew. s.mu is held.
func (s *session) remember() {
	m := &roster{hs: make([]*Holder, 0, len(s.holders))}
	for h := range s.holders {
		m.hs = append(m.hs, h)
		if m.every == 0 || h.opts.Heartbeat < m.every {
			m.every = h.opts.Heartbeat
		}
		if m.silence == 0 || h.opts.Silence < m.silence {
			m.silence = h.opts.Silence
		}
	}
	s.roster.Store(m)
}

// run sends a keepalive every heartbeat until ctx ends — unless the
// service's beats vouch for every lease the session holds, when one at the
// interval the service's anchor asks for (keepEvery: at most every
// maxKeepaliveEvery) tells the service the session lives. A kick always
// sends one.
func (s *session) run(ctx context.Context, done chan struct{}) {
	defer close(done)
	s.followBeats()
	t := time.NewTimer(0)
	defer t.Stop()
	var last time.Time // the last keepalive sent
	for {
		kicked := false
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		case <-s.again:
			kicked = true
			if !t.Stop() {
				select {
				case <-t.C:
				default:
				}
			}
		}
		hs, every, silence := s.members()
		if len(hs) == 0 {
			return
		}
		every = min(every, maxKeepaliveEvery)
		if !kicked && s.beatsVouch(hs, every, time.Since(last)) {
			t.Reset(every)
			continue
		}
		began, answered := time.Now(), true
		whole := len(hs) <= maxKept
		for len(hs) > 0 {
			n := min(len(hs), maxKept)
			answered = s.keepalive(ctx, hs[:n], silence, whole) && answered
			hs = hs[n:]
		}
		if answered {
			// One lost is sent again at the next heartbeat, beats or
			// not: the service learns from keepalives alone that the
			// session lives.
			last = began
		}
		t.Reset(every)
	}
}

// keepalive is one keepalive for hs: each holder whose lease the service
// vouched for counts it heard as of the view the answer came from.
//
// whole says hs are all the session's holders: then an answer with a beat
// anchor, vouching for every lease as asked from a view read now, is what
// the service's beats vouch on from (beat.go). It reports whether the
// service answered.
func (s *session) keepalive(ctx context.Context, hs []*Holder, silence time.Duration, whole bool) bool {
	type asked struct {
		h    *Holder
		l    keptLease // the lease as h holds it
		sent time.Time
	}
	req := keepaliveRequest{Session: s.id, Leases: make([]keptLease, 0, len(hs)), Compact: true}
	asks := make([]asked, 0, len(hs))
	// find is the index of the ask about lease id (-1: none): a scan for
	// the few leases of most sessions, a map beyond.
	var byID map[string]int
	if len(hs) > 16 {
		byID = make(map[string]int, len(hs))
	}
	find := func(id string) int {
		if byID != nil {
			if i, ok := byID[id]; ok {
				return i
			}
			return -1
		}
		return slices.IndexFunc(asks, func(a asked) bool { return a.l.LeaseID == id })
	}
	for _, h := range hs {
		l, active := h.asKept()
		if !active || find(l.LeaseID) >= 0 {
			continue // (two holders of one lease: the first asks for both)
		}
		if byID != nil {
			byID[l.LeaseID] = len(asks)
		}
		asks = append(asks, asked{h, l, h.opts.Now()})
		req.Leases = append(req.Leases, l)
	}
	if len(req.Leases) == 0 {
		return true
	}
	kctx, cancel := context.WithTimeout(ctx, silence)
	defer cancel()
	r, err := s.c.request(kctx, "keepalive", &req, 0)
	if err == nil {
		err = r.Error.err()
	}
	if err != nil {
		return false // nothing heard: each holder's silence runs on
	}
	// One answer per lease: a listed one, else KeptRest's.
	answered := make([]bool, len(asks))
	for _, k := range r.Kept {
		i := find(k.LeaseID)
		if i < 0 || answered[i] {
			continue // not asked for, or answered already: not the service's word on anything we hold
		}
		answered[i] = true
		asks[i].h.kept(asks[i].l, k, asks[i].sent)
	}
	if r.KeptRest == nil {
		s.anchorOn(nil)
		return true
	}
	var on *anchored
	if whole && r.Beat != nil && r.KeptRest.Age == 0 && r.Beat.Epoch != "" {
		now := asks[0].h.opts.Now
		on = &anchored{beatAnchor: *r.Beat, now: now, sent: asks[0].sent, at: now(), leases: map[string]keptLease{}, buckets: map[uint16]struct{}{}}
	}
	for i, a := range asks {
		if answered[i] {
			continue
		}
		a.h.kept(a.l, keptAnswer{LeaseID: a.l.LeaseID, Age: r.KeptRest.Age}, a.sent)
		if on != nil {
			on.sent = minTime(on.sent, a.sent)
			on.leases[a.l.LeaseID] = a.l
			on.buckets[beatBucket(a.l.LeaseID)] = struct{}{}
		}
	}
	s.anchorOn(on)
	return true
}

// followBeats subscribes the session to the service's beats, once.
func (s *session) followBeats() {
	s.beatMu.Lock()
	defer s.beatMu.Unlock()
	if s.beats != nil {
		return
	}
	sub, err := s.c.nc.Subscribe(beatSubject, s.heardBeat)
	if err != nil {
		return // keepalives every heartbeat, as without beats
	}
	s.beats = sub
}

// anchorOn makes on the anchor beats vouch from (nil: none), caught up
// with the beats heard since its own.
func (s *session) anchorOn(on *anchored) {
	var vouch *anchored
	s.beatMu.Lock()
	s.anchor = on
	if on != nil {
		for _, b := range s.recent {
			if s.anchor == nil {
				break
			}
			if b.Epoch == on.Epoch && b.Seq > on.Seq {
				vouch = s.applyBeatLocked(&b, on.at)
			}
		}
	}
	again := on != nil && s.anchor == nil
	s.beatMu.Unlock()
	if again {
		s.kick()
	}
	s.vouch(vouch)
}

// heardBeat follows one of the service's beats: it vouches for the
// anchored leases it does not name, or, when it breaks the anchor's chain,
// sends a keepalive.
func (s *session) heardBeat(m *nats.Msg) {
	if !isBeat(m) {
		return
	}
	b, ok := decodeBeat(m.Data)
	if !ok {
		return
	}
	s.beatMu.Lock()
	if len(s.recent) == beatRecent {
		s.recent = append(s.recent[:0], s.recent[1:]...)
	}
	s.recent = append(s.recent, *b)
	had := s.anchor != nil
	var vouch *anchored
	if had {
		vouch = s.applyBeatLocked(b, s.anchor.now())
	}
	again := had && s.anchor == nil
	s.beatMu.Unlock()
	switch {
	case again && b.All:
		// Every session of the fleet heard it at once: spread their
		// keepalives over a beat's interval rather than send them
		// together (their holders' silence runs from the last beat that
		// vouched, well within it).
		time.AfterFunc(rand.N(beatEvery), s.kick)
	case again:
		s.kick()
	}
	s.vouch(vouch)
}

// applyBeatLocked moves the anchor on by b, which arrived at now: it
// returns the anchor (with vouched set to the time b vouches for) when b
// vouches for its leases, else nil — and drops the anchor when b breaks
// its chain, or takes off it the leases in the buckets b names. s.beatMu
// is held.
func (s *session) applyBeatLocked(b *beat, now time.Time) *anchored {
	on := s.anchor
	switch {
	case b.Epoch != on.Epoch:
		// Another instance, or another term: its beats say nothing of
		// what this one answered, and nothing against it either (two
		// instances that have not met yet may both beat a while). Once
		// the anchor's own beats stop, it vouches for nothing and the
		// session asks at its heartbeat.
		return nil
	case b.Seq <= on.Seq:
		return nil // one applied already
	case b.Seq != on.Seq+1 || b.All:
		s.anchor = nil // a beat missed, or every lease named
		return nil
	}
	ran := time.Duration(b.Clock - on.Clock)
	if held := now.Sub(on.sent); ran < 0 || ran > held+held/beatDrift || held > maxAnchorAge {
		// The service's clock ran back, or further than the holders'
		// since the keepalive was sent (one of them was stepped), or
		// the anchor is too old to bound the drift.
		s.anchor = nil
		return nil
	}
	// A lease whose bucket b names may have changed: b vouches for it no
	// more, nor does any later beat; the rest go on. (Most often it is the
	// session's own renewal. The lease is not on the anchor any more, so
	// the session asks at its next heartbeat, spread over the fleet's
	// sessions as their loops are, not all at once on this beat; the
	// holder's silence runs from the last beat that vouched for it.)
	for _, k := range b.Buckets {
		if _, mine := on.buckets[k]; mine {
			on.leases, on.buckets = maps.Clone(on.leases), maps.Clone(on.buckets) // copies handed out read the old ones
			for _, k := range b.Buckets {
				delete(on.buckets, k)
			}
			maps.DeleteFunc(on.leases, func(id string, _ keptLease) bool {
				_, still := on.buckets[beatBucket(id)]
				return !still
			})
			break
		}
	}
	on.Seq = b.Seq
	// The service's clock ran ran from reading the views to cutting b, and
	// it read them after the keepalive was sent.
	on.vouched = on.sent.Add(ran - ran/beatDrift)
	v := *on
	return &v
}

// vouch has every holder whose lease on anchored as asked count it heard
// as of on.vouched.
func (s *session) vouch(on *anchored) {
	if on == nil {
		return
	}
	hs, _, _ := s.members()
	for _, h := range hs {
		l, active := h.asKept()
		if a, ok := on.leases[l.LeaseID]; !active || !ok || a != l {
			continue
		}
		h.kept(l, keptAnswer{LeaseID: l.LeaseID}, minTime(on.vouched, h.opts.Now()))
	}
}

// beatsVouch reports whether the service's beats vouch for every active
// lease of hs, the last within every and a beat's interval, and the
// session's last keepalive, since ago, is not due again within every: the
// session need not ask.
func (s *session) beatsVouch(hs []*Holder, every, since time.Duration) bool {
	s.beatMu.Lock()
	on := s.anchor
	fresh := on != nil && !on.vouched.IsZero() && on.now().Sub(on.vouched) <= every+beatEvery && since+every <= min(time.Duration(on.Every), maxKeepaliveEvery)
	var leases map[string]keptLease
	if fresh {
		leases = on.leases // never changed once anchored: a beat that takes leases off replaces it
	}
	s.beatMu.Unlock()
	if !fresh {
		return false
	}
	for _, h := range hs {
		if l, active := h.asKept(); active && leases[l.LeaseID] != l {
			return false
		}
	}
	return true
}

// asKept is the holder's lease as a keepalive asks after it, and whether
// it is active.
func (h *Holder) asKept() (keptLease, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	l := &h.lease
	return keptLease{LeaseID: l.LeaseID, Repo: l.Repo, Fence: l.Fence, Version: l.Version}, l.Active()
}

// kept applies the service's word on the holder's lease held, from a
// keepalive sent at sent. A view confirmed Age before the answer counts as
// heard Age before the keepalive was sent: the service cannot have
// confirmed it earlier than that on any clock.
func (h *Holder) kept(held keptLease, k keptAnswer, sent time.Time) {
	h.sessionMu.Lock()
	defer h.sessionMu.Unlock()
	if h.left {
		return
	}
	switch {
	case k.Unknown:
		// The instance that answered could not vouch for it now.
	case k.Missing:
		// The service read the log, and it has no such lease.
		h.heard(sent)
		h.doubt(fmt.Errorf("%w: %s (fence %d): the lease service does not know the lease; writes stop until it answers a renewal", lease.ErrLeaseUnknown, held.LeaseID, held.Fence), true)
	case k.Lease != nil && (k.Lease.LeaseID != held.LeaseID || k.Lease.Repo != held.Repo || k.Lease.Fence != held.Fence):
		// Not the service's answer about this lease: nothing heard.
	default:
		confirmed := sent.Add(-max(time.Duration(k.Age), 0)) // never later than sent
		h.heard(confirmed)
		if k.Lease != nil {
			h.observe(k.Lease)
			return
		}
		// Active at the version asked after: settles a doubt older than
		// the view.
		h.settle(held, confirmed)
	}
}
