package scope

import (
	"strconv"
	"strings"
	"testing"
)

func TestNormalizePath(t *testing.T) {
	good := []struct{ in, want string }{
		{"services/billing", "services/billing"},
		{"services/billing/", "services/billing"},
		{"./services//billing/.", "services/billing"},
		{"services/x/../billing", "services/billing"},
		{"a/b/../../c", "c"},
		{"Src/Main.go", "Src/Main.go"},
		{"a b/c", "a b/c"},
		{".gitignore", ".gitignore"},
		{".github/workflows", ".github/workflows"},
		{"docs/.git", "docs/.git"},
		{"..foo", "..foo"},
		{"ünï/cødé", "ünï/cødé"},
	}
	for _, tc := range good {
		t.Run("ok "+tc.in, func(t *testing.T) {
			got, err := NormalizePath(tc.in)
			if err != nil {
				t.Fatalf("NormalizePath(%q) error: %v", tc.in, err)
			}
			if got != tc.want {
				t.Fatalf("NormalizePath(%q) = %q, want %q", tc.in, got, tc.want)
			}
		})
	}

	bad := []struct{ in, mention string }{
		{"", "--whole-repo"},
		{".", "--whole-repo"},
		{"./", "--whole-repo"},
		{"a/..", "--whole-repo"},
		{"/etc/passwd", "relative"},
		{"//a", "relative"},
		{"..", "escapes"},
		{"../x", "escapes"},
		{"a/../../x", "escapes"},
		{"./../x", "escapes"},
		{"a\x00b", "NUL"},
		{`services\billing`, "use / separators"},
		{"bad\xffutf8", "UTF-8"},
		{".git", "git directory"},
		{".git/hooks", "git directory"},
		{"./.git/", "git directory"},
		{"a/../.git/config", "git directory"},
		{".GIT", "git directory"},
	}
	for _, tc := range bad {
		t.Run("bad "+strconv.Quote(tc.in), func(t *testing.T) {
			got, err := NormalizePath(tc.in)
			if err == nil {
				t.Fatalf("NormalizePath(%q) = %q, want error", tc.in, got)
			}
			msg := err.Error()
			if !strings.Contains(msg, strconv.Quote(tc.in)) {
				t.Errorf("error %q does not name the input %q", msg, tc.in)
			}
			if !strings.Contains(msg, tc.mention) {
				t.Errorf("error %q does not mention %q", msg, tc.mention)
			}
		})
	}
}

func TestPathsOverlap(t *testing.T) {
	cases := []struct {
		name string
		a, b string
		want bool
	}{
		{"exact", "services/billing", "services/billing", true},
		{"ancestor", "services", "services/billing/api", true},
		{"descendant", "services/billing/api", "services/billing", true},
		{"disjoint", "services/billing", "libs/tax", false},
		{"siblings", "services/billing", "services/shipping", false},
		{"name prefix", "services/bill", "services/billing", false},
		{"name prefix reversed", "services/billing", "services/bill", false},
		{"dash sorts before slash", "a", "a-b", false},
		{"file and dir", "a/b.go", "a/b", false},
		{"case differs", "Src", "src", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := PathsOverlap(tc.a, tc.b); got != tc.want {
				t.Errorf("PathsOverlap(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
			}
			if got := PathsOverlap(tc.b, tc.a); got != tc.want {
				t.Errorf("PathsOverlap(%q, %q) = %v, want %v", tc.b, tc.a, got, tc.want)
			}
		})
	}
}
