package leasebus

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// A holder's heartbeat defaults (HoldOptions): a service silent longer
// than DefaultSilence (a pause, a partition, an overload) stops its writes,
// below the one-second bound on a write after a revoke.
const (
	DefaultHeartbeat = 200 * time.Millisecond
	DefaultSilence   = 800 * time.Millisecond
)

// HoldOptions tune a Holder. Zero values pick safe defaults.
type HoldOptions struct {
	// Interval between renewals (default TTL/3).
	Interval time.Duration
	// Margin: the holder stops considering itself valid this long before
	// the service may consider the lease expired (default TTL/10, at least
	// 50 ms).
	Margin time.Duration
	// Now is the clock (default time.Now); its monotonic reading is used.
	Now func() time.Time
	// OnChange is called on every state change, in the order they
	// happened, one call at a time, from a goroutine of the holder's (never
	// while the holder is locked): it should return promptly.
	OnChange func(lease.HolderState, error)
	// OnRenew is called (from the holder's goroutine) after each renewal
	// attempt, once its outcome is applied, with how long it took and its
	// error (nil when renewed), for metrics. The holder sends nothing while
	// it runs: it must return promptly.
	OnRenew func(took time.Duration, err error)
	// Heartbeat is how often the holder's session asks the lease service
	// after its leases (one keepalive for all the holders of a client,
	// answered from the service's recent view; default 200 ms; the
	// session goes at its holders' shortest). See session.go.
	Heartbeat time.Duration
	// Silence is how long without an answer from the lease service the
	// holder still vouches for the lease (default 800 ms, at least 3 ×
	// Heartbeat): below the one-second bound on writes after a revoke. A service
	// that stops answering (paused, partitioned from the holder's server,
	// overloaded) cannot deliver a revoke's notice, and the connection only
	// drops after several missed pings (seconds) — or never, when the
	// holder's own server is up but cut off from the service's; past
	// Silence the holder is Unknown and writes stop until a renewal sent
	// afterwards is answered.
	Silence time.Duration
}

