package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// Client asks the lease service for leases. It is safe for concurrent use.
type Client struct {
	nc       *nats.Conn
	identity string // the request subjects' last token: IdentityOf(nc)
	boxes    *mailboxes
	// permitted holds the ops the bus is known to accept from this
	// connection (a first request of each checks).
	permitted sync.Map
	// Timeout bounds one try of a request, on top of any wait it asks for.
	Timeout time.Duration
	// Tries is how often an idempotent request is sent before giving up
	// when the service does not answer.
	Tries int
	// Hedge is how long a try of a request whose copies the service
	// answers alike (hedgedOps) waits for an answer before it sends a
	// copy, then twice that before the next (mailbox.go, Resending); 0
	// sends one per try.
	Hedge time.Duration

	sessOnce sync.Once
	sess     *session // the client's session (session.go), made on first use
}

// NewClient returns a client on nc with a 5 s timeout, 3 tries and a 1 s
// hedge. It keeps a reply subscription on nc for each request it has in
// flight at once (up to 16; more share one), until it is garbage
// collected.
func NewClient(nc *nats.Conn) *Client {
	c := &Client{nc: nc, identity: IdentityOf(nc), boxes: newMailboxes(nc, 16), Timeout: 5 * time.Second, Tries: 3, Hedge: time.Second}
	runtime.AddCleanup(c, func(p *mailboxes) { p.close() }, c.boxes)
	return c
}

// Conn is the client's NATS connection.
func (c *Client) Conn() *nats.Conn { return c.nc }

// errNoAnswer marks a request that may have reached the service but got
// no reply: its outcome is unknown. Its text is empty so it adds nothing to
// the message it is wrapped into.
var errNoAnswer = errors.New("")

// errNoService marks a request no lease service received: its outcome is
// known (nothing happened). Empty text, like errNoAnswer.
var errNoService = errors.New("")

// NoService reports whether err is a request no lease service received
// (nothing happened).
func NoService(err error) bool { return errors.Is(err, errNoService) }

// replyGrace is how much longer than its wait a client waits for a queued
// acquire's answer; the service answers at the wait's end.
const replyGrace = 5 * time.Second

func (c *Client) request(ctx context.Context, op string, req any, wait time.Duration) (*reply, error) {
	var data []byte
	switch r := req.(type) {
	case interface{ encode() []byte }: // the hot requests, without reflection
		data = r.encode()
	default:
		var err error
		if data, err = json.Marshal(req); err != nil {
			return nil, fmt.Errorf("encode %s request: %w", op, err)
		}
	}
	subj := requestSubject(op, c.identity)
	// The first request of each kind makes sure the bus took it (one
	// round trip more), so a refused permission shows at once rather than
	// as a timeout; later ones go out without it.
	var check func(context.Context) error
	if _, done := c.permitted.Load(op); !done {
		check = func(ctx context.Context) error {
			fctx, cancel := context.WithTimeout(ctx, time.Second)
			defer cancel()
			if err := c.nc.FlushWithContext(fctx); err != nil {
				return nil // not known yet (reconnecting): wait for the reply as usual
			}
			if err := c.forbidden(op, subj); err != nil {
				return err
			}
			c.permitted.Store(op, true)
			return nil
		}
	}
	// The answer must echo this nonce (see nonceHeader): the client takes
	// no other message on its reply subject for the answer.
	nonce := randomToken()
	msg := &nats.Msg{Subject: subj, Data: data, Header: nats.Header{nonceHeader: []string{nonce}}}
	accept := func(r *nats.Msg) bool { return r.Header.Get(nonceHeader) == nonce && !jetStreamReply(r) }
	var hedge time.Duration
	if wait == 0 && hedgedOps[op] {
		hedge = c.Hedge
	}
	tries := max(c.Tries, 1)
	var lastErr error
	for try := 0; try < tries; try++ {
		if try > 0 {
			select {
			case <-ctx.Done():
				return nil, fmt.Errorf("%s: %w", op, ctx.Err())
			case <-time.After(time.Duration(try) * 100 * time.Millisecond):
			}
		}
		tctx, cancel := context.WithTimeout(ctx, c.Timeout+wait)
		m, err := c.boxes.requestChecked(tctx, msg, check, accept, hedge)
		cancel()
		if err != nil && !errors.Is(err, ErrForbidden) {
			if ferr := c.forbidden(op, subj); ferr != nil {
				err = ferr // the bus dropped the request: say why
			}
		}
		switch {
		case errors.Is(err, ErrForbidden):
			return nil, err
		case err == nil:
			var r reply
			if err := unmarshalReply(m.Data, &r); err != nil {
				return nil, fmt.Errorf("decode %s reply: %w", op, err)
			}
			return &r, nil
		case errors.Is(err, nats.ErrNoResponders):
			lastErr = fmt.Errorf("%w: no lease service answers on %s; start one with `fenceline bus serve` or connect to a bus that runs it%w", lease.ErrUnavailable, subj, errNoService)
		case ctx.Err() != nil:
			return nil, fmt.Errorf("%s: %w%w", op, ctx.Err(), errNoAnswer)
		case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout):
			lastErr = fmt.Errorf("%w: %s got no answer within %s%w", lease.ErrUnavailable, op, c.Timeout+wait, errNoAnswer)
		case errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrConnectionDraining):
			return nil, fmt.Errorf("%w: %s: %v", lease.ErrUnavailable, op, err)
		default:
			lastErr = fmt.Errorf("%w: %s: %v", lease.ErrUnavailable, op, err)
		}
	}
	return nil, lastErr
}

