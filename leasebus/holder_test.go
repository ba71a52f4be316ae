package leasebus

// Holder behaviour (invariant 4: the holder stops before anyone else may
// consider its lease expired): it renews and keeps answering Fence; it
// learns of a revocation within a second; when the bus is unreachable it
// reports Unknown and refuses fences, then Lost once its own margin has run
// out — never later than the service's deadline; and a renewal whose reply
// was lost and that is retried does not stretch the holder's validity past
// the service's deadline.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

func holderValidUntil(h *Holder) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.validUntil
}

func TestHolderRenewsAndFences(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "held"), Owner: owner(1), TTL: lease.Duration(1500 * time.Millisecond)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	// For three TTLs the holder keeps the lease: every fence succeeds,
	// the version rises, and the service's expiry is never before the
	// holder's own validity.
	end := time.Now().Add(3 * 1500 * time.Millisecond)
	for time.Now().Before(end) {
		f, err := h.Fence()
		if err != nil || f != l.Fence {
			t.Fatalf("fence while held: %d %v", f, err)
		}
		cur := h.Lease()
		if vu := holderValidUntil(h); !vu.Before(cur.ExpiresAt) {
			t.Fatalf("holder valid until %s, service lets v%d expire at %s", vu.Format(time.StampMicro), cur.Version, cur.ExpiresAt.Format(time.StampMicro))
		}
		time.Sleep(50 * time.Millisecond) // spacing the probes
	}
	if v := h.Lease().Version; v < 5 {
		t.Fatalf("after 3 TTLs the lease is at version %d: the holder did not renew every TTL/3", v)
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || !got.Active() || got.Version < h.Lease().Version {
		t.Fatalf("service has %+v %v", got, err)
	}
	if err := h.Close(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.Lost():
	default:
		t.Fatal("released holder not lost")
	}
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("fence after release: %v", err)
	}
	if got, _ := b.c.Get(ctx, l.LeaseID); got.Status != lease.StatusReleased {
		t.Fatalf("service has %s after release", got.Status)
	}
}

func TestHolderLostWithinASecondOfRevoke(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "revoked"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	changes := make(chan lease.HolderState, 8)
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(t.Context(), l, cred, sent, HoldOptions{OnChange: func(s lease.HolderState, _ error) { changes <- s }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	start := time.Now()
	if _, err := b.c.Revoke(ctx, l.LeaseID, "test: operator ends it"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.Lost():
	case <-time.After(time.Second):
		t.Fatal("holder not lost within 1s of the revoke (its next renewal is 20s away)")
	}
	t.Logf("holder lost %s after the revoke was sent", time.Since(start))
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("fence after revoke: %v", err)
	}
	if st, err := h.State(); st != lease.Lost || !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("state after revoke: %s %v", st, err)
	}
	// The notice makes it Unknown at once; the service's refusal of the
	// re-check makes it Lost.
	for _, want := range []lease.HolderState{lease.Unknown, lease.Lost} {
		select {
		case s := <-changes:
			if s != want {
				t.Fatalf("OnChange got %s, want %s", s, want)
			}
		case <-time.After(time.Second):
			t.Fatalf("OnChange(%s) not called", want)
		}
	}
}

// pausableProxy forwards TCP connections to target; while paused it holds
// back what the server sends (replies are delayed, requests still arrive).
// cut drops every connection through it; while refusing, it drops new ones
// at once (the client keeps trying to reconnect).
type pausableProxy struct {
	ln       net.Listener
	target   string
	mu       sync.Mutex
	cond     *sync.Cond
	paused   bool
	refusing bool       // guarded by mu
	conns    []net.Conn // guarded by mu
}