// Holder keeps a lease alive: it renews it with compare-and-swap on its
// version, watches for revocation, and answers Fence for each write.
//
// Validity is judged by the holder's own monotonic clock: a renewal sent
// at t0 makes the lease valid until t0+TTL-Margin. The service starts its
// own TTL only when it processes the renewal, after t0, so the holder
// always stops first — no wall clocks involved.
//
// The holder acts only on what the service vouches for. Anything that casts
// doubt on the lease — a change notice saying it ended, the connection to
// the bus dropping, reconnecting or closing, the service silent, a renewal
// unanswered — makes it Unknown at once (so Fence fails closed) and starts
// a new "doubt epoch". Only the service's word about the lease from after
// the doubt arose settles it: the answer to a renewal sent since (a
// refusal makes the holder Lost, a success makes it Held again), or, for a
// doubt that says nothing against the lease itself (silence, a connection
// change, an unanswered renewal), a keepalive answer vouching for it at the
// held version from a view confirmed since (settle: one request settles
// every holder of the session). A notice alone never ends a lease (a
// forged or stale one costs a brief Unknown), and a revoke whose notice was
// missed while the connection was down is found by the keepalive the
// session sends as soon as it is back, whose answer carries the ended
// record:
//
//	notice "revoked"                  -> Unknown (epoch++), renew now
//	silence / disconnect / reconnect  -> Unknown (epoch++), keepalive now; renew after Silence if unsettled
//	keepalive: active, confirmed since -> Held
//	renew sent in this epoch: ok      -> Held (the service says active)
//	renew refused                     -> Lost
//	renew sent before the doubt       -> stays Unknown
//
// Fence also fails while the connection is not up, before the holder has
// even seen the status event, and once the lease service has not answered
// a heartbeat for longer than Silence (a paused service, or a server cut
// off from the service's, delivers no notices, and a connection only drops
// after missed pings, or never).
type Holder struct {
	c      *Client
	cred   Credential
	opts   HoldOptions
	grants *GrantKeys // from the acquire or attach; never changes
	// attached: the holder attached to a lease acquired elsewhere
	// (AttachAndHold), which Close leaves to its owner; otherwise it
	// acquired the lease, and Close releases it. Never changes.
	attached bool

	mu         sync.Mutex
	lease      lease.Lease       // guarded by mu
	state      lease.HolderState // guarded by mu
	err        error             // why not held; guarded by mu
	validUntil time.Time         // monotonic; guarded by mu
	// epoch counts the doubts cast on the lease (notices that it ended,
	// connection status changes); a renewal makes the holder Held only if
	// no doubt arose since it was sent. Guarded by mu.
	epoch uint64
	// doubtAt is when the last doubt arose: a keepalive answer vouching
	// for the lease as of a later moment settles it (settle). Guarded by mu.
	doubtAt time.Time
	// recheckAt, for a doubt the session's keepalive is to settle (silence,
	// a connection change, a renewal unanswered), is when run renews to
	// settle it should no keepalive have by then; zero when none is
	// pending. Guarded by mu.
	recheckAt time.Time
	// renewCancel cancels the renewal in flight (nil when none): a
	// connection change makes its answer late or moot. Guarded by mu.
	renewCancel context.CancelFunc
	lost        chan struct{}
	// kick asks run for a renewal now (a doubt to settle).
	kick chan struct{}
	// failures counts the renewals unanswered in a row, which space the
	// next tries (retryAfter). Owned by run.
	failures int
	// status receives the connection's status changes (nats.go's status
	// API, so the caller's own handlers stay untouched).
	status     chan nats.Status
	statusDone chan struct{}
	// connected is the connection's state as last seen, for FenceNoWait:
	// read without a lock, because nats.go's IsConnected waits for the
	// connection's lock, which a reconnect holds while it dials (up to its
	// connect timeout), and the Postgres fence's event loop asks before
	// every write (a wait there would hold every session). Set from each
	// status change (watchConn) and by every answer of the service
	// (heardLocked); it makes writes stop early on a drop, while the bound
	// that holds whatever it says is Silence.
	connected atomic.Bool

	// changes are the state changes OnChange has yet to hear, oldest
	// first; announcing says a goroutine delivers them. Guarded by mu.
	changes    []stateChange
	announcing bool

	// heardAt is when the last request the service answered was sent: the
	// service reached us then. Guarded by mu.
	heardAt time.Time

	cancel   context.CancelFunc
	done     chan struct{}
	stopOnce sync.Once
	// closeOnce makes Close's ending happen once; closeErr is its error.
	closeOnce sync.Once
	closeErr  error
	// sessionMu orders the session's answers (kept) against leaving it:
	// once left, none applies. It is taken before mu.
	sessionMu sync.Mutex
	left      bool // guarded by sessionMu
	unwatch   func() error
	// renewID is reused until a renewal gets an answer, so a retry of a
	// renewal whose reply was lost is recognised, not refused. Owned by run.
	renewID string
	// renewAt is the version that renewal proves when the service had it
	// prove the lease's current one instead (renew_again); 0: the held
	// lease's. Owned by run.
	renewAt uint64
	// renewSent is when the first try with renewID was sent: the service
	// may have processed that try (and started its TTL) then, so validity
	// counts from it even when a retry brings the answer. Owned by run.
	renewSent time.Time
}

// A Holder is what a process acting under its lease sees of it.
var _ lease.Holding = (*Holder)(nil)

