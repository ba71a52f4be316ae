//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"os/exec"
	"path/filepath"
	"testing"
)

// TestRefusalsByCause: a connect and a chmod refused while the lease holds
// are refused for what they are, not for a loss (issue 33: run said "N
// file writes were refused after the lease was lost" for one refused
// connect of a held lease); writes refused after the loss are counted as
// such.
func TestRefusalsByCause(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	secret := filepath.Join(w.outside, "secret.txt")
	run := func(gate Gate, cmd *exec.Cmd) Refusals {
		t.Helper()
		pr, err := Start(context.Background(), w.policy(), gate, &memAuditor{}, cmd)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := pr.Wait(); err != nil {
			t.Fatal(err)
		}
		if pr.Denials() != pr.Refusals().Total() {
			t.Errorf("Denials %d, Refusals %+v: want the total", pr.Denials(), pr.Refusals())
		}
		return pr.Refusals()
	}
	held := &testGate{}
	got := run(held, exec.Command(helper, "connect", "127.0.0.1:9"))
	got2 := run(held, exec.Command("/bin/sh", "-c", "chmod 600 "+secret))
	got.Confined += got2.Confined
	got.AfterLoss += got2.AfterLoss
	if got.Confined < 2 || got.AfterLoss != 0 {
		t.Errorf("a refused connect and chmod while the lease holds: %+v, want 2 confined and none after a loss", got)
	}
	lost := &testGate{}
	lost.lost.Store(true)
	got = run(lost, exec.Command(helper, "write", filepath.Join(w.leased, "mine.txt")))
	if got.AfterLoss == 0 || got.Confined != 0 {
		t.Errorf("a write of the lease after the loss: %+v, want it counted after the loss only", got)
	}
}
