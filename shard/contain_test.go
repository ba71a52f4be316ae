package shard

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// plainGit runs git as a user (or an agent) would: the repository's own
// configuration and hooks apply.
func plainGit(t *testing.T, dir string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@localhost", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@localhost")
	out, err := cmd.CombinedOutput()
	return strings.TrimSpace(string(out)), err
}

// shardGitDirs are the git dirs an exclusive attempt in the shard may
// write: the worktree's and the common one, as git reports them there.
func shardGitDirs(t *testing.T, path string) []string {
	t.Helper()
	out, err := plainGit(t, path, "rev-parse", "--absolute-git-dir", "--git-common-dir")
	if err != nil {
		t.Fatal(out, err)
	}
	var dirs []string
	for _, d := range strings.Split(out, "\n") {
		if !filepath.IsAbs(d) {
			d = filepath.Join(path, d)
		}
		dirs = append(dirs, filepath.Clean(d))
	}
	return dirs
}

// TestExclusiveAttemptLeavesNothingBehind is the attack of issue 22 (1-3):
// an exclusive attempt in a shard commits, moves refs/heads/main in its git
// dir to its commit, and plants every hook and every configuration that
// runs a program in each git dir it may write. Then fenceline settles and
// cleans the shard. Fenceline's own cleaning runs none of it; the main
// checkout's branch has not moved; the user's git status in the checkout
// and a later attempt's git status in the shard run none of it either;
// the attempt's work is kept.
func TestExclusiveAttemptLeavesNothingBehind(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 20, 1, 0)
	ctx := context.Background()
	mainTip := mustGit(t, co, "rev-parse", "refs/heads/main")
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pl, err := st.Place(ctx, pool, *l.Record, ModeExclusive, Attempt{AttemptID: "att_evil", Command: []string{"evil"}}, l)
	if err != nil {
		t.Fatal(err)
	}
	sh := pl.Worktree.Path

	// The attempt: a commit, the main branch moved to it, traps planted.
	os.WriteFile(filepath.Join(sh, "d000", "f00000.txt"), []byte("agent\n"), 0o644)
	if out, err := plainGit(t, sh, "commit", "-qam", "agent work"); err != nil {
		t.Fatal(out, err)
	}
	work, _ := plainGit(t, sh, "rev-parse", "HEAD")
	if out, err := plainGit(t, sh, "update-ref", "refs/heads/main", work); err != nil {
		t.Fatal(out, err)
	}
	marker := filepath.Join(t.TempDir(), "ran")
	scripts := filepath.Join(t.TempDir(), "traps") // the attempt's temp dir
	for _, d := range shardGitDirs(t, sh) {
		if err := gittrap.Plant(d, sh, scripts, marker); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(sh, "d000", "f00001.txt"), []byte("uncommitted\n"), 0o644)
	os.WriteFile(filepath.Join(sh, "new.inc"), []byte("untracked\n"), 0o644)
	// An LFS object under another's name, for a later attempt's git lfs
	// checkout in the shard (git-lfs checks only its size).
	lfsObj := filepath.Join(shardGitDirs(t, sh)[0], "lfs", "objects", "ab", "cd", "abcd"+strings.Repeat("0", 60))
	os.MkdirAll(filepath.Dir(lfsObj), 0o755)
	os.WriteFile(lfsObj, []byte("forged\n"), 0o644)

	if err := pl.Settle(ctx, StatusSucceeded, 0); err != nil {
		t.Fatal(err)
	}
	kept, err := pl.CleanAfter(ctx)
	if err != nil {
		t.Errorf("cleaning after the attempt: %v", err)
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("fenceline's cleaning ran the attempt's programs:\n%s", ran)
	}
	os.Remove(marker)
	if _, err := os.Lstat(lfsObj); err == nil {
		t.Errorf("the attempt's LFS object %s outlived the cleaning, for the shard's next attempt", lfsObj)
	}
	if got := mustGit(t, co, "rev-parse", "refs/heads/main"); got != mainTip {
		t.Errorf("the main checkout's branch moved to %s (was %s)", got, mainTip)
	}
	if got, _ := plainGit(t, co, "rev-parse", "refs/fenceline/attempts/att_evil"); got != work {
		t.Errorf("kept %s as the attempt's commit, want %s (kept %v)", got, work, kept)
	}
	if out, err := plainGit(t, co, "status", "--porcelain"); err != nil || strings.Contains(out, "d000") {
		t.Errorf("the user's git status in the checkout: %q, %v", out, err)
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the user's git status in the checkout ran the attempt's programs:\n%s", ran)
	}
	os.Remove(marker)
	os.WriteFile(filepath.Join(sh, "d000", "f00002.txt"), []byte("next attempt\n"), 0o644)
	if out, err := plainGit(t, sh, "status", "--porcelain"); err != nil {
		t.Errorf("a later attempt's git status in the shard: %q, %v", out, err)
	}
	plainGit(t, sh, "add", "-A")
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("a later attempt's git in the shard ran the earlier attempt's programs:\n%s", ran)
	}
}