// hedgedOps are the requests a copy of which the service answers as it
// does the first (see Client.Hedge), and whose copy taking effect after
// another copy's answer leaves the asker no worse off: reads, and the
// revoke and release of a named lease (one of an ended lease answers its
// record; a late copy ends a lease its asker meant to end). Not a
// renewal: a copy still queued when another was answered "try again"
// renews the lease to a version its holder never learns, and the holder's
// next renewal is refused as lost. Not an acquire (it may wait in the
// queue), nor a write of the shard, policy or audit records, whose copies
// would each be a write.
var hedgedOps = map[string]bool{"get": true, "list": true, "release": true, "revoke": true}

// forbidden returns an ErrForbidden error when the bus refused this
// connection's publish on subj (nats.go reports the server's
// "Permissions Violation" asynchronously, as the connection's last error).
func (c *Client) forbidden(op, subj string) error {
	err := c.nc.LastError()
	if err == nil || !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), `"`+subj+`"`) {
		return nil
	}
	return fmt.Errorf("%s: %w: the bus refused identity %s permission to %s (%v); use credentials of a role that may (%s)", op, ErrForbidden, c.identity, op, err, rolesFor(op))
}

func (c *Client) leaseOp(ctx context.Context, op string, req any) (*lease.Lease, error) {
	r, err := c.answer(ctx, op, req)
	if err != nil {
		if errors.Is(err, errRenewAgain) && r != nil && r.Lease != nil {
			return nil, &renewAgainError{err: err, current: r.Lease}
		}
		return nil, err
	}
	if r.Lease == nil {
		return nil, fmt.Errorf("%s: reply carries no lease", op)
	}
	r.Lease.Grants = r.Grants
	return r.Lease, nil
}

// answer sends req and returns the service's reply with the error it
// carries (r is nil when no reply came). A request whose copies the
// service answers alike (hedgedOps: a read, the release or revoke of a
// named lease) rides out the service's "try again" answers (an election,
// a standby that has not yet read the new primary's claim, a node
// rejoining its cluster, its own intake full): it asks again, spaced out
// and jittered, for up to c.Timeout from its first try, as an acquire
// rides them out within its wait. Without that, a release in the second
// a takeover takes failed, and its holder was left to guess whether its
// lease was still held. Conditions only an operator ends (a full store,
// a read-only one) are answered at once.
func (c *Client) answer(ctx context.Context, op string, req any) (*reply, error) {
	giveUp := time.Now().Add(c.Timeout)
	for try := 1; ; try++ {
		r, err := c.request(ctx, op, req, 0)
		if err != nil {
			return nil, err
		}
		if err = r.Error.err(); err == nil || !hedgedOps[op] || !passing(err) {
			return r, err
		}
		pause := retryPause(try)
		if time.Until(giveUp) < pause {
			return r, fmt.Errorf("%w (asked %d times within %s)", err, try, c.Timeout)
		}
		select {
		case <-ctx.Done():
			return r, err
		case <-time.After(pause):
		}
	}
}

// passing reports whether err is the service saying it cannot serve now
// for a while only: unavailable, but not for want of room, which an
// operator must make.
func passing(err error) bool {
	return errors.Is(err, lease.ErrUnavailable) &&
		!errors.Is(err, ErrStoreFull) && !errors.Is(err, ErrLogFull) && !errors.Is(err, ErrStoreReadOnly)
}