func startProxy(t *testing.T, target string) *pausableProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pausableProxy{ln: ln, target: target}
	p.cond = sync.NewCond(&p.mu)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			p.mu.Lock()
			refusing := p.refusing
			p.mu.Unlock()
			if refusing {
				_ = c.Close()
				continue
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			p.mu.Lock()
			p.conns = append(p.conns, c, s)
			p.mu.Unlock()
			go func() { _, _ = io.Copy(s, c); _ = s.Close() }()
			go func() {
				buf := make([]byte, 32<<10)
				for {
					n, err := s.Read(buf)
					p.mu.Lock()
					for p.paused {
						p.cond.Wait()
					}
					p.mu.Unlock()
					if n > 0 {
						if _, werr := c.Write(buf[:n]); werr != nil {
							return
						}
					}
					if err != nil {
						_ = c.Close()
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		p.pause(false)
		_ = ln.Close()
		p.cut()
	})
	return p
}

// cut closes every connection through the proxy, as a dead bus would.
func (p *pausableProxy) cut() {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		_ = c.Close()
	}
	p.conns = nil
}

// refuse makes the proxy drop new connections (on) or forward them again.
func (p *pausableProxy) refuse(on bool) {
	p.mu.Lock()
	p.refusing = on
	p.mu.Unlock()
}

func (p *pausableProxy) pause(on bool) {
	p.mu.Lock()
	p.paused = on
	p.mu.Unlock()
	p.cond.Broadcast()
}

func (p *pausableProxy) url() string { return "nats://" + p.ln.Addr().String() }

// A lease granted after a wait longer than its ttl minus margin: Hold
// renews at once and keeps it, counting validity from that renewal.
func TestHoldAfterLongWaitRenewsAtOnce(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	const ttl = 2 * time.Second
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "waited"), Owner: owner(1), TTL: lease.Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// As if the acquire had been sent 3 s ago and waited in the queue.
	sent := time.Now().Add(-3 * time.Second)
	h, err := b.c.Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	if f, err := h.Fence(); err != nil || f != l.Fence {
		t.Fatalf("fence right after Hold: %d, %v", f, err)
	}
	if got := h.Lease().Version; got != l.Version+1 {
		t.Fatalf("Hold did not renew at once: version %d", got)
	}
}

