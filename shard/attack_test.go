package shard

import (
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestRestoreCheckoutNestedRepos: an exclusive attempt without a pool
// plants every trap in the git dir of a repository nested in the checkout
// (vendor/lib, registered as a gitlink, as the user had it) and makes a
// nested repository of its own (gen/, a .git file naming a git dir it
// hid under the checkout's .git/objects, which no snapshot walks). The
// user's git status in the checkout runs git in both. Restore puts the
// nested repository's config and hooks back and moves the attempt's .git
// file aside; the user's git status runs none of the traps.
func TestRestoreCheckoutNestedRepos(t *testing.T) {
	t.Parallel()
	co := newRepo(t, 2)
	gd := filepath.Join(co, ".git")
	lib := filepath.Join(co, "vendor", "lib")
	os.MkdirAll(lib, 0o755)
	mustGit(t, lib, "init", "-q")
	os.WriteFile(filepath.Join(lib, "x"), []byte("x\n"), 0o644)
	mustGit(t, lib, "add", "x")
	mustGit(t, lib, "commit", "-qm", "lib")
	if out, err := plainGit(t, co, "add", "vendor/lib"); err != nil {
		t.Fatal(out)
	}
	if out, err := plainGit(t, co, "commit", "-qm", "vendor lib"); err != nil {
		t.Fatal(out)
	}
	libCfg, _ := os.ReadFile(filepath.Join(lib, ".git", "config"))

	snap, err := SnapshotCheckout(t.Context(), co, []string{gd})
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	marker := filepath.Join(t.TempDir(), "ran")
	scripts := filepath.Join(t.TempDir(), "traps")
	if err := gittrap.Plant(filepath.Join(lib, ".git"), "", scripts, marker); err != nil {
		t.Fatal(err)
	}
	hidden := filepath.Join(gd, "objects", "ff", "gen")
	os.MkdirAll(filepath.Dir(hidden), 0o755)
	gen := filepath.Join(co, "gen")
	os.MkdirAll(gen, 0o755)
	mustGit(t, co, "init", "-q", "--separate-git-dir", hidden, gen)
	os.WriteFile(filepath.Join(gen, "y"), []byte("y\n"), 0o644)
	mustGit(t, gen, "add", "y")
	mustGit(t, gen, "commit", "-qm", "gen")
	if err := gittrap.Plant(hidden, "", scripts, marker); err != nil {
		t.Fatal(err)
	}
	if out, err := plainGit(t, co, "-c", "core.hooksPath=/dev/null", "-c", "core.fsmonitor=false", "add", "gen"); err != nil {
		t.Fatal(out)
	}

	undone, err := snap.Restore(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("undone: %v", undone)
	for _, want := range []string{"vendor/lib/.git/config (changed)", "vendor/lib/.git/hooks/post-checkout (added)", "gen/.git (added; moved to gen/.git.fenceline-undone-"} {
		if !strings.Contains(strings.Join(undone, "\n"), want) {
			t.Errorf("undone %v lacks %q", undone, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(lib, ".git", "config")); string(b) != string(libCfg) {
		t.Errorf("vendor/lib's config after restore:\n%s", b)
	}
	os.WriteFile(filepath.Join(lib, "x"), []byte("user edit\n"), 0o644)
	os.WriteFile(filepath.Join(gen, "y"), []byte("user edit\n"), 0o644)
	if out, err := plainGit(t, co, "status", "--porcelain"); err != nil || !strings.Contains(out, "vendor/lib") {
		t.Errorf("the user's git status: %q, %v", out, err)
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the user's git status ran the attempt's programs:\n%s", ran)
	}
}

// TestCleanIgnoresANestedGitDirInTheShardsGitDir: git upload-pack, which
// the fetch into the checkout runs on the shard's git dir (Path/.git),
// serves Path/.git/.git instead when that is a repository. An attempt
// that makes one there (here with a ref under the name its work would be
// kept under, pointing at a commit of its choosing) decides what the
// checkout takes for its kept work, or wedges every later cleaning of
// the shard. Cleaning removes it first: the checkout keeps the attempt's
// real commit.
func TestCleanIgnoresANestedGitDirInTheShardsGitDir(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	co, base, w := newShard(t, 3, "att_a")
	os.WriteFile(filepath.Join(w.Path, "d000", "f00000.txt"), []byte("changed\n"), 0o644)
	mustGit(t, w.Path, "commit", "-q", "-am", "work")
	work := mustGit(t, w.Path, "rev-parse", "HEAD")
	fake := filepath.Join(w.Path, ".git", ".git")
	mustGit(t, w.Path, "init", "-q", "--bare", fake)
	mustGit(t, w.Path, "--git-dir="+fake, "fetch", "-q", co, "HEAD:refs/fenceline/attempts/att_b")

	kept, err := w.Clean(ctx, base, "att_b")
	if err != nil {
		t.Fatalf("clean: %v (undone %v)", err, w.Undone)
	}
	if got := mustGit(t, co, "rev-parse", "refs/fenceline/attempts/att_b"); got != work {
		t.Errorf("kept %v: refs/fenceline/attempts/att_b is %s, want the attempt's commit %s", kept, got, work)
	}
	if !strings.Contains(strings.Join(w.Undone, " "), ".git") {
		t.Errorf("undone %v does not name .git", w.Undone)
	}
}

// forgeCommitGraph writes into gitDir's objects/info/commit-graph a
// commit-graph whose one commit is base but with the tree and parents of
// commit real (a commit of gitDir's): git believes a commit-graph over
// the commit objects (git log, status, merge-base read a commit's tree
// and parents from it).
func forgeCommitGraph(t *testing.T, dir, real, base string) {
	t.Helper()
	mustGitIn(t, dir, "", strings.NewReader(real+"\n"), "commit-graph", "write", "--stdin-commits")
	p := filepath.Join(dir, ".git", "objects", "info", "commit-graph")
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if b, err = gittrap.ForgeCommitGraph(b, real, base); err != nil {
		t.Fatal(err)
	}
	os.Chmod(p, 0o644)
	if err := os.WriteFile(p, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustGitIn(t *testing.T, dir, _ string, stdin io.Reader, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	cmd.Stdin = stdin
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// TestCleanDropsAForgedCommitGraph: an attempt in a shard writes a
// commit-graph (objects/info, which cleaning keeps for the alternates
// file) saying the base commit has another tree. git reads commits'
// trees and parents from it: after cleaning, the shard's HEAD (base)
// would show another tree than base's (git status not clean, so every
// later cleaning fails and the shard is lost to the pool; git log and
// diff in the next attempt lie about base). Cleaning drops it.
func TestCleanDropsAForgedCommitGraph(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	co, base, w := newShard(t, 3, "att_a")
	os.WriteFile(filepath.Join(w.Path, "d000", "f00000.txt"), []byte("planted\n"), 0o644)
	mustGit(t, w.Path, "commit", "-q", "-am", "planted")
	planted := mustGit(t, w.Path, "rev-parse", "HEAD")
	// A commit like base (no parent) with the planted tree.
	real := mustGitIn(t, w.Path, "", nil, "-c", "user.name=a", "-c", "user.email=a@a", "commit-tree", "-m", "seed", planted+"^{tree}")
	forgeCommitGraph(t, w.Path, real, base)
	if got := mustGitIn(t, w.Path, "", nil, "log", "-1", "--format=%T", base); got != mustGit(t, w.Path, "rev-parse", planted+"^{tree}") {
		t.Fatalf("the forged commit-graph is not believed (base's tree %s): the test proves nothing", got)
	}

	if _, err := w.Clean(ctx, base, "att_a"); err != nil {
		t.Fatalf("clean: %v", err)
	}
	if err := w.Ready(ctx, base); err != nil {
		t.Fatal(err)
	}
	want := mustGit(t, co, "rev-parse", base+"^{tree}")
	if got := mustGitIn(t, w.Path, "", nil, "log", "-1", "--format=%T", base); got != want {
		t.Errorf("in the cleaned shard, git log says base's tree is %s, not %s", got, want)
	}
	if out, _ := plainGit(t, w.Path, "status", "--porcelain"); out != "" {
		t.Errorf("the cleaned shard's status: %q", out)
	}
}

// TestCleanSurvivesABrokenShard: an attempt breaks what cleaning needs
// (here it deletes an object of its own commit, so the fetch that keeps
// its work fails; a directory it made unreadable does as much for git
// clean). Cleaning used to fail there and leave the shard dirty, and so
// every later cleaning: one attempt per shard took the pool out of
// service. The shard is moved aside instead (its files kept on disk and
// named) and made anew at base.
func TestCleanSurvivesABrokenShard(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, base, w := newShard(t, 3, "att_a")
	os.WriteFile(filepath.Join(w.Path, "d000", "f00000.txt"), []byte("work\n"), 0o644)
	mustGit(t, w.Path, "commit", "-q", "-am", "work")
	tree := mustGit(t, w.Path, "rev-parse", "HEAD^{tree}")
	if err := os.Remove(filepath.Join(w.Path, ".git", "objects", tree[:2], tree[2:])); err != nil {
		t.Fatal(err)
	}
	kept, err := w.Clean(ctx, base, "att_a")
	if err != nil {
		t.Fatalf("clean: %v", err)
	}
	if err := w.Ready(ctx, base); err != nil {
		t.Fatal(err)
	}
	if len(kept) == 0 || !strings.Contains(kept[len(kept)-1], ".orphan-att_a-") {
		t.Errorf("kept %v does not name the shard moved aside", kept)
	} else if b, _ := os.ReadFile(filepath.Join(kept[len(kept)-1], "d000", "f00000.txt")); string(b) != "work\n" {
		t.Errorf("the moved-aside shard lost the attempt's file: %q", b)
	}
	if _, err := w.Clean(ctx, base, "att_b"); err != nil {
		t.Fatalf("the next cleaning: %v", err)
	}
}

// TestCommitPlacementRestoresTheGitDir: a shard is left as an exclusive
// attempt made it when its cleaning could not run (its lease was lost
// before it settled, or its runner died): a commondir naming the
// checkout's git dir, and hooks. A commit capacity placed there next is
// not cleaned (it commits on the shard's branch), and fenceline then asks
// git in the shard for its git dirs, to make them writable: git answered
// the checkout's .git, so the commit attempt could write the checkout's
// refs, config and hooks, and its git ran the planted hooks. Placing a
// commit capacity restores the shard's git dir first.
func TestCommitPlacementRestoresTheGitDir(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 1, 0)
	ctx := context.Background()
	ex := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pe, err := st.Place(ctx, pool, *ex.Record, ModeExclusive, Attempt{AttemptID: "att_lost", Command: []string{"x"}}, ex)
	if err != nil {
		t.Fatal(err)
	}
	gd := filepath.Join(pe.Worktree.Path, ".git")
	os.WriteFile(filepath.Join(gd, "commondir"), []byte(filepath.Join(co, ".git")+"\n"), 0o644)
	os.MkdirAll(filepath.Join(gd, "hooks"), 0o755)
	os.WriteFile(filepath.Join(gd, "hooks", "pre-commit"), []byte("#!/bin/sh\nexit 0\n"), 0o755)
	pe.Settle(ctx, StatusFailed, 1) // no CleanAfter: the lease was lost
	if err := ex.Close(ctx); err != nil {
		t.Fatal(err)
	}

	cm := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pc, err := st.Place(ctx, pool, *cm.Record, ModeCommitExclusive, Attempt{AttemptID: "att_commit", Command: []string{"commit"}}, cm)
	if err != nil {
		t.Fatal(err)
	}
	out, err := plainGit(t, pc.Worktree.Path, "rev-parse", "--path-format=absolute", "--git-common-dir")
	if err != nil || out != gd {
		t.Errorf("the commit capacity's git common dir is %q (%v), want the shard's own %s", out, err, gd)
	}
	if _, err := os.Stat(filepath.Join(gd, "hooks", "pre-commit")); err == nil {
		t.Error("the lost attempt's hook is still in the shard when the commit capacity starts")
	}
	if !strings.Contains(strings.Join(pc.Worktree.Undone, " "), "commondir") {
		t.Errorf("undone %v does not name commondir", pc.Worktree.Undone)
	}
}

// TestSharedPlacementOnADirtyShardRestoresTheGitDir: the same shard, left
// with hooks and config by an exclusive attempt whose cleaning never ran,
// gets a path-leased attempt next (placed without cleaning). Its git, and
// the git status of every later sharer, would run them under their own
// leases. With nobody in the shard, placing it restores the git dir.
func TestSharedPlacementOnADirtyShardRestoresTheGitDir(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 1, 0)
	ctx := context.Background()
	ex := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pe, err := st.Place(ctx, pool, *ex.Record, ModeExclusive, Attempt{AttemptID: "att_lost", Command: []string{"x"}}, ex)
	if err != nil {
		t.Fatal(err)
	}
	gd := filepath.Join(pe.Worktree.Path, ".git")
	marker := filepath.Join(t.TempDir(), "ran")
	if err := gittrap.Plant(gd, "", filepath.Join(t.TempDir(), "traps"), marker); err != nil {
		t.Fatal(err)
	}
	pe.Settle(ctx, StatusFailed, 1) // no CleanAfter: the lease was lost
	if err := ex.Close(ctx); err != nil {
		t.Fatal(err)
	}
	sh := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "d000"), WorkspaceID: "shard-1", TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	ps, err := st.Place(ctx, pool, *sh.Record, ModeShared, Attempt{AttemptID: "att_shared", Command: []string{"edit"}}, sh)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(ps.Worktree.Path, "d000", "f00000.txt"), []byte("edit\n"), 0o644)
	plainGit(t, ps.Worktree.Path, "status", "--porcelain")
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the shared attempt's git ran the lost attempt's traps:\n%s", ran)
	}
}

// TestRestoreCheckoutDropsReplaceRefsAndGrafts: an exclusive attempt
// without a pool commits a change, then makes the user's git show another
// commit in its place (refs/replace/<its commit>) or another parent
// (info/grafts): the user's git log, show and diff review that, not what
// the branch holds (and what a push sends). Restore removes what the
// attempt added there.
func TestRestoreCheckoutDropsReplaceRefsAndGrafts(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"replace", "graft"} {
		t.Run(how, func(t *testing.T) {
			co := newRepo(t, 2)
			gd := filepath.Join(co, ".git")
			snap, err := SnapshotCheckout(t.Context(), co, []string{gd})
			if err != nil {
				t.Fatal(err)
			}
			defer snap.Close()
			os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("sneaky\n"), 0o644)
			mustGit(t, co, "commit", "-q", "-am", "harmless")
			real := mustGit(t, co, "rev-parse", "HEAD")
			// A commit with real's tree: shown as real's parent, real changes nothing.
			same := mustGit(t, co, "commit-tree", "-m", "same", "-p", real+"~1", real+"^{tree}")
			switch how {
			case "replace":
				shown := mustGit(t, co, "commit-tree", "-m", "harmless", "-p", real+"~1", real+"~1^{tree}")
				mustGit(t, co, "update-ref", "refs/replace/"+real, shown)
			case "graft":
				os.WriteFile(filepath.Join(gd, "info", "grafts"), []byte(real+" "+same+"\n"), 0o644)
			}
			show := func() string {
				out, _ := plainGit(t, co, "-c", "advice.graftFileDeprecated=false", "show", "--stat", "--format=", "HEAD")
				return out
			}
			if out := show(); strings.Contains(out, "f00000") {
				t.Fatalf("the lie is not believed (%q): the test proves nothing", out)
			}
			undone, err := snap.Restore(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("undone: %v", undone)
			if out := show(); !strings.Contains(out, "f00000") {
				t.Errorf("after restore the user's git show HEAD still hides the change: %q", out)
			}
		})
	}
}

// TestRestoreClaimsRepos: a path-leased attempt (git dir read-only) may
// write only its claims, and there it plants traps in a repository the
// user had (claim/lib, a nested clone), makes a bare repository whose
// work tree is itself (claim/bare) and a .git file naming a git dir
// elsewhere (claim/gen). The user's git in each ran them. Restore puts
// claim/lib's config and hooks back and disarms the attempt's two; a
// repository outside the claims (other/, the attempt could not write it)
// is not its business. "checkout" is the same in an exclusive attempt
// without a pool (SnapshotCheckout: the whole worktree is walked).
func TestRestoreClaimsRepos(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"claims", "checkout"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			testRestoreClaimsRepos(t, how)
		})
	}
}