// AcquireAndHold acquires a lease proven by cred and starts holding it,
// the holder's validity counting from the moment the acquire was sent: the
// only start that cannot overstate how long the lease is known to be
// valid. It is what Acquire then Hold does, for every caller that
// acquires to hold. A refused acquire returns Acquire's error as is (a
// *ConflictError on a conflict); a lease granted but not held (Hold
// refused the options) is released before the error returns. Close the
// holder when done (it releases the lease), or Orphan it to leave the
// lease to expire.
//
// The lease is bound to the client's session (AcquireRequest.Session, if
// req names none): should this process die, the lease service reclaims it
// once the session has been silent for its grace, not at the end of its
// TTL.
func (c *Client) AcquireAndHold(ctx context.Context, req AcquireRequest, cred Credential, opts HoldOptions) (*Holder, error) {
	if req.Session == "" {
		req.Session = c.SessionID()
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	sent := now()
	l, err := c.Acquire(ctx, req, cred)
	if err != nil {
		return nil, err
	}
	h, err := c.hold(ctx, l, cred, sent, opts, req.Session == c.SessionID())
	if err != nil {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if _, rerr := c.Release(rctx, l.LeaseID, cred); rerr != nil {
			err = errors.Join(err, fmt.Errorf("release %s, granted but not held: %w", l.LeaseID, rerr))
		}
		return nil, err
	}
	return h, nil
}

// AttachAndHold starts holding an existing lease, leaseID, whose owner
// credential is cred (the one its acquirer received): it renews the lease
// once, which proves cred, and holds it with the holder's validity
// counting from the moment that renewal was sent, on opts.Now's clock as
// AcquireAndHold does. A refused renewal is returned wrapped: ErrNotOwner
// for a wrong credential, ErrLeaseLost for a lease that is no longer
// active. The lease stays its owner's: a holder that cannot start leaves
// it as it is, and the holder's Close only stops renewing it.
func (c *Client) AttachAndHold(ctx context.Context, leaseID string, cred Credential, opts HoldOptions) (*Holder, error) {
	if cred == "" {
		return nil, fmt.Errorf("attach to %s: %w: empty credential", leaseID, lease.ErrInvalid)
	}
	cur, err := c.Get(ctx, leaseID)
	if err != nil {
		return nil, fmt.Errorf("attach to %s: %w", leaseID, err)
	}
	now := opts.Now
	if now == nil {
		now = time.Now
	}
	sent := now()
	req := RenewRequest{LeaseID: leaseID, Repo: cur.Repo, Credential: cred, Version: cur.Version}
	l, req, err := c.renew(ctx, req)
	if err != nil {
		return nil, fmt.Errorf("attach to %s: %w", leaseID, err)
	}
	if why := notOurs(*cur, req, l); why != "" {
		return nil, fmt.Errorf("attach to %s: %w: the answer to the renewal is not one the lease service makes for it: %s", leaseID, lease.ErrUnavailable, why)
	}
	h, err := c.Hold(ctx, l, cred, sent, opts)
	if err != nil {
		return nil, err
	}
	h.attached = true
	return h, nil
}

// Hold starts keeping granted alive, a lease this process acquired (with
// cred): validity starts from sent, the moment the acquire (or the last
// renewal) was sent. ctx bounds the checks Hold makes before it returns,
// not the holding. Close the holder when done (it releases the lease), or
// Orphan it to leave the lease to expire.
func (c *Client) Hold(ctx context.Context, granted *lease.Lease, cred Credential, sent time.Time, opts HoldOptions) (*Holder, error) {
	return c.hold(ctx, granted, cred, sent, opts, false)
}

// hold is Hold; inSession says that granted is bound to the client's
// session, whose one subscription then carries its change notices
// (session.watch) instead of one of the lease's own.
func (c *Client) hold(ctx context.Context, granted *lease.Lease, cred Credential, sent time.Time, opts HoldOptions, inSession bool) (*Holder, error) {
	ttl := time.Duration(granted.TTL)
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Interval <= 0 {
		opts.Interval = ttl / 3
	}
	if opts.Margin <= 0 {
		opts.Margin = max(ttl/10, 50*time.Millisecond)
	}
	if opts.Interval+opts.Margin >= ttl {
		return nil, fmt.Errorf("hold %s: %w: renew interval %s plus margin %s must be below the ttl %s", granted.LeaseID, lease.ErrInvalid, opts.Interval, opts.Margin, ttl)
	}
	if opts.Heartbeat <= 0 {
		opts.Heartbeat = DefaultHeartbeat
	}
	if opts.Silence <= 0 {
		opts.Silence = max(DefaultSilence, 3*opts.Heartbeat)
	}
	if opts.Silence <= opts.Heartbeat {
		return nil, fmt.Errorf("hold %s: %w: silence %s must be longer than the heartbeat %s", granted.LeaseID, lease.ErrInvalid, opts.Silence, opts.Heartbeat)
	}
	h := &Holder{c: c, cred: cred, opts: opts, lease: *granted, grants: granted.Grants, state: lease.Held,
		validUntil: sent.Add(ttl - opts.Margin), lost: make(chan struct{}), heardAt: sent,
		done: make(chan struct{}), kick: make(chan struct{}, 1), statusDone: make(chan struct{})}
	if !granted.Active() {
		h.setLost(fmt.Errorf("%w: lease %s is %s", lease.ErrLeaseLost, granted.LeaseID, granted.Status))
	}
	// Listen to the connection before the watch: a drop between the two
	// must not go unseen.
	h.status = c.nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CONNECTED, nats.CLOSED)
	h.connected.Store(c.nc.IsConnected()) // after the listener: a change from here on is heard
	go h.watchConn()
	var unwatch func() error
	var err error
	if inSession {
		unwatch, err = c.session().watch(granted.LeaseID, h)
	} else {
		unwatch, err = c.watch(ChangedSubject(granted.Repo, granted.LeaseID), h.observe)
	}
	if err != nil {
		c.nc.RemoveStatusListener(h.status)
		<-h.statusDone
		return nil, err
	}
	h.unwatch = unwatch
	if granted.Active() {
		// A change committed between the acquire's reply and the watch
		// above announced itself to nobody: ask the service once, now that
		// later notices reach us.
		gctx, cancel := context.WithTimeout(ctx, max(min(opts.Interval, 2*time.Second), 100*time.Millisecond))
		asked := opts.Now()
		l, err := c.Get(gctx, granted.LeaseID)
		cancel()
		if err != nil {
			h.doubt(fmt.Errorf("%w: %s (fence %d): could not confirm the lease after starting to watch it: %w", lease.ErrLeaseUnknown, granted.LeaseID, granted.Fence, err), true)
		} else {
			h.heard(asked)
			h.observe(l)
		}
	}
	if !c.nc.IsConnected() {
		h.doubt(fmt.Errorf("%w: %s: not connected to the bus; writes wait for a re-check once it is back", lease.ErrLeaseUnknown, granted.LeaseID), true)
	}
	if granted.Active() && opts.Now().Sub(sent) >= opts.Interval {
		// The acquire waited (in a queue, or on a slow bus): its validity,
		// counted from when it was sent, is partly or wholly spent. Renew
		// once now; a renewal counts from its own send.
		rctx, cancel := context.WithTimeout(ctx, max(opts.Interval, time.Second))
		h.renew(rctx)
		cancel()
	}
	// The holding outlives the call: ctx's values, not its end.
	hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	h.cancel = cancel
	go h.run(hctx)
	c.session().join(h)
	return h, nil
}

