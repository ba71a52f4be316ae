package shard

import (
	"context"
	"encoding/binary"
	"encoding/hex"
	"os"
	"path/filepath"
	"slices"
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
	}, {
		name: "the user's multi-pack-index forged",
		before: func(t *testing.T, co string) {
			mustGit(t, co, "repack", "-adq")
			mustGit(t, co, "multi-pack-index", "write", "--no-progress")
		},
		attack: func(t *testing.T, co string) {
			a := mustGit(t, co, "rev-parse", "HEAD:d000/f00000.txt")
			b := mustGit(t, co, "rev-parse", "HEAD:d000/f00001.txt")
			forgeMIDX(t, co, a, b)
			if out, _ := plainGit(t, co, "cat-file", "-p", a); out != "file 1" {
				t.Fatalf("the forged multi-pack-index is not believed (%s reads %q): the test proves nothing", a, out)
			}
		},
		want: []string{".git/objects/pack/multi-pack-index (written by the attempt: removed)", ".git/objects/pack/multi-pack-index (the repository's: written anew)"},
		check: func(t *testing.T, co string) {
			if out, err := plainGit(t, co, "cat-file", "-p", "HEAD:d000/f00000.txt"); err != nil || out != "file 0" {
				t.Errorf("after restore git reads %q, %v", out, err)
			}
			if out, err := plainGit(t, co, "multi-pack-index", "verify", "--no-progress"); err != nil {
				t.Errorf("the multi-pack-index written anew: %v\n%s", err, out)
			}
		},
	}, {
		name: "the user's pack index forged",
		before: func(t *testing.T, co string) {
			mustGit(t, co, "repack", "-adq")
		},
		attack: func(t *testing.T, co string) {
			a := mustGit(t, co, "rev-parse", "HEAD:d000/f00000.txt")
			b := mustGit(t, co, "rev-parse", "HEAD:d000/f00001.txt")
			forgeIdx(t, co, a, b)
			if out, _ := plainGit(t, co, "cat-file", "-p", a); out != "file 1" {
				t.Fatalf("the forged pack index is not believed (%s reads %q): the test proves nothing", a, out)
			}
		},
		want: []string{"(its index written by the attempt does not match the repository's pack: moved aside to pack-", ", the index written anew from the pack)"},
		check: func(t *testing.T, co string) {
			if out, err := plainGit(t, co, "cat-file", "-p", "HEAD:d000/f00000.txt"); err != nil || out != "file 0" {
				t.Errorf("after restore git reads %q, %v", out, err)
			}
		},
	}, {
		name: "bitmap and split commit-graph written",
		attack: func(t *testing.T, co string) {
			mustGit(t, co, "repack", "-adqb")
			mustGit(t, co, "commit-graph", "write", "--reachable", "--split", "--no-progress")
		},
		want: []string{".bitmap (added by the attempt: removed)", ".git/objects/info/commit-graphs/commit-graph-chain (added by the attempt: removed)"},
		check: func(t *testing.T, co string) {
			for _, glob := range []string{"pack/*.bitmap", "info/commit-graphs/*"} {
				if m, _ := filepath.Glob(filepath.Join(co, ".git", "objects", glob)); len(m) > 0 {
					t.Errorf("left after restore: %v", m)
				}
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
			if !strings.Contains(strings.Join(tc.want, "\n"), "does not verify") { // its objects are gone with the pack
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

// forgeMIDX swaps, in co's multi-pack-index, the pack offsets of objects
// a and b: git then reads b's content under a's id (it hashes neither a
// packed object nor the multi-pack-index when it reads them).
func forgeMIDX(t *testing.T, co, a, b string) {
	t.Helper()
	p := filepath.Join(co, ".git", "objects", "pack", "multi-pack-index")
	m, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	if string(m[:4]) != "MIDX" || m[5] != 1 {
		t.Fatalf("not a SHA-1 multi-pack-index: % x", m[:8])
	}
	chunk := map[string]int{}
	for i := range int(m[6]) {
		e := m[12+12*i:]
		chunk[string(e[:4])] = int(binary.BigEndian.Uint64(e[4:12]))
	}
	oidl, ooff := chunk["OIDL"], chunk["OOFF"]
	if oidl == 0 || ooff == 0 {
		t.Fatalf("no OIDL or OOFF chunk: %v", chunk)
	}
	n := int(binary.BigEndian.Uint32(m[chunk["OIDF"]+4*255:]))
	find := func(id string) int {
		for i := range n {
			if hex.EncodeToString(m[oidl+20*i:oidl+20*i+20]) == id {
				return i
			}
		}
		t.Fatalf("%s is not in the multi-pack-index", id)
		return 0
	}
	i, j := ooff+8*find(a), ooff+8*find(b)
	ei, ej := slices.Clone(m[i:i+8]), slices.Clone(m[j:j+8])
	copy(m[i:], ej)
	copy(m[j:], ei)
	os.Chmod(p, 0o644)
	if err := os.WriteFile(p, m, 0o444); err != nil {
		t.Fatal(err)
	}
}

// forgeIdx swaps, in the index of co's one pack, the offsets of objects a
// and b: git then reads b's content under a's id.
func forgeIdx(t *testing.T, co, a, b string) {
	t.Helper()
	idx, _ := filepath.Glob(filepath.Join(co, ".git", "objects", "pack", "*.idx"))
	if len(idx) != 1 {
		t.Fatalf("want one pack index, have %v", idx)
	}
	m, err := os.ReadFile(idx[0])
	if err != nil {
		t.Fatal(err)
	}
	if string(m[:4]) != "\xfftOc" || binary.BigEndian.Uint32(m[4:]) != 2 {
		t.Fatalf("not a version 2 pack index")
	}
	n := int(binary.BigEndian.Uint32(m[8+4*255:]))
	ids, offs := 8+4*256, 8+4*256+24*n
	find := func(id string) int {
		for i := range n {
			if hex.EncodeToString(m[ids+20*i:ids+20*i+20]) == id {
				return offs + 4*i
			}
		}
		t.Fatalf("%s is not in the pack", id)
		return 0
	}
	i, j := find(a), find(b)
	ei, ej := slices.Clone(m[i:i+4]), slices.Clone(m[j:j+4])
	copy(m[i:], ej)
	copy(m[j:], ei)
	os.Chmod(idx[0], 0o644)
	if err := os.WriteFile(idx[0], m, 0o444); err != nil {
		t.Fatal(err)
	}
}

// TestRestoreLFSObjects: the user's repository keeps a file in Git LFS.
// An exclusive attempt without a pool rewrites its LFS object in place
// (same size, its own bytes): git-lfs checks only the size, so the
// user's git checkout -- a.bin wrote the attempt's bytes. Restore removes
// an LFS object that does not hash to its name (git lfs fetch brings it
// back) and keeps the ones the attempt added honestly.
func TestRestoreLFSObjects(t *testing.T) {
	t.Parallel()
	co := newRepo(t, 2)
	for _, args := range [][]string{{"lfs", "install", "--local"}, {"lfs", "track", "*.bin"}} {
		if out, err := plainGit(t, co, args...); err != nil {
			t.Fatalf("git %s (Git LFS is one of the test's tools): %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	os.WriteFile(filepath.Join(co, "a.bin"), []byte("original\n"), 0o644)
	userGit := func(args ...string) { // with the repository's own config: the LFS filter
		t.Helper()
		if out, err := plainGit(t, co, args...); err != nil {
			t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	userGit("add", "-A")
	userGit("commit", "-qm", "lfs")
	snap, err := SnapshotObjects(co, []string{filepath.Join(co, ".git")}, filepath.Join(t.TempDir(), "keep"))
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()

	objs, _ := filepath.Glob(filepath.Join(co, ".git", "lfs", "objects", "*", "*", "*"))
	if len(objs) != 1 {
		t.Fatalf("want a.bin's one LFS object, have %v", objs)
	}
	os.Chmod(objs[0], 0o644)
	if err := os.WriteFile(objs[0], []byte("EVILEVIL\n"), 0o444); err != nil { // same size
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(co, "b.bin"), []byte("the attempt's\n"), 0o644) // honest
	userGit("add", "b.bin")
	userGit("commit", "-qm", "attempt")
	checkout := func() string {
		os.WriteFile(filepath.Join(co, "a.bin"), []byte("user edit\n"), 0o644)
		plainGit(t, co, "checkout", "--", "a.bin")
		b, _ := os.ReadFile(filepath.Join(co, "a.bin"))
		return string(b)
	}
	if got := checkout(); got != "EVILEVIL\n" {
		t.Fatalf("the rewritten LFS object is not believed (checkout wrote %q): the test proves nothing", got)
	}

	undone, err := snap.Restore(context.Background())
	if err != nil {
		t.Errorf("restore: %v", err)
	}
	t.Logf("undone: %v", undone)
	rel, _ := filepath.Rel(co, objs[0])
	want := rel + " (written by the attempt, its content does not hash to its name: removed; git lfs fetch brings it back)"
	if len(undone) != 1 || undone[0] != want {
		t.Errorf("undone %q, want only %q", undone, want)
	}
	if got := checkout(); got == "EVILEVIL\n" {
		t.Errorf("after restore the user's git checkout -- a.bin still writes the attempt's bytes")
	}
	if out, err := plainGit(t, co, "show", "HEAD:b.bin"); err != nil || !strings.Contains(out, "oid sha256:") {
		t.Errorf("the attempt's honest LFS file: %q, %v", out, err)
	}
	if b, err := os.ReadFile(filepath.Join(co, "b.bin")); err != nil || string(b) != "the attempt's\n" {
		t.Errorf("the attempt's honest LFS object is gone: %q, %v", b, err)
	}
}
