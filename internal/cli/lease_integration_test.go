//go:build integration

package cli

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

func TestSweepStale(t *testing.T) {
	isolate(t)
	url := startBus(t)
	r := fl(t, "--nats", url, "lease", "sweep-stale").want(t, ExitOK)
	mustContain(t, "sweep", r.stdout, "nothing to reclaim")
	r = fl(t, "--nats", url, "lease", "sweep-stale", "--json").want(t, ExitOK)
	if r.stdout != "[]\n" {
		t.Errorf("sweep-stale --json with nothing stale = %q, want []", r.stdout)
	}
	a := acquireJSON(t, url, "--scope", "docs", "--ttl", "1s", "--agent", "agent-d")
	// Nobody renews it: the service (or a sweep) reclaims it after its TTL.
	reclaimedBySweep := false
	checkFor(t, 10*time.Second, 100*time.Millisecond, func() error {
		r := fl(t, "--nats", url, "lease", "sweep-stale", "--repo", testRepo).want(t, ExitOK)
		if strings.Contains(r.stdout, "reclaimed: "+a.LeaseID+" owner=agent-d/") {
			reclaimedBySweep = true
		}
		for _, l := range listJSON(t, url, "--all") {
			if l.LeaseID == a.LeaseID && l.Status == lease.StatusReclaimed {
				return nil
			}
		}
		return errors.New("not reclaimed yet")
	})
	t.Logf("reclaimed by sweep-stale: %v (else by the service's own sweeper)", reclaimedBySweep)
	fl(t, "lease", "renew", a.LeaseID).want(t, ExitLost)
}
