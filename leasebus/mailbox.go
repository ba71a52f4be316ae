package leasebus

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
)

// mailboxes sends requests whose replies come back on reply subscriptions
// of their own, one request at a time each. nats.go's Request hands every
// reply from the connection's reader to a dispatcher goroutine and from
// there to the requester; a mailbox's synchronous subscription hands it to
// the requester directly: one goroutine hand-off less per request, on the
// lease bus's hot path (client requests, log appends). At most max
// mailboxes are kept; requests beyond that share one more subscription
// (overflow), as nats.go's Request does. Subscriptions are made, never
// made and dropped per request: every subscription change is propagated
// to every server of a cluster, and each invalidates the server's subject
// cache (at fleet size such churn took a quarter of the servers' CPU).
type mailboxes struct {
	nc  *nats.Conn
	max int

	mu     sync.Mutex
	free   []*mailbox // guarded by mu
	made   int        // guarded by mu
	closed bool       // guarded by mu
	over   *overflow  // made on first need; guarded by mu
}

// mailbox is one reply subscription on <inbox>.*, where inbox ends in 128
// random bits: nobody who cannot hear it can name its subjects. Each
// request gets the next subject under it, so a late reply to an abandoned
// request is recognized and dropped.
//
// Its replies come on a channel of its own, mailboxDepth deep: a
// synchronous subscription's is the connection's SubChanLen (65,536
// messages, 512 KB of pointers, allocated whole), and a service's 64
// mailboxes held 30 MB of them at 10,000 leases. A mailbox waits for one
// reply at a time.
type mailbox struct {
	sub    *nats.Subscription
	ch     chan *nats.Msg
	closed chan struct{} // closed with the subscription (its connection closed, or unsubscribed)
	prefix string        // <inbox>.
	seq    uint64
}

// mailboxDepth is how many messages a mailbox holds unread: a reply, the
// one its request does not accept before it (nonceHeader), and late
// replies to a request that gave up, dropped by the next. A message beyond
// it is dropped by the connection (a slow consumer), which no answer of
// the bus's needs.
const mailboxDepth = 8

// newMailbox subscribes a mailbox under inbox on nc.
func newMailbox(nc *nats.Conn, inbox string) (*mailbox, error) {
	mb := &mailbox{ch: make(chan *nats.Msg, mailboxDepth), closed: make(chan struct{}), prefix: inbox + "."}
	sub, err := nc.ChanSubscribe(inbox+".*", mb.ch)
	if err != nil {
		return nil, err
	}
	var once sync.Once
	sub.SetClosedHandler(func(string) { once.Do(func() { close(mb.closed) }) })
	if !sub.IsValid() { // closed before the handler was set
		_ = sub.Unsubscribe()
		return nil, nats.ErrConnectionClosed
	}
	mb.sub = sub
	return mb, nil
}

// next waits for the mailbox's next message, as a synchronous
// subscription's NextMsgWithContext would (nats.ErrConnectionClosed once
// its connection closed); errResend when resend fires first.
func (mb *mailbox) next(ctx context.Context, resend <-chan time.Time) (*nats.Msg, error) {
	select {
	case m := <-mb.ch:
		return m, nil
	default:
	}
	select {
	case m := <-mb.ch:
		return m, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-mb.closed:
		return nil, nats.ErrConnectionClosed
	case <-resend:
		return nil, errResend
	}
}

// overflow is the reply subscription shared by requests beyond the pool's
// max: each waits on a channel of its own, keyed by its reply subject.
type overflow struct {
	sub    *nats.Subscription
	prefix string // <inbox>.

	mu      sync.Mutex
	seq     uint64                    // guarded by mu
	waiting map[string]chan *nats.Msg // reply subject -> its waiter; guarded by mu
}

// overflowDepth is how many messages on one reply subject an overflow
// waiter may have pending (an answer it does not accept, see nonceHeader,
// is followed by the one it does); more are dropped.
const overflowDepth = 8

