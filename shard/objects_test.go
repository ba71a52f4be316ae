package shard

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestRestoreObjects: what an exclusive attempt without a pool writes to
// the checkout's object store, one attack each. Restore undoes the
// forgeries (and names them), keeps what is honest (a commit), and leaves
// a store git fsck finds whole, with the user's bytes where git reads them.
func TestRestoreObjects(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name   string
		before func(t *testing.T, co string) // the user's repository, before the snapshot
		attack func(t *testing.T, co string)
		want   []string // in undone
		check  func(t *testing.T, co string)
	}{{
		name: "honest commit",
		attack: func(t *testing.T, co string) {
			os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("agent\n"), 0o644)
			mustGit(t, co, "commit", "-qam", "agent")
		},
		check: func(t *testing.T, co string) {
			if got := mustGit(t, co, "log", "-1", "--format=%s"); got != "agent" {
				t.Errorf("the attempt's commit is gone: HEAD is %q", got)
			}
		},
	}, {
		name: "loose object rewritten in place",
		attack: func(t *testing.T, co string) {
			evil := mustGitIn(t, co, "", strings.NewReader("evil\n"), "hash-object", "-w", "--stdin")
			id := mustGit(t, co, "rev-parse", "HEAD:d000/f00000.txt")
			b, _ := os.ReadFile(loosePath(co, evil))
			p := loosePath(co, id)
			os.Chmod(p, 0o644)
			if err := os.WriteFile(p, b, 0o644); err != nil { // same inode
				t.Fatal(err)
			}
		},
		want: []string{"(written by the attempt, its content does not hash to its name: put back)"},
		check: func(t *testing.T, co string) {
			if got := mustGit(t, co, "cat-file", "-p", "HEAD:d000/f00000.txt"); got != "file 0" {
				t.Errorf("after restore git reads %q", got)
			}
		},
	}, {
		name: "a submodule's loose object rewritten",
		before: func(t *testing.T, co string) {
			sub := filepath.Join(co, ".git", "modules", "sub")
			mustGit(t, co, "init", "-q", "--bare", sub)
			mustGitIn(t, sub, "", strings.NewReader("sub\n"), "hash-object", "-w", "--stdin")
		},
		attack: func(t *testing.T, co string) {
			sub := filepath.Join(co, ".git", "modules", "sub")
			id := mustGitIn(t, sub, "", strings.NewReader("sub\n"), "hash-object", "--stdin")
			p := filepath.Join(sub, "objects", id[:2], id[2:])
			os.Chmod(p, 0o644)
			os.WriteFile(p, []byte("garbage"), 0o644)
		},
		want: []string{".git/modules/sub/objects/"},
		check: func(t *testing.T, co string) {
			if got := mustGit(t, filepath.Join(co, ".git", "modules", "sub"), "cat-file", "-p", "62e0af52c199ec731fe4ad230041cd3286192d49"); got != "sub" {
				t.Errorf("the submodule's object after restore: %q", got)
			}
		},
	}, {
		name: "forged object added",
		attack: func(t *testing.T, co string) {
			evil := mustGitIn(t, co, "", strings.NewReader("evil\n"), "hash-object", "-w", "--stdin")
			b, _ := os.ReadFile(loosePath(co, evil))
			fake := strings.Repeat("ab", 20)
			os.MkdirAll(filepath.Dir(loosePath(co, fake)), 0o755)
			os.WriteFile(loosePath(co, fake), b, 0o444)
		},
		want: []string{"objects/ab/" + strings.Repeat("ab", 19) + " (added by the attempt, its content does not hash to its name: removed)"},
	}, {
		name: "corrupt pack",
		attack: func(t *testing.T, co string) {
			os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("agent\n"), 0o644)
			mustGit(t, co, "commit", "-qam", "agent")
			mustGit(t, co, "repack", "-q", "-d")
			ents, _ := os.ReadDir(filepath.Join(co, ".git", "objects", "pack"))
			for _, e := range ents {
				if strings.HasSuffix(e.Name(), ".pack") {
					p := filepath.Join(co, ".git", "objects", "pack", e.Name())
					b, _ := os.ReadFile(p)
					b[len(b)/2] ^= 0xff
					os.Chmod(p, 0o644)
					os.WriteFile(p, b, 0o444)
				}
			}
		},
		want: []string{"does not verify: moved aside to pack-"},
	}, {
		name: "link out of the store",
		attack: func(t *testing.T, co string) {
			os.Symlink(t.TempDir(), filepath.Join(co, ".git", "objects", "fe"))
		},
		want: []string{".git/objects/fe (L--------- made by the attempt: removed)"},
	}, {
		name: "alternates added",
		attack: func(t *testing.T, co string) {
			os.WriteFile(filepath.Join(co, ".git", "objects", "info", "alternates"), []byte(t.TempDir()+"\n"), 0o644)
		},
		want: []string{".git/objects/info/alternates (added by the attempt: removed)"},
	}, {
		name: "the user's commit-graph rewritten",
		before: func(t *testing.T, co string) {
			mustGit(t, co, "commit-graph", "write", "--reachable")
		},
		attack: func(t *testing.T, co string) {
			base := mustGit(t, co, "rev-parse", "HEAD")
			os.WriteFile(filepath.Join(co, "d000", "f00000.txt"), []byte("planted\n"), 0o644)
			mustGit(t, co, "commit", "-qam", "planted")
			real := mustGitIn(t, co, "", nil, "-c", "user.name=a", "-c", "user.email=a@a", "commit-tree", "-m", "seed", "HEAD^{tree}")
			mustGit(t, co, "reset", "-q", "--hard", base)
			forgeCommitGraph(t, co, real, base)
		},
		want: []string{".git/objects/info/commit-graph (written by the attempt: removed)"},
		check: func(t *testing.T, co string) {
			if _, err := os.Stat(filepath.Join(co, ".git", "objects", "info", "commit-graph")); err != nil {
				t.Errorf("the user's commit-graph is not written anew: %v", err)
			}
			if out, err := plainGit(t, co, "show", "--stat", "--format=", "HEAD"); err != nil || !strings.Contains(out, "f00000") {
				t.Errorf("git show HEAD after restore: %q, %v", out, err)
			}
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			co := newRepo(t, 2)
			gd := filepath.Join(co, ".git")
			if tc.before != nil {
				tc.before(t, co)
			}
			snap, err := SnapshotObjects(co, []string{gd}, filepath.Join(t.TempDir(), "keep"))
			if err != nil {
				t.Fatal(err)
			}
			defer snap.Close()
			tc.attack(t, co)
			undone, err := snap.Restore(context.Background())
			if err != nil {
				t.Errorf("restore: %v", err)
			}
			t.Logf("undone: %v", undone)
			all := strings.Join(undone, "\n")
			for _, w := range tc.want {
				if !strings.Contains(all, w) {
					t.Errorf("undone %v lacks %q", undone, w)
				}
			}
			if len(tc.want) == 0 && len(undone) > 0 {
				t.Errorf("undone %v; want nothing", undone)
			}
			if tc.name != "corrupt pack" { // its objects are gone with it
				if out, err := plainGit(t, co, "fsck", "--no-dangling"); err != nil || out != "" {
					t.Errorf("git fsck after restore: %v\n%s", err, out)
				}
			}
			if tc.check != nil {
				tc.check(t, co)
			}
			if again, err := snap.Restore(context.Background()); err != nil || len(again) > 0 {
				t.Errorf("a second restore undid %v, %v; want nothing", again, err)
			}
		})
	}
}

func loosePath(co, id string) string {
	return filepath.Join(co, ".git", "objects", id[:2], id[2:])
}