// heard notes that the lease service answered something sent at sent.
func (h *Holder) heard(sent time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.heardLocked(sent)
}

func (h *Holder) heardLocked(sent time.Time) {
	h.connected.Store(true) // an answer came through
	if sent.After(h.heardAt) {
		h.heardAt = sent
	}
}

// Fence returns the lease's fence token if the lease is held right now, or
// ErrLeaseLost / ErrLeaseUnknown. Call it for every write and put the
// token into the write; holding is not permission to write.
func (h *Holder) Fence() (uint64, error) {
	// Asked first and outside mu (nats.go takes its own lock): a dropped
	// connection fails the write even before its status event is handled.
	return h.fence(h.c.nc.IsConnected())
}

// FenceNoWait is Fence for a caller that must not wait (the Postgres
// fence's event loop, whose thread every session shares): it takes the
// connection's state as the holder last saw it (see connected) rather than
// asking nats.go, whose lock a reconnect holds while it dials. A drop is
// seen once its status change is handled, and the bound that holds
// whatever the connection says is Silence, as for Fence.
func (h *Holder) FenceNoWait() (uint64, error) {
	return h.fence(h.connected.Load())
}

func (h *Holder) fence(connected bool) (uint64, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	// Unknown too: a holder that cannot reach the bus past its margin may
	// already have been reclaimed.
	if h.state != lease.Lost && !h.opts.Now().Before(h.validUntil) {
		h.setLostLocked(fmt.Errorf("%w: %s not renewed within its ttl minus margin", lease.ErrLeaseLost, h.lease.LeaseID))
	}
	if h.state == lease.Held {
		if silent := h.opts.Now().Sub(h.heardAt); silent > h.opts.Silence {
			// The server may be paused or cut off: a revoke's notice
			// could not reach us. Stop, and re-check once it answers.
			h.softDoubtLocked(fmt.Errorf("%w: %s (fence %d): no answer from the lease service for %s; writes wait until the lease is re-checked",
				lease.ErrLeaseUnknown, h.lease.LeaseID, h.lease.Fence, silent.Round(time.Millisecond)))
			defer h.c.session().kick()
		}
	}
	if h.state != lease.Held {
		return 0, h.err
	}
	if !connected {
		return 0, fmt.Errorf("%w: %s (fence %d): the connection to the bus is down; writes wait until the lease is re-checked", lease.ErrLeaseUnknown, h.lease.LeaseID, h.lease.Fence)
	}
	return h.lease.Fence, nil
}