// heldLeaseFor acquires a lease with ttl on the bus and holds it over nc.
func heldLeaseFor(t *testing.T, b *bus, nc *nats.Conn, path string, ttl time.Duration, opts HoldOptions) (*Holder, *lease.Lease) {
	t.Helper()
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctxT(t), AcquireRequest{Repo: repo, Scope: claim(t, path), Owner: owner(1), TTL: lease.Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewClient(nc).Hold(t.Context(), l, cred, sent, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	return h, l
}

// fenceWatch calls Fence in a loop from start until stop and records the
// first success seen after armed (nil: none).
type fenceWatch struct {
	armed   atomic.Bool
	success atomic.Pointer[time.Time]
	// heard is, at the first success, when the last request the service
	// answered was sent (Holder.heardAt).
	heard atomic.Pointer[time.Time]
	stop  chan struct{}
	done  chan struct{}
}

func watchFences(h *Holder) *fenceWatch {
	w := &fenceWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(w.done)
		for {
			select {
			case <-w.stop:
				return
			default:
			}
			armed := w.armed.Load()
			if _, err := h.Fence(); err == nil && armed {
				now := time.Now()
				if w.success.CompareAndSwap(nil, &now) {
					h.mu.Lock()
					heard := h.heardAt
					h.mu.Unlock()
					w.heard.Store(&heard)
				}
			}
			runtime.Gosched()
		}
	}()
	return w
}

func (w *fenceWatch) end() *time.Time {
	close(w.stop)
	<-w.done
	return w.success.Load()
}

// A change notice is not the service's word: one saying the lease was
// revoked (a forged one here, with a version far ahead) stops writes at
// once, but the service's answer to the re-check says the lease is active,
// and the holder is Held again with the same fence.
func TestHolderNoticeContradictedByServiceStaysHeld(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	changes := make(chan lease.HolderState, 8)
	h, l := heldLeaseFor(t, b, connect(t, b.srv.ClientURL()), "forged", time.Minute,
		HoldOptions{OnChange: func(s lease.HolderState, _ error) { changes <- s }})
	forged := *l
	forged.Status, forged.Version, forged.Reason = lease.StatusRevoked, l.Version+1000, "forged by a test"
	data, err := json.Marshal(forged)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.nc.Publish(ChangedSubject(l.Repo, l.LeaseID), data); err != nil {
		t.Fatal(err)
	}
	for _, want := range []lease.HolderState{lease.Unknown, lease.Held} {
		select {
		case s := <-changes:
			if s != want {
				t.Fatalf("after a notice the service contradicts: OnChange got %s, want %s", s, want)
			}
		case <-time.After(2 * time.Second):
			st, err := h.State()
			t.Fatalf("OnChange(%s) not called; holder is %s: %v", want, st, err)
		}
	}
	if f, err := h.Fence(); err != nil || f != l.Fence {
		t.Fatalf("fence after the service confirmed the lease: %d %v", f, err)
	}
	// Held may come from the session's keepalive, sent after the notice,
	// before the renewal the notice asked for lands: both are the
	// service's word. The renewal comes either way, and the notice's
	// version is never taken.
	checkFor(t, 2*time.Second, time.Millisecond, func() error {
		if v := h.Lease().Version; v != l.Version+1 {
			return fmt.Errorf("holder at version %d, want %d (one re-check renewal; the notice's version %d is not taken)", v, l.Version+1, forged.Version)
		}
		return nil
	})
	select {
	case <-h.Lost():
		t.Fatal("a notice alone made the holder lost")
	default:
	}
	got, err := b.c.Get(ctxT(t), l.LeaseID)
	if err != nil || !got.Active() {
		t.Fatalf("service has %+v %v", got, err)
	}
}

// The moment the holder's connection drops, Fence fails (Unknown), before
// any renewal or timeout; reads are the boundaries' business.
func TestHolderDisconnectFailsFenceAtOnce(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	proxy := startProxy(t, b.srv.Addr().String())
	nc := connect(t, proxy.url())
	changes := make(chan lease.HolderState, 8)
	h, l := heldLeaseFor(t, b, nc, "dropped", time.Minute,
		HoldOptions{OnChange: func(s lease.HolderState, _ error) { changes <- s }})
	if _, err := h.Fence(); err != nil {
		t.Fatal(err)
	}
	proxy.refuse(true)
	cut := time.Now()
	proxy.cut()
	// As soon as the client knows its connection is gone, Fence fails,
	// whether or not the holder has handled the status event.
	checkFor(t, time.Second, 100*time.Microsecond, func() error {
		if nc.IsConnected() {
			return errors.New("client still connected")
		}
		return nil
	})
	if f, err := h.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) {
		t.Fatalf("fence with the connection down: %d %v, want ErrLeaseUnknown", f, err)
	}
	select {
	case s := <-changes:
		if s != lease.Unknown {
			t.Fatalf("OnChange got %s, want unknown", s)
		}
	case <-time.After(time.Second):
		t.Fatal("holder not unknown within 1s of the disconnect")
	}
	t.Logf("holder unknown %s after the cut", time.Since(cut))
	if st, err := h.State(); st != lease.Unknown || !errors.Is(err, lease.ErrLeaseUnknown) {
		t.Fatalf("state with the connection down: %s %v", st, err)
	}
	if got, _ := b.c.Get(ctxT(t), l.LeaseID); !got.Active() {
		t.Fatalf("the service ended the lease: %+v", got)
	}
}

