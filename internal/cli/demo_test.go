package cli

import (
	"testing"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
)

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
