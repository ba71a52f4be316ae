package leasebus

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
)

// mailboxes sends requests whose replies come back on reply subscriptions
// of their own, one request at a time each. nats.go's Request hands every
// reply from the connection's reader to a dispatcher goroutine and from
// there to the requester; a mailbox's synchronous subscription hands it to
// the requester directly: one goroutine hand-off less per request, on the
// lease bus's hot path (client requests, log appends). At most max
// mailboxes are kept; a request beyond that gets one of its own for its
// duration.
type mailboxes struct {
	nc  *nats.Conn
	max int

	mu     sync.Mutex
	free   []*mailbox // guarded by mu
	made   int        // guarded by mu
	closed bool       // guarded by mu
}

// mailbox is one reply subscription on <inbox>.*, where inbox ends in 128
// random bits: nobody who cannot hear it can name its subjects. Each
// request gets the next subject under it, so a late reply to an abandoned
// request is recognized and dropped.
type mailbox struct {
	sub    *nats.Subscription
	prefix string // <inbox>.
	seq    uint64
	own    bool // made for one request beyond max: dropped when put back
}

// get returns an idle mailbox, or a new one (kept for reuse while fewer
// than max exist), or nil when the pool is closed or the subscription
// fails.
func (p *mailboxes) get() *mailbox {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if n := len(p.free); n > 0 {
		mb := p.free[n-1]
		p.free = p.free[:n-1]
		return mb
	}
	inbox := inboxBase(p.nc) + "." + randomToken()
	sub, err := p.nc.SubscribeSync(inbox + ".*")
	if err != nil {
		return nil
	}
	own := p.made >= p.max
	if !own {
		p.made++
	}
	return &mailbox{sub: sub, prefix: inbox + ".", own: own}
}

// inboxBase is the connection's inbox prefix (the identity's own, see
// Creds.Options).
func inboxBase(nc *nats.Conn) string {
	if nc.Opts.InboxPrefix != "" {
		return nc.Opts.InboxPrefix
	}
	return nats.InboxPrefix[:len(nats.InboxPrefix)-1]
}

// randomToken is 128 random bits as a subject token.
func randomToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails on Linux
	return hex.EncodeToString(b[:])
}

// put returns a mailbox for reuse; a broken one, or one made beyond max,
// is dropped.
func (p *mailboxes) put(mb *mailbox) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if mb.own {
		_ = mb.sub.Unsubscribe()
		return
	}
	if p.closed || !mb.sub.IsValid() {
		p.made--
		_ = mb.sub.Unsubscribe()
		return
	}
	p.free = append(p.free, mb)
}

// close unsubscribes the idle mailboxes; busy ones are dropped when put back.
func (p *mailboxes) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, mb := range p.free {
		_ = mb.sub.Unsubscribe()
	}
	p.free = nil
}

// request publishes m and waits for its reply, like nats.go's
// RequestMsgWithContext (the same errors: ctx.Err(), ErrNoResponders,
// connection errors).
func (p *mailboxes) request(ctx context.Context, m *nats.Msg) (*nats.Msg, error) {
	return p.requestChecked(ctx, m, nil, nil)
}

// requestChecked is request; check, when set, runs right after the
// publish (before waiting for the reply) and its error ends the request;
// accept, when set, decides which message on the reply subject is the
// reply (others are dropped, and the wait goes on).
func (p *mailboxes) requestChecked(ctx context.Context, m *nats.Msg, check func(context.Context) error, accept func(*nats.Msg) bool) (*nats.Msg, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	mb := p.get()
	if mb == nil {
		if accept != nil {
			return nil, nats.ErrConnectionClosed
		}
		return p.nc.RequestMsgWithContext(ctx, m)
	}
	mb.seq++
	reply := mb.prefix + strconv.FormatUint(mb.seq, 36)
	m.Reply = reply
	err := p.nc.PublishMsg(m)
	m.Reply = ""
	if err == nil && check != nil {
		err = check(ctx)
	}
	if err != nil {
		p.put(mb)
		return nil, err
	}
	for {
		r, err := mb.sub.NextMsgWithContext(ctx)
		if err != nil {
			p.put(mb) // a late reply is dropped by the next request
			return nil, err
		}
		if r.Subject != reply && strings.HasPrefix(r.Subject, mb.prefix) {
			continue // the reply to an earlier request that gave up
		}
		if len(r.Data) == 0 && r.Header.Get("Status") == "503" {
			p.put(mb)
			return nil, nats.ErrNoResponders
		}
		if accept != nil && !accept(r) {
			continue // not the answer to this request (see nonceHeader)
		}
		p.put(mb)
		return r, nil
	}
}
