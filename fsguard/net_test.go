//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// wantDenial fails unless audit holds a denial on boundary with reason
// whose message contains every part.
func wantDenial(t *testing.T, audit *memAuditor, boundary, reason string, parts ...string) {
	t.Helper()
	evs := audit.all()
	for _, ev := range evs {
		if ev.Type != lease.EventDenied || ev.Boundary != boundary || ev.Reason != reason ||
			ev.LeaseID != "lease_test1" || ev.Fence != 7 {
			continue
		}
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(ev.Message, p)
		}
		if ok {
			return
		}
	}
	var msgs []string
	for _, ev := range evs {
		msgs = append(msgs, fmt.Sprintf("[%s %s] %s", ev.Boundary, ev.Reason, ev.Message))
	}
	t.Errorf("no %s denial (%s) mentioning %q among %d audit events:\n%s", boundary, reason, parts, len(evs), strings.Join(msgs, "\n"))
}

// counted is a listener that accepts (and closes) every connection and
// counts them.
type counted struct {
	net.Listener
	n atomic.Int64
}

func countingListener(t *testing.T, network, addr string) *counted {
	t.Helper()
	l, err := net.Listen(network, addr)
	if err != nil {
		t.Fatal(err)
	}
	c := &counted{Listener: l}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			conn, err := l.Accept()
			if err != nil {
				return
			}
			c.n.Add(1)
			conn.Close()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return c
}

// reached is how many connections from anyone but the test reached the
// listener: the test connects once itself and waits for that connection,
// which the listener accepts after every earlier one (FIFO backlog).
func (c *counted) reached(t *testing.T) int64 {
	t.Helper()
	before := c.n.Load()
	conn, err := net.Dial(c.Addr().Network(), c.Addr().String())
	if err != nil {
		t.Fatalf("sentinel connect to %s: %v", c.Addr(), err)
	}
	conn.Close()
	testutil.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if c.n.Load() <= before {
			return fmt.Errorf("sentinel connection not accepted by %s yet", c.Addr())
		}
		return nil
	})
	return c.n.Load() - 1
}

func (c *counted) port() uint16 { return port(c.Listener) }

// TestTCPFastOpenRefused: sendto(MSG_FASTOPEN) on a fresh TCP socket
// connects inside the send call, where Landlock's connect hook never runs.
// The guard refuses it (and TCP_FASTOPEN_CONNECT, which defers a connect
// into the first send): the listener never sees the agent.
func TestTCPFastOpenRefused(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	allowed := countingListener(t, "tcp", "127.0.0.1:0")
	forbidden := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{allowed.port()}
	audit := &memAuditor{}
	for _, call := range []string{"sendto", "sendmsg"} {
		if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "tfo", forbidden.Addr().String(), call); r.out == "ok" {
			t.Errorf("%s(MSG_FASTOPEN) to %s: %q, want it refused", call, forbidden.Addr(), r.out)
		}
	}
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "tfoconnect"); r.out == "ok" {
		t.Errorf("setsockopt(TCP_FASTOPEN_CONNECT): %q, want it refused", r.out)
	}
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "rawconnect", forbidden.Addr().String(), "block"); r.out != "EACCES" {
		t.Errorf("connect to %s: %q, want EACCES", forbidden.Addr(), r.out)
	}
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("the forbidden listener accepted %d connections from the guarded agent", n)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "sendto with MSG_FASTOPEN")
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "sendmsg with MSG_FASTOPEN")
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "TCP_FASTOPEN_CONNECT")
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "connect", forbidden.Addr().String())
}

// TestTCPConnectAllowedLoopback: a connect to a ConnectPorts port on the
// loopback works with blocking and non-blocking sockets; the same port on
// another address is refused (the port rule is for the sidecar, hosts go
// through the egress proxy).
func TestTCPConnectAllowedLoopback(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	allowed := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{allowed.port()}
	audit := &memAuditor{}
	for _, mode := range []string{"block", "nonblock"} {
		if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "rawconnect", allowed.Addr().String(), mode); r.out != "ok" {
			t.Errorf("%s connect to the allowed %s: %q, want ok", mode, allowed.Addr(), r.out)
		}
	}
	if n := allowed.reached(t); n != 2 {
		t.Errorf("the allowed listener accepted %d connections, want 2", n)
	}
	remote := "192.0.2.1:" + strconv.Itoa(int(allowed.port())) // TEST-NET-1: not local
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "rawconnect", remote, "nonblock"); r.out != "EACCES" {
		t.Errorf("connect to %s (allowed port, not loopback): %q, want EACCES", remote, r.out)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, remote, "--allow-host")
}

