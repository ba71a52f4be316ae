//go:build integration && linux && (amd64 || arm64)

package fsguard

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestGitShimSharedWorkspace: in a path-leased attempt the shim refuses
// repo-wide git with a message naming the lease, passes read-only git, and
// the real git called by absolute path is still stopped by Landlock.
func TestGitShimSharedWorkspace(t *testing.T) {
	w := newWorktree(t)
	gitRepo(t, w)
	p := w.policy()
	p.GitShim = true
	realGit, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(w.leased, "mine.txt"), []byte("edited"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, script := range []string{"git stash", gitID + " commit -am edit", "git -C . checkout -b x", "git branch -D main", "git reset --hard"} {
		r := sh(t, p, w.root, script)
		if r.code != 3 || !strings.Contains(r.out, "lease_test1") || !strings.Contains(r.out, "exclusive workspace") {
			t.Errorf("%q: exit %d %q, want the shim's refusal (exit 3) naming the lease and who may run it", script, r.code, r.out)
		}
	}
	for _, script := range []string{"git status --short", "git diff --stat", "git log --oneline", "git show --stat HEAD", "git blame leased/mine.txt", "git grep data"} {
		if r := sh(t, p, w.root, script); r.code != 0 {
			t.Errorf("%q: exit %d %q, want read-only git to work", script, r.code, r.out)
		}
	}
	for _, script := range []string{realGit + " stash", realGit + " -c user.name=a -c user.email=a@b commit -am edit"} {
		r := sh(t, p, w.root, script)
		if r.code == 0 {
			t.Errorf("%q by absolute path succeeded (%s), want Landlock to refuse the git dir write", script, r.out)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(w.leased, "mine.txt")); string(b) != "edited" {
		t.Errorf("leased file = %q after refused git commands, want the agent's edit kept", b)
	}
	out, err := exec.Command("git", "-C", w.root, "stash", "list").CombinedOutput()
	if err != nil || len(out) != 0 {
		t.Errorf("git stash list = %q, %v: want no stash", out, err)
	}
}
