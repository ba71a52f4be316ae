//go:build integration

package gitproxy

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestBranchCreateAndTags(t *testing.T) {
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
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
	other := e.lease([]string{"libs/tax"}, lease.WorkspaceShared)
	l := e.lease(nil, lease.WorkspaceExclusive) // claims nothing repo-wide
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
	if err := other.Close(ctxT(t)); err != nil {
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

func TestDeleteAndForcePushPolicy(t *testing.T) {
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	mustPush(t, dir, "origin", "main:refs/heads/topic")

	mustRefuse(t, dir, "deleting refs/heads/topic is not allowed for path lease", "origin", "--delete", "topic")
	if e.upstreamRef("refs/heads/topic") == "" {
		t.Fatal("refused delete removed the branch")
	}
	e.commit(dir, "one", "services/billing/a.go", "a\n")
	mustPush(t, dir, "origin", "main")
	mustGit(t, dir, "commit", "--quiet", "--amend", "-m", "rewritten")
	mustRefuse(t, dir, "non-fast-forward update of refs/heads/main is not allowed for path lease", "origin", "+main")

	// The policy can allow both for path leases.
	dir2 := e.clone(e.proxy(l, func(c *Config) { c.Policy = Policy{AllowForcePush: true, AllowRefDelete: true} }).URL)
	mustPush(t, dir2, "origin", "--delete", "topic")
	if e.upstreamRef("refs/heads/topic") != "" {
		t.Fatal("allowed delete did not land")
	}
	mustGit(t, dir2, "commit", "--quiet", "--amend", "-m", "rewritten")
	mustPush(t, dir2, "origin", "+main")
}

func TestPushOptionsAndFenceReachUpstream(t *testing.T) {
	e := newEnv(t)
	// A hook upstream writes the push options it sees.
	seen := filepath.Join(t.TempDir(), "options")
	hook := fmt.Sprintf("#!/bin/sh\ni=0\nwhile [ $i -lt ${GIT_PUSH_OPTION_COUNT:-0} ]; do eval echo \\$GIT_PUSH_OPTION_$i >> %s; i=$((i+1)); done\ncat >/dev/null\n", seen)
	writeHook(t, e.bare, "pre-receive", hook)
	var err error
	if e.hookKey, err = GenerateHookKey(); err != nil {
		t.Fatal(err)
	}
	// Registered with the lease service, so the lease comes with a git
	// grant key for the proxy to sign with.
	if err := leasebus.WriteFenceSecret(e.bus.FenceSecrets, testRepo, lease.StorageGit, e.hookKey); err != nil {
		t.Fatal(err)
	}
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	mustPush(t, dir, "-o", "ci.skip", "-o", "reviewer=alice", "origin", "main")
	data, err := os.ReadFile(seen)
	if err != nil {
		t.Fatal(err)
	}
	got := string(data)
	for _, want := range []string{"ci.skip\n", "reviewer=alice\n", OptionLease + "=" + l.Record.LeaseID + "\n",
		fmt.Sprintf("%s=%d\n", OptionFence, l.Record.Fence), OptionRepo + "=" + testRepo + "\n", OptionClaim + "=", OptionMAC + "=" + MACVersion + ":"} {
		if !strings.Contains(got, want) {
			t.Errorf("upstream push options lack %q:\n%s", want, got)
		}
	}
	// Without client options, the fence still travels as options.
	os.Remove(seen)
	e.commit(dir, "y", "services/billing/y.go", "y\n")
	mustPush(t, dir, "origin", "main")
	data, _ = os.ReadFile(seen)
	if !strings.Contains(string(data), OptionLease+"="+l.Record.LeaseID) {
		t.Fatalf("fence options missing without client options:\n%s", data)
	}
}

// TestFastForwardToAnUpstreamCommit: moving a ref to a commit the upstream
// already has sends no new commits. The proxy, which has none of the
// upstream's objects yet, must fetch its mirror to read the new tip and the
// old value, and then let the fast-forward through.
func TestFastForwardToAnUpstreamCommit(t *testing.T) {
	e := newEnv(t)
	seed := e.clone(e.gs.srv.URL)
	e.commit(seed, "topic", "services/billing/topic.go", "t\n")
	mustGit(t, seed, "push", "--quiet", "origin", "HEAD:refs/heads/topic")
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL) // a fresh proxy: empty mirror, no local objects
	mustPush(t, dir, "origin", "origin/topic:refs/heads/main")
	if e.upstreamRef("refs/heads/main") != e.upstreamRef("refs/heads/topic") {
		t.Fatal("fast-forward did not land")
	}
}
