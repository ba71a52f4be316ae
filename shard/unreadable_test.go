package shard

import (
	"io"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"

	"github.com/fenceline/fenceline/internal/gitsafe/gittrap"
)

// TestUnreadableDirHidesNoRepository: a path-leased attempt makes a
// repository whose config names programs inside its claim, then makes the
// directory above it unreadable (chmod 311). The user can still cd
// through it to the repository by name, and their git status there ran
// the attempt's programs; settle's walk for repositories skipped what it
// could not read. Settle makes such a directory, unreadable since the
// snapshot, searchable again, disarms the repository and says both.
// Root reads every directory, so as root the attack runs as nobody.
func TestUnreadableDirHidesNoRepository(t *testing.T) {
	if dir := os.Getenv("FENCELINE_TEST_UNREADABLE_DIR"); dir != "" {
		unreadableDirAttack(t, dir)
		return
	}
	if os.Geteuid() != 0 {
		unreadableDirAttack(t, t.TempDir())
		return
	}
	u, err := user.Lookup("nobody")
	if err != nil {
		t.Fatalf("the attack runs as the user nobody: %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	base, err := os.MkdirTemp("", "fenceline-unreadable-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		filepath.WalkDir(base, func(p string, d os.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				os.Chmod(p, 0o755)
			}
			return nil
		})
		os.RemoveAll(base)
	})
	bin := filepath.Join(base, "shard.test")
	if err := copyExecutable(os.Args[0], bin); err != nil {
		t.Fatal(err)
	}
	work := filepath.Join(base, "work")
	os.Mkdir(work, 0o755)
	for _, p := range []string{base, bin, work} {
		if err := os.Chown(p, uid, gid); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command(bin, "-test.run=^TestUnreadableDirHidesNoRepository$", "-test.v", "-test.count=1")
	cmd.Dir = work
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + base, "FENCELINE_TEST_UNREADABLE_DIR=" + work, "GIT_CONFIG_NOSYSTEM=1"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}}
	out, err := cmd.CombinedOutput()
	t.Logf("as nobody:\n%s", out)
	if err != nil || !strings.Contains(string(out), "--- PASS") {
		t.Fatalf("the attack as nobody: %v", err)
	}
}

func copyExecutable(src, dst string) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o755)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}

func unreadableDirAttack(t *testing.T, dir string) {
	claim := filepath.Join(dir, "claim")
	os.MkdirAll(claim, 0o755)
	snap, err := SnapshotClaims(t.Context(), dir, []string{claim})
	if err != nil {
		t.Fatal(err)
	}
	defer snap.Close()

	locked := filepath.Join(claim, "locked")
	trap := filepath.Join(locked, "trap")
	os.MkdirAll(trap, 0o755)
	mustGit(t, trap, "init", "-q")
	marker := filepath.Join(dir, "ran")
	if err := gittrap.Plant(filepath.Join(trap, ".git"), "", filepath.Join(dir, "traps"), marker); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(locked, 0o311); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(locked, 0o755) })
	if _, err := os.ReadDir(locked); err == nil {
		t.Fatalf("%s is readable after chmod 311 (running as uid %d): the test proves nothing", locked, os.Geteuid())
	}
	if out, _ := plainGit(t, trap, "status"); gittrap.Ran(marker) == "" {
		t.Fatalf("the planted repository runs nothing (%s): the test proves nothing", out)
	}
	os.Remove(marker)

	undone, err := snap.Restore(t.Context())
	if err != nil {
		t.Errorf("restore: %v", err)
	}
	t.Logf("undone: %v", undone)
	all := strings.Join(undone, "\n")
	for _, want := range []string{
		"claim/locked (unreadable since the snapshot, mode 0311: made searchable, 0711, to look for repositories in it)",
		"claim/locked/trap/.git (added; moved to",
	} {
		if !strings.Contains(all, want) {
			t.Errorf("undone lacks %q", want)
		}
	}
	plainGit(t, trap, "status")
	if ran := gittrap.Ran(marker); ran != "" {
		t.Errorf("the user's git in %s ran the attempt's programs:\n%s", trap, ran)
	}
}
