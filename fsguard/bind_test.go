//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// freePort returns a loopback TCP port that was just listened on and is
// free again: a sidecar's port after the sidecar was killed.
func freePort(t *testing.T) uint16 {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := port(l)
	l.Close()
	return p
}

// TestAgentListensOnEphemeralAndAllowedPorts: a port the kernel chooses
// (bind to port 0, or listen with no bind: test servers) is the agent's;
// a fixed port is refused unless the policy allows it (a dev server's), and
// a sidecar's port cannot be allowed.
func TestAgentListensOnEphemeralAndAllowedPorts(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	admin, dev := freePort(t), freePort(t)
	w := newWorktree(t)
	p := w.policy()
	p.ReservedPorts = []uint16{admin}
	for _, args := range [][]string{{"listen", "127.0.0.1:0"}, {"listen", "[::]:0"}, {"listenauto"}} {
		r := runAudited(t, p, &testGate{}, nil, w.root, helper, args...)
		n, err := strconv.Atoi(strings.TrimPrefix(r.out, "ok:"))
		if !strings.HasPrefix(r.out, "ok:") || err != nil || n == 0 || n == int(admin) {
			t.Errorf("%v: %q, want ok and a port the kernel chose", args, r.out)
		}
	}
	devAddr := "127.0.0.1:" + strconv.Itoa(int(dev))
	audit := &memAuditor{}
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "listen", devAddr); r.out != "bind: EACCES" {
		t.Errorf("a dev server on %s with no allowed port: %q, want bind: EACCES", devAddr, r.out)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "bind to "+devAddr, "--allow-bind")
	p.BindPorts = []uint16{dev}
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "listen", devAddr); r.out != fmt.Sprintf("ok:%d", dev) {
		t.Errorf("a dev server on the allowed %s: %q, want ok:%d", devAddr, r.out, dev)
	}
	for _, q := range []Policy{
		{BindPorts: []uint16{admin}, ReservedPorts: []uint16{admin}},
		{BindPorts: []uint16{dev}, ConnectPorts: []uint16{dev}},
	} {
		if err := q.Validate(); err == nil || !strings.Contains(err.Error(), "bind") {
			t.Errorf("Validate(BindPorts %v, reserved %v, connect %v) = %v, want a refusal", q.BindPorts, q.ReservedPorts, q.ConnectPorts, err)
		}
	}
}

// TestAbstractUnixBindRefused: an abstract Unix name is a listener anyone
// in the network namespace (the sidecar's container included) can reach
// by name, like a port; the agent may not take one. An autobind (a name
// the kernel picks) is allowed.
func TestAbstractUnixBindRefused(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	p := w.policy()
	audit := &memAuditor{}
	name := "fenceline-admin-" + strconv.Itoa(int(freePort(t)))
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "bindabstract", name); r.out != "EACCES" {
		t.Errorf("abstract bind @%s: %q, want EACCES", name, r.out)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "abstract Unix socket", name)
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "bindabstract", ""); r.out != "ok" {
		t.Errorf("abstract autobind: %q, want ok", r.out)
	}
}

// TestBindWithoutLandlockNet: on a kernel whose Landlock cannot judge
// binds (ABI < 4), the supervisor's checks stand alone: a bind to the
// sidecar's port is still refused, and a bind that races its check may
// reach the port but cannot listen on it, so no client of the sidecar
// reaches the agent.
func TestBindWithoutLandlockNet(t *testing.T) {
	// Not in parallel: it lowers the package's abiLimit.
	abiLimit = 3
	t.Cleanup(func() { abiLimit = 0 })
	helper := guardHelper(t)
	admin := freePort(t)
	w := newWorktree(t)
	p := w.policy()
	p.ReservedPorts = []uint16{admin}
	ps := strconv.Itoa(int(admin))
	audit := &memAuditor{}
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "listen", "127.0.0.1:"+ps); r.out != "bind: EACCES" {
		t.Errorf("ABI 3: the agent listening on the sidecar's port: %q, want bind: EACCES", r.out)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "bind to 127.0.0.1:"+ps, "sidecar")
	r := runAudited(t, p, &testGate{}, audit, w.root, helper, "bindrace", filepath.Join(w.leased, "race.sock"), ps, "3000")
	if !strings.HasPrefix(r.out, "reached=") || !strings.HasSuffix(r.out, " listened=0") {
		t.Errorf("ABI 3: the raced bind: %q, want listened=0", r.out)
	}
	if r.out != "reached=0 listened=0" {
		wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "listen on port "+ps, "sidecar")
	}
	t.Logf("ABI 3, raced bind: %s", r.out)
}