func testRestoreClaimsRepos(t *testing.T, how string) {
	co := newRepo(t, 2)
	claim := filepath.Join(co, "claim")
	lib := filepath.Join(claim, "lib")
	other := filepath.Join(co, "other")
	for _, d := range []string{lib, other} {
		os.MkdirAll(d, 0o755)
		mustGit(t, d, "init", "-q")
	}
	libCfg, _ := os.ReadFile(filepath.Join(lib, ".git", "config"))
	snap, err := SnapshotClaims(t.Context(), co, []string{claim})
	if how == "checkout" {
		snap, err = SnapshotCheckout(t.Context(), co, []string{filepath.Join(co, ".git")})
	}
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	marker := filepath.Join(t.TempDir(), "ran")
	scripts := filepath.Join(t.TempDir(), "traps")
	bare := filepath.Join(claim, "bare")
	mustGit(t, claim, "init", "-q", "--bare", bare)
	mustGit(t, claim, "--git-dir="+bare, "config", "core.bare", "false")
	mustGit(t, claim, "--git-dir="+bare, "config", "core.worktree", ".")
	elsewhere := filepath.Join(t.TempDir(), "elsewhere.git")
	mustGit(t, claim, "init", "-q", "--bare", elsewhere)
	mustGit(t, claim, "--git-dir="+elsewhere, "config", "core.bare", "false")
	os.MkdirAll(filepath.Join(claim, "gen"), 0o755)
	os.WriteFile(filepath.Join(claim, "gen", ".git"), []byte("gitdir: "+elsewhere+"\n"), 0o644)
	// A repository whose objects/ and refs/ are links to directories: git
	// takes it for a git dir (it follows them), a walk of directories alone
	// does not.
	linked := filepath.Join(claim, "linked")
	mustGit(t, claim, "init", "-q", "--bare", linked)
	mustGit(t, claim, "--git-dir="+linked, "config", "core.bare", "false")
	mustGit(t, claim, "--git-dir="+linked, "config", "core.worktree", ".")
	for _, d := range []string{"objects", "refs"} {
		os.Rename(filepath.Join(linked, d), filepath.Join(claim, "linked-"+d))
		if err := os.Symlink("../linked-"+d, filepath.Join(linked, d)); err != nil {
			t.Fatal(err)
		}
	}
	for _, gd := range []string{filepath.Join(lib, ".git"), bare, elsewhere, linked} {
		if err := gittrap.Plant(gd, "", scripts, marker); err != nil {
			t.Fatal(err)
		}
	}
	for _, d := range []string{bare, linked} {
		if out, _ := plainGit(t, d, "status"); gittrap.Ran(marker) == "" {
			t.Fatalf("the planted repository %s runs nothing (%s): the test proves nothing", d, out)
		}
		os.Remove(marker)
	}

	undone, err := snap.Restore(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("undone: %v", undone)
	for _, want := range []string{"claim/lib/.git/config (changed)", "claim/lib/.git/hooks/post-checkout (added)", "claim/bare (a repository the attempt made: its HEAD moved to HEAD.fenceline-undone-", "claim/gen/.git (added; moved to claim/gen/.git.fenceline-undone-", "claim/linked (a repository the attempt made: its HEAD moved to HEAD.fenceline-undone-"} {
		if !strings.Contains(strings.Join(undone, "\n"), want) {
			t.Errorf("undone %v lacks %q", undone, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(lib, ".git", "config")); string(b) != string(libCfg) {
		t.Errorf("claim/lib's config after restore:\n%s", b)
	}
	for _, d := range []string{lib, bare, filepath.Join(claim, "gen"), linked, claim} {
		plainGit(t, d, "status")
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the user's git in the claim ran the attempt's programs:\n%s", ran)
	}
	if again, err := snap.Restore(t.Context()); err != nil || len(again) != 0 {
		t.Errorf("a second restore undid %v, %v; want nothing", again, err)
	}
}

// TestMovedAsideShardDisarmed: an attempt replaces its shard's .git by a
// .git file naming a git dir it planted every trap in (or leaves such a
// repository nested in its files). Cleaning moves the shard aside, kept
// for its files, and makes it anew. Whoever then looks into the shard
// moved aside with git ran the attempt's programs. Every repository in it
// is disarmed, and Undone says so.
func TestMovedAsideShardDisarmed(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	_, base, w := newShard(t, 3, "att_a")
	marker := filepath.Join(t.TempDir(), "ran")
	scripts := filepath.Join(t.TempDir(), "traps")
	evil := filepath.Join(t.TempDir(), "evil.git")
	mustGit(t, w.Path, "init", "-q", "--bare", evil)
	mustGit(t, w.Path, "--git-dir="+evil, "config", "core.bare", "false")
	if err := gittrap.Plant(evil, "", scripts, marker); err != nil {
		t.Fatal(err)
	}
	os.RemoveAll(filepath.Join(w.Path, ".git"))
	os.WriteFile(filepath.Join(w.Path, ".git"), []byte("gitdir: "+evil+"\n"), 0o644)
	nested := filepath.Join(w.Path, "d000", "sub")
	os.MkdirAll(nested, 0o755)
	os.WriteFile(filepath.Join(nested, ".git"), []byte("gitdir: "+evil+"\n"), 0o644)
	if plainGit(t, nested, "status"); gittrap.Ran(marker) == "" {
		t.Fatal("the planted repository runs nothing: the test proves nothing")
	}
	os.Remove(marker)

	kept, err := w.Clean(ctx, base, "att_a")
	if err != nil {
		t.Fatalf("clean: %v", err)
	}
	t.Logf("kept %v, undone %v", kept, w.Undone)
	if len(kept) == 0 || !strings.Contains(kept[0], ".orphan-att_a-") {
		t.Fatalf("kept %v does not name the shard moved aside", kept)
	}
	if !strings.Contains(strings.Join(w.Undone, "\n"), filepath.Join(kept[0], ".git")+" (moved to .git.fenceline-undone-") {
		t.Errorf("undone %v does not name the moved-aside shard's .git", w.Undone)
	}
	plainGit(t, kept[0], "status")
	plainGit(t, filepath.Join(kept[0], "d000", "sub"), "status")
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("git in the shard moved aside ran the attempt's programs:\n%s", ran)
	}
	if err := w.Ready(ctx, base); err != nil {
		t.Error(err)
	}
}

// TestRestoreCheckoutDropsALeftRebase: an exclusive attempt without a
// pool stops an interactive rebase (a break) with an exec line next in
// its todo list, and leaves. The user's git rebase --continue in the
// checkout then ran the attempt's command, unconfined. Restore removes
// the rebase state the attempt left and says so.
func TestRestoreCheckoutDropsALeftRebase(t *testing.T) {
	t.Parallel()
	co := newRepo(t, 2)
	os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("one\n"), 0o644)
	mustGit(t, co, "commit", "-q", "-am", "one")
	gd := filepath.Join(co, ".git")
	snap, err := SnapshotCheckout(t.Context(), co, []string{gd})
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()
	marker := filepath.Join(t.TempDir(), "ran")
	editor := "sed -i '1i break\\nexec touch " + marker + "'"
	if out, err := plainGit(t, co, "-c", "sequence.editor="+editor, "rebase", "-i", "HEAD~1"); err != nil {
		t.Fatalf("git rebase -i: %v\n%s", err, out)
	}
	if _, err := os.Stat(filepath.Join(gd, "rebase-merge")); err != nil {
		t.Fatalf("no rebase in progress: the test proves nothing (%v)", err)
	}
	undone, err := snap.Restore(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("undone: %v", undone)
	if !strings.Contains(strings.Join(undone, "\n"), ".git/rebase-merge (added)") {
		t.Errorf("undone %v lacks the rebase the attempt left", undone)
	}
	plainGit(t, co, "rebase", "--continue")
	if _, err := os.Stat(marker); err == nil {
		t.Errorf("the user's git rebase --continue ran the attempt's exec line")
	}
}

// TestRestoreHooksPathInTheWorkTree: the user's repository takes its
// hooks from the work tree (core.hooksPath = .husky/_, as husky sets it;
// that directory is generated and git-ignored, so no diff shows it). An
// attempt that may write it — an exclusive one without a pool, or a
// path-leased one claiming .husky — rewrites the pre-commit hook there,
// and the user's next git commit ran it, unconfined. Restore puts the
// hooks directory back as it was and names what it undid.
func TestRestoreHooksPathInTheWorkTree(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"checkout", "claims"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			co := newRepo(t, 2)
			hooks := filepath.Join(co, ".husky", "_")
			os.MkdirAll(hooks, 0o755)
			os.WriteFile(filepath.Join(hooks, ".gitignore"), []byte("*\n"), 0o644)
			os.WriteFile(filepath.Join(hooks, "pre-commit"), []byte("#!/bin/sh\nexit 0\n"), 0o755)
			mustGit(t, co, "config", "core.hooksPath", ".husky/_")
			var snap *GitDirSnapshot
			var err error
			if how == "checkout" {
				snap, err = SnapshotCheckout(t.Context(), co, []string{filepath.Join(co, ".git")})
			} else {
				snap, err = SnapshotClaims(t.Context(), co, []string{filepath.Join(co, ".husky")})
			}
			if err != nil {
				t.Fatal(err)
			}
			defer snap.Close()
			marker := filepath.Join(t.TempDir(), "ran")
			os.WriteFile(filepath.Join(hooks, "pre-commit"), []byte("#!/bin/sh\ntouch "+marker+"\n"), 0o755)
			os.WriteFile(filepath.Join(hooks, "post-checkout"), []byte("#!/bin/sh\ntouch "+marker+"\n"), 0o755)
			probe := t.TempDir()
			mustGit(t, probe, "clone", "-q", "--no-local", co, "c")
			pc := filepath.Join(probe, "c")
			mustGit(t, pc, "config", "core.hooksPath", hooks)
			os.WriteFile(filepath.Join(pc, "x"), []byte("x\n"), 0o644)
			plainGit(t, pc, "add", "x")
			plainGit(t, pc, "commit", "-qm", "x")
			if _, err := os.Stat(marker); err != nil {
				t.Fatalf("the planted hook does not run: the test proves nothing")
			}
			os.Remove(marker)

			undone, err := snap.Restore(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("undone: %v", undone)
			all := strings.Join(undone, "\n")
			for _, want := range []string{".husky/_/pre-commit (changed)", ".husky/_/post-checkout (added)"} {
				if !strings.Contains(all, want) {
					t.Errorf("undone lacks %q", want)
				}
			}
			os.WriteFile(filepath.Join(co, "y"), []byte("y\n"), 0o644)
			plainGit(t, co, "add", "y")
			plainGit(t, co, "commit", "-qm", "y")
			if _, err := os.Stat(marker); err == nil {
				t.Errorf("the user's git commit ran the attempt's hook")
			}
		})
	}
}
