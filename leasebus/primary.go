package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// The primary. Several lease service instances on one bus (a cluster runs
// one per node) elect one of them to serve the lease requests, as Chubby's
// replicas elect a master. The others, standbys, take no lease request,
// read no repo's log and write none: they watch the primary's claim and
// take over once it goes unrenewed, with views kept warm from the
// primary's announcements of its appends (warm.go). So one instance writes the lease log —
// no two race each other's compare-and-swap, none re-reads a log another
// wrote — and its views are the log's: it answers keepalives and cached
// gets from memory, as an instance alone on a bus does, instead of reading
// each repo's log to confirm the view it vouches from.
//
// The claim is the last record on primarySubject (PrimaryStream), written
// with compare-and-swap on its sequence. The primary renews it every
// quarter of its term; a claim counts for the term from when its writer
// sent it, on the writer's clock, after which the primary neither appends
// nor vouches for a view until a renewal is acknowledged, and stops
// serving once it learns another took the claim. A standby takes over only
// once it has seen the same record for the term plus primaryGap on its own
// clock: the old primary's term ended at least primaryGap before (clocks
// differ in rate, never by that much — the assumption lease TTLs make), so
// whatever it sent had that long to land. A primary that stops releases
// its claim, and a standby takes over at once; one that crashes is
// replaced within the term plus primaryGap plus a poll.
//
// A primary's term also runs out when its renewals go unanswered for a
// term: the claim's stream electing a new leader takes seconds, longer
// than a term, when the node that led it dies. The primary then takes the
// claim back at once if the last record is still its own (lapsed), while
// a standby waits primaryGap after it can read the claim again
// (sinceBack): a takeover costs reads of every repo's log (one for a
// warm view, a load back to a snapshot for any other), and holders
// cannot renew meanwhile.
//
// What the claim does not decide, compare-and-swap still does: every
// append is one on its repo's log, so even two instances that both believe
// they are primary could not grant over each other's leases.

const (
	// PrimaryStream holds the primary's claim on primarySubject.
	PrimaryStream  = "FENCELINE_PRIMARY"
	primarySubject = "fenceline.primary"
	// DefaultPrimaryTerm is how long a claim counts from when it was sent.
	DefaultPrimaryTerm = 4 * time.Second
	// primaryGap is how much longer than the term a standby waits on a
	// claim before it takes over.
	primaryGap = time.Second
)

// claimRecord is one record of the claim.
type claimRecord struct {
	// Writer is the instance that wrote it (its writer stamp).
	Writer string `json:"writer"`
	// Released: the writer stopped serving; the claim is free.
	Released bool `json:"released,omitempty"`
}

func primaryStreamConfig(replicas int) jetstream.StreamConfig {
	return jetstream.StreamConfig{
		Name:              PrimaryStream,
		Description:       "fenceline lease service: the claim of the instance that serves the lease requests, written with compare-and-swap",
		Subjects:          []string{primarySubject},
		Storage:           jetstream.FileStorage,
		Replicas:          replicas,
		Retention:         jetstream.LimitsPolicy,
		MaxMsgsPerSubject: 1,
		DenyDelete:        true,
		DenyPurge:         true,
		// Read through the leader: a standby must see the last claim.
		AllowDirect: false,
	}
}

// primacy is where this instance stands in the election.
type primacy struct {
	term time.Duration

	mu     sync.Mutex
	number uint64 // how many terms this instance has begun; guarded by mu
	// epoch counts the terms this instance began over another instance's
	// claim (or none): a term taken back over its own last record (a
	// lapse) follows its previous term with no other primary between,
	// and a view kept across them is still the only one that answered
	// (enterTerm). Guarded by mu.
	epoch uint64
	until time.Time // primary until then (service clock); zero: standby; guarded by mu
	seq   uint64    // the claim's sequence while primary; guarded by mu
	began bool      // a term has begun once (the audit catch-up runs); guarded by mu

	// What a standby last learned of the claim (guarded by mu): the
	// writer of its last record, whether it was released, and the error
	// of the last read (nil: read).
	leader  string
	free    bool
	readErr error
	// seen is the sequence of the claim's record last read, seenAt when
	// it was first read, readAt when the claim was last read; guarded by
	// mu.
	seen           uint64
	seenAt, readAt time.Time
	// backAt is when the claim was read again after a read failed; guarded by mu.
	backAt time.Time
	// apartAt is when the primary next checks where the streams it waits
	// on are led (keepApart); guarded by mu. apartBusy: a check runs.
	apartAt   time.Time
	apartBusy atomic.Bool
}

// mayReread reports whether the claim was read longer than rereadEvery
// ago, and notes a read now if so.
func (p *primacy) mayReread(now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if now.Sub(p.readAt) < rereadEvery {
		return false
	}
	p.readAt = now
	return true
}

