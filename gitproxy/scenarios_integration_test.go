//go:build integration

package gitproxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/leasebus"
)

func TestBranchCreateAndTags(t *testing.T) {
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, leasebus.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)

	// A new branch at a commit the upstream has: nothing new, nothing touched.
	mustPush(t, dir, "origin", "main:refs/heads/copy")
	// A new branch with new commits is judged on them, relative to what
	// the upstream already has.
	mustGit(t, dir, "checkout", "--quiet", "-b", "feature")
	head := e.commit(dir, "feature", "services/billing/feature.go", "package billing\n")
	mustPush(t, dir, "origin", "feature")
	if got := e.upstreamRef("refs/heads/feature"); got != head {
		t.Fatalf("feature = %q, want %s", got, head)
	}
	e.commit(dir, "escape", "README.md", "changed\n")
	mustRefuse(t, dir, "README.md is outside lease", "origin", "feature:refs/heads/feature2")
	mustGit(t, dir, "reset", "--quiet", "--hard", "HEAD~1")

	// Tags: lightweight and annotated, on in-scope history.
	mustGit(t, dir, "tag", "v1")
	mustGit(t, dir, "tag", "-a", "-m", "release", "v1-annotated")
	mustPush(t, dir, "origin", "v1", "v1-annotated")
	if e.upstreamRef("refs/tags/v1") != head || e.upstreamRef("refs/tags/v1-annotated^{commit}") != head {
		t.Fatal("tags did not land")
	}
	// A tag on an out-of-scope commit is refused like a branch.
	e.commit(dir, "escape", "libs/tax/rates.go", "changed\n")
	mustGit(t, dir, "tag", "-a", "-m", "bad", "v2")
	mustRefuse(t, dir, "libs/tax/rates.go is outside lease", "origin", "v2")
}

func TestExclusiveWithoutClaimYieldsToDeclaredClaims(t *testing.T) {
	e := newEnv(t)
	other := e.lease([]string{"libs/tax"}, leasebus.WorkspaceShared)
	l := e.lease(nil, leasebus.WorkspaceExclusive) // claims nothing repo-wide
	dir := e.clone(e.proxy(l).URL)

	e.commit(dir, "readme", "README.md", "mine\n")
	mustPush(t, dir, "origin", "main")
	e.commit(dir, "tax", "libs/tax/rates.go", "not mine\n")
	out := mustRefuse(t, dir, "libs/tax/rates.go is inside lease "+other.Record.LeaseID, "origin", "main")
	if !strings.Contains(out, other.Record.Owner.AgentID) {
		t.Fatalf("refusal does not name the other lease's owner:\n%s", out)
	}
	// A force push that only discards someone else's leased change is
	// judged on its net diff, too.
	mustGit(t, dir, "reset", "--quiet", "--hard", "HEAD~1")
	e.commit(dir, "more", "README.md", "mine again\n")
	mustPush(t, dir, "origin", "main")
	if err := other.Release(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	// With the claim gone, the same change may land.
	e.commit(dir, "tax", "libs/tax/rates.go", "now mine\n")
	mustPush(t, dir, "origin", "main")
}

// TestThinAndLargePushes resolves thin-pack bases and parents from the
// agent's own repository, and, without one, from the proxy's mirror of the
// upstream.
func TestThinAndLargePushes(t *testing.T) {
	for _, local := range []bool{true, false} {
		t.Run(fmt.Sprintf("local objects=%v", local), func(t *testing.T) { testThinAndLarge(t, local) })
	}
}