// Remaining is how much longer the holder considers the lease valid
// without another renewal (0 unless held): whoever acts on the holder's
// word elsewhere must stop trusting it after that long.
func (h *Holder) Remaining() time.Duration {
	if _, err := h.Fence(); err != nil {
		return 0
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	return max(h.validUntil.Sub(h.opts.Now()), 0)
}

// State returns the holder's state and, unless held, why.
func (h *Holder) State() (lease.HolderState, error) {
	_, _ = h.Fence() // applies the margin
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.state, h.err
}

// Lease returns the holder's latest copy of the lease record.
func (h *Holder) Lease() lease.Lease {
	h.mu.Lock()
	defer h.mu.Unlock()
	l := h.lease
	l.Grants = h.grants
	return l
}

// Lost is closed once the lease is lost.
func (h *Holder) Lost() <-chan struct{} { return h.lost }

// Attached reports whether the holder attached to a lease acquired
// elsewhere (AttachAndHold): Close then leaves the lease to its owner.
func (h *Holder) Attached() bool { return h.attached }

// Orphan stops keeping the lease alive without releasing it: the lease
// then expires by its TTL, or is reclaimed sooner once the session it was
// acquired in falls silent (when this was its last holder, or its process
// exits); Fence answers until the last renewal's validity runs out. It
// ends a lease that must not be released yet: its agent may still write
// (it did not report its attempt settled), or another process takes over.
func (h *Holder) Orphan() {
	h.stopOnce.Do(func() {
		h.cancel()
		<-h.done
		h.c.session().leave(h)
		_ = h.unwatch()
		h.c.nc.RemoveStatusListener(h.status)
		<-h.statusDone
	})
}

// Close ends holding the lease the way the holder came by it: a lease it
// acquired is released, waiting up to ReleaseTimeout for the service's
// answer even when ctx is done (a release that fails leaves the lease to
// expire, and Close returns why); one it attached to (Attached) is only no
// longer renewed, its owner decides. Either way the holder stops renewing
// first. Only the first call ends anything; later ones return its error.
func (h *Holder) Close(ctx context.Context) error {
	h.closeOnce.Do(func() {
		h.Orphan()
		if h.attached {
			return
		}
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), ReleaseTimeout)
		defer cancel()
		h.closeErr = h.release(rctx)
	})
	return h.closeErr
}

// ReleaseTimeout bounds Close's release of a lease.
const ReleaseTimeout = 5 * time.Second

// release releases the lease (its renewing stopped).
func (h *Holder) release(ctx context.Context) error {
	h.mu.Lock()
	id, repo := h.lease.LeaseID, h.lease.Repo
	h.mu.Unlock()
	l, err := h.c.leaseOp(ctx, "release", ReleaseRequest{LeaseID: id, Repo: repo, Credential: h.cred})
	if err != nil {
		return fmt.Errorf("release %s: %w", id, err)
	}
	h.mu.Lock()
	h.lease = *l
	h.setLostLocked(fmt.Errorf("%w: %s released", lease.ErrLeaseLost, id))
	h.mu.Unlock()
	return nil
}

func (h *Holder) setLost(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.setLostLocked(err)
}

func (h *Holder) setLostLocked(err error) {
	if h.state == lease.Lost {
		return
	}
	h.state, h.err = lease.Lost, err
	close(h.lost)
	h.announceLocked(lease.Lost, err)
}

func (h *Holder) setState(st lease.HolderState, err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.setStateLocked(st, err)
}

func (h *Holder) setStateLocked(st lease.HolderState, err error) {
	if h.state == lease.Lost {
		return
	}
	if h.state == st {
		h.err = err // the newest reason
		return
	}
	h.state, h.err = st, err
	h.announceLocked(st, err)
}

// announceLocked queues a state change for OnChange, whose calls are
// made in order by one goroutine at a time (deliverChanges): a goroutine
// per change would let a consumer that tracks the state see Held, then
// the Unknown that came before it, and keep the wrong one.
func (h *Holder) announceLocked(st lease.HolderState, err error) {
	if h.opts.OnChange == nil {
		return
	}
	h.changes = append(h.changes, stateChange{st, err})
	if !h.announcing {
		h.announcing = true
		go h.deliverChanges()
	}
}

// deliverChanges calls OnChange for each queued change, in order, and
// returns once the queue is empty.
func (h *Holder) deliverChanges() {
	for {
		h.mu.Lock()
		if len(h.changes) == 0 {
			h.announcing = false
			h.changes = nil
			h.mu.Unlock()
			return
		}
		c := h.changes[0]
		h.changes = h.changes[1:]
		h.mu.Unlock()
		h.opts.OnChange(c.state, c.err) // never call out under mu
	}
}

// stateChange is one state change waiting for OnChange.
type stateChange struct {
	state lease.HolderState
	err   error
}