// route says where a standby sends a lease request: to the primary whose
// claim it last read, or nowhere, and why. Whether that claim is still
// renewed decides when a standby takes over, not where it forwards: a
// standby that cannot read the claim for a while (its node cut off, or
// just back and catching up) still forwards to the primary it knows,
// which most likely serves on; a primary that is gone answers nothing,
// and the asker tries again, as it would while no instance serves.
func (p *primacy) route() (primary string, why error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.leader != "" && !p.free && p.readErr == nil && p.readAt.Sub(p.seenAt) > p.term:
		// Read just now, the claim had gone unrenewed for longer than a
		// term: its writer's term is over, and it serves nothing until it
		// renews (lapsed) or another takes over.
		return "", fmt.Errorf("%w: the primary's claim went unrenewed for %s: its term is over and another instance takes over within %s; try again",
			lease.ErrUnavailable, p.readAt.Sub(p.seenAt).Round(time.Millisecond), primaryGap)
	case p.leader != "" && !p.free:
		return p.leader, nil
	case p.readErr != nil:
		// Before "free": a claim last read free (at the start, before
		// any instance had written it) and unreadable since is not known
		// free. (A CI run's standby said "free" for seconds after the
		// primary had been elected, its reads timing out while the
		// cluster formed.)
		return "", fmt.Errorf("%w: no lease service instance is known to be the primary: the claim cannot be read (%v); an election follows once it can", lease.ErrUnavailable, p.readErr)
	case p.free:
		return "", fmt.Errorf("%w: no lease service instance is the primary: the claim is free and an instance takes it within a second; try again", lease.ErrUnavailable)
	}
	return "", fmt.Errorf("%w: no lease service instance is known to be the primary yet (an election is under way); try again", lease.ErrUnavailable)
}

// current is the number of this instance's term and whether it is in it
// at now.
func (p *primacy) current(now time.Time) (uint64, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.number, !p.until.IsZero() && now.Before(p.until)
}

// serving reports whether this instance holds a term (it may have run out
// and not yet been renewed).
func (p *primacy) serving() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.until.IsZero()
}

// leaseOps are the requests only the primary serves: every one that reads
// or writes a repo's leases, and the keepalives answered from them. A
// standby takes them too (every instance is in the queue group) and
// forwards them to the primary (forward), or answers why there is none.
var leaseOps = []string{"acquire", "renew", "release", "revoke", "cancel", "get", "list", "sweep", "keepalive"}

// otherOps are served by every instance: none reads the lease state.
var otherOps = []string{"audit", opShard, opShardAdmin, opPolicy}

// Headers of a forwarded request: the subject and reply it was asked on,
// and the account (fleetAccount or serviceAccount) whose connection
// answers it.
const (
	forwardSubjectHeader = "Fenceline-Forward-Subject"
	forwardReplyHeader   = "Fenceline-Forward-Reply"
	forwardAccountHeader = "Fenceline-Forward-Account"
	fleetAccount         = "fleet"
	serviceAccount       = "service"
)

// forwardSubject is where the instance writer takes the requests of op
// that standbys forward to it (on the service account's connection, which
// no client's identity reaches).
func forwardSubject(writer, op string) string { return apiPrefix + ".forward." + writer + "." + op }

// forward hands a lease request a standby took to the primary, which
// answers the asker itself; with no primary known, the asker is told why.
// The request is forwarded as it came (its headers, its nonce); the
// primary checks it as if it had taken it.
func (s *Service) forward(m *nats.Msg, op string, inServiceAccount bool) {
	to, why := s.prim.route()
	if why != nil && s.prim.mayReread(s.cfg.Now()) {
		// No primary known: an election may just have ended. Read the
		// claim once (at most every rereadEvery) before saying so.
		ctx, cancel := context.WithTimeout(s.ctx, 250*time.Millisecond)
		_, _ = s.observeClaim(ctx)
		cancel()
		to, why = s.prim.route()
	}
	if why != nil {
		s.cfg.Metrics.forwarded("none")
		if s.answerable(m) {
			respondErr(m, why)
		}
		return
	}
	s.cfg.Metrics.forwarded("primary")
	f := nats.NewMsg(forwardSubject(to, op))
	for k, v := range m.Header {
		f.Header[k] = v
	}
	account := fleetAccount
	if inServiceAccount {
		account = serviceAccount
	}
	f.Header.Set(forwardSubjectHeader, m.Subject)
	f.Header.Set(forwardReplyHeader, m.Reply)
	f.Header.Set(forwardAccountHeader, account)
	f.Header.Set(writerHeader, s.store.writer)
	f.Data = m.Data
	if op != "keepalive" && s.answerable(m) {
		// Should the primary take no forwarded requests any more (it
		// stopped or crashed, or its node did, and its claim is not yet
		// seen unrenewed), the server says so at once on this reply
		// subject (no responders), and the asker is told to try again
		// rather than waiting out its timeout. A keepalive is resent
		// within its interval anyway.
		f.Reply = s.gone.watch(m, to)
	}
	_ = s.nc.PublishMsg(f)
}

// goneWatch remembers, for a short while, the requests a standby forwarded,
// each under a reply token of its own, so that should the server answer
// one's forward with "no responders" (the primary's subscription is gone)
// the asker is answered at once. Nothing answers a forward that reached
// the primary, so entries expire: two generations, each at least
// goneKeep long, swapped as they age.
type goneWatch struct {
	prefix string // the reply subjects' prefix, "<inbox>."

	mu        sync.Mutex
	cur, prev map[string]forwarded
	since     time.Time // when cur began
}

// forwarded is a request a standby forwarded, and to which instance.
type forwarded struct {
	m  *nats.Msg
	to string
}

