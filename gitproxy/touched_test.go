package gitproxy

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/object"
)

// TestTouchedPathsMatchGit checks the analyzer's paths of every commit of
// a random history — edits, adds, deletes, renames, a file turned into a
// directory and back, merges — against git diff-tree's.
func TestTouchedPathsMatchGit(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	mustGit(t, dir, "init", "--quiet", "--initial-branch=main")
	rng := rand.New(rand.NewPCG(1, 2))
	names := []string{"a", "b", "c/d", "c/e/f", "g/h", "i"}
	write := func(p, content string) {
		full := filepath.Join(dir, p)
		os.RemoveAll(full)
		os.MkdirAll(filepath.Dir(full), 0o755)
		if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
			// a path component is a file: replace it
			parts := strings.Split(p, "/")
			for i := range parts[:len(parts)-1] {
				os.Remove(filepath.Join(dir, filepath.Join(parts[:i+1]...)))
			}
			os.MkdirAll(filepath.Dir(full), 0o755)
			if err := os.WriteFile(full, []byte(content), 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range 40 {
		switch rng.IntN(5) {
		case 0, 1:
			write(names[rng.IntN(len(names))], fmt.Sprint(rng.Int()))
		case 2:
			os.RemoveAll(filepath.Join(dir, names[rng.IntN(len(names))]))
		case 3: // a file becomes a directory, or a directory a file
			write("c", fmt.Sprint(rng.Int()))
			if rng.IntN(2) == 0 {
				write("c/x", "y")
			}
		case 4:
			if i > 5 {
				mustGit(t, dir, "checkout", "--quiet", "-B", "side", "HEAD~2")
				write("side/"+fmt.Sprint(i), "s")
				mustGit(t, dir, "add", "-A")
				mustGit(t, dir, "commit", "--quiet", "--allow-empty", "-m", "side")
				mustGit(t, dir, "checkout", "--quiet", "main")
				out, err := gitCmd(t, dir, nil, "merge", "--quiet", "--no-edit", "-s", "ours", "side")
				if err != nil {
					t.Fatalf("merge: %v\n%s", err, out)
				}
				continue
			}
		}
		mustGit(t, dir, "add", "-A")
		mustGit(t, dir, "commit", "--quiet", "--allow-empty", "-m", fmt.Sprint(i))
	}
	st := baseStores([]string{filepath.Join(dir, ".git")})
	a := newAnalyzer(st, func(plumbing.Hash) bool { return true })
	for _, h := range strings.Fields(mustGit(t, dir, "rev-list", "--all")) {
		c, err := object.GetCommit(st, plumbing.NewHash(h))
		if err != nil {
			t.Fatal(err)
		}
		got, err := a.commitPaths(context.Background(), c)
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(got)
		out := mustGit(t, dir, "diff-tree", "-r", "--name-only", "--no-renames", "--no-commit-id", "-m", "--root", h)
		want := slices.Compact(slices.Sorted(slices.Values(strings.Fields(out))))
		if !slices.Equal(got, want) {
			t.Fatalf("commit %s: paths %v, git says %v", h, got, want)
		}
	}
}
