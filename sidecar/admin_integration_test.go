//go:build integration

package sidecar

import (
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestAdminMetricsCountRenewals: the renew histogram and the held gauge
// follow a real holder renewing on a real bus.
func TestAdminMetricsCountRenewals(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	m := NewMetrics()
	a := startAdmin(t, AdminConfig{Metrics: m})
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "a"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(6 * time.Second)},
		// A renewal waits up to its interval: a second holds on a loaded
		// machine (100 ms did not, with other builds on both cores).
		leasebus.HoldOptions{Interval: time.Second, OnRenew: m.ObserveRenew})
	m.TrackLease(l.Holder)
	a.SetLease(l.Holder, Fences{})
	testutil.CheckFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		_, body := testutil.HTTPGet(t, a.URL()+PathMetrics, "")
		n := metricValue(body, "fenceline_lease_renew_seconds_count")
		if n < 3 {
			return fmt.Errorf("%v renewals observed", n)
		}
		if metricValue(body, "fenceline_lease_renew_failures_total") != 0 || metricValue(body, "fenceline_leases_held") != 1 {
			return fmt.Errorf("metrics:\n%s", grepMetrics(body, "fenceline_lease"))
		}
		return nil
	})
}
