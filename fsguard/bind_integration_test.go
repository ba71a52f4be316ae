//go:build integration && linux && (amd64 || arm64)

package fsguard

import (
	"path/filepath"
	"strconv"
	"testing"
)

// TestBindRaceCannotTakeSidecarPort: a Unix socket bind in the agent's
// own dir continues to the kernel (Landlock judges the socket file); the
// agent swaps a TCP socket onto the descriptor and the sidecar's port into
// the address while the call waits. The kernel must still refuse the port.
func TestBindRaceCannotTakeSidecarPort(t *testing.T) {
	helper := guardHelper(t)
	admin := freePort(t)
	w := newWorktree(t)
	p := w.policy()
	p.ReservedPorts = []uint16{admin}
	r := runAudited(t, p, &testGate{}, nil, w.root, helper, "bindrace", filepath.Join(w.leased, "race.sock"), strconv.Itoa(int(admin)), "3000")
	if r.out != "reached=0 listened=0" {
		t.Errorf("the raced bind: %q, want reached=0 listened=0", r.out)
	}
}