// doubt makes the holder Unknown at once, starts a new doubt epoch (so no
// renewal sent before it can make the holder Held) and, with recheck,
// asks run for a renewal now.
func (h *Holder) doubt(why error, recheck bool) {
	h.mu.Lock()
	h.doubtLocked(why)
	h.mu.Unlock()
	if recheck {
		h.poke()
	}
}

func (h *Holder) doubtLocked(why error) {
	h.epoch++
	h.doubtAt = h.opts.Now()
	h.recheckAt = time.Time{} // a renewal is asked for now
	h.setStateLocked(lease.Unknown, why)
}

// softDoubtLocked is a doubt that says nothing against the lease itself —
// the service was not heard for a while, the connection changed, a
// renewal went unanswered — which the session's next keepalive settles
// (settle), all of a session's holders with one request: renewing each
// lease instead, a write apiece, turned a slow moment of a busy bus into
// a storm of appends. Should no keepalive settle it within Silence, run
// renews.
func (h *Holder) softDoubtLocked(why error) {
	h.epoch++
	h.doubtAt = h.opts.Now()
	h.recheckAt = h.doubtAt.Add(h.opts.Silence)
	h.setStateLocked(lease.Unknown, why)
}

// settle makes the holder Held again after a doubt, on a keepalive's
// answer that the service's view of the lease, confirmed at confirmed (on
// the holder's clock, never later than it was), has it active at the
// version the holder holds, held: a lease never becomes active again
// once it ended, so it did not end before confirmed — and if that is
// after the doubt arose, whatever raised the doubt did not end it. The
// validity still counts from the last renewal.
func (h *Holder) settle(held keptLease, confirmed time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.state != lease.Unknown || !confirmed.After(h.doubtAt) || !h.opts.Now().Before(h.validUntil) ||
		h.lease.LeaseID != held.LeaseID || h.lease.Version != held.Version || h.lease.Fence != held.Fence {
		return
	}
	h.recheckAt = time.Time{}
	h.setStateLocked(lease.Held, nil)
}

// poke asks run for a renewal now.
func (h *Holder) poke() {
	select {
	case h.kick <- struct{}{}:
	default: // one is pending already
	}
}

// observe handles a change notice of our lease from the watch. A notice is
// not the service's word to this holder — it may be late, or forged by
// whoever can publish on the subject — so one saying the lease ended stops
// writes and asks the service; only its answer makes the lease Lost.
func (h *Holder) observe(l *lease.Lease) {
	h.mu.Lock()
	if h.state == lease.Lost || l.Version <= h.lease.Version || l.Active() || l.LeaseID != h.lease.LeaseID || l.Fence != h.lease.Fence || l.Repo != h.lease.Repo {
		h.mu.Unlock()
		return // stale, already known, or nothing to act on
	}
	h.doubtLocked(fmt.Errorf("%w: %s (fence %d): announced %s (version %d: %s); writes stop until the lease service confirms",
		lease.ErrLeaseUnknown, h.lease.LeaseID, h.lease.Fence, l.Status, l.Version, l.Reason))
	h.mu.Unlock()
	h.poke()
}

// watchConn turns the connection's status changes into doubts: any drop
// makes the holder Unknown at once and cancels the renewal in flight (its
// answer may never come); once the connection is back, the lease is
// re-checked with the service before Fence succeeds again. Notices missed
// meanwhile do not matter: the re-check asks the service itself.
func (h *Holder) watchConn() {
	defer close(h.statusDone)
	for st := range h.status {
		// The change at once, then the state asked where a wait for
		// nats.go's lock holds no one (the channel drops changes while it
		// is full, so the last one seen may not be the last one made).
		h.connected.Store(st == nats.CONNECTED)
		h.connected.Store(h.c.nc.IsConnected())
		h.mu.Lock()
		id, fence := h.lease.LeaseID, h.lease.Fence
		if h.renewCancel != nil {
			h.renewCancel()
		}
		switch st {
		case nats.CONNECTED:
			h.softDoubtLocked(fmt.Errorf("%w: %s (fence %d): reconnected to the bus; re-checking the lease before the next write", lease.ErrLeaseUnknown, id, fence))
		case nats.CLOSED:
			h.doubtLocked(fmt.Errorf("%w: %s (fence %d): the connection to the bus is closed", lease.ErrLeaseUnknown, id, fence))
		default:
			h.softDoubtLocked(fmt.Errorf("%w: %s (fence %d): disconnected from the bus (%s); writes wait until it is back and the lease is re-checked", lease.ErrLeaseUnknown, id, fence, st))
		}
		h.mu.Unlock()
		if st == nats.CONNECTED {
			h.c.session().kick() // one keepalive settles all of the session's holders
		}
	}
}