// TestRestoreGitDirs: an exclusive attempt without a pool (its checkout's
// git dir writable) plants every trap, a hook in a submodule's git dir,
// and removes one of the user's hooks; Restore puts back exactly what the
// user had and names what it undid, and the user's git status runs none
// of the traps afterwards.
func TestRestoreGitDirs(t *testing.T) {
	t.Parallel()
	co := newRepo(t, 3)
	gd := filepath.Join(co, ".git")
	os.MkdirAll(filepath.Join(gd, "hooks"), 0o755)
	userHook := "#!/bin/sh\nexit 0\n"
	os.WriteFile(filepath.Join(gd, "hooks", "pre-push"), []byte(userHook), 0o755)
	os.MkdirAll(filepath.Join(gd, "modules", "sub", "hooks"), 0o755)
	os.WriteFile(filepath.Join(gd, "modules", "sub", "config"), []byte("[core]\n\tbare = false\n"), 0o644)
	userConfig, _ := os.ReadFile(filepath.Join(gd, "config"))

	snap, err := SnapshotGitDirs(t.Context(), []string{gd})
	if err != nil {
		t.Fatal(err)
	}
	marker := filepath.Join(t.TempDir(), "ran")
	os.Remove(filepath.Join(gd, "hooks", "pre-push"))
	if err := gittrap.Plant(gd, "", filepath.Join(t.TempDir(), "traps"), marker); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(gd, "modules", "sub", "hooks", "post-checkout"), []byte("#!/bin/sh\necho sub >> "+marker+"\n"), 0o755)
	os.WriteFile(filepath.Join(gd, "config.worktree"), []byte("[core]\n\tfsmonitor = /x\n"), 0o644)

	undone, err := snap.Restore(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("undone: %v", undone)
	for _, want := range []string{".git/config (changed)", ".git/config.worktree (added)", ".git/hooks/pre-push (changed)", ".git/hooks/post-checkout (added)", ".git/modules/sub/hooks/post-checkout (added)", ".git/info/attributes (added)"} {
		if !slices.Contains(undone, want) {
			t.Errorf("undone %v lacks %q", undone, want)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(gd, "config")); string(b) != string(userConfig) {
		t.Errorf("config after restore:\n%s\nwant:\n%s", b, userConfig)
	}
	if b, _ := os.ReadFile(filepath.Join(gd, "hooks", "pre-push")); string(b) != userHook {
		t.Errorf("the user's pre-push hook after restore: %q", b)
	}
	os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("user edit\n"), 0o644)
	if out, err := plainGit(t, co, "status", "--porcelain"); err != nil || !strings.Contains(out, "f00000") {
		t.Errorf("the user's git status: %q, %v", out, err)
	}
	plainGit(t, co, "commit", "-qam", "user commit")
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the user's git ran the attempt's programs after restore:\n%s", ran)
	}
	if again, err := snap.Restore(t.Context()); err != nil || len(again) != 0 {
		t.Errorf("a second restore undid %v, %v; want nothing", again, err)
	}
}
