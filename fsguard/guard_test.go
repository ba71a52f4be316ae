//go:build linux && (amd64 || arm64)

package fsguard

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestAvailable(t *testing.T) {
	t.Parallel()
	abi, err := Available()
	if err != nil {
		t.Fatalf("Available: %v (this suite needs a kernel with Landlock)", err)
	}
	if abi < 4 {
		t.Fatalf("Landlock ABI %d, want >= 4 for TCP rules", abi)
	}
}

func TestShellWritesConfinedToLease(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	p := w.policy()
	for _, tc := range []struct {
		name, script string
		wantOK       bool
	}{
		{"leased file", "echo hi > leased/new.txt && echo more >> leased/mine.txt", true},
		{"leased subdir", "mkdir -p leased/a/b && echo x > leased/a/b/c && mv leased/a/b/c leased/a/d && rm leased/a/d", true},
		{"private tmp", `echo x > "$TMPDIR/t" && cat "$TMPDIR/t"`, true},
		{"dev null", "echo x > /dev/null", true},
		{"other path of the worktree", "echo x > other/new.txt", false},
		{"overwrite another claim's file", "echo x > other/theirs.txt", false},
		{"worktree root", "echo x > new-at-root.txt", false},
		{"git dir", "mkdir .git", false},
		{"outside the worktree", "echo x > " + filepath.Join(w.outside, "new.txt"), false},
		{"delete outside the lease", "rm other/theirs.txt", false},
		{"system tmp", "echo x > /tmp/fsguard-escape-$$", false},
		{"read anywhere", "cat other/theirs.txt " + filepath.Join(w.outside, "secret.txt") + " /etc/hostname >/dev/null", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := sh(t, p, w.root, tc.script)
			if (r.code == 0) != tc.wantOK {
				t.Fatalf("%q: exit %d (%s), want success=%v", tc.script, r.code, r.out, tc.wantOK)
			}
			if !tc.wantOK && !strings.Contains(r.out, "ermission denied") && !strings.Contains(r.out, "Operation not permitted") {
				t.Errorf("%q: output %q, want a permission error", tc.script, r.out)
			}
		})
	}
	if _, err := os.Stat(filepath.Join(w.other, "theirs.txt")); err != nil {
		t.Errorf("another claim's file was touched: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(w.leased, "new.txt")); string(b) != "hi\n" {
		t.Errorf("leased/new.txt = %q, want the guarded write", b)
	}
}
