package leasebus

// Holder behaviour (invariant 4: the holder stops before anyone else may
// consider its lease expired): it renews and keeps answering Fence; it
// learns of a revocation within a second; when the bus is unreachable it
// reports Unknown and refuses fences, then Lost once its own margin has run
// out — never later than the service's deadline; and a renewal whose reply
// was lost and that is retried does not stretch the holder's validity past
// the service's deadline.

import (
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

func holderValidUntil(h *Holder) time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.validUntil
}

func TestHolderRenewsAndFences(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "held"), Owner: owner(1), TTL: Duration(1500 * time.Millisecond)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
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
	if err := h.Release(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case <-h.Lost():
	default:
		t.Fatal("released holder not lost")
	}
	if _, err := h.Fence(); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("fence after release: %v", err)
	}
	if got, _ := b.c.Get(ctx, l.LeaseID); got.Status != StatusReleased {
		t.Fatalf("service has %s after release", got.Status)
	}
}

func TestHolderLostWithinASecondOfRevoke(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "revoked"), Owner: owner(1), TTL: Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	changes := make(chan HolderState, 8)
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(l, cred, sent, HoldOptions{OnChange: func(s HolderState, _ error) { changes <- s }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
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
	if _, err := h.Fence(); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("fence after revoke: %v", err)
	}
	if st, err := h.State(); st != Lost || !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("state after revoke: %s %v", st, err)
	}
	select {
	case s := <-changes:
		if s != Lost {
			t.Fatalf("OnChange got %s", s)
		}
	case <-time.After(time.Second):
		t.Fatal("OnChange not called")
	}
}

// When the bus is gone the holder refuses fences at once (Unknown), and
// turns Lost when its own validity ends — not an interval later, and
// before the service's own deadline.
func TestHolderUnknownThenLostWhenBusUnreachable(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	const ttl = 5 * time.Second
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "offline"), Owner: owner(1), TTL: Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	changes := make(chan HolderState, 8)
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(l, cred, sent, HoldOptions{
		Interval: 1500 * time.Millisecond, Margin: 1200 * time.Millisecond,
		OnChange: func(s HolderState, _ error) { changes <- s }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
	// Wait for a renewal, then take the bus away right after it.
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if h.Lease().Version < 2 {
			return errors.New("not renewed yet")
		}
		return nil
	})
	b.srv.Shutdown()
	validUntil := holderValidUntil(h)
	last := h.Lease()
	if !validUntil.Before(last.ExpiresAt) {
		t.Fatalf("holder valid until %s, the service's deadline is %s", validUntil.Format(time.StampMicro), last.ExpiresAt.Format(time.StampMicro))
	}
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		st, _ := h.State()
		if st != Unknown {
			return errors.New("state is " + string(st))
		}
		return nil
	})
	if _, err := h.Fence(); !errors.Is(err, ErrLeaseUnknown) || errors.Is(err, ErrLeaseLost) {
		t.Fatalf("fence while the bus is unreachable: want ErrLeaseUnknown, got %v", err)
	}
	var lostAt time.Time
	select {
	case <-h.Lost():
		lostAt = time.Now()
	case <-time.After(time.Until(validUntil) + 2*time.Second):
		t.Fatal("holder never lost after its validity ended (still unknown)")
	}
	late := lostAt.Sub(validUntil)
	t.Logf("lost %s after its validity ended", late)
	for _, want := range []HolderState{Unknown, Lost} {
		select {
		case s := <-changes:
			if s != want {
				t.Errorf("OnChange got %s, want %s", s, want)
			}
		case <-time.After(time.Second):
			t.Errorf("OnChange(%s) not called", want)
		}
	}
	if late > 400*time.Millisecond {
		t.Errorf("holder reported Lost %s after its own validity ended (Lost() and OnChange are what a write guard waits on)", late)
	}
	if late < 0 {
		t.Errorf("holder lost %s before its validity ended", -late)
	}
	if lostAt.After(last.ExpiresAt) {
		t.Errorf("holder reported Lost at %s, after the service's deadline %s", lostAt.Format(time.StampMicro), last.ExpiresAt.Format(time.StampMicro))
	}
	if _, err := h.Fence(); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("fence after the margin: %v", err)
	}
}

// pausableProxy forwards TCP connections to target; while paused it holds
// back what the server sends (replies are delayed, requests still arrive).
type pausableProxy struct {
	ln     net.Listener
	target string
	mu     sync.Mutex
	cond   *sync.Cond
	paused bool
}

