package demo

import (
	"testing"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

func TestCheckFences(t *testing.T) {
	g := func(fence uint64, paths ...string) grant {
		c, err := scope.New(paths, false, nil)
		if err != nil {
			t.Fatal(err)
		}
		return grant{agent: "x", lease: &lease.Lease{LeaseID: "lease_" + string(rune('a'+fence)), Scope: c, Fence: fence}}
	}
	for _, tc := range []struct {
		name   string
		grants []grant
		ok     bool
	}{
		{"rising", []grant{g(1, "a"), g(2, "a/b"), g(3, "a")}, true},
		{"disjoint may interleave", []grant{g(2, "a"), g(1, "b"), g(3, "a")}, true},
		{"overlap falls", []grant{g(2, "a"), g(1, "a/b")}, false},
		{"reused", []grant{g(1, "a"), g(1, "b")}, false},
		{"zero", []grant{g(0, "a")}, false},
	} {
		if err := checkFences(tc.grants); (err == nil) != tc.ok {
			t.Errorf("%s: checkFences = %v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}