// goneKeep is how long a forward is remembered at least: the server's
// "no responders" comes back in a round trip.
const goneKeep = 2 * time.Second

// watch remembers m, forwarded to instance to, and returns the reply
// subject for its forward.
func (g *goneWatch) watch(m *nats.Msg, to string) string {
	token := randomToken()
	now := time.Now()
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.cur == nil || now.Sub(g.since) > goneKeep {
		g.prev, g.cur, g.since = g.cur, make(map[string]forwarded), now
	}
	g.cur[token] = forwarded{m, to}
	return g.prefix + token
}

// take returns and forgets the request forwarded under reply subject subj.
func (g *goneWatch) take(subj string) (forwarded, bool) {
	token := strings.TrimPrefix(subj, g.prefix)
	g.mu.Lock()
	defer g.mu.Unlock()
	for _, gen := range []map[string]forwarded{g.cur, g.prev} {
		if f, ok := gen[token]; ok {
			delete(gen, token)
			return f, true
		}
	}
	return forwarded{}, false
}

// watchGone subscribes to the reply subjects of forwards (goneWatch): a
// "no responders" status on one answers its asker that the primary it
// went to takes no requests, which a retry then finds out again.
func (s *Service) watchGone() error {
	s.gone.prefix = s.nc.NewInbox() + "."
	sub, err := s.nc.Subscribe(s.gone.prefix+"*", func(r *nats.Msg) {
		if r.Header.Get("Status") != "503" || len(r.Data) != 0 {
			return // only the server's "no responders" comes here
		}
		f, ok := s.gone.take(r.Subject)
		if !ok {
			return
		}
		s.cfg.Metrics.forwarded("gone")
		respondErr(f.m, fmt.Errorf("%w: the primary lease service instance (%s) takes no forwarded requests: it stopped, or its node did; another takes over once its claim goes unrenewed; try again", lease.ErrUnavailable, f.to))
	})
	if err != nil {
		return fmt.Errorf("subscribe %s*: %w", s.gone.prefix, err)
	}
	s.track(sub)
	return nil
}

// answerable reports whether a request may be answered before the handler
// has checked it: it is no JetStream delivery, and its reply is the inbox
// of the identity its subject names (as the handler requires), so that no
// one can have the service publish an answer onto a subject of their
// choosing.
func (s *Service) answerable(m *nats.Msg) bool {
	if m.Reply == "" || jetStreamDelivery(m) {
		return false
	}
	_, ok := s.sender(m)
	return ok
}

// takeForwarded serves the requests standbys forward to this instance, one
// subscription per op as the instance's own (so requests of one op keep
// their order, and ops run side by side): as the primary, each as if it
// had taken it itself (the handler checks the asker's identity and reply
// as always); no longer the primary, it tells the asker to try again.
func (s *Service) takeForwarded() error {
	if err := s.watchGone(); err != nil {
		return err
	}
	for _, op := range leaseOps {
		handlers := map[string]serveFunc{
			fleetAccount:   s.handlerOf(op, false, true),
			serviceAccount: s.handlerOf(op, true, true),
		}
		prefix := requestSubject(op, "")
		// Forwarded requests wait in turns by their askers too: the
		// standby's forwarding does not make them one sender.
		in, ok := s.newIntake(op, false, func(m *nats.Msg, at time.Time, _ bool) {
			if !s.Primary() {
				s.cfg.Metrics.forwardIn("not_primary")
				if s.answerable(m) {
					respondErr(m, fmt.Errorf("%w: the lease service instance this request was forwarded to is no longer the primary; try again", lease.ErrUnavailable))
				}
				return
			}
			s.cfg.Metrics.forwardIn("taken")
			handlers[m.Header.Get(forwardAccountHeader)](m, at, false)
		})
		if !ok {
			return fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable)
		}
		sub, err := s.nc.Subscribe(forwardSubject(s.store.writer, op), func(f *nats.Msg) {
			subj := f.Header.Get(forwardSubjectHeader)
			account := f.Header.Get(forwardAccountHeader)
			if !fromInstance(f) || handlers[account] == nil || !strings.HasPrefix(subj, prefix) {
				s.cfg.Metrics.forwardIn("ignored")
				return // not a standby's (see fromInstance), or not this op's
			}
			m := &nats.Msg{Subject: subj, Reply: f.Header.Get(forwardReplyHeader), Data: f.Data, Header: nats.Header{}}
			for k, v := range f.Header {
				switch k {
				case forwardSubjectHeader, forwardReplyHeader, writerHeader:
				default:
					m.Header[k] = v // forwardAccountHeader too: the intake's serve reads it
				}
			}
			conn := s.fleet
			if account == serviceAccount {
				conn = s.nc
			}
			s.mu.Lock()
			m.Sub = s.answerVia[conn] // answers go out on the connection the asker used
			s.mu.Unlock()
			if m.Sub == nil {
				s.cfg.Metrics.forwardIn("ignored")
				return
			}
			in.deliver(m, f.Sub, f)
		})
		if err != nil {
			return fmt.Errorf("subscribe %s: %w", forwardSubject(s.store.writer, op), err)
		}
		s.track(sub)
		if op == "keepalive" {
			s.mu.Lock()
			s.keepaliveSubs = append(s.keepaliveSubs, sub)
			s.mu.Unlock()
		}
	}
	return nil
}

