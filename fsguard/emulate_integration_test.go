//go:build integration && linux && (amd64 || arm64)

package fsguard

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestMetadataSymlinkRace: a thread swaps a symlink in the lease between a
// leased file and an outside one while another chmods it. The supervisor
// resolves the path once and acts on what it judged, so the outside file's
// mode never changes.
func TestMetadataSymlinkRace(t *testing.T) {
	helper := guardHelper(t)
	w := newWorktree(t)
	secret, mine := filepath.Join(w.outside, "secret.txt"), filepath.Join(w.leased, "mine.txt")
	link := filepath.Join(w.leased, "swap")
	r := runGuardedAudit(t, w.policy(), &testGate{}, &memAuditor{}, exec.Command(helper, "chmodrace", link, mine, secret, "3000"))
	t.Logf("race: %s", r.out)
	if !strings.HasPrefix(r.out, "ok=") || strings.HasPrefix(r.out, "ok=0 ") {
		t.Errorf("race output %q: want some chmods of the leased file to succeed", r.out)
	}
	if got := metaOf(t, secret).mode; got != 0o644 {
		t.Errorf("outside file mode %o after the race, want 644", got)
	}
	if got := metaOf(t, mine).mode; got != 0o600 {
		t.Errorf("leased file mode %o after the race, want 600", got)
	}
}
