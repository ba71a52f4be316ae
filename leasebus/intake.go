package leasebus

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

// An intake is the way in of one request subscription: every runner's
// requests of one kind reach the service on one subscription, read off
// its connection in the order they came, and nats.go hands them to one
// goroutine first come first served. Served there, a runner that floods
// the subscription with requests costly to read (a decode, a policy
// check, an answer each) makes every other runner's requests of that
// kind wait behind the whole flood, and past nats.go's pending limits
// has them dropped with it.
//
// So the subscription's goroutine only sorts: it reads the asker off the
// subject (O(1), no decode) and queues the message behind that asker's
// own, and the intake's goroutine serves them in turns, one request of
// each asker with requests waiting per turn, each asker's in the order
// they came (turns). A request waits for at most one request of every
// other asker, however deep their backlogs; a flood lengthens only its
// sender's queue, which is bounded: past maxIntakeQueued requests or
// maxIntakeBytes of them (their size on the wire, headers too) the
// sender's next is refused at once, as an overload (audited), before
// anything decodes its body. Every asker's together are bounded too:
// past maxIntakeTotal bytes an asker is taken only within its fair share
// of that (the total over the askers waiting) and up to twice the total,
// or with a first small request (maxIntakeFirst), so many flooders
// together still cannot lock another runner out. A request's headers (nats.go has decoded them into
// a map by then) are bounded on their own, maxRequestHeaders.
//
// With nothing waiting, the subscription's goroutine serves the request
// itself, as before intakes: no hand-off for an uncontended request
// (while it serves, what comes waits unsorted in nats.go: for one
// request's time, an inline batch's append included).
type intake struct {
	svc *Service
	op  string
	// inline says its requests may run their repo's batch on the serving
	// goroutine when nothing waits behind them (actor.inline): false for
	// requests forwarded by a standby.
	inline bool
	serve  serveFunc
	ready  chan struct{} // one slot: requests came since the goroutine last looked

	mu     sync.Mutex
	q      turns[arrived] // guarded by mu
	busy   bool           // a request is being served; guarded by mu
	closed bool           // the service stopped; guarded by mu
}

// A serveFunc serves request m, received at at; alone says that no other
// request waits behind it, so its repo's batch may run on the caller's
// goroutine (actor.inline).
type serveFunc func(m *nats.Msg, at time.Time, alone bool)

// arrived is a request waiting in an intake, and when it came.
type arrived struct {
	m  *nats.Msg
	at time.Time
}

// Bounds of the requests waiting in one intake: one asker's (past either
// its next is refused as an overload), far above what a runner sends at
// once (a keepalive and a few renewals a session); and every asker's
// together, nats.go's own default for a subscription's pending bytes.
// Past that an asker is still taken within its fair share of it (divided
// by the askers waiting), up to twice maxIntakeTotal in all, and with a
// first request of at most maxIntakeFirst bytes however full: an intake
// holds at most twice maxIntakeTotal, and maxIntakeFirst an asker more.
// The anonymous asker of a bus without identities is everyone: it has
// only the bounds of all.
const (
	maxIntakeQueued = 4096
	maxIntakeBytes  = 16 << 20
	maxIntakeTotal  = 64 << 20
	maxIntakeFirst  = 64 << 10
)

// maxRequestHeaders bounds the headers of a request, in bytes on the
// wire: a client sends one (its nonce), a standby's forward a few more.
// nats.go holds each header in a map of its own, larger than on the
// wire, so they are bounded apart from the request's size.
const maxRequestHeaders = 4 << 10

// forwardHeaders is room for the headers a standby adds to a request it
// forwards (primary.go): the asker's subject and reply, its account and
// the standby's name.
const forwardHeaders = 2 << 10

// newIntake makes the intake of op's requests, served by serve, and
// starts its goroutine; false when the service is stopping.
func (s *Service) newIntake(op string, inline bool, serve serveFunc) (*intake, bool) {
	in := &intake{svc: s, op: op, inline: inline, serve: serve, ready: make(chan struct{}, 1)}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		return nil, false
	}
	s.wg.Go(func() { in.run(s.ctx) })
	s.intakes = append(s.intakes, in)
	return in, true
}

// askerOf is the asker whose turn m waits for: the identity its subject
// names when its reply is that identity's own inbox (a request it sent;
// the bus lets each identity publish only under its own name), the
// anonymous asker on a bus without identities (Service.open), else "" —
// an answer someone had the bus send onto a request subject, which the
// handler refuses; such messages share one turn and count against no
// identity.
func (s *Service) askerOf(m *nats.Msg) string {
	if id, ok := s.sender(m); ok {
		return id
	}
	return ""
}

// sender is the identity request m's subject names, and whether it sent
// m: its reply is that identity's own inbox (IdentityOfSubject), or, on a
// bus without identities (Service.open) and only there, it is Anonymous,
// whose replies are any inbox. On a bus with identities no one asks as
// Anonymous.
func (s *Service) sender(m *nats.Msg) (string, bool) {
	id, ok := IdentityOfSubject(m.Subject, m.Reply)
	if id == Anonymous {
		return id, s.open
	}
	return id, ok
}

