package gitsafe_test

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe"
)

// TestLazyFetchRunsNoUploadPack: a repository that says it is a partial
// clone (extensions.partialClone) makes git fetch a missing object from
// its promisor remote on its own, inside whatever command needed it:
// git runs "git fetch <remote>", which runs the remote's uploadpack
// program (the first value wins, so no override can neutralize it). An
// index naming a blob the repository lacks is enough: fenceline's
// checkout, reset or read of that blob would run the program.
func TestLazyFetchRunsNoUploadPack(t *testing.T) {
	dir := t.TempDir()
	repo := filepath.Join(dir, "repo")
	marker := filepath.Join(dir, "ran")
	plainGit(t, dir, "init", "-q", repo)
	os.WriteFile(filepath.Join(repo, "a"), []byte("a\n"), 0o644)
	plainGit(t, repo, "add", "a")
	plainGit(t, repo, "commit", "-qm", "a")
	blob := strings.TrimSpace(plainGit(t, repo, "rev-parse", "HEAD:a"))
	os.Remove(filepath.Join(repo, ".git", "objects", blob[:2], blob[2:]))
	f, _ := os.OpenFile(filepath.Join(repo, ".git", "config"), os.O_APPEND|os.O_WRONLY, 0)
	f.WriteString("[core]\n\trepositoryformatversion = 1\n[extensions]\n\tpartialClone = evil\n[remote \"evil\"]\n\turl = " + dir + "\n\tpromisor = true\n\tuploadpack = touch " + marker + "; false\n")
	f.Close()

	for _, args := range [][]string{{"cat-file", "-p", blob}, {"reset", "-q", "--hard", "HEAD"}, {"checkout", "-q", "-f", "HEAD", "--", "a"}} {
		gitsafe.Git{Dir: repo}.Output(context.Background(), args...)
		if _, err := os.Stat(marker); err == nil {
			t.Fatalf("git %s ran the repository's remote.evil.uploadpack (lazy fetch of a missing object)", strings.Join(args, " "))
		}
	}
	// A partial clone that configures no program works as before.
	plainGit(t, repo, "config", "--unset", "remote.evil.uploadpack")
	if out, err := (gitsafe.Git{Dir: repo}).Output(context.Background(), "rev-parse", "HEAD"); err != nil || strings.TrimSpace(out) == "" {
		t.Errorf("rev-parse in a plain partial clone: %q, %v", out, err)
	}
}
