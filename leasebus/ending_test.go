package leasebus

import (
	"errors"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestHolderEndings: a holder knows how it came by its lease. Close
// releases a lease it acquired (once: a second Close ends nothing more
// and returns the first's answer) and only stops renewing one it attached
// to, which stays its owner's and active; Orphan stops renewing without
// releasing, the lease left active (to expire, or to be reclaimed once
// its session falls silent).
func TestHolderEndings(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	owned := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	status := func(id string) lease.Status {
		t.Helper()
		l, err := b.c.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		return l.Status
	}
	acquire := func(path string) (*Holder, Credential) {
		t.Helper()
		cred := NewCredential()
		h, err := owned.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, path), Owner: owner(1), TTL: lease.Duration(30 * time.Second)}, cred, HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.Orphan)
		return h, cred
	}

	t.Run("close acquired", func(t *testing.T) {
		h, _ := acquire("ending/close")
		id := h.Lease().LeaseID
		if h.Attached() {
			t.Fatal("an acquired holder says it attached")
		}
		if err := h.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if st := status(id); st != lease.StatusReleased {
			t.Fatalf("lease %s after Close of its acquirer's holder, want released", st)
		}
		if st, err := h.State(); st != lease.Lost || !errors.Is(err, lease.ErrLeaseLost) {
			t.Fatalf("holder after Close: %s %v, want lost", st, err)
		}
		if err := h.Close(ctx); err != nil {
			t.Fatalf("second Close: %v, want the first's answer (nil)", err)
		}
	})

	t.Run("close attached", func(t *testing.T) {
		acquirer, cred := acquire("ending/attached")
		id := acquirer.Lease().LeaseID
		other := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
		h, err := other.AttachAndHold(ctx, id, cred, HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if !h.Attached() {
			t.Fatal("an attached holder says it acquired")
		}
		if err := h.Close(ctx); err != nil {
			t.Fatal(err)
		}
		if st := status(id); st != lease.StatusActive {
			t.Fatalf("lease %s after Close of an attached holder, want active (its owner's)", st)
		}
		if _, err := acquirer.Fence(); err != nil {
			t.Fatalf("the owner's holder after the attached one closed: %v", err)
		}
	})

	t.Run("orphan", func(t *testing.T) {
		h, _ := acquire("ending/orphan")
		id := h.Lease().LeaseID
		h.Orphan()
		if st := status(id); st != lease.StatusActive {
			t.Fatalf("lease %s after Orphan, want active (left to expire)", st)
		}
		h.Orphan() // again: nothing more
	})
}
