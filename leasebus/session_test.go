package leasebus

import (
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// requests is how many op requests the service answered with result.
func requests(m *ServiceMetrics, op, result string) int {
	return int(promtest.ToFloat64(m.requests.WithLabelValues(op, result)))
}

// TestOneKeepalivePerSession: a client holding many leases keeps them all
// alive with one keepalive per heartbeat, not a request per lease (a fleet
// of 10,000 holders on 1,000 connections sends 5,000 a second, not
// 50,000), and each holder still hears the service through it.
func TestOneKeepalivePerSession(t *testing.T) {
	t.Parallel()
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const holders = 20
	hs := make([]*Holder, holders)
	for i := range hs {
		h, err := b.c.AcquireAndHold(ctx, AcquireRequest{Repo: fmt.Sprintf("github.com/acme/keep-%d", i%4), Scope: claim(t, fmt.Sprintf("svc/%d", i)), Owner: owner(i), TTL: lease.Duration(time.Minute)}, NewCredential(), HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Orphan()
		hs[i] = h
	}
	gets := requests(m, "get", "ok") // each holder's one confirming get
	const beats = 10
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if n := requests(m, "keepalive", "ok"); n < beats {
			return fmt.Errorf("%d keepalives answered, waiting for %d", n, beats)
		}
		return nil
	})
	if more := requests(m, "get", "ok") - gets; more > 0 {
		t.Errorf("%d gets while %d holders beat: heartbeats went per lease", more, holders)
	}
	// Each beat asked after every lease: every holder heard recently.
	for _, h := range hs {
		if _, err := h.Fence(); err != nil {
			t.Errorf("holder of %s: %v", h.Lease().LeaseID, err)
		}
	}
}

// The killed runner: a real process that acquires and holds a lease, then
// is killed with SIGKILL. Its scope comes back within 15 s although its
// TTL is 5 minutes, at the service's default grace.

const (
	envHoldURL   = "FENCELINE_TEST_HOLD_URL"
	envHoldCreds = "FENCELINE_TEST_HOLD_CREDS"
	envHoldRepo  = "FENCELINE_TEST_HOLD_REPO"
)

// waitEnded waits until c's lease service says lease id is no longer
// active, and returns its record.
func waitEnded(t *testing.T, c *Client, id string, within time.Duration) *lease.Lease {
	t.Helper()
	var ended *lease.Lease
	checkFor(t, within, 50*time.Millisecond, func() error {
		l, err := c.Get(ctxT(t), id)
		if err != nil {
			return err
		}
		if l.Active() {
			return fmt.Errorf("%s still active", id)
		}
		ended = l
		return nil
	})
	return ended
}

// checkAudited waits until the repo's audit holds exactly one event of
// type typ with reason for the lease.
func checkAudited(t *testing.T, b *bus, repo, leaseID, typ, reason string) {
	t.Helper()
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctxT(t), b.nc, repo, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.LeaseID == leaseID && ev.Type == typ && ev.Reason == reason {
				n++
			}
		}
		if n != 1 {
			return fmt.Errorf("%d %s events (%s) for %s in the audit, want 1", n, typ, reason, leaseID)
		}
		return nil
	})
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }
