package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestGate: the agent wrapper's gate allows writes only on a fresh
// "held" from the sidecar: never before the first word, not once the last
// word is older than the grace, and never again after "lost" or a change
// of lease.
func TestGate(t *testing.T) {
	now := time.Unix(1000, 0)
	g := NewGate("http://sidecar", time.Second)
	g.now = func() time.Time { return now }
	bound := &lease.Lease{LeaseID: "lease_a", Fence: 7}
	view := func(st lease.HolderState, l *lease.Lease) *LeaseView {
		return &LeaseView{State: st, Lease: l, Reason: "why"}
	}
	want := func(what string, ok bool, is error) {
		t.Helper()
		fence, err := g.Fence()
		switch {
		case ok && (err != nil || fence != 7):
			t.Errorf("%s: Fence() = %d, %v; want 7", what, fence, err)
		case !ok && !errors.Is(err, is):
			t.Errorf("%s: Fence() = %d, %v; want %v", what, fence, err, is)
		}
	}
	want("never heard", false, lease.ErrLeaseUnknown)
	g.Heard(view(lease.Unknown, nil)) // the sidecar is still acquiring
	want("no lease yet", false, lease.ErrLeaseUnknown)
	held := view(lease.Held, bound)
	held.Fence = 7
	held.ValidFor = lease.Duration(time.Minute)
	// The sidecar's holder has 300 ms of validity left: past that, no
	// grace makes its word good.
	short := *held
	short.ValidFor = lease.Duration(300 * time.Millisecond)
	g.Heard(&short)
	want("held, short validity", true, nil)
	// The first lease named binds the gate, even after lease-less views
	// (the wrapper's policy is made from it).
	select {
	case <-g.first:
	default:
		t.Fatal("the first view naming a lease did not release waitFirst")
	}
	if v := g.WaitFirst(context.Background(), 0); v == nil || v.Lease == nil || v.Lease.LeaseID != "lease_a" {
		t.Fatalf("waitFirst = %+v, want the view that named lease_a", v)
	}
	now = now.Add(300 * time.Millisecond)
	want("past the sidecar's validity, within the grace", false, lease.ErrLeaseUnknown)
	g.Heard(held)
	want("held", true, nil)
	now = now.Add(999 * time.Millisecond)
	want("held, within the grace", true, nil)
	now = now.Add(2 * time.Millisecond)
	want("silent past the grace", false, lease.ErrLeaseUnknown)
	g.Heard(held)
	want("heard again", true, nil)
	g.Heard(view(lease.Unknown, bound))
	want("sidecar unknown", false, lease.ErrLeaseUnknown)
	g.Heard(held)
	g.Heard(view(lease.Unknown, nil)) // a restarted sidecar, no lease yet
	want("sidecar names no lease", false, lease.ErrLeaseUnknown)
	g.Heard(held)
	want("held again", true, nil)
	other := *held
	other.Lease = &lease.Lease{LeaseID: "lease_b", Fence: 9}
	g.Heard(&other)
	want("another lease", false, lease.ErrLeaseLost)
	g2 := NewGate("http://sidecar", time.Second)
	g2.Heard(held)
	g2.Heard(view(lease.Lost, bound))
	g2.Heard(held)
	if _, err := g2.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Errorf("held after lost: %v, want lost for good", err)
	}
	// A policy made without a lease: no lease that arrives later opens it.
	g3 := NewGate("http://sidecar", time.Second)
	g3.Unbound("no lease within --wait")
	g3.Heard(held)
	if _, err := g3.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) || !strings.Contains(err.Error(), "policy was made without a lease") {
		t.Errorf("gate of a policy made without a lease, after a lease arrived: %v, want closed for good", err)
	}
}

// TestClientFollowsTheAdminServer: a Client against a real admin server
// with a token feeds its gate the lease view (closed before a lease, the
// fence while held, lost for good after a revoke), records a file denial
// under the sidecar's lease, and delivers the settle report; a wrong token
// gets the server's refusal back.
func TestClientFollowsTheAdminServer(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	const token = "0123456789abcdef0123"
	a := startAdmin(t, AdminConfig{Token: token, Audit: bus.Auditor, KeepAlive: 50 * time.Millisecond, Poll: 20 * time.Millisecond})
	c := NewClient(a.URL()+"/", token)
	g := NewGate(a.URL(), 10*time.Second)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Follow(ctx, g, slog.New(slog.DiscardHandler))
	}()
	t.Cleanup(func() { cancel(); <-done })

	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !g.EverHeard() {
			return errors.New("the gate never heard from the sidecar")
		}
		return nil
	})
	if _, err := g.Fence(); !errors.Is(err, lease.ErrLeaseUnknown) {
		t.Fatalf("Fence before the sidecar has a lease: %v, want unknown", err)
	}

	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/client", Scope: bustest.Claim(t, "a"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	a.SetLease(l.Holder, Fences{Git: "http://127.0.0.1:1"})
	v := g.WaitFirst(ctx, 10*time.Second)
	if v == nil || v.Lease == nil || v.Lease.LeaseID != l.Record.LeaseID || v.Fences.Git != "http://127.0.0.1:1" {
		t.Fatalf("WaitFirst = %+v, want the view naming %s", v, l.Record.LeaseID)
	}
	if fence, err := g.Fence(); err != nil || fence != l.Record.Fence {
		t.Fatalf("Fence while held = %d, %v; want %d", fence, err, l.Record.Fence)
	}

	ev := lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile,
		Reason: "lease-lost", Message: "file write denied: openat /w/in/client-probe"}
	if err := c.Auditor().Record(ctx, ev); err != nil {
		t.Fatalf("record a denial through the sidecar: %v", err)
	}
	evs, err := leasebus.ReadAudit(ctx, bus.Conn, "github.com/acme/client", 0)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs {
		if e.Boundary == lease.BoundaryFile && e.LeaseID == l.Record.LeaseID && strings.Contains(e.Message, "/w/in/client-probe") {
			found = true
		}
	}
	if !found {
		t.Fatalf("denial recorded through the client not on the audit stream: %+v", evs)
	}

	if _, err := bus.Operator.Revoke(ctx, l.Record.LeaseID, "runaway agent"); err != nil {
		t.Fatal(err)
	}
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if _, err := g.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
			return fmt.Errorf("Fence after the revoke: %v, want lost", err)
		}
		return nil
	})

	rep := SettledReport{ExitCode: 3, Denials: 1}
	if err := NewClient(a.URL(), "wrong-token-wrong-token").Settled(ctx, rep, 0); err == nil || !strings.Contains(err.Error(), "401") {
		t.Fatalf("settle report with a wrong token: %v, want the server's 401", err)
	}
	select {
	case <-a.Settled():
		t.Fatal("a refused settle report settled the attempt")
	default:
	}
	if err := c.Settled(ctx, rep, 0); err != nil {
		t.Fatalf("settle report: %v", err)
	}
	select {
	case <-a.Settled():
	default:
		t.Fatal("Settled not closed after the client's report")
	}
	if !a.View().Settled {
		t.Fatal("view does not say settled")
	}
}