// deliver takes request m off via, the subscription it came on, as wire
// (m, or the standby's message that forwarded it): served at once when
// nothing waits, else queued in its asker's turn.
func (in *intake) deliver(m *nats.Msg, via *nats.Subscription, wire *nats.Msg) {
	by, at := in.svc.askerOf(m), in.svc.cfg.Now()
	size := wire.Size() // as received: O(1)
	limit := maxRequestHeaders
	if wire != m {
		limit += forwardHeaders // a standby's own, around the asker's
	}
	if hdr := size - len(wire.Subject) - len(wire.Reply) - len(wire.Data); hdr > limit {
		in.invalid(m, by, fmt.Errorf("%w: request headers of %d bytes: at most %d", lease.ErrInvalid, hdr, limit))
		return
	}
	in.mu.Lock()
	if in.closed {
		in.mu.Unlock()
		in.stopped(m, by)
		return
	}
	if !in.busy && in.q.len() == 0 && pendingAtMost(via, 1) {
		// Nothing waits here, nor behind m on the subscription (nats.go
		// counts the message being handled): served on this goroutine.
		in.busy = true
		in.mu.Unlock()
		in.serve(m, at, in.inline)
		in.mu.Lock()
		in.busy = false
		more := in.q.len() > 0
		in.mu.Unlock()
		if more {
			in.wake()
		}
		return
	}
	n, waiting, total := in.q.lenOf(by), in.q.sizeOf(by), in.q.total()
	askers := in.q.identities()
	if n == 0 {
		askers++
	}
	switch {
	case by != Anonymous && (n >= maxIntakeQueued || waiting+size > maxIntakeBytes):
		in.mu.Unlock()
		in.shed(m, by, fmt.Sprintf("has %d %s requests (%d bytes) waiting to be read already (at most %d requests and %d bytes an identity)",
			n, in.op, waiting, maxIntakeQueued, maxIntakeBytes))
		return
	case (n > 0 || size > maxIntakeFirst) && (total+size > 2*maxIntakeTotal || total+size > maxIntakeTotal && waiting+size > maxIntakeTotal/askers):
		in.mu.Unlock()
		in.shed(m, by, fmt.Sprintf("has %d %s requests (%d bytes) waiting to be read already, and every identity's waiting are %d bytes: past %d, at most a fair share of it an identity (%d bytes, of %d identities), and past %d none but a first small request",
			n, in.op, waiting, total, maxIntakeTotal, maxIntakeTotal/askers, askers, 2*maxIntakeTotal))
		return
	}
	in.q.push(by, arrived{m, at}, size)
	in.mu.Unlock()
	in.wake()
}

func (in *intake) wake() {
	select {
	case in.ready <- struct{}{}:
	default: // a wake-up is pending already
	}
}

// run serves what waits, in turns, until ctx ends; then it answers what
// is left that the service is stopping.
func (in *intake) run(ctx context.Context) {
	defer in.close()
	for {
		select {
		case <-ctx.Done():
			return
		case <-in.ready:
		}
		for ctx.Err() == nil {
			in.mu.Lock()
			if in.busy { // the subscription's goroutine serves; it wakes this one for what comes after
				in.mu.Unlock()
				break
			}
			r, ok := in.q.pop()
			if !ok {
				in.mu.Unlock()
				break
			}
			in.busy = true
			alone := in.inline && in.q.len() == 0
			in.mu.Unlock()
			in.serve(r.m, r.at, alone && pendingAtMost(r.m.Sub, 0))
			in.mu.Lock()
			in.busy = false
			in.mu.Unlock()
		}
	}
}

// close answers every request still waiting that the service is
// stopping, and those that come after too.
func (in *intake) close() {
	in.mu.Lock()
	in.closed = true
	var left []arrived
	for {
		r, ok := in.q.pop()
		if !ok {
			break
		}
		left = append(left, r)
	}
	in.mu.Unlock()
	for _, r := range left {
		in.stopped(r.m, in.svc.askerOf(r.m))
	}
}

// stopped answers m, asked by by, that the service is stopping.
func (in *intake) stopped(m *nats.Msg, by string) {
	if by != "" && in.svc.answerable(m) {
		respondErr(m, fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable))
	}
}

// invalid answers m, asked by by, that it is refused for err, without
// reading it.
func (in *intake) invalid(m *nats.Msg, by string, err error) {
	s := in.svc
	s.cfg.Metrics.took(in.op)
	s.cfg.Metrics.answered(in.op, 0, toWire(err))
	if by != "" && in.svc.answerable(m) {
		respondErr(m, err)
	}
}

// shed refuses m, asked by by, for why (what by has waiting here):
// audited as an overload in by's name (counted past refusalRate a
// second), and answered unless it is not by's request.
func (in *intake) shed(m *nats.Msg, by, why string) {
	s := in.svc
	who := "messages no identity sent"
	if by != "" {
		who = s.name(by)
	}
	what := who + " " + why
	s.refuse(ReasonBusOverload, by, "refused a "+in.op+" request: "+what)
	err := fmt.Errorf("%w: lease service overloaded: %s; retry once they are answered", lease.ErrUnavailable, what)
	s.cfg.Metrics.took(in.op)
	s.cfg.Metrics.answered(in.op, 0, toWire(err))
	if by != "" && in.svc.answerable(m) {
		respondErr(m, err)
	}
}

// waitingOf is how many requests by has waiting here.
func (in *intake) waitingOf(by string) int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.q.lenOf(by)
}

// waiting is how many requests wait here.
func (in *intake) waiting() int {
	in.mu.Lock()
	defer in.mu.Unlock()
	return in.q.len()
}

// pendingAtMost reports whether at most n messages wait on sub in
// nats.go (false when it cannot say).
func pendingAtMost(sub *nats.Subscription, n int) bool {
	if sub == nil {
		return false
	}
	msgs, _, err := sub.Pending()
	return err == nil && msgs <= n
}

// keepalivesWaiting reports whether keepalives of identity id wait in
// this instance's intakes: its sessions' silence may be this instance's
// backlog, not theirs (silentSession).
func (s *Service) keepalivesWaiting(id string) bool {
	s.mu.Lock()
	intakes := s.intakes
	s.mu.Unlock()
	for _, in := range intakes {
		if in.op == "keepalive" && in.waitingOf(id) > 0 {
			return true
		}
	}
	return false
}