// newMailboxes makes the pool of at most max mailboxes on nc, with every
// one of them, and the overflow, subscribed now rather than at its first
// request. On a cluster a new subscription's interest reaches the other
// servers asynchronously, on a route connection of its account, while the
// request sent on it goes its own way (through a standby, forwarded in
// another account, or to a stream's leader): an answer published on
// another server before that server heard of the interest is dropped
// there, and its request waits out its whole timeout. Made at once, the mailboxes'
// interest travels while the client starts, not in a race with the first
// answers. (A fleet's ramp made mailboxes as its connections' concurrency
// grew, and lost 1–6 acquires' answers and some of the service's appends'
// acknowledgements in each run: docs/benchmarks.md, stop 58.)
func newMailboxes(nc *nats.Conn, max int) *mailboxes {
	p := &mailboxes{nc: nc, max: max}
	for range max {
		mb, err := newMailbox(nc, inboxBase(nc)+"."+randomToken())
		if err != nil {
			break // made on demand, as before (a closed connection makes none)
		}
		p.made++
		p.free = append(p.free, mb)
	}
	p.overflowBox() // the requests beyond max share it: subscribed now too
	return p
}

// get returns an idle mailbox, or a new one while fewer than max exist;
// nil when the pool is closed, full, or the subscription fails.
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
	if p.made >= p.max {
		return nil
	}
	mb, err := newMailbox(p.nc, inboxBase(p.nc)+"."+randomToken())
	if err != nil {
		return nil
	}
	p.made++
	return mb
}

// overflowBox returns the shared reply subscription, made on first use;
// nil when the pool is closed or the subscription fails.
func (p *mailboxes) overflowBox() *overflow {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	if p.over != nil {
		return p.over
	}
	o := &overflow{prefix: inboxBase(p.nc) + "." + randomToken() + ".", waiting: map[string]chan *nats.Msg{}}
	sub, err := p.nc.Subscribe(o.prefix+"*", o.deliver)
	if err != nil {
		return nil
	}
	o.sub = sub
	p.over = o
	return o
}

// deliver hands a reply to the request waiting on its subject; a reply
// nobody waits for (late, or made up) is dropped.
func (o *overflow) deliver(m *nats.Msg) {
	o.mu.Lock()
	ch := o.waiting[m.Subject]
	o.mu.Unlock()
	if ch == nil {
		return
	}
	select {
	case ch <- m:
	default:
	}
}

// wait registers a waiter on a new reply subject; done unregisters it.
func (o *overflow) wait() (reply string, ch chan *nats.Msg, done func()) {
	ch = make(chan *nats.Msg, overflowDepth)
	o.mu.Lock()
	o.seq++
	reply = o.prefix + strconv.FormatUint(o.seq, 36)
	o.waiting[reply] = ch
	o.mu.Unlock()
	return reply, ch, func() {
		o.mu.Lock()
		delete(o.waiting, reply)
		o.mu.Unlock()
	}
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

// put returns a mailbox for reuse; a broken one is dropped.
func (p *mailboxes) put(mb *mailbox) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || !mb.sub.IsValid() {
		p.made--
		_ = mb.sub.Unsubscribe()
		return
	}
	p.free = append(p.free, mb)
}

// close unsubscribes the idle mailboxes and the overflow; busy mailboxes
// are dropped when put back, and requests waiting on the overflow end with
// their contexts.
func (p *mailboxes) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, mb := range p.free {
		_ = mb.sub.Unsubscribe()
	}
	p.free = nil
	if p.over != nil {
		_ = p.over.sub.Unsubscribe()
	}
}

// request publishes m and waits for its reply, like nats.go's
// RequestMsgWithContext (the same errors: ctx.Err(), ErrNoResponders,
// connection errors).
func (p *mailboxes) request(ctx context.Context, m *nats.Msg) (*nats.Msg, error) {
	return p.requestChecked(ctx, m, nil, nil, 0)
}

// requestChecked is request; check, when set, runs right after the
// publish (before waiting for the reply) and its error ends the request;
// accept, when set, decides which message on the reply subject is the
// reply (others are dropped, and the wait goes on). With hedge > 0 the
// request is published again, on the same reply subject, when no reply
// came within hedge, then within twice that, and so on (see resends):
// only for a request whose copies the service answers alike.
func (p *mailboxes) requestChecked(ctx context.Context, m *nats.Msg, check func(context.Context) error, accept func(*nats.Msg) bool, hedge time.Duration) (*nats.Msg, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	mb := p.get()
	if mb == nil {
		return p.overflowRequest(ctx, m, check, accept, hedge)
	}
	mb.seq++
	reply := mb.prefix + strconv.FormatUint(mb.seq, 36)
	if err := p.send(ctx, m, reply, check); err != nil {
		p.put(mb)
		return nil, err
	}
	again := newResends(hedge)
	defer again.stop()
	for {
		r, err := mb.next(ctx, again.c)
		if errors.Is(err, errResend) {
			p.resend(m, reply, again)
			continue
		}
		if err != nil {
			p.put(mb) // a late reply is dropped by the next request
			return nil, err
		}
		if r.Subject != reply && strings.HasPrefix(r.Subject, mb.prefix) {
			continue // the reply to an earlier request that gave up
		}
		if done, err := takeReply(r, accept); done {
			p.put(mb)
			return answerOrErr(r, err)
		}
	}
}

