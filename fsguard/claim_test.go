//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// TestWritableThroughSymlinkRefused is finding 3 of issue 17 at the guard:
// a writable path that resolves through a symlink (leased/evil ->
// ../other) would grant its target, which the lease service never
// compared with other claims. Start refuses it, naming the real path.
func TestWritableThroughSymlinkRefused(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	evil := filepath.Join(w.leased, "evil")
	if err := os.Symlink("../other", evil); err != nil {
		t.Fatal(err)
	}
	for _, writable := range []string{evil, filepath.Join(evil, ".")} {
		p := w.policy()
		p.Writable = []string{writable}
		cmd := exec.Command("sh", "-c", "echo pwned > "+filepath.Join(w.other, "theirs.txt"))
		pr, err := Start(context.Background(), p, &testGate{}, nil, cmd)
		if err == nil {
			pr.Wait()
			t.Fatalf("Start granted %s, a symlink to %s", writable, w.other)
		}
		if !strings.Contains(err.Error(), "resolves to \""+w.other+"\" through a symlink") {
			t.Errorf("Start(%s): %v; want it to name the real path %s", writable, err, w.other)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(w.other, "theirs.txt")); string(b) != "data" {
		t.Fatalf("the other claim's file changed: %q", b)
	}
}

// TestWritableRuleChecksTheDescriptor: the guarded child grants a writable
// path on the descriptor it opened, only once that descriptor is the path
// itself; a symlink swapped in after the supervisor resolved the policy
// (another agent replacing the claimed directory) is refused.
func TestWritableRuleChecksTheDescriptor(t *testing.T) {
	t.Parallel()
	if _, err := Available(); err != nil {
		t.Fatalf("the guard's tests need Landlock: %v", err)
	}
	w := newWorktree(t)
	attr := rulesetAttr{fs: handledFS(1)}
	rfd, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), unsafe.Sizeof(attr.fs), 0)
	if errno != 0 {
		t.Fatal(errno)
	}
	defer unix.Close(int(rfd))
	if err := addWritableRule(int(rfd), w.leased, handledFS(1)); err != nil {
		t.Fatalf("real path refused: %v", err)
	}
	// The claimed directory is swapped for a symlink to another claim.
	if err := os.RemoveAll(w.leased); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(w.other, w.leased); err != nil {
		t.Fatal(err)
	}
	err := addWritableRule(int(rfd), w.leased, handledFS(1))
	if err == nil || !strings.Contains(err.Error(), "now resolves to "+w.other) {
		t.Fatalf("swapped path: %v; want a refusal naming %s", err, w.other)
	}
}
