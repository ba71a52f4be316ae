//go:build integration

package gitproxy

import (
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/leasebus"
)

// TestForgedLooseObjectCannotChangeTheVerdict: a services/billing lease
// pushes a commit that changes libs/tax too, after forging, in the
// repository the fence resolves base trees from (its ObjectDirs), the
// upstream tip's root tree so that the diff shows services alone. The
// fence refuses it (outside-lease) and nothing lands.
func TestForgedLooseObjectCannotChangeTheVerdict(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	l := e.lease([]string{"services/billing"}, leasebus.WorkspaceExclusive)
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