// Primary reports whether this instance serves the lease requests: always
// without an election (ServiceConfig.Primary off), else while it holds
// the claim.
func (s *Service) Primary() bool {
	if s.prim == nil {
		return true
	}
	_, ok := s.prim.current(s.cfg.Now())
	return ok
}

// mayAppend refuses an append when this instance is not in a term of its
// own (an election runs and it lost, or has not renewed its claim).
func (s *Service) mayAppend() error {
	if s.Primary() {
		return nil
	}
	return fmt.Errorf("%w: this lease service instance is not the primary (another serves the lease requests, or its claim was not renewed in time)", lease.ErrUnavailable)
}

// withinTerm bounds ctx by the end of this primary's term: an append not
// acknowledged by then is not waited for (its outcome is unknown, and the
// batch is answered so), so no answer says a record was written that a
// successor, which takes over only primaryGap after the term, may not see
// when it loads the repo.
func (s *Service) withinTerm(ctx context.Context) (context.Context, context.CancelFunc) {
	if s.prim == nil {
		return ctx, func() {}
	}
	s.prim.mu.Lock()
	until := s.prim.until
	s.prim.mu.Unlock()
	if until.IsZero() {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, until.Sub(s.cfg.Now()))
}

// vouches reports whether this primary may answer from a's view as the
// log's: it is in its term, and a read or wrote its log in this term.
// Never without an election: instances that all serve confirm each view
// with a read of the log.
func (s *Service) vouches(a *actor) bool {
	if s.prim == nil {
		return false
	}
	n, ok := s.prim.current(s.cfg.Now())
	return ok && a.term.Load() == n
}

// termNow is the number of the term this instance is in (0: none).
func (s *Service) termNow() uint64 {
	n, _ := s.termAndEpoch()
	return n
}

// termAndEpoch is the number of the term this instance is in (0: none)
// and its epoch (primacy.epoch), read together.
func (s *Service) termAndEpoch() (term, epoch uint64) {
	if s.prim == nil {
		return 0, 0
	}
	p := s.prim
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.until.IsZero() || !s.cfg.Now().Before(p.until) {
		return 0, 0
	}
	return p.number, p.epoch
}

// elect runs the election until ctx ends: as a standby it watches the
// claim and takes it once free or unrenewed; as the primary it renews it.
func (s *Service) elect(ctx context.Context) {
	p := s.prim
	wait := time.Duration(0)
	// Claim writes refused in a row (lost to another instance, or found
	// busy), and since when they have been refused as busy.
	refused, busySince, warned := 0, time.Time{}, false
	unheard := false // the fleet connection last failed hearsFleet
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
		if p.serving() {
			wait = p.term / 4
			s.renewClaim(ctx)
			s.checkApart(ctx)
			continue
		}
		wait = p.term / 8
		seen, err := s.observeClaim(ctx)
		if err != nil {
			continue
		}
		seq := seen.seq
		if !seen.free && !p.lapsed(seq, s.store.writer) && (seen.age < p.term+primaryGap || p.sinceBack(s.cfg.Now()) < primaryGap) {
			refused, busySince, warned = 0, time.Time{}, false // a round without a write ends the row
			continue
		}
		if err := s.probeFleet(ctx, p.term/2); err != nil {
			if !unheard {
				unheard = true
				s.log.Warn("primary election: the claim is free to take, but not by this instance while the fleet cannot reach it", "err", err)
			}
			continue
		}
		unheard = false
		sent := s.cfg.Now()
		got, err := s.writeClaim(ctx, seq, false)
		switch {
		case err == nil:
			refused, busySince, warned = 0, time.Time{}, false
			s.beginTerm(got, sent.Add(p.term), seen.own)
			wait = p.term / 4
		case errors.Is(err, errCAS), errors.Is(err, errClaimBusy):
			// Another took it (or, busy, another write of it is in
			// flight at the stream's leader: when instances race, the
			// loser's usually comes while the winner's is): read whose
			// at once, so that the requests this standby takes go to
			// it, not answered "the claim is free" from the read before
			// (for half a second after every start, when all instances
			// race for the claim). Once in a row, never in a loop: a
			// leader cut off from its followers keeps the last write
			// it took in flight for as long as the cut lasts and
			// refuses every later one at once, and an instance that
			// asked again at once spun — thousands of writes a second
			// on two cores, starving the nodes that were to elect its
			// successor (TestClusterPrimaryCutOffWithTheClaimsLeader).
			if refused++; refused == 1 {
				wait = 0
			}
			if !errors.Is(err, errClaimBusy) {
				busySince = time.Time{}
				break
			}
			if busySince.IsZero() {
				busySince = sent
			}
			if !warned && sent.Sub(busySince) >= p.term {
				warned = true
				s.log.Warn("primary election: a write of the claim has been in flight at its stream's leader for a term (a leader cut off from its followers?); trying again", "every", p.term/8, "err", err)
			}
		default:
			refused, busySince, warned = 0, time.Time{}, false
			s.log.Warn("primary election: claim", "err", err)
		}
	}
}

