package cli

import (
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
)

func TestDemo(t *testing.T) {
	isolate(t)
	start := time.Now()
	// An unreachable default bus proves the demo needs none.
	r := flDefault(t, closedURL(t), "demo").want(t, ExitOK)
	t.Logf("demo took %s:\n%s", time.Since(start), r.stdout)
	mustContain(t, "demo", r.stdout,
		"== 1. Two agents race", "winner: agent-", "loser:  agent-", "conflict in "+demoRepo,
		"== 2. A disjoint scope", "agent-c got lease_",
		"== 3. A crashed holder", "reclaimed: lease_",
		"== 4. Fence tokens rise", "strictly increasing",
		"== 5. An operator revokes", "agent-c's holder saw it after",
		"== 6. The audit trail", "demo complete")
	if strings.Count(r.stdout, " grant ") < 5 {
		t.Errorf("audit trail should show at least 5 grants")
	}
	if r.stderr != "" {
		t.Errorf("stderr: %s", r.stderr)
	}
}

func TestCheckFences(t *testing.T) {
	g := func(fence uint64, paths ...string) demoGrant {
		c, err := scope.New(paths, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return demoGrant{agent: "x", lease: &leasebus.Lease{LeaseID: "lease_" + string(rune('a'+fence)), Scope: c, Fence: fence}}
	}
	for _, tc := range []struct {
		name   string
		grants []demoGrant
		ok     bool
	}{
		{"rising", []demoGrant{g(1, "a"), g(2, "a/b"), g(3, "a")}, true},
		{"disjoint may interleave", []demoGrant{g(2, "a"), g(1, "b"), g(3, "a")}, true},
		{"overlap falls", []demoGrant{g(2, "a"), g(1, "a/b")}, false},
		{"reused", []demoGrant{g(1, "a"), g(1, "b")}, false},
		{"zero", []demoGrant{g(0, "a")}, false},
	} {
		if err := checkFences(tc.grants); (err == nil) != tc.ok {
			t.Errorf("%s: checkFences = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}