func (h *Holder) run(ctx context.Context) {
	defer close(h.done)
	var retry time.Duration // after an unanswered renewal: when to try again
	timer := time.NewTimer(h.opts.Interval)
	defer timer.Stop()
	for {
		wait := h.untilRenewal()
		if retry > 0 {
			wait = retry
		}
		if recheck, ok := h.recheckIn(); ok {
			wait = min(wait, recheck)
		}
		timer.Reset(wait)
		kicked := false
		select {
		case <-ctx.Done():
			return
		case <-h.lost:
			return
		case <-timer.C:
		case <-h.kick:
			kicked = true
		}
		if _, err := h.Fence(); err != nil && errors.Is(err, lease.ErrLeaseLost) {
			return
		}
		if !kicked && retry == 0 && h.untilRenewal() > 0 && !h.recheckDue() {
			continue // woken for a recheck a keepalive made moot
		}
		if h.renew(ctx) {
			retry, h.failures = 0, 0
			continue
		}
		h.failures++
		retry = h.retryAfter()
	}
}

// untilRenewal is how long until the lease is due for renewal: once its
// validity has shrunk by one interval, an interval after the last
// renewal was sent (at once for a lease whose acquire waited long in a
// queue).
func (h *Holder) untilRenewal() time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	ttl := time.Duration(h.lease.TTL)
	return max(h.validUntil.Sub(h.opts.Now())-(ttl-h.opts.Margin-h.opts.Interval), 0)
}

// recheckIn is how long until a soft doubt is to be settled by a renewal
// (ok false when none is pending).
func (h *Holder) recheckIn() (time.Duration, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.state != lease.Unknown || h.recheckAt.IsZero() {
		return 0, false
	}
	return max(h.recheckAt.Sub(h.opts.Now()), 0), true
}

// recheckDue reports whether a soft doubt is still unsettled at its
// recheck time, and takes it: run renews to settle it. Not while the
// connection is down: its return raises the doubt again.
func (h *Holder) recheckDue() bool {
	connected := h.c.nc.IsConnected() // outside mu, as in Fence
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.state != lease.Unknown || h.recheckAt.IsZero() || h.opts.Now().Before(h.recheckAt) {
		return false
	}
	h.recheckAt = time.Time{}
	return connected
}

// retryAfter spaces the tries after unanswered renewals: from a quarter
// of a second (shorter for short intervals), doubling with each failure
// in a row up to a quarter of the interval, with jitter, and never more
// than a quarter of the validity left. A bus too slow to answer is not
// sent more of the same at once by every holder that waited on it.
func (h *Holder) retryAfter() time.Duration {
	base := min(250*time.Millisecond, h.opts.Interval/8)
	d := base << min(h.failures-1, 16)
	d = min(d, max(base, h.opts.Interval/4))
	d = d*4/5 + rand.N(d*2/5+1) // ±20 %
	h.mu.Lock()
	left := h.validUntil.Sub(h.opts.Now())
	h.mu.Unlock()
	return max(min(d, left/4), time.Millisecond)
}

