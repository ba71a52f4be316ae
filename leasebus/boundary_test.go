package leasebus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// A runner's credentials once let it write the audit stream itself: a
// 7 MiB event, an event in another writer's name (a forged writer
// header), for any repo, as fast as the store took them — enough to fill
// the store or evict every grant and revoke record. Now the bus refuses a
// holder's own writes to the audit stream, and what it sends through the
// service is clipped, named after its sender, and rate-limited per
// identity.
// flood records n events (ev(i)) one by one and counts those written and
// those the service refused over a rate limit, and how long it took.
func flood(ctx context.Context, t *testing.T, aud *Auditor, n int, ev func(int) lease.AuditEvent) (written, limited int, took time.Duration) {
	t.Helper()
	start := time.Now()
	for i := range n {
		err := aud.Record(ctx, ev(i))
		switch {
		case err == nil:
			written++
		case errors.Is(err, lease.ErrUnavailable) && strings.Contains(err.Error(), "faster than"):
			limited++
		default:
			t.Fatal(err)
		}
	}
	return written, limited, time.Since(start)
}

// One identity writing boundary events as fast as it can gets its burst and
// its rate, the rest is counted in one event a second; another identity's
// events still land.
func TestBoundaryEventsRateLimitedPerIdentity(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	flooder, err := NewAuditor(connectAs(t, url, RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	written, limited, took := flood(ctx, t, flooder, 3*boundaryBurst, func(i int) lease.AuditEvent {
		return lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile, Repo: repo, Message: fmt.Sprintf("flood %d", i)}
	})
	if most := boundaryBurst + int(took.Seconds()*boundaryRate) + 1; written > most || limited == 0 {
		t.Fatalf("%d events written one by one in %s (at most %d), %d refused over the rate", written, took.Round(time.Millisecond), most, limited)
	}
	other, err := NewAuditor(connectAs(t, url, RoleOperator))
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Record(ctx, lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryGit, Repo: repo, Message: "another runner's refusal"}); err != nil {
		t.Fatalf("another identity's event, during the flood: %v", err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Reason == ReasonRateLimited && strings.Contains(ev.Message, "boundary events more than") {
				return nil
			}
		}
		return errors.New("no event counts the dropped ones yet")
	})
}
