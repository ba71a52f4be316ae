package gitproxy

import "testing"

func TestFenceIndex(t *testing.T) {
	t.Parallel()
	x := newFenceIndex(map[string]fenceEntry{
		"services/billing":     {Fence: 7, Lease: "b"},
		"libs/tax/rates.go":    {Fence: 9, Lease: "t"},
		"services/bill":        {Fence: 20, Lease: "x"},
		"docs/readme.md":       {Fence: 2, Lease: "d"},
		"services/billing/api": {Fence: 3, Lease: "a"},
	})
	for _, tc := range []struct {
		path  string
		fence uint64
		want  string // "" = none newer, "*" = any
	}{
		{"services/billing/invoice.go", 5, "services/billing"}, // ancestor
		{"services/billing/invoice.go", 7, ""},                 // not newer
		{"services", 8, "services/bill"},                       // descendant
		{"services/billing", 8, ""},                            // services/bill is not an ancestor
		{"libs", 8, "libs/tax/rates.go"},
		{"libs/tax/rates.go", 9, ""},
		{"", 8, "*"}, // the whole repo overlaps everything
		{"docs", 1, "docs/readme.md"},
		{"other", 0, ""},
	} {
		got, _, ok := x.newerOverlapping(tc.path, tc.fence)
		if !ok {
			got = ""
		}
		if got != tc.want && !(tc.want == "*" && ok) {
			t.Errorf("newerOverlapping(%q, %d) = %q, want %q", tc.path, tc.fence, got, tc.want)
		}
	}
	whole := newFenceIndex(map[string]fenceEntry{"": {Fence: 10, Lease: "w"}})
	if _, _, ok := whole.newerOverlapping("a/b", 9); !ok {
		t.Error("a whole-repo fence must cover every path")
	}
}