// lapsed reports whether the claim's last record, at seq, is this
// instance's own (writer): its term ran out with no renewal acknowledged
// (the claim's stream electing a leader, most likely) and nobody has
// claimed since. It takes the claim back at once: there is no other
// instance's term to wait out, and its views of the repos need a re-read
// each, not the load a standby's takeover costs. A standby that could not
// read the claim waits primaryGap after reading it again (sinceBack), so
// the lapsed primary, which reads the claim as often, comes first.
//
// Its own is the record it last read if that names it (its writer stamp
// is made anew at each start): its last acknowledged renewal, or a renewal
// the stream wrote but whose acknowledgement was lost to the election (the
// renewal timed out), which is as much its own. Not the sequence alone: a
// claim stream made anew numbers from 1 again. (Taken only by the
// acknowledged sequence, such a lapse left the two instances waiting the
// same primaryGap, and the standby took over as often as not.) Taking it
// back is a compare-and-swap on that record like any claim.
func (p *primacy) lapsed(seq uint64, writer string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return seq != 0 && seq == p.seen && !p.free && p.leader == writer
}

// sinceBack is how long the claim has been readable again since a read of
// it last failed (long: never failed).
func (p *primacy) sinceBack(now time.Time) time.Duration {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.backAt.IsZero() {
		return time.Duration(1<<63 - 1)
	}
	return now.Sub(p.backAt)
}

// claimSeen is what observeClaim read of the claim.
type claimSeen struct {
	seq  uint64        // its record's sequence (0: none)
	free bool          // no record, or a released one
	own  bool          // this instance wrote it
	age  time.Duration // how long this instance has seen that same record
}

// observeClaim reads the claim and notes what it says for routing: its
// sequence, whether it is free, and how long this instance has seen that
// same record (a renewed claim is a new record).
func (s *Service) observeClaim(ctx context.Context) (claimSeen, error) {
	p := s.prim
	seq, rec, err := s.readClaim(ctx)
	now := s.cfg.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	p.readAt = now
	if err != nil {
		p.readErr = err
		s.log.Debug("primary election: read the claim", "err", err)
		return claimSeen{}, err
	}
	if seq != p.seen || p.seenAt.IsZero() {
		p.seen, p.seenAt = seq, now
	}
	if p.readErr != nil {
		p.backAt = now
	}
	free := seq == 0 || rec.Released
	if rec.Writer != p.leader && rec.Writer != "" && rec.Writer != s.store.writer && !free {
		// Where this standby forwards the lease requests from now on:
		// said once a change, so that a fault's log tells who served.
		s.log.Info("standby: forwarding the lease requests to the primary", "primary", rec.Writer, "claim_seq", seq)
	}
	p.leader, p.free, p.readErr = rec.Writer, free, nil
	return claimSeen{seq: seq, free: free, own: seq != 0 && rec.Writer == s.store.writer, age: now.Sub(p.seenAt)}, nil
}

// rereadEvery bounds how often a standby that knows no primary reads the
// claim for a request (forward): an election just ended, most likely.
const rereadEvery = 50 * time.Millisecond

// renewClaim renews the primary's claim; losing it ends the term.
func (s *Service) renewClaim(ctx context.Context) {
	p := s.prim
	p.mu.Lock()
	expect, until := p.seq, p.until
	p.mu.Unlock()
	sent := s.cfg.Now()
	// No later than the term: past it a standby may have taken over.
	rctx, cancel := context.WithTimeout(ctx, max(until.Sub(sent), time.Millisecond))
	err := s.hearsFleet(rctx)
	var seq uint64
	if err == nil {
		seq, err = s.writeClaim(rctx, expect, false)
	}
	cancel()
	switch {
	case err == nil:
		p.mu.Lock()
		p.seq = seq // the claim's last record is ours, term or not (leaveTerm releases it)
		if !p.until.IsZero() {
			p.until = sent.Add(p.term)
		}
		p.mu.Unlock()
	case errors.Is(err, errCAS):
		s.endTerm("another lease service instance took the claim")
	case !s.cfg.Now().Before(until):
		// Busy (errClaimBusy) included: a renewal still in flight at
		// the stream's leader is no renewal, and the term is over.
		s.endTerm("the claim was not renewed within its term: " + err.Error())
	default:
		s.log.Warn("primary: renew the claim; trying again", "err", err)
	}
}