// TestTCPConnectAddressRace: another thread rewrites the sockaddr between
// the allowed and a forbidden port while the agent connects in a loop; the
// supervisor connects with its own copy, so the forbidden listener is never
// reached.
func TestTCPConnectAddressRace(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	allowed := countingListener(t, "tcp", "127.0.0.1:0")
	forbidden := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{allowed.port()}
	r := runAudited(t, p, &testGate{}, nil, w.root, helper, "connectrace",
		strconv.Itoa(int(allowed.port())), strconv.Itoa(int(forbidden.port())), "2000")
	t.Logf("connects: %s", r.out)
	if !onlyOKOrRefused.MatchString(r.out) {
		t.Errorf("connects ended %s, want only ok (some) and EACCES", r.out)
	}
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("the forbidden listener accepted %d connections (race won): %s", n, r.out)
	}
}

// onlyOKOrRefused matches the helper's tally of a race: some connects
// succeeded, the others were refused, none failed otherwise.
var onlyOKOrRefused = regexp.MustCompile(`^map\[(EACCES:\d+ )?ok:\d+\]$`)

// TestUnixConnectLimited: a Unix socket is reachable only when the policy
// lists it (judged by the socket file, however the path is spelled);
// another local server's socket, an abstract socket and a missing path are
// not.
func TestUnixConnectLimited(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	dir := t.TempDir()
	allowedPath, forbiddenPath := filepath.Join(dir, "allowed.sock"), filepath.Join(dir, "pg.sock")
	allowed := countingListener(t, "unix", allowedPath)
	forbidden := countingListener(t, "unix", forbiddenPath)
	abstract := countingListener(t, "unix", "@fsguard-test-"+strconv.Itoa(os.Getpid()))
	if err := os.Symlink(allowedPath, filepath.Join(dir, "link.sock")); err != nil {
		t.Fatal(err)
	}
	w := newWorktree(t)
	p := w.policy()
	p.UnixSockets = []string{allowedPath}
	audit := &memAuditor{}
	for _, tc := range []struct{ path, want string }{
		{forbiddenPath, "EACCES"},
		{"@fsguard-test-" + strconv.Itoa(os.Getpid()), "EACCES"},
		{allowedPath, "ok"},
		{"allowed.sock", "ok"}, // relative to the agent's cwd
		{filepath.Join(dir, "link.sock"), "ok"},
		{filepath.Join(dir, "missing.sock"), "ENOENT"},
	} {
		if r := runAudited(t, p, &testGate{}, audit, dir, helper, "unixconnect", tc.path); r.out != tc.want {
			t.Errorf("unix connect to %s: %q, want %s", tc.path, r.out, tc.want)
		}
	}
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("the unlisted socket accepted %d connections", n)
	}
	if n := abstract.reached(t); n != 0 {
		t.Errorf("the abstract socket accepted %d connections", n)
	}
	if n := allowed.reached(t); n != 3 {
		t.Errorf("the listed socket accepted %d connections, want 3", n)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, forbiddenPath)
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "abstract")
}

// TestUnixConnectSymlinkRace: the test swaps a symlink between the listed
// socket and another server's while the agent connects through it in a
// loop; the supervisor connects to the socket file it judged (through its
// own O_PATH descriptor), never to what the name points to later.
func TestUnixConnectSymlinkRace(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	dir := t.TempDir()
	allowedPath, forbiddenPath := filepath.Join(dir, "allowed.sock"), filepath.Join(dir, "pg.sock")
	allowed := countingListener(t, "unix", allowedPath)
	forbidden := countingListener(t, "unix", forbiddenPath)
	link := filepath.Join(dir, "link.sock")
	if err := os.Symlink(allowedPath, link); err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	swapped := make(chan int)
	go func() {
		n := 0
		defer func() { swapped <- n }()
		for ; ; n++ {
			select {
			case <-stop:
				return
			default:
			}
			target := allowedPath
			if n%2 == 0 {
				target = forbiddenPath
			}
			tmp := link + ".tmp"
			os.Remove(tmp)
			if os.Symlink(target, tmp) == nil {
				os.Rename(tmp, link)
			}
		}
	}()
	w := newWorktree(t)
	p := w.policy()
	p.UnixSockets = []string{allowedPath}
	r := runAudited(t, p, &testGate{}, nil, dir, helper, "unixrace", link, "2000")
	close(stop)
	t.Logf("connects: %s; %d symlink swaps", r.out, <-swapped)
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("the unlisted socket accepted %d connections (race won): %s", n, r.out)
	}
	if allowed.reached(t) == 0 || !onlyOKOrRefused.MatchString(r.out) {
		t.Errorf("connects ended %s, want only ok (some) and EACCES", r.out)
	}
}

