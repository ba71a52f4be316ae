package cli

import (
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// TestRepoSpellingsConflict is issue 19's second finding: lease acquire,
// run and sidecar took --repo as typed, so each spelling of one repository
// got a lease space of its own. Every spelling now names
// github.com/acme/payments, and a lease under one conflicts with a claim
// under any other, through each command.
func TestRepoSpellingsConflict(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "https://bot:s3cret@github.com/acme/payments.git")
	spellings := []string{
		"github.com/acme/payments",
		"https://github.com/acme/payments.git",
		"https://bot:s3cret@GitHub.com/acme/payments",
		"git@github.com:acme/payments.git",
		"ssh://git@github.com:22/acme/payments",
		co, // a local checkout: its origin's identity
	}
	const want = "github.com/acme/payments"
	for _, held := range spellings {
		r := fl(t, "--nats", url, "lease", "acquire", "--repo", held, "--scope", "in", "--agent", "holder", "--json").want(t, ExitOK)
		var a acquired
		if err := json.Unmarshal([]byte(r.stdout), &a); err != nil {
			t.Fatal(err)
		}
		if a.Repo != want {
			t.Fatalf("lease acquire --repo %s: repo %q, want %q", held, a.Repo, want)
		}
		for _, other := range spellings {
			r := fl(t, "--nats", url, "lease", "acquire", "--repo", other, "--scope", "in/sub", "--agent", "other").want(t, ExitConflict)
			mustContain(t, "acquire --repo "+other+" stderr", r.stderr, a.LeaseID, "in "+want+":")
		}
		if ls := listJSON(t, url, "--repo", held); len(ls) != 1 || ls[0].LeaseID != a.LeaseID {
			t.Fatalf("lease list --repo %s: %+v, want %s", held, ls, a.LeaseID)
		}
		fl(t, "--nats", url, "lease", "release", a.LeaseID).want(t, ExitOK)
	}

	// run on the checkout and sidecar under every spelling, against a
	// lease taken under another.
	held := acquireJSON(t, url, "--scope", "in", "--agent", "holder")
	defer fl(t, "--nats", url, "lease", "release", held.LeaseID)
	r := runFL(t, url, "--checkout", co, "--scope", "in/sub", "--", "true").want(t, ExitConflict)
	mustContain(t, "run stderr", r.stderr, held.LeaseID, "in "+want+":")
	for _, s := range spellings {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		var out, errOut syncBuffer
		code := run(ctx, []string{"--nats", url, "sidecar", "--repo", s, "--scope", "in/sub", "--workspace", "exclusive",
			"--git-upstream", "http://127.0.0.1:9/payments.git", "--state-dir", t.TempDir()}, &out, &errOut, url, cfgOf(t))
		cancel()
		if code != ExitConflict || !strings.Contains(errOut.String(), held.LeaseID) || !strings.Contains(errOut.String(), "in "+want+":") {
			t.Fatalf("sidecar --repo %s: exit %d, want %d naming %s in %s:\n%s\n%s", s, code, ExitConflict, held.LeaseID, want, out.String(), errOut.String())
		}
	}
}