// retryPause is how long a request answered "try again" waits before its
// next try (try counts from 1): growing by 100 ms a try up to a second,
// half of it at random, so that the askers a takeover turned away do not
// come back all at once.
func retryPause(try int) time.Duration {
	pause := min(time.Duration(try)*100*time.Millisecond, time.Second)
	return pause/2 + rand.N(pause/2)
}

// renewAgainError is errRenewAgain with the lease at its current version.
type renewAgainError struct {
	err     error
	current *lease.Lease
}

func (e *renewAgainError) Error() string { return e.err.Error() }
func (e *renewAgainError) Unwrap() error { return e.err }

// Acquire asks for a lease proven by cred. With req.Wait it queues behind
// conflicting leases until they are gone or the wait ends; a conflict is a
// *ConflictError naming each blocking lease, its owner and its expiry. A
// retry after a lost reply gets the same lease (req.RequestID).
func (c *Client) Acquire(ctx context.Context, req AcquireRequest, cred Credential) (*lease.Lease, error) {
	if cred == "" {
		return nil, fmt.Errorf("acquire: %w: empty credential", lease.ErrInvalid)
	}
	if req.RequestID == "" {
		req.RequestID = NewRequestID()
	}
	req.CredentialHash = cred.hash()
	wait := time.Duration(req.Wait)
	if wait > 0 {
		wait += replyGrace
	}
	// An acquire that waits rides out the bus's brief unavailability (an
	// election, a node rejoining its cluster) as it would a conflict: the
	// service's "try again" answers are retried, spaced out, until its
	// wait ends, each try asking for what is left of it.
	until := time.Now().Add(time.Duration(req.Wait))
	tries := max(c.Tries, 1)
	for try := 1; ; try++ {
		r, err := c.request(ctx, "acquire", &req, wait)
		if err == nil {
			if err = r.Error.err(); err == nil && r.Lease == nil {
				err = errors.New("acquire: reply carries no lease")
			}
		}
		if err == nil {
			r.Lease.Grants = r.Grants
			return r.Lease, nil
		}
		if errors.Is(err, errNoService) {
			return nil, err // nothing reached a service: nothing to retry or withdraw
		}
		unknown := errors.Is(err, errNoAnswer) || errors.Is(err, lease.ErrUnavailable)
		if unknown && ctx.Err() == nil && !errors.Is(err, errNoAnswer) {
			// The service answered that it cannot serve now: the same
			// request id makes a retry return the first try's lease if it
			// landed. The pause is jittered (retryPause).
			pause := retryPause(try)
			left := time.Until(until) - pause
			if try < tries || left > 0 {
				if try >= tries {
					req.Wait, wait = lease.Duration(left), left+replyGrace
				}
				select {
				case <-ctx.Done():
				case <-time.After(pause):
				}
				continue
			}
			if req.Wait > 0 {
				err = fmt.Errorf("%w (tried %d times within the wait)", err, try)
			}
		}
		if unknown {
			// We may have been queued, or even granted, before giving up:
			// withdraw so nothing is held in our name.
			cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
			_, _ = c.request(cctx, "cancel", cancelRequest{Repo: req.Repo, RequestID: req.RequestID, Credential: cred}, 0)
			cancel()
		}
		return nil, err
	}
}

// Renew extends a lease. It is a compare-and-swap on req.Version; a
// refusal (ErrLeaseLost, ErrNotOwner) means stop writing. After the lease
// service changed hands, a renewal of a version the last primary may have
// answered is answered with the lease's current version, which Renew
// renews instead (see renewSlack): the lease it returns is then more than
// one version past req.Version.
func (c *Client) Renew(ctx context.Context, req RenewRequest) (*lease.Lease, error) {
	l, _, err := c.renew(ctx, req)
	return l, err
}

// renew is Renew, which also returns the request whose answer it returns.
func (c *Client) renew(ctx context.Context, req RenewRequest) (*lease.Lease, RenewRequest, error) {
	cred := req.Credential
	if cred == "" {
		return nil, req, fmt.Errorf("renew %s: %w: empty credential", req.LeaseID, lease.ErrInvalid)
	}
	req.Credential = ""
	if req.RenewID == "" {
		req.RenewID = NewRequestID()
	}
	for again := false; ; again = true {
		req.Proof = renewProof(cred.hash(), req.LeaseID, req.Version, req.RenewID)
		l, err := c.leaseOp(ctx, "renew", &req)
		var cur *lease.Lease
		if ra := (*renewAgainError)(nil); errors.As(err, &ra) {
			cur = ra.current
		}
		// Once only, and only up: a service that keeps moving the version
		// is not one to follow.
		// A holder is never more than renewSlack+1 versions behind one.
		if cur == nil || again || cur.LeaseID != req.LeaseID || !cur.Active() || cur.Version <= req.Version || cur.Version > req.Version+renewSlack+1 {
			return l, req, err
		}
		req.Version, req.RenewID = cur.Version, NewRequestID()
	}
}