// TestDatagramSocketsRefused: UDP (and every socket but TCP, Unix stream
// and seqpacket and netlink route) is refused at socket(), so no datagram
// can be addressed to a local or remote port; AllowAnyConnect allows UDP.
func TestDatagramSocketsRefused(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	w := newWorktree(t)
	p := w.policy()
	audit := &memAuditor{}
	if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "udp", pc.LocalAddr().String()); r.out != "EACCES" {
		t.Errorf("UDP datagram to %s: %q, want EACCES", pc.LocalAddr(), r.out)
	}
	// A sentinel datagram from the test: anything the agent sent would
	// have been queued before it.
	if _, err := pc.WriteTo([]byte("sentinel"), pc.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	pc.SetReadDeadline(time.Now().Add(5 * time.Second))
	buf := make([]byte, 64)
	if n, _, err := pc.ReadFrom(buf); err != nil || string(buf[:n]) != "sentinel" {
		t.Errorf("UDP listener received %q (%v), want only the test's sentinel", buf[:n], err)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "SOCK_DGRAM")

	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"unix dgram", []string{"1", "2", "0"}, "EACCES"},
		{"unix dgram pair", []string{"1", "2", "0", "pair"}, "EACCES"},
		{"inet raw", []string{"2", "3", "1"}, "EACCES"},
		{"icmp ping", []string{"2", "2", "1"}, "EACCES"},
		{"mptcp", []string{"2", "1", "262"}, "EACCES"},
		{"sctp", []string{"2", "1", "132"}, "EACCES"},
		{"udp6", []string{"10", "2", "0"}, "EACCES"},
		{"packet", []string{"17", "3", "0"}, "EACCES"},
		{"vsock", []string{"40", "1", "0"}, "EACCES"},
		{"netlink audit", []string{"16", "3", "9"}, "EACCES"},
		{"tcp", []string{"2", strconv.Itoa(unix.SOCK_STREAM | unix.SOCK_NONBLOCK | unix.SOCK_CLOEXEC), "0"}, "ok"},
		{"tcp6 ipproto_tcp", []string{"10", "1", "6"}, "ok"},
		{"unix stream", []string{"1", "1", "0"}, "ok"},
		{"unix seqpacket pair", []string{"1", "5", "0", "pair"}, "ok"},
		{"netlink route", []string{"16", "3", "0"}, "ok"},
	} {
		if r := runAudited(t, p, &testGate{}, nil, w.root, helper, append([]string{"socket"}, tc.args...)...); r.out != tc.want {
			t.Errorf("%s socket: %q, want %s", tc.name, r.out, tc.want)
		}
	}

	p.AllowAnyConnect = true
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "udp", pc.LocalAddr().String()); r.out != "ok" {
		t.Errorf("UDP with AllowAnyConnect: %q, want ok", r.out)
	}
	pc.SetReadDeadline(time.Now().Add(5 * time.Second)) // the one above ran out over the table's runs (-race)
	if n, _, err := pc.ReadFrom(buf); err != nil || string(buf[:n]) != "leak" {
		t.Errorf("UDP with AllowAnyConnect: received %q (%v)", buf[:n], err)
	}
}

// TestBindAfterLoss: once the lease is lost, binding a Unix socket (which
// creates a file) in the leased dir is refused and audited; binding a TCP
// port the kernel chooses, or an abstract name it chooses, still works (it
// writes nothing). While the lease holds, Landlock
// judges the socket file like any other.
func TestBindAfterLoss(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	p := w.policy()
	held := filepath.Join(w.leased, "held.sock")
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "bindunix", held); r.out != "ok" {
		t.Errorf("bind %s while the lease holds: %q, want ok", held, r.out)
	}
	if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "bindunix", filepath.Join(w.other, "x.sock")); r.out != "EACCES" {
		t.Errorf("bind outside the lease: %q, want EACCES", r.out)
	}
	gate := &testGate{}
	gate.lost.Store(true)
	audit := &memAuditor{}
	for _, path := range []string{filepath.Join(w.leased, "lost.sock"), "leased/rel.sock"} {
		if r := runAudited(t, p, gate, audit, w.root, helper, "bindunix", path); r.out != "EACCES" {
			t.Errorf("bind %s after the loss: %q, want EACCES", path, r.out)
		}
	}
	for _, f := range []string{"lost.sock", "rel.sock"} {
		if _, err := os.Lstat(filepath.Join(w.leased, f)); err == nil {
			t.Errorf("%s was created after the lease was lost", f)
		}
	}
	wantDenial(t, audit, lease.BoundaryFile, lease.ReasonLeaseLost, filepath.Join(w.leased, "lost.sock"))
	wantDenial(t, audit, lease.BoundaryFile, lease.ReasonLeaseLost, filepath.Join(w.leased, "rel.sock"))
	if r := runAudited(t, p, gate, audit, w.root, helper, "bindtcp"); r.out != "ok" {
		t.Errorf("TCP bind after the loss: %q, want ok", r.out)
	}
	if r := runAudited(t, p, gate, audit, w.root, helper, "bindabstract", ""); r.out != "ok" {
		t.Errorf("abstract autobind after the loss: %q, want ok (it creates no file)", r.out)
	}
}