// After a reconnect the holder re-checks its lease with the service before
// Fence succeeds again: no write goes through on the strength of the old
// connection. The re-check is the session's keepalive, sent once the
// connection is back (one for all the session's holders, not a renewal
// apiece), or a renewal should none settle it.
func TestHolderRechecksAfterReconnect(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	proxy := startProxy(t, b.srv.Addr().String())
	nc := connect(t, proxy.url())
	h, _ := heldLeaseFor(t, b, nc, "reconnect", time.Minute, HoldOptions{})
	w := watchFences(h)
	proxy.refuse(true)
	proxy.cut()
	checkFor(t, time.Second, time.Millisecond, func() error {
		if st, _ := h.State(); st != lease.Unknown {
			return errors.New("not unknown yet")
		}
		return nil
	})
	w.armed.Store(true)
	time.Sleep(100 * time.Millisecond) // the connection stays down a while (what is tested is the reconnect)
	reopened := time.Now()
	proxy.refuse(false)
	checkFor(t, 3*time.Second, time.Millisecond, func() error {
		_, err := h.Fence()
		return err
	})
	// The watch polls on its own goroutine: let it see what checkFor saw.
	checkFor(t, 3*time.Second, time.Millisecond, func() error {
		if w.success.Load() == nil {
			return errors.New("fence watch saw no success after the reconnect")
		}
		return nil
	})
	first := w.end()
	if heard := w.heard.Load(); !heard.After(reopened) {
		t.Fatalf("a fence succeeded after the reconnect at %s, when the service had answered nothing sent since the connection could come back at %s (last heard: a request sent at %s)",
			first.Format(time.StampMicro), reopened.Format(time.StampMicro), heard.Format(time.StampMicro))
	}
}

// A revoke issued while the holder is cut off from the bus (its notice is
// lost) is found as soon as the holder is back: the re-check is refused,
// the holder is Lost, and no fence succeeded in between.
func TestHolderSeesRevokeMadeWhileDisconnected(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	proxy := startProxy(t, b.srv.Addr().String())
	nc := connect(t, proxy.url())
	h, l := heldLeaseFor(t, b, nc, "missed", time.Minute, HoldOptions{})
	w := watchFences(h)
	proxy.refuse(true)
	proxy.cut()
	checkFor(t, time.Second, time.Millisecond, func() error {
		if nc.IsConnected() {
			return errors.New("still connected")
		}
		return nil
	})
	w.armed.Store(true)
	if _, err := b.c.Revoke(ctxT(t), l.LeaseID, "test: revoked while its holder is away"); err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	proxy.refuse(false)
	select {
	case <-h.Lost():
	case <-time.After(time.Second):
		st, err := h.State()
		t.Fatalf("holder not lost within 1s of reconnecting after a revoke it missed: %s %v", st, err)
	}
	t.Logf("lost %s after the bus was reachable again", time.Since(back))
	if at := w.end(); at != nil {
		t.Fatalf("a fence succeeded at %s, after the lease was revoked while the holder was away", at.Format(time.StampMicro))
	}
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("fence after the re-check: %v", err)
	}
}

// The bus is stopped and restarted on the same port and store, and the
// lease revoked the moment the service answers: the holder, reconnecting,
// is Lost within a second of the revoke returning. That second is the
// bound: a re-check the service ordered before the revoke can be answered
// after the revoke's own answer (they travel on different connections),
// and fences succeed until the holder hears the revoke (the storage
// fences refuse what it writes then). The one flake of a stricter
// version, no fence at all after the revoke returned, was that order. A
// fence after the revoke must still follow some answer to what the
// holder sent after the restart (heardAt is the latest such send: a
// sanity check that it did not resume on what it heard before, which its
// silence bound already refuses).
func TestHolderRevokeRightAfterBusRestart(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	addr := b.srv.Addr().String()
	nc := connect(t, b.srv.ClientURL())
	h, l := heldLeaseFor(t, b, nc, "restart", time.Minute, HoldOptions{})
	b.stop()
	checkFor(t, time.Second, time.Millisecond, func() error {
		if _, err := h.Fence(); err == nil {
			return errors.New("fence still succeeds with the bus down")
		}
		return nil
	})
	restarted := time.Now()
	b.start(addr)
	w := watchFences(h)
	if _, err := b.c.Revoke(ctxT(t), l.LeaseID, "test: revoked right after a restart"); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	w.armed.Store(true)
	select {
	case <-h.Lost():
	case <-time.After(time.Second):
		st, err := h.State()
		t.Fatalf("holder not lost within 1s of a revoke right after a restart: %s %v", st, err)
	}
	t.Logf("lost %s after the revoke returned", time.Since(revoked))
	if at := w.end(); at != nil {
		if heard := *w.heard.Load(); heard.Before(restarted) {
			t.Fatalf("a fence succeeded %s after the revoke returned, on an answer to what the holder sent %s before the bus restarted", at.Sub(revoked), restarted.Sub(heard))
		}
		t.Logf("a fence succeeded %s after the revoke returned, on the answer to a re-check sent %s after the restart (ordered before the revoke)", at.Sub(revoked), w.heard.Load().Sub(restarted))
	}
}

