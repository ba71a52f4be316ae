package gitsafe_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe"
	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

func plainGit(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-C", dir}, args...)...)
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@localhost", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@localhost")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// trapped makes a repository with a commit, then plants every trap.
func trapped(t *testing.T) (repo, marker string) {
	t.Helper()
	dir := t.TempDir()
	repo = filepath.Join(dir, "repo")
	marker = filepath.Join(dir, "marker")
	os.MkdirAll(repo, 0o755)
	plainGit(t, repo, "init", "-q", "-b", "main")
	os.WriteFile(filepath.Join(repo, "a.txt"), []byte("a\n"), 0o644)
	os.WriteFile(filepath.Join(repo, "b.inc"), []byte("b\n"), 0o644)
	plainGit(t, repo, "add", "-A")
	plainGit(t, repo, "commit", "-q", "-m", "seed")
	if err := gittrap.Plant(filepath.Join(repo, ".git"), repo, filepath.Join(dir, "scripts"), marker); err != nil {
		t.Fatal(err)
	}
	return repo, marker
}

// The traps work: plain git runs them.
func TestTrapsRunUnderPlainGit(t *testing.T) {
	repo, marker := trapped(t)
	os.WriteFile(filepath.Join(repo, "a.txt"), []byte("changed\n"), 0o644)
	exec.Command("git", "-C", repo, "status").Run()
	exec.Command("git", "-C", repo, "add", "-A").Run()
	got := gittrap.Ran(marker)
	for _, want := range []string{"fsmonitor", "filter-process", "hook post-index-change"} {
		if !strings.Contains(got, want) {
			t.Errorf("plain git did not run the %s trap; ran:\n%s", want, got)
		}
	}
}

// Every command fenceline runs, run through gitsafe on a trapped
// repository, runs none of the traps.
func TestNoTrapRuns(t *testing.T) {
	repo, marker := trapped(t)
	ctx := context.Background()
	g := gitsafe.Git{Dir: repo, Env: []string{"GIT_AUTHOR_NAME=t", "GIT_AUTHOR_EMAIL=t@localhost", "GIT_COMMITTER_NAME=t", "GIT_COMMITTER_EMAIL=t@localhost"}}
	base, err := g.Output(ctx, "rev-parse", "HEAD")
	if err != nil {
		t.Fatal(err)
	}
	base = strings.TrimSpace(base)
	os.WriteFile(filepath.Join(repo, "a.txt"), []byte("changed\n"), 0o644)
	os.WriteFile(filepath.Join(repo, "b.inc"), []byte("changed\n"), 0o644)
	os.WriteFile(filepath.Join(repo, "new.txt"), []byte("new\n"), 0o644)
	steps := [][]string{
		{"rev-parse", "--show-toplevel", "--absolute-git-dir", "--git-common-dir"},
		{"config", "--get", "remote.trap.url"},
		{"status", "--porcelain", "--ignored", "--untracked-files=all"},
		{"status"},
		{"diff"},
		{"diff", "HEAD"},
		{"log", "-p", "-1"},
		{"add", "-A"},
		{"commit", "-q", "-m", "work"},
		{"update-ref", "refs/fenceline/attempts/x", "HEAD"},
		{"checkout", "-q", "-f", "-B", "other", base},
		{"reset", "-q", "--hard", base},
		{"clean", "-q", "-ffdx"},
		{"merge", "-q", "--no-edit", "main"},
		{"gc", "--auto"},
		{"fetch", "-q", "--no-tags", repo, "+refs/heads/main:refs/remotes/self/main"},
		{"fetch", "-q", "trap"},
	}
	for _, s := range steps {
		out, err := g.Output(ctx, s...)
		t.Logf("git %s: %v %s", strings.Join(s, " "), err, strings.TrimSpace(out))
	}
	if ran := gittrap.Ran(marker); ran != "" {
		t.Fatalf("fenceline's git ran repository-controlled programs:\n%s", ran)
	}
}

func TestOverrides(t *testing.T) {
	listed := "core.fsmonitor\n/x\x00filter.a.b.clean\n/y\x00filter.a.b.required\ntrue\x00pager.status\n/z\x00user.name\nme\x00remote.o.uploadpack\n/u\x00uploadpack.packobjectshook\n/p\x00diff.t.textconv\n/t\x00"
	got := gitsafe.Overrides([]byte(listed))
	want := [][2]string{{"core.fsmonitor", "false"}, {"filter.a.b.clean", ""}, {"filter.a.b.required", "false"}, {"pager.status", "false"}, {"diff.t.textconv", ""}}
	if len(got) != len(want) {
		t.Fatalf("Overrides = %q, want %q", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("override %d = %q, want %q", i, got[i], want[i])
		}
	}
}