// Release ends a lease. Releasing an already ended lease is not an error.
func (c *Client) Release(ctx context.Context, leaseID string, cred Credential) (*lease.Lease, error) {
	return c.leaseOp(ctx, "release", &ReleaseRequest{LeaseID: leaseID, Credential: cred})
}

// Revoke ends a lease now as an operator; reason is required and audited.
func (c *Client) Revoke(ctx context.Context, leaseID, reason string) (*lease.Lease, error) {
	return c.leaseOp(ctx, "revoke", RevokeRequest{LeaseID: leaseID, Reason: reason})
}

// Get returns a lease record, active or recently ended.
func (c *Client) Get(ctx context.Context, leaseID string) (*lease.Lease, error) {
	return c.leaseOp(ctx, "get", getRequest{LeaseID: leaseID})
}

// List returns the active leases of repo (every repo when empty); with all,
// recently ended ones too.
func (c *Client) List(ctx context.Context, repo string, all bool) ([]*lease.Lease, error) {
	r, err := c.answer(ctx, "list", listRequest{Repo: repo, All: all})
	if err != nil {
		return nil, err
	}
	if r.Leases == nil {
		r.Leases = []*lease.Lease{}
	}
	return r.Leases, nil
}

// Sweep reclaims the expired leases of repo (every repo when empty) now and
// returns them. The service also sweeps on its own at each deadline.
func (c *Client) Sweep(ctx context.Context, repo string) ([]*lease.Lease, error) {
	r, err := c.request(ctx, "sweep", sweepRequest{Repo: repo}, 0)
	if err != nil {
		return nil, err
	}
	if err := r.Error.err(); err != nil {
		return nil, err
	}
	if r.Leases == nil {
		r.Leases = []*lease.Lease{}
	}
	return r.Leases, nil
}

// Watch calls fn with every lease record the service commits for repo
// (every repo when empty) until the returned stop is called. Delivery is
// best effort; act on what a record says, and reconcile with List.
func (c *Client) Watch(repo string, fn func(*lease.Lease)) (stop func() error, err error) {
	subj := changedPrefix + ".*.*"
	if repo != "" {
		subj = changedPrefix + "." + RepoKey(repo) + ".*"
	}
	return c.watch(subj, fn)
}

// fromService reports whether m can be a change notice of the lease
// service: a plain message, as only the service may publish on the change
// subjects. A JetStream delivery there is not: the server delivers a push
// consumer's messages to any subject its creator names, without checking
// that creator's permissions, so a holder able to write a stream (the
// shard attempts) could otherwise have the server deliver a forged record.
// JetStream deliveries always carry a reply subject ($JS.ACK.…).
func fromService(m *nats.Msg) bool {
	return m.Reply == "" && !jetStreamDelivery(m)
}

// jetStreamDelivery reports a message the server delivered for a push
// consumer: its reply subject is the ack subject, $JS.ACK.….
func jetStreamDelivery(m *nats.Msg) bool {
	return strings.HasPrefix(m.Reply, "$JS.") || m.Header.Get(jetstream.StreamHeader) != ""
}

// jetStreamReply reports an answer that carries a stored message's
// headers: a direct get publishes whatever someone stored, behind the
// server's Nats-Stream and Nats-Sequence, onto the reply subject its
// asker names. The lease service's answers never carry them.
func jetStreamReply(m *nats.Msg) bool {
	return m.Header.Get(jetstream.StreamHeader) != "" || m.Header.Get(jetstream.SequenceHeader) != ""
}

func (c *Client) watch(subj string, fn func(*lease.Lease)) (func() error, error) {
	sub, err := c.nc.Subscribe(subj, func(m *nats.Msg) {
		if !fromService(m) {
			return
		}
		var l lease.Lease
		// A record of the lease its subject names, or not a notice at all
		// (an answer someone had the server send here as its reply).
		if json.Unmarshal(m.Data, &l) == nil && l.LeaseID != "" && m.Subject == ChangedSubject(l.Repo, l.LeaseID) {
			fn(&l)
		}
	})
	if err != nil {
		return nil, fmt.Errorf("watch %s: %w", subj, err)
	}
	if err := c.nc.Flush(); err != nil {
		_ = sub.Unsubscribe()
		return nil, fmt.Errorf("watch %s: %w", subj, err)
	}
	return sub.Unsubscribe, nil
}