// A holder whose connection is closed under it fails its fences at once
// (it can never re-check), and is Lost once its own validity ends.
func TestHolderClosedConnectionFailsClosed(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	nc := connect(t, b.srv.ClientURL())
	h, _ := heldLeaseFor(t, b, nc, "closed", 2*time.Second, HoldOptions{})
	nc.Close()
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) {
		t.Fatalf("fence right after the connection was closed: %v, want ErrLeaseUnknown", err)
	}
	select {
	case <-h.Lost():
	case <-time.After(3 * time.Second):
		st, err := h.State()
		t.Fatalf("holder on a closed connection not lost after its ttl: %s %v", st, err)
	}
}

// A revoke committed between the acquire's reply and the holder's watch
// announces itself to nobody; Hold asks the service once after it starts
// watching, so the holder does not write on until its first renewal.
func TestHolderSeesRevokeBeforeItsWatch(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "early"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Revoke(ctx, l.LeaseID, "test: revoked before the holder watched"); err != nil {
		t.Fatal(err)
	}
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	if _, err := h.Fence(); err == nil {
		t.Fatal("Hold returned a holder that fences a lease revoked before it watched")
	}
	select {
	case <-h.Lost():
	case <-time.After(time.Second):
		t.Fatal("holder not lost within 1s (its first renewal is 20s away)")
	}
}

// A server that stops answering (paused, cut off) delivers no revoke
// notice, and the connection drops only after missed pings, seconds
// later. The holder stops vouching for its lease once its server has been
// silent longer than Silence, so a revoke answered by another node while
// the holder's node is paused stops its writes within the 1 s bound; once
// the server answers again, the re-check finds the revoke.
func TestHolderStopsWhenItsServerFallsSilent(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	proxy := startProxy(t, b.srv.Addr().String())
	h, l := heldLeaseFor(t, b, connect(t, proxy.url()), "silent", time.Minute, HoldOptions{})
	if _, err := h.Fence(); err != nil {
		t.Fatal(err)
	}
	proxy.pause(true) // the holder's server goes quiet
	paused := time.Now()
	if _, err := b.c.Revoke(ctxT(t), l.LeaseID, "test: revoked while the holder's server is silent"); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	checkFor(t, 2*time.Second, time.Millisecond, func() error {
		if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) {
			return fmt.Errorf("fence while the server is silent: %v", err)
		}
		return nil
	})
	if late := time.Since(revoked); late > time.Second {
		t.Fatalf("the holder vouched for its lease %s after the revoke returned (%s after its server fell silent)", late, time.Since(paused))
	}
	t.Logf("fence refused %s after the server fell silent", time.Since(paused).Round(time.Millisecond))
	proxy.pause(false)
	select {
	case <-h.Lost():
	case <-time.After(3 * time.Second):
		t.Fatal("the holder did not find the revoke once its server answered again")
	}
}

