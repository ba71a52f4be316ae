//go:build integration

package gitproxy

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// TestForgedLooseObjectCannotChangeTheVerdict: a services/billing lease
// pushes a commit that changes libs/tax too, after forging, in the
// repository the fence resolves base trees from (its ObjectDirs), the
// upstream tip's root tree so that the diff shows services alone. The
// fence refuses it (outside-lease) and nothing lands.
func TestForgedLooseObjectCannotChangeTheVerdict(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	checkout := e.clone(e.gs.srv.URL) // the agent's repository: the fence's ObjectDirs
	px := e.proxy(l, func(c *Config) { c.ObjectDirs = []string{filepath.Join(checkout, ".git")} })
	work := e.clone(px.URL) // the agent pushes from another clone, free of the forgery
	before := e.upstreamRef("refs/heads/main")
	c := e.commit(work, "both", "services/billing/invoice.go", "billing\n", "libs/tax/rates.go", "tax\n")
	mustGit(t, checkout, "fetch", "--quiet", work, "main:refs/heads/agent")
	forgeRootTree(t, checkout, before, c, "services")

	out := mustRefuse(t, work, "libs/tax/rates.go", "origin", "main")
	if !strings.Contains(out, ReasonOutsideLease) && !strings.Contains(out, "outside lease") {
		t.Errorf("refusal does not say the path is outside the lease:\n%s", out)
	}
	if got := e.upstreamRef("refs/heads/main"); got != before {
		t.Fatalf("the push landed: main is %s", got)
	}
}

// TestHookChecksTouchedPathsAgainstTheClaim: a push the proxy misjudged
// (here: sent straight to the server with a genuinely signed fence for a
// services/billing claim) that changes libs/tax is refused by the
// pre-receive hook, which computes the touched paths from the server's
// own objects, and the refusal is logged.
func TestHookChecksTouchedPathsAgainstTheClaim(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.gs.srv.URL)
	e.commit(dir, "both", "services/billing/invoice.go", "billing\n", "libs/tax/rates.go", "tax\n")
	before := e.upstreamRef("refs/heads/main")
	opts := signed(t, e.hookKey, testRepo, l.Record, e.updateOf(dir))
	out := mustRefuse(t, dir, "libs/tax/rates.go", append(pushOpts(opts), e.gs.url("payments.git"), "HEAD:main")...)
	if !strings.Contains(out, "["+HookOutsideClaim+"]") {
		t.Errorf("refusal lacks the reason %s:\n%s", HookOutsideClaim, out)
	}
	if got := e.upstreamRef("refs/heads/main"); got != before {
		t.Fatalf("the push landed: main is %s", got)
	}
	if got := e.hookRefusals(); len(got) != 1 || got[0] != HookOutsideClaim {
		t.Errorf("refusal log = %v, want [%s]", got, HookOutsideClaim)
	}
	if e.fenceOf("libs/tax") != 0 || e.fenceOf("libs/tax/rates.go") != 0 {
		t.Errorf("a refused push recorded fences:\n%s", e.fenceTable())
	}
	// Inside the claim, the same fence lands.
	mustGit(t, dir, "reset", "--quiet", "--hard", before)
	head := e.commit(dir, "billing", "services/billing/invoice.go", "billing\n")
	opts = signed(t, e.hookKey, testRepo, l.Record, e.updateOf(dir))
	mustPush(t, dir, append(pushOpts(opts), e.gs.url("payments.git"), "HEAD:main")...)
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("a push inside the claim did not land")
	}
}
