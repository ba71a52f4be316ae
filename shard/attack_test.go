package shard

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
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

	snap, err := SnapshotCheckout(co, []string{gd})
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

	undone, err := snap.Restore()
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