func startProxy(t *testing.T, target string) *pausableProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &pausableProxy{ln: ln, target: target}
	p.cond = sync.NewCond(&p.mu)
	var conns []net.Conn
	var cmu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			cmu.Lock()
			conns = append(conns, c, s)
			cmu.Unlock()
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
		cmu.Lock()
		defer cmu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return p
}

func (p *pausableProxy) pause(on bool) {
	p.mu.Lock()
	p.paused = on
	p.mu.Unlock()
	p.cond.Broadcast()
}

func (p *pausableProxy) url() string { return "nats://" + p.ln.Addr().String() }

// A renewal reaches the service but its reply is lost; the holder retries
// it (same renew id) and gets the same version back. Its validity must
// still count from the first send — the service's deadline counts from
// when it processed that first try — or the holder keeps writing after the
// service has reclaimed the lease.
func TestHolderRetriedRenewalDoesNotOutliveServiceDeadline(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	proxy := startProxy(t, b.srv.Addr().String())
	hc := NewClient(connect(t, proxy.url()))
	cred := NewCredential()
	const ttl = 3 * time.Second
	sent := time.Now()
	l, err := hc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "retry"), Owner: owner(1), TTL: Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reclaimedAt time.Time
	var fenceAtReclaim error
	var holder atomic.Pointer[Holder]
	stop, err := b.c.Watch(repo, func(r *Lease) {
		if r.LeaseID == l.LeaseID && r.Status == StatusReclaimed {
			_, ferr := holder.Load().Fence()
			mu.Lock()
			reclaimedAt, fenceAtReclaim = time.Now(), ferr
			mu.Unlock()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	// Once the retry is answered, the holder goes quiet (as if the bus
	// became unreachable for it for good): OnRenew holds its goroutine, so
	// it sends nothing more, and the service reclaims v2 at its deadline.
	var armed atomic.Bool
	answered, quiet := make(chan struct{}), make(chan struct{})
	h, err := hc.Hold(l, cred, sent, HoldOptions{Interval: 400 * time.Millisecond, Margin: 300 * time.Millisecond,
		OnRenew: func(_ time.Duration, err error) {
			if err == nil && armed.CompareAndSwap(true, false) {
				close(answered)
				<-quiet
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
	defer close(quiet)
	holder.Store(h)
	// The first renewal's reply is held back longer than the holder waits
	// for it (its interval), then let through.
	proxy.pause(true)
	checkFor(t, 3*time.Second, 5*time.Millisecond, func() error {
		if st, _ := h.State(); st != Unknown {
			return errors.New("renewal not yet timed out")
		}
		return nil
	})
	// Hold the replies back a while longer, so the retry is sent well
	// after the first try (the retry itself gets through).
	time.Sleep(150 * time.Millisecond) // spacing the retry from the first try
	armed.Store(true)
	proxy.pause(false)
	select {
	case <-answered:
	case <-time.After(3 * time.Second):
		st, err := h.State()
		t.Fatalf("retry not answered 3s after the replies flowed again: %s %v", st, err)
	}
	if st, err := h.State(); st != Held || h.Lease().Version != 2 {
		t.Fatalf("after the retry: %s %v v%d, want held v2 (the first try's version)", st, err, h.Lease().Version)
	}
	v2 := h.Lease()
	validUntil := holderValidUntil(h)
	if validUntil.After(v2.ExpiresAt) {
		t.Errorf("after the retried renewal the holder is valid until %s, %s after the service's deadline %s",
			validUntil.Format(time.StampMicro), validUntil.Sub(v2.ExpiresAt), v2.ExpiresAt.Format(time.StampMicro))
	}
	checkFor(t, ttl+2*time.Second, 10*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if reclaimedAt.IsZero() {
			return errors.New("not reclaimed yet")
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if fenceAtReclaim == nil {
		t.Fatalf("the service reclaimed %s while its holder still handed out fences (holder valid until %s, %s later)",
			l.LeaseID, validUntil.Format(time.StampMicro), validUntil.Sub(reclaimedAt))
	}
}

// A lease granted after a wait longer than its ttl minus margin: Hold
// renews at once and keeps it, counting validity from that renewal.
func TestHoldAfterLongWaitRenewsAtOnce(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	const ttl = 2 * time.Second
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "waited"), Owner: owner(1), TTL: Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// As if the acquire had been sent 3 s ago and waited in the queue.
	sent := time.Now().Add(-3 * time.Second)
	h, err := b.c.Hold(l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Stop()
	if f, err := h.Fence(); err != nil || f != l.Fence {
		t.Fatalf("fence right after Hold: %d, %v", f, err)
	}
	if got := h.Lease().Version; got != l.Version+1 {
		t.Fatalf("Hold did not renew at once: version %d", got)
	}
}
