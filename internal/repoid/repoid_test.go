package repoid

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// spellings of github.com/acme/payments (issue 19: each got its own lease
// space).
var spellings = []string{
	"github.com/acme/payments",
	"github.com/acme/payments.git",
	"GitHub.com/acme/payments/",
	"https://github.com/acme/payments",
	"https://github.com/acme/payments.git",
	"https://bot:s3cret@github.com/acme/payments.git",
	"https://github.com:443/acme/payments/",
	"http://github.com/acme/payments",
	"git@github.com:acme/payments.git",
	"github.com:acme/payments",
	"ssh://git@github.com/acme/payments.git",
	"ssh://git@github.com:22/acme/payments",
	"git://github.com/acme/payments.git",
}

func TestNormalizeSpellings(t *testing.T) {
	const want = "github.com/acme/payments"
	for _, s := range spellings {
		got := Normalize(s)
		if got != want {
			t.Errorf("Normalize(%q) = %q, want %q", s, got, want)
		}
		if again := Normalize(got); again != got {
			t.Errorf("Normalize is not idempotent on %q: %q", got, again)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{"http://git.internal:8080/acme/payments.git", "git.internal:8080/acme/payments"},
		{"ssh://git@github.com:2222/acme/payments", "github.com:2222/acme/payments"},
		{"file:///srv/git/payments.git", "/srv/git/payments"},
		{"/srv/git/payments.git/", "/srv/git/payments"},
		{"/srv/git/../git/payments", "/srv/git/payments"},
		{"gitlab.example.com/group/sub/repo.git", "gitlab.example.com/group/sub/repo"},
		{"git.internal:8080/acme/payments", "git.internal:8080/acme/payments"},
		{"127.0.0.1:35837/payments.git", "127.0.0.1:35837/payments"},
		{"git@git.internal:8080/payments.git", "git.internal/8080/payments"}, // scp-like: the path is 8080/payments
	} {
		if got := Normalize(tc.in); got != tc.want {
			t.Errorf("Normalize(%q) = %q, want %q", tc.in, got, tc.want)
		}
		if got := Normalize(tc.want); got != tc.want {
			t.Errorf("Normalize is not idempotent on %q: %q", tc.want, got)
		}
	}
}

func TestResolveCheckout(t *testing.T) {
	ctx := context.Background()
	git := func(dir string, args ...string) {
		t.Helper()
		cmd := exec.Command("git", args...)
		cmd.Dir = dir
		cmd.Env = append(os.Environ(), "GIT_CONFIG_NOSYSTEM=1", "HOME="+dir)
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	root := t.TempDir()
	co := filepath.Join(root, "co")
	git(root, "init", "--quiet", co)
	if err := os.MkdirAll(filepath.Join(co, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	// No origin: the checkout's real top directory.
	real, _ := filepath.EvalSymlinks(co)
	for _, p := range []string{co, filepath.Join(co, "sub"), co + "/"} {
		if got, err := Resolve(ctx, p); err != nil || got != real {
			t.Fatalf("Resolve(%q) without origin = %q, %v; want %q", p, got, err, real)
		}
	}
	// With one: its identity, however the origin is spelled.
	for _, origin := range []string{"git@github.com:acme/payments.git", "https://tok@github.com/acme/payments"} {
		git(co, "config", "remote.origin.url", origin)
		for _, p := range []string{co, filepath.Join(co, "sub")} {
			if got, err := Resolve(ctx, p); err != nil || got != "github.com/acme/payments" {
				t.Fatalf("Resolve(%q) with origin %s = %q, %v", p, origin, got, err)
			}
		}
	}
	// A plain directory is its path; a name that is no directory, an identity.
	plain := t.TempDir()
	realPlain, _ := filepath.EvalSymlinks(plain)
	if got, _ := Resolve(ctx, plain); got != realPlain {
		t.Fatalf("Resolve(plain dir) = %q, want %q", got, realPlain)
	}
	if got, _ := Resolve(ctx, "github.com/acme/payments.git"); got != "github.com/acme/payments" {
		t.Fatalf("Resolve(identity) = %q", got)
	}
}

// TestFromRemote: a checkout's origin, as git config spells it, to its
// identity; a relative one is taken from the checkout.
func TestFromRemote(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"https://github.com/acme/payments", "github.com/acme/payments"},
		{"https://github.com/acme/payments.git", "github.com/acme/payments"},
		{"https://bot:s3cret@GitHub.com/acme/payments.git/", "github.com/acme/payments"},
		{"https://github.com:443/acme/payments", "github.com/acme/payments"},
		{"http://git.internal:8080/acme/payments.git", "git.internal:8080/acme/payments"},
		{"git@github.com:acme/payments.git", "github.com/acme/payments"},
		{"github.com:acme/payments", "github.com/acme/payments"},
		{"ssh://git@github.com:22/acme/payments.git", "github.com/acme/payments"},
		{"ssh://git@github.com:2222/acme/payments", "github.com:2222/acme/payments"},
		{"file:///srv/git/payments.git", "/srv/git/payments"},
		{"/srv/git/payments.git/", "/srv/git/payments"},
		{"../payments.git", "/home/dev/payments"},
	} {
		if got := FromRemote(tc.in, "/home/dev/checkout"); got != tc.want {
			t.Errorf("FromRemote(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}