// renew sends one renewal and reports whether it was answered (granted,
// refused, or made moot by the holder stopping): false asks for a retry.
func (h *Holder) renew(ctx context.Context) bool {
	if h.renewID == "" {
		h.renewID = NewRequestID()
		h.renewSent = h.opts.Now()
	}
	sent := h.renewSent
	h.mu.Lock()
	held := h.lease
	version := held.Version
	if h.renewAt != 0 {
		version = h.renewAt // the version the renewal retried was re-proved at (renew_again)
	}
	req := RenewRequest{LeaseID: held.LeaseID, Repo: held.Repo, Credential: h.cred, Version: version, RenewID: h.renewID}
	remaining := h.validUntil.Sub(h.opts.Now())
	// Wait for the answer no longer than the lease is valid: past that the
	// holder is lost, and Lost must not wait for a hung request.
	// (Only Hold renews with no validity left: a lease whose acquire waited.)
	limit := h.opts.Interval
	if remaining > 0 {
		limit = min(limit, remaining)
	}
	rctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	epoch := h.epoch // the doubts this renewal can settle
	h.renewCancel = cancel
	h.mu.Unlock()
	defer func() {
		h.mu.Lock()
		h.renewCancel = nil
		h.mu.Unlock()
	}()
	start := time.Now()
	// req becomes the renewal answered: after a takeover, the lease's
	// current version's (Client.renew).
	l, req, err := h.c.renew(rctx, req)
	if h.opts.OnRenew != nil && ctx.Err() == nil {
		took := time.Since(start)
		defer func() { h.opts.OnRenew(took, err) }() // once the outcome is applied
	}
	if err == nil {
		if why := notOurs(held, req, l); why != "" {
			// Not applied, and the renewal's id kept: a retry is still
			// recognised if the service did renew.
			err = fmt.Errorf("%w: the answer to the renewal is not one the lease service makes for it: %s", lease.ErrUnavailable, why)
			l = nil
		}
	}
	if err == nil || lease.IsFenced(err) {
		h.renewID, h.renewAt = "", 0
	} else {
		// Retried as last sent: a renewal the service told to renew the
		// current version may have landed there, unanswered.
		h.renewID, h.renewAt = req.RenewID, req.Version
	}
	switch {
	case err == nil:
		h.mu.Lock()
		defer h.mu.Unlock()
		if h.state == lease.Lost {
			return true
		}
		h.lease = *l
		h.validUntil = sent.Add(time.Duration(l.TTL) - h.opts.Margin)
		h.heardLocked(sent) // the service answered: alive since sent
		if h.epoch != epoch {
			// A doubt arose while this renewal was under way: its answer
			// may predate a revoke. Left to what settles that doubt (run
			// was poked, or a recheck is pending).
			return true
		}
		h.recheckAt = time.Time{}
		h.setStateLocked(lease.Held, nil)
		return true
	case ctx.Err() != nil:
		return true
	case lease.IsFenced(err):
		h.setLost(fmt.Errorf("%w: renew refused: %w", lease.ErrLeaseLost, err))
		return true
	case errors.Is(err, context.Canceled):
		// Cancelled by a connection change, which made the holder Unknown;
		// its return has the session re-check.
		return false
	default:
		h.mu.Lock()
		h.softDoubtLocked(fmt.Errorf("%w: %s (fence %d): the lease service did not answer the renewal: %v", lease.ErrLeaseUnknown, req.LeaseID, h.lease.Fence, err))
		h.mu.Unlock()
		h.c.session().kick()
		return false
	}
}

// notOurs says why got cannot be the lease service's answer to renewal
// sent of held ("" when it can be): another lease, the same lease with
// another repo, fence, owner, claim, workspace or ttl, a version other
// than the one the renewal makes, or a lease that is not active. The
// request's nonce already keeps others' answers out (see nonceHeader);
// this keeps a holder from ever taking an answer as what it holds
// without checking that it is.
func notOurs(held lease.Lease, sent RenewRequest, got *lease.Lease) string {
	switch {
	case got.LeaseID != held.LeaseID:
		return fmt.Sprintf("it is lease %q, not %s", got.LeaseID, held.LeaseID)
	case got.Repo != held.Repo:
		return fmt.Sprintf("repo %q, not %q", got.Repo, held.Repo)
	case got.Fence != held.Fence:
		return fmt.Sprintf("fence %d, not %d", got.Fence, held.Fence)
	case got.Owner != held.Owner:
		return fmt.Sprintf("owner %s, not %s", got.Owner, held.Owner)
	case !got.Scope.Equal(held.Scope):
		return fmt.Sprintf("claim %s, not %s", got.Scope, held.Scope)
	case got.WorkspaceID != held.WorkspaceID || got.WorkspaceMode != held.WorkspaceMode:
		return fmt.Sprintf("workspace %s (%s), not %s (%s)", got.WorkspaceID, got.WorkspaceMode, held.WorkspaceID, held.WorkspaceMode)
	case got.TTL != held.TTL:
		return fmt.Sprintf("ttl %s, not %s", got.TTL, held.TTL)
	case got.Version != sent.Version+1:
		return fmt.Sprintf("version %d, where renewing version %d makes %d", got.Version, sent.Version, sent.Version+1)
	case !got.Active():
		return fmt.Sprintf("status %s in a successful answer", got.Status)
	}
	return ""
}

// Frozen is a lease as a paused holder remembers it: it keeps answering
// the fence it had and never learns that the lease ended. It stands for a
// zombie writer in the fences' demos, benchmarks and tests: the storage
// must refuse what it writes.
type Frozen struct{ Record lease.Lease }

// Fence returns the remembered fence, always.
func (f Frozen) Fence() (uint64, error) { return f.Record.Fence, nil }

// Lease returns the remembered record.
func (f Frozen) Lease() lease.Lease { return f.Record }
