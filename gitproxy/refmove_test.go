//go:build integration

package gitproxy

import (
	"slices"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// uploadOther puts a branch "other" on the upstream, straight to the git
// server (as another agent's earlier, legitimate push would), whose commit
// touches libs/tax on top of main. It returns the commit.
func (e *env) uploadOther() string {
	e.t.Helper()
	dir := e.t.TempDir() + "/other"
	mustGit(e.t, "", "clone", "--quiet", e.bare, dir)
	x := e.commit(dir, "tax change", "libs/tax/rates.go", "package tax // new rates\n")
	mustGit(e.t, dir, "push", "--quiet", "origin", "HEAD:refs/heads/other")
	return x
}

// TestRefMovedOntoUploadedCommit is issue 19's first finding: an update
// whose pack is empty, because the commit it moves to is already on the
// upstream, was not judged at all.
func TestRefMovedOntoUploadedCommit(t *testing.T) {
	t.Run("outside the claim", func(t *testing.T) {
		e := newEnv(t)
		x := e.uploadOther()
		l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
		dir := e.clone(e.proxy(l).URL)
		mustGit(t, dir, "fetch", "--quiet", "origin")
		main := e.upstreamRef("refs/heads/main")

		out := mustRefuse(t, dir, "libs/tax/rates.go is outside lease "+l.Record.LeaseID, "origin", "origin/other:refs/heads/main")
		if e.upstreamRef("refs/heads/main") != main {
			t.Fatalf("main moved onto %s:\n%s", x, out)
		}
		mustRefuse(t, dir, "libs/tax/rates.go is outside lease "+l.Record.LeaseID, "origin", "origin/other:refs/heads/copy")
		mustRefuse(t, dir, "libs/tax/rates.go is outside lease "+l.Record.LeaseID, "origin", x+":refs/tags/v-tax")
		if e.upstreamRef("refs/heads/copy") != "" || e.upstreamRef("refs/tags/v-tax") != "" {
			t.Fatal("a refused new ref landed")
		}
		var reasons []string
		for _, ev := range e.audit() {
			if strings.Contains(ev.Message, "libs/tax/rates.go") {
				reasons = append(reasons, ev.Reason)
			}
		}
		if len(reasons) != 3 || slices.ContainsFunc(reasons, func(r string) bool { return r != ReasonOutsideLease }) {
			t.Fatalf("audit reasons naming the path = %v, want 3 × %s", reasons, ReasonOutsideLease)
		}
	})
	t.Run("inside another lease", func(t *testing.T) {
		e := newEnv(t)
		x := e.uploadOther()
		other := e.lease([]string{"libs/tax"}, lease.WorkspaceShared)
		l := e.lease(nil, lease.WorkspaceExclusive) // claims nothing: yields to declared claims
		dir := e.clone(e.proxy(l).URL)
		mustGit(t, dir, "fetch", "--quiet", "origin")

		want := "libs/tax/rates.go is inside lease " + other.Record.LeaseID
		mustRefuse(t, dir, want, "origin", "origin/other:refs/heads/main")
		mustRefuse(t, dir, want, "origin", "origin/other:refs/heads/copy")
		if e.upstreamRef("refs/heads/main") == x || e.upstreamRef("refs/heads/copy") != "" {
			t.Fatal("a refused update landed")
		}
		// With the other lease gone, the same moves land.
		if err := other.Close(ctxT(t)); err != nil {
			t.Fatal(err)
		}
		mustPush(t, dir, "origin", "origin/other:refs/heads/main", "origin/other:refs/heads/copy")
		if e.upstreamRef("refs/heads/main") != x || e.upstreamRef("refs/heads/copy") != x {
			t.Fatal("allowed moves did not land")
		}
	})
	t.Run("inside the claim", func(t *testing.T) {
		e := newEnv(t)
		x := e.uploadOther()
		l := e.lease([]string{"libs/tax"}, lease.WorkspaceExclusive)
		dir := e.clone(e.proxy(l).URL)
		mustGit(t, dir, "fetch", "--quiet", "origin")
		mustPush(t, dir, "origin", "origin/other:refs/heads/main", "origin/other:refs/heads/copy")
		// A new ref where the default branch is adds nothing.
		mustPush(t, dir, "origin", "origin/other:refs/tags/v1")
		if e.upstreamRef("refs/heads/main") != x || e.upstreamRef("refs/tags/v1") != x {
			t.Fatal("moves inside the claim did not land")
		}
	})
}

// TestHookJudgesMovedRefs: the pre-receive hook applies the same rule to a
// signed push that reaches the server without the proxy's judgement (a
// proxy misled about its objects, say): the claim the fence was signed
// with bounds what the update moves, not only what its new commits touch.
func TestHookJudgesMovedRefs(t *testing.T) {
	e := newEnv(t)
	x := e.uploadOther()
	e.installHook(false)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.gs.srv.URL)
	mustGit(t, dir, "fetch", "--quiet", "origin")
	main := e.upstreamRef("refs/heads/main")

	for _, u := range []RefUpdate{
		{Old: main, New: x, Ref: "refs/heads/main"},
		{Old: zeroOID, New: x, Ref: "refs/heads/copy"},
	} {
		opts := signed(t, e.hookKey, testRepo, l.Record, u)
		args := append(pushOpts(opts), "origin", u.New+":"+u.Ref)
		out, ok := pushOut(t, dir, args...)
		if ok || !strings.Contains(out, "libs/tax/rates.go is outside its claim") {
			t.Fatalf("signed push of %s onto %s: accepted=%v, want refused naming libs/tax/rates.go:\n%s", u.Ref, x, ok, out)
		}
	}
	if e.upstreamRef("refs/heads/main") != main || e.upstreamRef("refs/heads/copy") != "" {
		t.Fatal("the hook let a moved ref land")
	}
	if got := e.hookRefusals(); len(got) != 2 || got[0] != HookOutsideClaim || got[1] != HookOutsideClaim {
		t.Fatalf("hook refusals = %v, want 2 × %s", got, HookOutsideClaim)
	}
}

