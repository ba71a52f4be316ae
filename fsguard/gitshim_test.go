//go:build linux && (amd64 || arm64)

package fsguard

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

func gitRepo(t *testing.T, w worktree) {
	t.Helper()
	for _, args := range [][]string{
		{"init", "-q", "-b", "main"},
		{"add", "-A"},
		{"-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-q", "-m", "init"},
	} {
		cmd := exec.Command("git", args...)
		cmd.Dir = w.root
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
}

const gitID = "git -c user.name=agent -c user.email=agent@example.com"

// TestGitExclusiveWorkspace: an exclusive workspace writes its git dir and
// commits; with a path claim its file writes still stay inside the claim.
func TestGitExclusiveWorkspace(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	gitRepo(t, w)
	p := w.policy()
	p.GitDirWritable = true
	r := sh(t, p, w.root, "echo more >> leased/mine.txt && "+gitID+" commit -qam 'agent edit' && git log --oneline | wc -l")
	if r.code != 0 || r.out != "2" {
		t.Fatalf("commit in an exclusive workspace: exit %d %q, want 2 commits", r.code, r.out)
	}
	if r := sh(t, p, w.root, "echo x >> other/theirs.txt"); r.code == 0 {
		t.Errorf("write outside the claim of an exclusive workspace succeeded")
	}
	p.Writable = []string{w.root}
	if r := sh(t, p, w.root, "echo x >> other/theirs.txt && "+gitID+" commit -qam whole"); r.code != 0 {
		t.Errorf("exclusive workspace without a claim: exit %d %q, want its whole tree writable", r.code, r.out)
	}
}

func TestPolicyValidate(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	for _, tc := range []struct {
		name string
		p    Policy
		want string
	}{
		{"shared workspace writing the root", Policy{Root: w.root, Writable: []string{w.root}}, "covers the git dir"},
		{"relative writable", Policy{Writable: []string{"leased"}}, "absolute"},
		{"whole filesystem", Policy{Writable: []string{"/"}}, "whole filesystem"},
		{"missing writable", Policy{Writable: []string{filepath.Join(w.root, "nope")}}, "create it"},
		{"hidden under writable", Policy{Writable: []string{w.leased}, Hidden: []string{filepath.Join(w.leased, "k")}}, "lies under writable"},
	} {
		err := tc.p.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Validate = %v, want an error containing %q", tc.name, err, tc.want)
		}
	}
	ok := Policy{Root: w.root, Writable: []string{w.root}, GitDirWritable: true}
	if err := ok.Validate(); err != nil {
		t.Errorf("exclusive workspace: %v", err)
	}
	if err := (&Policy{}).Validate(); err != nil {
		t.Errorf("zero policy: %v", err)
	}
}

func TestDeniedGit(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"stash"}, "stash"},
		{[]string{"-C", "x", "-c", "a=b", "--no-pager", "commit", "-m", "x"}, "commit"},
		{[]string{"branch", "-D", "x"}, "branch -d"},
		{[]string{"branch", "new"}, ""},
		{[]string{"tag", "--delete", "v1"}, "tag -d"},
		{[]string{"status"}, ""},
		{[]string{"--version"}, ""},
		{[]string{"log", "--", "stash"}, ""},
	} {
		if got := deniedGit(DefaultRepoWideGit, tc.args); got != tc.want {
			t.Errorf("deniedGit(%q) = %q, want %q", tc.args, got, tc.want)
		}
	}
}