// hearsFleet checks that the fleet connection, which takes the fleet's
// requests and carries their answers, reaches the claim connection, which
// writes the claim: it asks the claim connection's own subscription
// (reachSubject) and waits for its answer. The two connections may have
// dialled different servers. Without this, an instance whose fleet
// connection's server froze (SIGSTOP) or was cut off from the others
// renewed its claim through the other for as long as that lasted and
// answered nobody — every request forwarded to it lost, no standby taking
// over (the fault harness's pause of a node, CI at fdb89d2). Asked before
// each claim write, whose acknowledgement by the claim's quorum shows the
// claim connection's server is on the quorum's side, so at most one
// renewal follows a cut: the primary then lets its term run out, and
// neither it nor a standby like it takes the claim.
//
// The answer travels core NATS between the two servers, so the check
// asks only what it must: a JetStream API request (stop 63 asked for the
// claim's stream's info) waits in the servers' one API queue, which every
// fleet identity may flood — the queue drops everything past 10,000, and
// info requests wait behind all others — and a runner could then have
// every instance stop serving. It also needs no reasoning about which
// replica answers: a cut-off replica answered for the claim itself, with
// the records it had at the cut.
func (s *Service) hearsFleet(ctx context.Context) error {
	if s.fleet == s.nc {
		return nil // one connection: the claim's write is the proof
	}
	if at := s.fleetUnprobedAt.Load(); at != 0 {
		if s.cfg.Now().Sub(time.Unix(0, at)) < fleetReprobe {
			return nil
		}
		// Asked again, the answer's subscription made again (the same
		// configuration refused it too). The check stays off until it is
		// answered: asking again costs no renewal.
		err := s.answerReach(ctx)
		if err == nil {
			err = s.askReach(ctx)
		}
		if err != nil {
			s.fleetUnprobedAt.Store(s.cfg.Now().UnixNano())
			s.log.Debug("lease service: its fleet connection's check is still off", "err", err, "retry", fleetReprobe)
			return nil
		}
		s.fleetUnprobedAt.Store(0)
		s.log.Info("the bus lets the lease service's fleet connection reach its claim connection again: a primary whose fleet connection is cut off lets its term run out")
		return nil
	}
	err := s.askReach(ctx)
	if errors.Is(err, nats.ErrNoResponders) {
		// Nobody answers: the claim connection's subscription is gone
		// (refused by the server it reconnected to) or not yet known
		// where the fleet connection is. Made again, and asked again.
		if err = s.answerReach(ctx); err == nil {
			err = s.askReach(ctx)
		}
	}
	if refusesReach(err) {
		s.reachRefused(err)
		return nil
	}
	if err != nil {
		return fmt.Errorf("its fleet connection (to server %q) does not reach its claim connection (to server %q): %w", s.fleet.ConnectedServerName(), s.nc.ConnectedServerName(), err)
	}
	return nil
}

// askReach asks the claim connection's subscription (answerReach)
// through the fleet connection. A question the bus refuses is dropped
// without an answer; the refusal comes back before the answer to a flush,
// so it is told (refusesReach) at once rather than when ctx ends.
func (s *Service) askReach(ctx context.Context) error {
	subject := reachSubject(s.store.writer)
	inbox := s.fleet.NewInbox()
	sub, err := s.fleet.SubscribeSync(inbox)
	if err != nil {
		return err
	}
	defer func() { _ = sub.Unsubscribe() }()
	before := s.fleet.LastError()
	if err := s.fleet.PublishRequest(subject, inbox, nil); err != nil {
		return err
	}
	if err := s.fleet.FlushWithContext(ctx); err != nil {
		return err
	}
	if le := s.fleet.LastError(); le != before && refusesReach(le) {
		return le
	}
	m, err := sub.NextMsgWithContext(ctx)
	switch {
	case err != nil:
		return err
	case len(m.Data) == 0 && m.Header.Get("Status") == "503":
		return nats.ErrNoResponders
	case string(m.Data) != s.store.writer:
		return fmt.Errorf("answered %q on %s, not by its own claim connection", m.Data, subject)
	}
	return nil
}

// refusesReach reports whether err is the bus refusing hearsFleet's
// request or its answer's subscription: a permission violation on its
// subject.
func refusesReach(err error) bool {
	return errors.Is(err, nats.ErrPermissionViolation) && strings.Contains(err.Error(), reachPrefix+".")
}

// reachRefused holds hearsFleet off for fleetReprobe, and says why the
// first time.
func (s *Service) reachRefused(err error) {
	if s.fleetUnprobedAt.Swap(s.cfg.Now().UnixNano()) == 0 {
		s.log.Warn("the bus does not let the lease service's fleet connection reach its claim connection, so a primary whose fleet connection is cut off keeps its claim: print the bus's configuration again with `fenceline bus creds` and reload its servers (this instance asks again every minute)", "err", err, "retry", fleetReprobe)
	}
}

// fleetReprobe is how long an instance whose bus refused hearsFleet's
// request (a configuration from before it) waits before asking again: a
// reload of the servers' configuration brings the check back without a
// restart.
var fleetReprobe = time.Minute // a var: a sequential test shortens it

// answerReach subscribes the claim connection to answer the fleet
// connection's hearsFleet, with the instance's writer stamp, in place of
// any subscription before (refused by an older configuration, or lost).
// It fails if the bus refuses the subscription (refusesReach).
//
// Only a question asked through the service import is answered (its
// reply the server's "_R_." one): a fleet identity may have JetStream
// push its stream's records onto any subject of the service account,
// this one too, and those deliveries get no answer.
func (s *Service) answerReach(ctx context.Context) error {
	s.reachMu.Lock()
	defer s.reachMu.Unlock()
	if s.reach != nil {
		_ = s.reach.Unsubscribe()
		s.reach = nil
	}
	subject := reachSubject(s.store.writer)
	before := s.nc.LastError()
	sub, err := s.nc.Subscribe(subject, func(m *nats.Msg) {
		if strings.HasPrefix(m.Reply, "_R_.") {
			_ = m.Respond([]byte(s.store.writer)) // unanswered, the asker's check fails: as it must when the answer cannot go
		}
	})
	if err != nil {
		return fmt.Errorf("lease service: answer its fleet connection on %s: %w", subject, err)
	}
	// Known to its server before the first question (the others hear of
	// it later: until then a question is answered "no responders" and
	// asked again), and refused, if it is, before the flush's answer.
	err = s.nc.FlushWithContext(ctx)
	if le := s.nc.LastError(); err == nil && le != before && refusesReach(le) {
		err = le
	}
	if err != nil {
		_ = sub.Unsubscribe()
		return fmt.Errorf("lease service: answer its fleet connection on %s: %w", subject, err)
	}
	s.reach = sub
	return nil
}