// TestRewriteOverUnseenHistory: a force push whose old tip the agent never
// fetched discards whatever that history did. The proxy judges the two
// tips from the upstream's mirror; with no mirror and an agent repository
// that lacks the old tip, it refuses rather than guess.
func TestRewriteOverUnseenHistory(t *testing.T) {
	for _, mirror := range []bool{true, false} {
		t.Run(map[bool]string{true: "mirror", false: "no mirror"}[mirror], func(t *testing.T) {
			e := newEnv(t)
			other := e.lease([]string{"libs/tax"}, lease.WorkspaceShared)
			l := e.lease(nil, lease.WorkspaceExclusive) // may force-push, yields to claims
			dir := e.clone(e.gs.srv.URL)
			srv := e.proxy(l, func(c *Config) {
				c.ObjectDirs = []string{dir + "/.git"}
				if !mirror {
					c.MirrorDir = ""
				}
			})
			mustGit(t, dir, "remote", "set-url", "origin", srv.URL+"/payments.git")
			// The other lease's change lands on main; the agent never fetches it.
			tax := t.TempDir() + "/tax"
			mustGit(t, "", "clone", "--quiet", e.bare, tax)
			landed := e.commit(tax, "tax", "libs/tax/rates.go", "package tax // theirs\n")
			mustGit(t, tax, "push", "--quiet", "origin", "main")

			e.commit(dir, "readme", "README.md", "mine\n")
			want := "libs/tax/rates.go is inside lease " + other.Record.LeaseID
			if !mirror {
				want = "is in neither the agent's repository nor the upstream's mirror"
			}
			mustRefuse(t, dir, want, "origin", "+main")
			if e.upstreamRef("refs/heads/main") != landed {
				t.Fatal("the force push discarded the other lease's change")
			}
		})
	}
}