// TestGuardedToolsReachLocalhost: real tools under the guard (a Go
// program, glibc's resolver, curl, git) still resolve localhost (through
// /etc/hosts; glibc's netlink query is allowed) and connect to the
// sidecar's port.
func TestGuardedToolsReachLocalhost(t *testing.T) {
	t.Parallel()
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/" {
			http.NotFound(w, r)
			return
		}
		fmt.Fprint(w, "hello from the sidecar")
	}))
	defer srv.Close()
	_, portStr, _ := net.SplitHostPort(srv.Listener.Addr().String())
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{port(srv.Listener)}
	if r := runGuarded(t, p, &testGate{}, w.root, guardHelper(t), "connect", "localhost:"+portStr); r.out != "ok" {
		t.Errorf("a Go program dialing localhost:%s: %q, want ok", portStr, r.out)
	}
	if r := sh(t, p, w.root, "getent ahosts localhost"); r.code != 0 || !strings.Contains(r.out, "127.0.0.1") {
		t.Errorf("getent ahosts localhost: exit %d %q", r.code, r.out)
	}
	if r := sh(t, p, w.root, "curl -sS --max-time 10 http://localhost:"+portStr+"/"); r.code != 0 || r.out != "hello from the sidecar" {
		t.Errorf("curl http://localhost:%s/: exit %d %q", portStr, r.code, r.out)
	}
	if r := sh(t, p, w.root, "git ls-remote http://localhost:"+portStr+"/repo.git"); !strings.Contains(r.out, "not found") {
		t.Errorf("git ls-remote against the local server: exit %d %q, want the server's 404", r.code, r.out)
	}
}

// TestConnectUnderSignals: the agent's connecting thread is signalled over
// and over. A signal must not interrupt a connect the supervisor already
// made (the kernel would restart it and the agent see EISCONN).
func TestConnectUnderSignals(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	allowed := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{allowed.port()}
	r := runAudited(t, p, &testGate{}, nil, w.root, helper, "connectsig", allowed.Addr().String(), "1000")
	if r.out != "map[ok:1000]" {
		t.Errorf("1000 connects under signals ended %s, want all ok", r.out)
	}
}

// TestBlockedConnectEndsWithAttempt: a connect the supervisor makes for
// the agent blocks (the listener's backlog is full, its SYNs are dropped);
// canceling the attempt kills the agent, and the pending connect is shut
// down, so Wait returns and no goroutine is left (TestMain checks).
func TestBlockedConnectEndsWithAttempt(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(lfd)
	if err := unix.Bind(lfd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := unix.Listen(lfd, 0); err != nil { // one connection fills it
		t.Fatal(err)
	}
	sa, _ := unix.Getsockname(lfd)
	lport := sa.(*unix.SockaddrInet4).Port
	addr := "127.0.0.1:" + strconv.Itoa(lport)
	filler, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer filler.Close()

	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{uint16(lport)}
	p.KillGrace = 200 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.Command(helper, "rawconnect", addr, "block")
	pr, err := Start(ctx, p, &testGate{}, nil, cmd)
	if err != nil {
		t.Fatal(err)
	}
	// The helper waits in connect (system call 42 on amd64, 203 on arm64).
	connectNr := strconv.Itoa(unix.SYS_CONNECT) + " "
	testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		tasks, _ := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/syscall", pr.Pid()))
		for _, f := range tasks {
			if b, err := os.ReadFile(f); err == nil && strings.HasPrefix(string(b), connectNr) {
				return nil
			}
		}
		return fmt.Errorf("the helper is not in connect yet")
	})
	cancel()
	settled := make(chan struct{})
	go func() { pr.Wait(); close(settled) }()
	select {
	case <-settled:
	case <-time.After(20 * time.Second):
		t.Fatal("the attempt did not settle with a connect pending")
	}
}
