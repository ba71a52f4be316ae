//go:build integration

package leasebus

import (
	"testing"

	"pgregory.net/rapid"
)

func TestStateMachineProperties(t *testing.T) {
	total := map[string]int{}
	rapid.Check(t, func(rt *rapid.T) {
		s := newPureSim(rt)
		for range rapid.IntRange(1, 60).Draw(rt, "batches") {
			s.batch()
		}
		for k, v := range s.stats {
			total[k] += v
		}
	})
	t.Logf("outcomes over all runs: %v", total)
	if testing.Short() {
		return
	}
	for _, k := range []string{"grant", "conflict", "renew", "release", "swept", "parked", "served", "wait-expired", "acquire-retry", "renew-retry", "forged", "failed-append", "snapshot", "takeover", "retake", "renew-again", "renewals-unlogged"} {
		if total[k] == 0 {
			t.Errorf("no run exercised %q", k)
		}
	}
}
