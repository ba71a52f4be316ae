//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// captureListener stands for the egress proxy: it records the preamble
// and the first line of every connection handed to it.
type captureListener struct {
	net.Listener
	mu   sync.Mutex
	seen []string // "PREAMBLE|first line"
	wg   sync.WaitGroup
}

func listenCapture(t *testing.T) *captureListener {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &captureListener{Listener: ln}
	c.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.wg.Go(func() {
				defer conn.Close()
				br := bufio.NewReader(conn)
				var head strings.Builder
				for {
					line, err := br.ReadString('\n')
					head.WriteString(line)
					if err != nil || line == "\r\n" {
						break
					}
				}
				first, _ := br.ReadString('\n')
				io.Copy(io.Discard, br)
				c.mu.Lock()
				c.seen = append(c.seen, head.String()+"|"+first)
				c.mu.Unlock()
			})
		}
	})
	t.Cleanup(func() { ln.Close(); c.wg.Wait() })
	return c
}

func (c *captureListener) addr() netip.AddrPort {
	return netip.MustParseAddrPort(c.Addr().String())
}

// got waits for the listener's connections (closed by the agent) and
// returns what they carried.
func (c *captureListener) got() []string {
	c.Close()
	c.wg.Wait()
	c.mu.Lock()
	defer c.mu.Unlock()
	return append([]string(nil), c.seen...)
}

// TestTCPConnectCaptured: with Policy.Capture, a TCP connect to a
// non-loopback address (IPv4 or IPv6, Go's non-blocking connect, a
// v6-only socket) or to port 53 on the loopback is connected to the
// capture address instead, the preamble naming the address the agent
// chose comes before the agent's first byte, and the agent sees a
// connected socket. The loopback's other ports stay refused and audited.
func TestTCPConnectCaptured(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	capt := listenCapture(t)
	forbidden := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.Capture = capt.addr()
	audit := &memAuditor{}
	for _, tc := range []struct{ network, addr, want string }{
		{"tcp", "192.0.2.1:443", "ok"},
		{"tcp", "[2001:db8::1]:80", "ok"},
		{"tcp6", "[2001:db8::2]:80", "ok"}, // Go makes a v6-only socket
		{"tcp", "127.0.0.1:53", "ok"},
		{"tcp", forbidden.Addr().String(), "EACCES"},
	} {
		if r := runAudited(t, p, &testGate{}, audit, w.root, helper, "connectsend", tc.network, tc.addr); r.out != tc.want {
			t.Errorf("connect to %s: %q, want %s", tc.addr, r.out, tc.want)
		}
	}
	got := capt.got()
	want := []string{
		"CONNECT 192.0.2.1:443 HTTP/1.1\r\nHost: 192.0.2.1:443\r\nFenceline-Capture: 1\r\n\r\n|hello\n",
		"CONNECT [2001:db8::1]:80 HTTP/1.1\r\nHost: [2001:db8::1]:80\r\nFenceline-Capture: 1\r\n\r\n|hello\n",
		"CONNECT [2001:db8::2]:80 HTTP/1.1\r\nHost: [2001:db8::2]:80\r\nFenceline-Capture: 1\r\n\r\n|hello\n",
		"CONNECT 127.0.0.1:53 HTTP/1.1\r\nHost: 127.0.0.1:53\r\nFenceline-Capture: 1\r\n\r\n|hello\n",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("the capture listener got:\n%q\nwant:\n%q", got, want)
	}
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("a loopback port not allowed accepted %d connections", n)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "connect to "+forbidden.Addr().String())
}

// TestTCPConnectCaptureAddressRace: the agent flips the whole address
// under its connect between a non-loopback address (captured) and a
// loopback port it may not reach. The supervisor reads the address once:
// the loopback listener is never reached, and every captured connection
// names an address the agent wrote, never a mix handed elsewhere.
func TestTCPConnectCaptureAddressRace(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	capt := listenCapture(t)
	forbidden := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.Capture = capt.addr()
	r := runAudited(t, p, &testGate{}, nil, w.root, helper, "capturerace", "192.0.2.1:443", forbidden.Addr().String(), "1000")
	t.Logf("connects: %s", r.out)
	if !onlyOKOrRefused.MatchString(r.out) {
		t.Errorf("connects ended %s, want only ok (some) and EACCES", r.out)
	}
	if n := forbidden.reached(t); n != 0 {
		t.Errorf("the forbidden loopback listener accepted %d connections (race won): %s", n, r.out)
	}
	m := regexp.MustCompile(`ok:(\d+)`).FindStringSubmatch(r.out)
	ok := 0
	if m != nil {
		ok, _ = strconv.Atoi(m[1])
	}
	fport := strconv.Itoa(forbidden.Addr().(*net.TCPAddr).Port)
	preamble := regexp.MustCompile(`^CONNECT (192\.0\.2\.1:(443|` + fport + `)) HTTP/1\.1\r\nHost: 192\.0\.2\.1:(443|` + fport + `)\r\nFenceline-Capture: 1\r\n\r\n\|$`)
	got := capt.got()
	if len(got) != ok {
		t.Errorf("%d connections captured, %d connects succeeded", len(got), ok)
	}
	for _, g := range got {
		if !preamble.MatchString(g) {
			t.Errorf("captured connection announced %q", g)
		}
	}
}

// TestCapturedPeerName: getpeername on a captured socket answers the
// address the agent connected to (not the egress proxy's), in the
// socket's family, and cuts a short buffer as the kernel does (saying
// the full length); on a socket that was not captured it is the kernel's
// answer.
func TestCapturedPeerName(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	capt := listenCapture(t)
	allowed := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.Capture = capt.addr()
	p.ConnectPorts = []uint16{netip.MustParseAddrPort(allowed.Addr().String()).Port()}
	lport := netip.MustParseAddrPort(allowed.Addr().String()).Port()
	for _, tc := range []struct{ network, addr, want string }{
		{"tcp", "192.0.2.1:443", "192.0.2.1:443 16 020001bb errno 0"},
		{"tcp", "[2001:db8::1]:80", "[2001:db8::1]:80 28 0a000050 errno 0"},
		{"tcp6", "[2001:db8::2]:8443", "[2001:db8::2]:8443 28 0a0020fb errno 0"},
		{"tcp", allowed.Addr().String(), fmt.Sprintf("%s 16 0200%04x errno 0", allowed.Addr(), lport)},
	} {
		if r := runAudited(t, p, &testGate{}, nil, w.root, helper, "peername", tc.network, tc.addr); r.out != tc.want {
			t.Errorf("getpeername after connecting to %s: %q, want %q", tc.addr, r.out, tc.want)
		}
	}
}
