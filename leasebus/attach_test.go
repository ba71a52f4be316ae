package leasebus

import (
	"errors"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestAttachAndHold: a lease acquired elsewhere (another process of the
// same bus identity: `lease acquire`, then `run --lease`) is held by whoever
// has its credential (proved by a renewal, then renewed on), refused to
// anyone else with ErrNotOwner, and refused once released with
// ErrLeaseLost. (Another identity is refused even with the credential:
// TestLeaseBoundToItsIdentity.)
func TestAttachAndHold(t *testing.T) {
	t.Parallel() // waits on a renewal: runs beside the others (own server)
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	acquirer := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	l, err := acquirer.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "attached"), Owner: owner(1), TTL: lease.Duration(1500 * time.Millisecond)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	other := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))

	t.Run("wrong credential", func(t *testing.T) {
		h, err := other.AttachAndHold(ctx, l.LeaseID, NewCredential(), HoldOptions{})
		if !errors.Is(err, lease.ErrNotOwner) {
			if h != nil {
				h.Orphan()
			}
			t.Fatalf("attach with another credential: %v, want %v", err, lease.ErrNotOwner)
		}
		if got, err := b.c.Get(ctx, l.LeaseID); err != nil || got.Version != l.Version || !got.Active() {
			t.Fatalf("the refused attach changed the lease: %+v %v", got, err)
		}
	})

	t.Run("owner credential", func(t *testing.T) {
		renewed := make(chan error, 16)
		h, err := other.AttachAndHold(ctx, l.LeaseID, cred, HoldOptions{OnRenew: func(_ time.Duration, err error) {
			select {
			case renewed <- err:
			default:
			}
		}})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Orphan()
		attached := h.Lease()
		if attached.LeaseID != l.LeaseID || attached.Version <= l.Version {
			t.Fatalf("attached to %s v%d, want %s after v%d (the proving renewal)", attached.LeaseID, attached.Version, l.LeaseID, l.Version)
		}
		if f, err := h.Fence(); err != nil || f != l.Fence {
			t.Fatalf("fence after attaching: %d %v, want %d", f, err, l.Fence)
		}
		select {
		case err := <-renewed:
			if err != nil {
				t.Fatalf("first renewal of the attached holder: %v", err)
			}
		case <-ctx.Done():
			t.Fatal("the attached holder did not renew")
		}
		if v := h.Lease().Version; v <= attached.Version {
			t.Fatalf("after a renewal the holder has v%d, attached at v%d", v, attached.Version)
		}
		if st, err := h.State(); st != lease.Held {
			t.Fatalf("attached holder %s: %v", st, err)
		}
	})

	t.Run("released lease", func(t *testing.T) {
		if _, err := acquirer.Release(ctx, l.LeaseID, cred); err != nil {
			t.Fatal(err)
		}
		h, err := other.AttachAndHold(ctx, l.LeaseID, cred, HoldOptions{})
		if !errors.Is(err, lease.ErrLeaseLost) {
			if h != nil {
				h.Orphan()
			}
			t.Fatalf("attach to a released lease: %v, want %v", err, lease.ErrLeaseLost)
		}
	})
}