// probeFleet is hearsFleet within d.
func (s *Service) probeFleet(ctx context.Context, d time.Duration) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return s.hearsFleet(ctx)
}

// readClaim reads the claim's last record and its sequence (0: none). A
// record the service did not write (see serviceWrote) names no writer and
// is not released: a standby takes over once it has gone unrenewed.
func (s *Service) readClaim(ctx context.Context) (uint64, claimRecord, error) {
	var rec claimRecord
	ctx, cancel := context.WithTimeout(ctx, s.prim.term)
	defer cancel()
	stream, err := s.js.Stream(ctx, PrimaryStream)
	if err != nil {
		return 0, rec, fmt.Errorf("open stream %s: %w", PrimaryStream, err)
	}
	m, err := stream.GetLastMsgForSubject(ctx, primarySubject)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, rec, nil
	case err != nil:
		return 0, rec, err
	}
	if !serviceWrote(m.Header) || json.Unmarshal(m.Data, &rec) != nil || !validIdentity(rec.Writer) {
		rec = claimRecord{}
	}
	return m.Sequence, rec, nil
}

// errClaimBusy is a claim write the stream's leader refused because
// another write of the claim is still in flight there (JetStream's
// "wrong last sequence" without a sequence, error code 10164): nothing
// says another instance took it.
var errClaimBusy = errors.New("a write of the claim is still in flight at its stream's leader")

// writeClaim writes a claim record on top of the record at expect (0: the
// first) and returns its sequence; errCAS when another was written first,
// errClaimBusy when another write of it is in flight.
func (s *Service) writeClaim(ctx context.Context, expect uint64, released bool) (uint64, error) {
	data, err := json.Marshal(claimRecord{Writer: s.store.writer, Released: released})
	if err != nil {
		return 0, err
	}
	m := nats.NewMsg(primarySubject)
	m.Data = data
	m.Header.Set(writerHeader, s.store.writer)
	m.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect, 10))
	seq, err := s.store.publish(ctx, m)
	switch {
	case err == nil:
		s.cfg.Metrics.claimWritten("ok")
		return seq, nil
	case inFlightMismatch(err):
		s.cfg.Metrics.claimWritten("busy")
		return 0, fmt.Errorf("%w (%v)", errClaimBusy, err)
	case isCASMismatch(err):
		s.cfg.Metrics.claimWritten("lost")
		return 0, errCAS
	}
	s.cfg.Metrics.claimWritten("error")
	return 0, err
}

// beginTerm makes this instance the primary, until until unless renewed:
// it serves the lease requests, has every repo it has an actor for read
// its log again (a view is vouched for only once read or written in this
// term), and loads the rest.
func (s *Service) beginTerm(seq uint64, until time.Time, overOwn bool) {
	p := s.prim
	p.mu.Lock()
	p.number++
	if !overOwn || p.epoch == 0 {
		p.epoch++
	}
	p.seq, p.until = seq, until
	n, first := p.number, !p.began
	p.began = true
	p.leader, p.free, p.readErr = s.store.writer, false, nil
	p.apartAt = time.Time{} // once the pass below is done
	p.mu.Unlock()
	s.live.from(s.cfg.Now()) // every session gets its whole grace from the takeover
	s.log.Info("this lease service instance is the primary: it serves the lease requests", "term", n, "writer", s.store.writer)
	for _, a := range s.allActors() {
		a.nudge()
	}
	s.goBackground(func() {
		s.loadEvery(s.ctx)
		p.mu.Lock()
		if p.number == n {
			p.apartAt = s.cfg.Now().Add(apartAfter)
		}
		p.mu.Unlock()
		if first {
			s.catchUp(s.ctx)
		}
	})
}

// endTerm makes this instance a standby: it forwards the lease requests
// from now on (appends and vouching stopped with its term already).
func (s *Service) endTerm(why string) {
	if _, was := s.stopTerm(); was {
		s.log.Warn("this lease service instance is no longer the primary", "why", why)
	}
}

// stopTerm ends this instance's term, if it holds one (and says so, with
// the claim's sequence).
func (s *Service) stopTerm() (seq uint64, was bool) {
	p := s.prim
	p.mu.Lock()
	defer p.mu.Unlock()
	was = !p.until.IsZero()
	p.until = time.Time{}
	p.leader = ""
	return p.seq, was
}

// leaveTerm ends the term (Stop): nothing is appended or vouched for from
// here on. The release it returns frees the claim, so that a standby
// takes over at once; Stop calls it once its work has ended.
func (s *Service) leaveTerm() (release func()) {
	_, held := s.stopTerm() // a stop, not a fault: no warning
	if held {
		s.log.Info("the primary lease service instance is stopping; it releases its claim")
	}
	return func() {
		if !held {
			return
		}
		s.prim.mu.Lock()
		seq := s.prim.seq // after any renewal in flight when the term stopped
		s.prim.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if _, err := s.writeClaim(ctx, seq, true); err != nil && !errors.Is(err, errCAS) {
			s.log.Warn("primary: release the claim (a standby takes over once its term ends)", "err", err)
		}
	}
}

