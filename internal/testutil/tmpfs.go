package testutil

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// Tmpfs mounts a tmpfs of size (as mount takes it: "16m") for t and
// returns its directory: a real filesystem that fills up and can be
// remounted read-only, for store-fault tests. Mounting needs root, which CI
// has; elsewhere the test is skipped, loudly.
func Tmpfs(t testing.TB, size string) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("STORE FAULT TEST NOT RUN: mounting a small tmpfs needs root (CI runs as root)")
	}
	dir := filepath.Join(t.TempDir(), "vol")
	if err := os.Mkdir(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mount", "-t", "tmpfs", "-o", "size="+size, "tmpfs", dir).CombinedOutput(); err != nil {
		t.Fatalf("mount tmpfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if out, err := exec.Command("umount", "-l", dir).CombinedOutput(); err != nil {
			t.Errorf("umount %s: %v: %s", dir, err, out)
		}
	})
	return dir
}

// Remount remounts dir with mode "ro" or "rw".
func Remount(t testing.TB, dir, mode string) {
	t.Helper()
	if out, err := exec.Command("mount", "-o", "remount,"+mode, dir).CombinedOutput(); err != nil {
		t.Fatalf("remount %s %s: %v: %s", dir, mode, err, out)
	}
}
