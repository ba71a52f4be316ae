//go:build integration

package leasebus

import (
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// When the bus is gone the holder refuses fences at once (Unknown), and
// turns Lost when its own validity ends — not an interval later, and
// before the service's own deadline.
func TestHolderUnknownThenLostWhenBusUnreachable(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	const ttl = 5 * time.Second
	sent := time.Now()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "offline"), Owner: owner(1), TTL: lease.Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	changes := make(chan lease.HolderState, 8)
	h, err := NewClient(connect(t, b.srv.ClientURL())).Hold(t.Context(), l, cred, sent, HoldOptions{
		Interval: 1500 * time.Millisecond, Margin: 1200 * time.Millisecond,
		OnChange: func(s lease.HolderState, _ error) { changes <- s }})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
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
		if st != lease.Unknown {
			return errors.New("state is " + string(st))
		}
		return nil
	})
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) || errors.Is(err, lease.ErrLeaseLost) {
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
	for _, want := range []lease.HolderState{lease.Unknown, lease.Lost} {
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
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("fence after the margin: %v", err)
	}
}

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
	l, err := hc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "retry"), Owner: owner(1), TTL: lease.Duration(ttl)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var reclaimedAt time.Time
	var fenceAtReclaim error
	var holder atomic.Pointer[Holder]
	stop, err := b.c.Watch(repo, func(r *lease.Lease) {
		if r.LeaseID == l.LeaseID && r.Status == lease.StatusReclaimed {
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
	h, err := hc.Hold(t.Context(), l, cred, sent, HoldOptions{Interval: 400 * time.Millisecond, Margin: 300 * time.Millisecond,
		OnRenew: func(_ time.Duration, err error) {
			if err == nil && armed.CompareAndSwap(true, false) {
				close(answered)
				<-quiet
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	defer close(quiet)
	holder.Store(h)
	// The first renewal's reply is held back longer than the holder waits
	// for it (its interval), then let through.
	proxy.pause(true)
	checkFor(t, 3*time.Second, 5*time.Millisecond, func() error {
		if st, _ := h.State(); st != lease.Unknown {
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
	if st, err := h.State(); st != lease.Held || h.Lease().Version != 2 {
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