// Resending. A request the server hands to an instance that cannot answer
// is lost without a word: NATS gives a queue group's message to any one of
// its members, a member whose node is paused (a stopped VM, a long GC
// pause, SIGSTOP) keeps its interest until the node's routes time out
// (tens of seconds), and a standby forwards to a primary that may be
// such a member. In the fault harness's cluster (four instances, one a
// node's) a request sent as a node paused waited out its client's whole
// timeout (5 s) before its second try was answered. A request whose
// copies the service answers alike, and whose late copy harms nobody
// (Client's hedgedOps), is sent again when it is unanswered after the
// hedge, then after twice that, and so on, on the same reply subject, and
// the first answer to any copy is taken: a lost copy costs a hedge, not
// the timeout, and a slow service gets a handful of copies, not a stream.

// errResend is mailbox.next's word that the request is due to be resent.
var errResend = errors.New("resend due")

// resends times a request's copies: c fires when the next is due (never
// when hedge is 0).
type resends struct {
	t     *time.Timer
	c     <-chan time.Time
	every time.Duration
}

func newResends(hedge time.Duration) *resends {
	r := &resends{every: hedge}
	if hedge > 0 {
		r.t = time.NewTimer(hedge)
		r.c = r.t.C
	}
	return r
}

// next schedules the copy after the one just sent: twice as late.
func (r *resends) next() {
	r.every *= 2
	r.t.Reset(r.every)
}

func (r *resends) stop() {
	if r.t != nil {
		r.t.Stop()
	}
}

// resend publishes m again with reply as its reply subject (a copy lost
// to a closed connection is as good as a lost one: the wait tells).
func (p *mailboxes) resend(m *nats.Msg, reply string, again *resends) {
	_ = p.send(context.Background(), m, reply, nil)
	again.next()
}

// send publishes m with reply as its reply subject, then runs check.
func (p *mailboxes) send(ctx context.Context, m *nats.Msg, reply string, check func(context.Context) error) error {
	m.Reply = reply
	err := p.nc.PublishMsg(m)
	m.Reply = ""
	if err == nil && check != nil {
		err = check(ctx)
	}
	return err
}

func answerOrErr(r *nats.Msg, err error) (*nats.Msg, error) {
	if err != nil {
		return nil, err
	}
	return r, nil
}

// takeReply reports whether r, on a request's reply subject, ends the
// request: as its answer, or as the server's word that nobody listens
// (ErrNoResponders). One accept refuses is not this request's answer (see
// nonceHeader): the wait goes on.
func takeReply(r *nats.Msg, accept func(*nats.Msg) bool) (bool, error) {
	if len(r.Data) == 0 && r.Header.Get("Status") == "503" {
		return true, nats.ErrNoResponders
	}
	return accept == nil || accept(r), nil
}

// overflowRequest is requestChecked for a request beyond the pool's max,
// on the shared overflow subscription.
func (p *mailboxes) overflowRequest(ctx context.Context, m *nats.Msg, check func(context.Context) error, accept func(*nats.Msg) bool, hedge time.Duration) (*nats.Msg, error) {
	o := p.overflowBox()
	if o == nil {
		return nil, nats.ErrConnectionClosed
	}
	reply, ch, done := o.wait()
	defer done()
	if err := p.send(ctx, m, reply, check); err != nil {
		return nil, err
	}
	again := newResends(hedge)
	defer again.stop()
	for {
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-again.c:
			p.resend(m, reply, again)
		case r := <-ch:
			if done, err := takeReply(r, accept); done {
				return answerOrErr(r, err)
			}
		}
	}
}