// Apart. A node that dies while it runs the primary and also leads the
// lease log's stream (or the claim's) stacks two waits: the standbys' wait
// for the term to run out, then the stream's raft election (4-9 s in
// nats-server) before anything can be appended, and holders on a 30 s TTL
// ran out meanwhile (2,551 leases lost of 10,000 in one such run,
// docs/benchmarks.md). So the primary keeps those streams led from nodes
// other than the one it reaches the bus through: now and then it reads
// where each is led and, when it is its own server and another replica is
// current, asks the stream to elect another leader (a leadership transfer
// to a current replica). A node's death then costs either a takeover or
// an election, never both.
var apartStreams = []string{LogStream, PrimaryStream}

const (
	// apartAfter is how long after the takeover's pass (which a new
	// leader's election would stall) the first check comes.
	apartAfter = 5 * time.Second
	// apartEvery is how often the primary checks again. (10 s was tried:
	// a CI run's check moved the log stream's leader while a killed node
	// came back, and JetStream answered 503 for a minute after.)
	apartEvery = 30 * time.Second
)

// checkApart runs keepApart in the background when it is due and none
// runs: the election's loop never waits for it.
func (s *Service) checkApart(ctx context.Context) {
	p := s.prim
	now := s.cfg.Now()
	p.mu.Lock()
	due := !p.apartAt.IsZero() && !now.Before(p.apartAt)
	if due {
		p.apartAt = now.Add(apartEvery)
	}
	p.mu.Unlock()
	if !due || !p.apartBusy.CompareAndSwap(false, true) {
		return
	}
	if !s.goBackground(func() {
		defer p.apartBusy.Store(false)
		s.keepApart(ctx)
	}) {
		p.apartBusy.Store(false)
	}
}

// keepApart asks each of apartStreams led by this instance's server (its
// claim connection's; the claim's stream also its fleet connection's) to
// elect a leader elsewhere, when one of its other replicas is current.
func (s *Service) keepApart(ctx context.Context) {
	here := s.nc.ConnectedServerName()
	if here == "" {
		return
	}
	for _, name := range apartStreams {
		if !s.Primary() {
			return
		}
		away := []string{here}
		if f := s.fleet.ConnectedServerName(); name == PrimaryStream && f != "" && f != here {
			away = append(away, f)
		}
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		moved, err := s.leadElsewhere(rctx, name, away)
		cancel()
		switch {
		case err != nil:
			s.log.Debug("primary: where a stream is led", "stream", name, "err", err)
		case moved != "":
			s.log.Info("primary: asked a stream led from this instance's node to elect a leader on another", "stream", name, "server", moved)
		}
	}
}

// preferredActive bounds how long ago a stream's leader may have heard the
// replica it hands the leadership to: nats-server's raft takes a preferred
// peer only within three heartbeats (3 s), and picks another otherwise.
const preferredActive = 2 * time.Second

// leadElsewhere asks stream name to step down when one of the servers
// away leads it, for a current replica on none of them (on a server but
// the first, the claim connection's, only so); moved names the server
// that led it when it asked and the stream agreed.
//
// Away from the claim connection's server, so that the node's loss does
// not cost both a takeover and the stream's election; away from the
// fleet connection's for the same reason: that node's loss ends the term
// too (hearsFleet), and a standby takes the claim over sooner from a
// stream that keeps its leader.
func (s *Service) leadElsewhere(ctx context.Context, name string, away []string) (moved string, err error) {
	st, err := s.js.Stream(ctx, name)
	if err != nil {
		return "", err
	}
	ci := st.CachedInfo().Cluster
	if ci == nil {
		return "", nil
	}
	led := slices.Index(away, ci.Leader)
	if led < 0 {
		return "", nil
	}
	to := ""
	for _, r := range ci.Replicas {
		// Only a replica the leader heard within raft's live window
		// (3 s), and caught up, is taken as the preferred one; another,
		// the stream picks one itself, maybe the server it is moved off.
		if !r.Current || r.Offline || r.Lag != 0 || r.Active >= preferredActive {
			continue
		}
		if !slices.Contains(away, r.Name) {
			to = r.Name
			break
		}
		if led == 0 && to == "" {
			to = r.Name // off the claim connection's server, onto the fleet's: better than staying
		}
	}
	if to == "" {
		return "", nil
	}
	api, err := jsAPI(ctx, s.nc)
	if err != nil {
		return "", err
	}
	req := fmt.Sprintf(`{"placement":{"preferred":%q}}`, to)
	m, err := s.nc.RequestWithContext(ctx, api+".STREAM.LEADER.STEPDOWN."+name, []byte(req))
	if err != nil {
		return "", err
	}
	var resp struct {
		Success bool                `json:"success"`
		Error   *jetstream.APIError `json:"error"`
	}
	if err := json.Unmarshal(m.Data, &resp); err != nil {
		return "", fmt.Errorf("stream %s: step down: %w", name, err)
	}
	if resp.Error != nil {
		return "", fmt.Errorf("stream %s: step down: %w", name, resp.Error)
	}
	if !resp.Success {
		return "", nil
	}
	return ci.Leader, nil
}
