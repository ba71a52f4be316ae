//go:build integration && linux && (amd64 || arm64)

package fsguard

import (
	"net"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/fenceline/fenceline/lease"
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

// TestAgentCannotListenOnSidecarPorts: the sidecar is gone (killed,
// restarting) and its ports are free. The agent tries to take them — its
// admin port, which the agent wrapper asks for the lease, and a fence's —
// on every address that reaches them; every bind is refused with EACCES
// and audited naming the lease, while the lease holds and after it is
// lost, and the restarted sidecar listens there again. UDP gets the same
// answer.
func TestAgentCannotListenOnSidecarPorts(t *testing.T) {
	helper := guardHelper(t)
	admin, fence := freePort(t), freePort(t)
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{fence}
	p.ReservedPorts = []uint16{admin}
	for _, lost := range []bool{false, true} {
		gate := &testGate{}
		gate.lost.Store(lost)
		audit := &memAuditor{}
		for _, port := range []uint16{admin, fence} {
			ps := strconv.Itoa(int(port))
			for _, host := range []string{"127.0.0.1", "0.0.0.0", "[::]", "[::1]", "[::ffff:127.0.0.1]"} {
				addr := host + ":" + ps
				if r := runAudited(t, p, gate, audit, w.root, helper, "listen", addr); r.out != "bind: EACCES" {
					t.Errorf("lost=%v: the agent listening on the sidecar's %s: %q, want bind: EACCES", lost, addr, r.out)
				}
			}
			wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "bind to 127.0.0.1:"+ps, "sidecar")
		}
	}
	p.AllowAnyConnect = true // UDP sockets allowed
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "bindudp", "127.0.0.1:"+strconv.Itoa(int(admin))); r.out != "bind: EACCES" {
		t.Errorf("the agent binding UDP on the sidecar's admin port: %q, want bind: EACCES", r.out)
	}
	for _, port := range []uint16{admin, fence} {
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(int(port))))
		if err != nil {
			t.Fatalf("the restarted sidecar cannot listen on its port: %v", err)
		}
		l.Close()
	}
}
