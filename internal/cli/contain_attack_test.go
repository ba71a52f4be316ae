package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// TestExclusiveRunNestedRepoTrapUndone: an exclusive attempt without a
// pool makes a repository of its own inside the checkout (sub/.git, with
// every trap in its config and hooks) and registers it as a gitlink in
// the checkout's index. The user's git status in the checkout runs git
// status in every gitlink's repository, with that repository's config:
// core.fsmonitor would run, unconfined. At settle the run must leave no
// git dir it did not have in the worktree, and say so.
func TestExclusiveRunNestedRepoTrapUndone(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	ctl := newCtl(t)
	kit := newTrapKit(t, ctl)
	script := strings.Join([]string{
		`set -e`,
		`mkdir -p sub && cd sub && git init -q && echo b > b && git add b && git -c user.name=a -c user.email=a@a commit -qm b`,
		`(` + kit.plant(".git") + `)`,
		`cd .. && git add sub 2>/dev/null && echo planted`,
	}, "\n")
	r := runFL(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "planted")
	mustContain(t, "run", r.stderr, "sub/.git (added; moved to sub/.git.fenceline-undone-")
	os.WriteFile(filepath.Join(co, "sub", "b"), []byte("user edit\n"), 0o644)
	userGit(co, "status", "--porcelain")
	userGit(co, "diff")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("the user's git ran the attempt's programs (a nested repository's):\n%s", ran)
	}
}

// TestExclusiveRunCopiedGitDirRestored: the attempt replaces the
// checkout's .git by a copy with every trap planted and deletes the
// original. The copy is restored in place (the user's refs and objects
// are in it): the user's git runs none of the traps.
func TestExclusiveRunCopiedGitDirRestored(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	ctl := newCtl(t)
	kit := newTrapKit(t, ctl)
	head := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "HEAD"))
	script := strings.Join([]string{
		`set -e`,
		`cp -a .git copy && rm -rf .git`,
		`(` + kit.plant("copy") + `)`,
		`mv copy .git && echo planted`,
	}, "\n")
	r := runFL(t, url, "--checkout", co, "--allow-write", string(ctl), "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "planted")
	mustContain(t, "run", r.stderr, ".git (replaced by another directory, the original removed: restored in it)", ".git/hooks/pre-commit (added)")
	os.Remove(filepath.Join(co, ".gitattributes"))
	os.WriteFile(filepath.Join(co, "README.md"), []byte("user edit\n"), 0o644)
	userGit(co, "status", "--porcelain")
	userGit(co, "commit", "-qam", "user")
	if ran := gittrap.Ran(kit.marker); ran != "" {
		t.Errorf("the user's git ran the attempt's programs:\n%s\nrun's stderr:\n%s", ran, r.stderr)
	}
	if out, err := userGit(co, "rev-parse", "HEAD~1"); err != nil || strings.TrimSpace(out) != head {
		t.Errorf("the user's history after the run: %q, %v", out, err)
	}
}

// TestExclusiveRunInALinkedWorktreeLeavesTheOthersAlone: an exclusive
// attempt without a pool in a linked worktree has the repository's common
// git dir writable. It moved the branch the main checkout has checked out
// and rewrote the main checkout's HEAD (and could its index): the user's
// main checkout then stood on another branch with a staged reversal. At
// settle the other worktrees' HEAD, index and checked-out branches are put
// back, the attempt's value of such a branch kept under
// refs/fenceline/undone/, and run says so.
func TestExclusiveRunInALinkedWorktreeLeavesTheOthersAlone(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	wt := filepath.Join(t.TempDir(), "wt")
	mustGitRun(t, co, nil, "worktree", "add", "-q", "-b", "side", wt)
	cg := filepath.Join(co, ".git")
	mainTip := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/heads/main"))
	headBefore, _ := os.ReadFile(filepath.Join(cg, "HEAD"))
	script := strings.Join([]string{
		`set -e`,
		`echo evil > x && git add x && git -c user.name=a -c user.email=a@a commit -qm evil`,
		`git update-ref refs/heads/main HEAD`,
		`echo "ref: refs/heads/side" > ` + cg + `/HEAD`,
		`echo done`,
	}, "\n")
	r := runFL(t, url, "--checkout", wt, "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "attempt", r.stdout, "done")
	mustContain(t, "run", r.stderr, "refs/heads/main (moved", "HEAD (changed)")
	if got := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/heads/main")); got != mainTip {
		t.Errorf("the main checkout's branch moved to %s (was %s)", got, mainTip)
	}
	if b, _ := os.ReadFile(filepath.Join(cg, "HEAD")); string(b) != string(headBefore) {
		t.Errorf("the main checkout's HEAD: %q, want %q", b, headBefore)
	}
	if out, err := userGit(co, "status", "--porcelain"); err != nil || strings.TrimSpace(out) != "" {
		t.Errorf("the main checkout's status: %q, %v", out, err)
	}
	side := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/heads/side"))
	if got := strings.TrimSpace(mustGitRun(t, co, nil, "rev-parse", "refs/fenceline/undone/heads/main")); got != side {
		t.Errorf("the attempt's value of main is not kept: %s, want %s", got, side)
	}
}