// AcquireAndHold holds what it acquired, with validity counted from the
// acquire's sending; a conflict comes back as Acquire's *ConflictError;
// a lease granted but not held (options Hold refuses) is released, not
// left to expire.
func TestAcquireAndHold(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const ttl = 2 * time.Second
	before := time.Now()
	h, err := b.c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "mine"), Owner: owner(1), TTL: lease.Duration(ttl)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	if f, err := h.Fence(); err != nil || f != h.Lease().Fence {
		t.Fatalf("fence right after AcquireAndHold: %d, %v", f, err)
	}
	if vu := holderValidUntil(h); vu.Before(before) || !vu.Before(h.Lease().ExpiresAt) {
		t.Fatalf("holder valid until %s: want after %s (the acquire's sending) and before the service's expiry %s", vu, before, h.Lease().ExpiresAt)
	}

	_, err = b.c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "mine/sub"), Owner: owner(2), TTL: lease.Duration(ttl)}, NewCredential(), HoldOptions{})
	var ce *lease.ConflictError
	if !errors.As(err, &ce) || len(ce.Conflicts) != 1 || ce.Conflicts[0].LeaseID != h.Lease().LeaseID {
		t.Fatalf("overlapping AcquireAndHold: %v, want a *ConflictError naming %s", err, h.Lease().LeaseID)
	}

	_, err = b.c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(3), TTL: lease.Duration(ttl)}, NewCredential(), HoldOptions{Interval: ttl})
	if !errors.Is(err, lease.ErrInvalid) {
		t.Fatalf("AcquireAndHold with a renew interval of the whole ttl: %v, want ErrInvalid", err)
	}
	ls, err := b.c.List(ctx, repo, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		if l.Owner == owner(3) {
			t.Fatalf("the lease AcquireAndHold could not hold is still %s: %+v", l.Status, l)
		}
	}
}

// TestRenewalRetriesBackOff: the tries after unanswered renewals start
// short, double with each failure in a row up to a quarter of the
// interval (give or take a fifth), and shrink again as validity runs
// out: a bus too slow to answer is not sent ever more of the same by
// every holder waiting on it, and a holder still tries several times
// before its lease runs out.
func TestRenewalRetriesBackOff(t *testing.T) {
	t.Parallel()
	now := time.Now()
	clock := func() time.Time { return now }
	h := &Holder{opts: HoldOptions{Now: clock, Interval: 10 * time.Second}, validUntil: now.Add(time.Hour)}
	within := func(d, want time.Duration) bool { return d >= want*4/5 && d <= want*6/5 }
	for f, want := range []time.Duration{250 * time.Millisecond, 500 * time.Millisecond, time.Second, 2 * time.Second, 2500 * time.Millisecond, 2500 * time.Millisecond} {
		h.failures = f + 1
		if d := h.retryAfter(); !within(d, want) {
			t.Errorf("after %d failures: retry in %s, want %s ± 20 %%", f+1, d, want)
		}
	}
	h.failures = 30
	h.validUntil = now.Add(2 * time.Second)
	if d := h.retryAfter(); d > 500*time.Millisecond {
		t.Errorf("with 2 s of validity left: retry in %s, want at most a quarter of it", d)
	}
	short := &Holder{opts: HoldOptions{Now: clock, Interval: 300 * time.Millisecond}, validUntil: now.Add(time.Hour), failures: 1}
	if d := short.retryAfter(); !within(d, 300*time.Millisecond/8) {
		t.Errorf("interval 300 ms, first failure: retry in %s, want an eighth of the interval", d)
	}
}

// TestOnChangeInOrder: OnChange hears a holder's state changes in the
// order they happened, so a consumer that tracks the state ends where the
// holder is (with a goroutine per change, a Held could arrive before the
// Unknown it followed, and the consumer keep Unknown).
func TestOnChangeInOrder(t *testing.T) {
	t.Parallel()
	const n = 2000
	heard := make(chan lease.HolderState, n)
	h := &Holder{opts: HoldOptions{Now: time.Now, OnChange: func(s lease.HolderState, _ error) { heard <- s }}, state: lease.Held, lost: make(chan struct{})}
	want := make([]lease.HolderState, 0, n)
	for i := range n {
		st := lease.Unknown
		if i%2 == 1 {
			st = lease.Held
		}
		h.setState(st, nil)
		want = append(want, st)
	}
	timeout := time.After(10 * time.Second)
	for i, w := range want {
		select {
		case got := <-heard:
			if got != w {
				t.Fatalf("change %d heard as %s, want %s: out of order", i, got, w)
			}
		case <-timeout:
			t.Fatalf("heard %d of %d changes within 10 s", i, n)
		}
	}
}
