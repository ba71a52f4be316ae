//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bufio"
	"encoding/binary"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/fenceline/fenceline/lease"
)

// dnsCapture stands for the egress proxy's DNS over captured TCP: it
// answers allowed.test. with 192.0.2.7 and every other name with
// NXDOMAIN, and records the address each captured connection named.
type dnsCapture struct {
	net.Listener
	mu      sync.Mutex
	targets []string
	open    int // connections open now, and the most at once
	maxOpen int
	wg      sync.WaitGroup
}

func listenDNSCapture(t testing.TB) *dnsCapture {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &dnsCapture{Listener: ln}
	c.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			c.wg.Go(func() { c.serve(t, conn) })
		}
	})
	t.Cleanup(func() { ln.Close(); c.wg.Wait() })
	return c
}

func (c *dnsCapture) serve(t testing.TB, conn net.Conn) {
	c.mu.Lock()
	c.open++
	c.maxOpen = max(c.maxOpen, c.open)
	c.mu.Unlock()
	defer func() {
		conn.Close()
		c.mu.Lock()
		c.open--
		c.mu.Unlock()
	}()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(conn)
	req, err := http.ReadRequest(br)
	if err == io.EOF {
		// Closed before a byte was sent: a dial the attempt's end cut
		// short (stop cancels it; the kernel had completed the
		// handshake already).
		return
	}
	if err != nil || req.Method != http.MethodConnect || req.Header.Get("Fenceline-Capture") != "1" {
		t.Errorf("captured connection without the capture preamble: %v", err)
		return
	}
	c.mu.Lock()
	c.targets = append(c.targets, req.Host)
	c.mu.Unlock()
	for {
		var n [2]byte
		if _, err := io.ReadFull(br, n[:]); err != nil {
			return
		}
		q := make([]byte, binary.BigEndian.Uint16(n[:]))
		if _, err := io.ReadFull(br, q); err != nil {
			return
		}
		ans := answerTestDNS(t, q)
		conn.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(ans))), ans...))
	}
}

func answerTestDNS(t testing.TB, q []byte) []byte {
	var p dnsmessage.Parser
	h, err := p.Start(q)
	if err != nil {
		t.Errorf("bad DNS query: %v", err)
		return nil
	}
	qq, err := p.Question()
	if err != nil {
		t.Errorf("bad DNS question: %v", err)
		return nil
	}
	rh := dnsmessage.Header{ID: h.ID, Response: true, RecursionDesired: h.RecursionDesired, RecursionAvailable: true}
	allowed := strings.EqualFold(qq.Name.String(), "allowed.test.")
	if !allowed {
		rh.RCode = dnsmessage.RCodeNameError
	}
	b := dnsmessage.NewBuilder(nil, rh)
	b.StartQuestions()
	b.Question(qq)
	b.StartAnswers()
	if allowed && qq.Type == dnsmessage.TypeA {
		b.AResource(dnsmessage.ResourceHeader{Name: qq.Name, Class: dnsmessage.ClassINET, TTL: 30}, dnsmessage.AResource{A: [4]byte{192, 0, 2, 7}})
	}
	out, err := b.Finish()
	if err != nil {
		t.Errorf("build DNS answer: %v", err)
	}
	return out
}

func (c *dnsCapture) got() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	return slices.Clone(c.targets)
}

// TestSealedUDP (issue 31): with transparent capture, the agent's UDP
// socket is made in a sealed network. Go's own resolver (UDP only, as
// static binaries and musl resolve) gets answers for any name server
// address from the egress proxy over captured TCP, naming the address
// asked; and nothing the agent sends leaves: a datagram to a UDP port of
// this machine, sent with sendto or on a connected socket, never arrives,
// and port 53 of the sealed network cannot be taken from the relay.
func TestSealedUDP(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	dns := listenDNSCapture(t)
	leak, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer leak.Close()
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(dns.Addr().String())
	audit := &memAuditor{}
	run := func(args ...string) string {
		t.Helper()
		return runAudited(t, p, &testGate{}, audit, w.root, helper, args...).out
	}

	for _, tc := range []struct{ server, name, want string }{
		{"10.255.255.53:53", "allowed.test", "192.0.2.7"},
		{"192.0.2.53:53", "allowed.test", "192.0.2.7"},
		{"127.0.0.53:53", "allowed.test", "192.0.2.7"},
		{"10.255.255.53:53", "exfil.attacker.test", "NXDOMAIN"},
	} {
		if got := run("resolve", tc.server, tc.name); got != tc.want {
			t.Errorf("Go's resolver asking %s for %s: %q, want %s", tc.server, tc.name, got, tc.want)
		}
	}
	targets := dns.got()
	for _, want := range []string{"10.255.255.53:53", "192.0.2.53:53", "127.0.0.53:53"} {
		if !slices.Contains(targets, want) {
			t.Errorf("the egress proxy was never asked as %s (it saw %q)", want, targets)
		}
	}
	if r := run("resolve", "[2001:db8::53]:53", "allowed.test"); r != "192.0.2.7" && !strings.Contains(r, "network is unreachable") {
		t.Errorf("Go's resolver over IPv6: %q", r)
	}

	// The agent picks the address it asks: 300 name servers one after
	// another keep no more connections to the proxy than the bound
	// (counted where the relay opens and closes them: the proxy sees an
	// end only when it next reads).
	dnsConnsHigh.Store(dnsConnsOpen.Load())
	if got := run("resolvemany", "allowed.test", "300"); got != "300" {
		t.Errorf("300 lookups, each of another name server: %q answered, want 300", got)
	}
	if most := dnsConnsHigh.Load(); most > maxIdleDNSConns+maxDNSRelays {
		t.Errorf("the relay held %d connections to the proxy at once, want at most %d", most, maxIdleDNSConns+maxDNSRelays)
	}

	// The attacks: datagrams to a UDP port of this machine.
	if got := run("udp", leak.LocalAddr().String()); got != "ok" {
		t.Errorf("sendto from a sealed socket: %q, want ok (delivered inside the sealed network)", got)
	}
	if got := run("udpconnect", leak.LocalAddr().String()); got != "read: ECONNREFUSED" {
		t.Errorf("connected sealed socket: %q, want read: ECONNREFUSED (no one listens there inside)", got)
	}
	if got := run("udpbind", "53"); got != "EACCES" {
		t.Errorf("bind port 53 of a sealed socket: %q, want EACCES (a fixed port not in BindPorts)", got)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "bind to 0.0.0.0:53")
	p.BindPorts = []uint16{53}
	if got := run("udpbind", "53"); got != "address already in use" {
		t.Errorf("bind port 53 of a sealed socket, allowed by the policy: %q, want EADDRINUSE (the relay holds it)", got)
	}
	if _, err := leak.WriteTo([]byte("sentinel"), leak.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	leak.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	if n, _, err := leak.ReadFrom(buf); err != nil || string(buf[:n]) != "sentinel" {
		t.Errorf("the machine's UDP port received %q (%v), want only the test's sentinel", buf[:n], err)
	}

	// Without capture there is no sealed network: UDP stays refused.
	p.Capture = netip.AddrPort{}
	if got := run("resolve", "10.255.255.53:53", "allowed.test"); !strings.Contains(got, "permission denied") {
		t.Errorf("Go's resolver without capture: %q, want a refused socket", got)
	}
	wantDenial(t, audit, lease.BoundaryNet, lease.ReasonNotAllowed, "SOCK_DGRAM")
}

// BenchmarkSealedLookup: Go's own resolver looks a name up (A and AAAA)
// 200 times from a static binary: unguarded against a DNS server on the
// loopback answering the same records itself (the baseline), and guarded
// with capture, over UDP (the sealed network's relay, then DNS over TCP
// to a stand-in for the egress proxy) and over TCP (captured directly).
func BenchmarkSealedLookup(b *testing.B) {
	helper := guardHelper(b)
	const lookups = 200
	direct, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer direct.Close()
	go func() {
		buf := make([]byte, 1500)
		for {
			n, from, err := direct.ReadFrom(buf)
			if err != nil {
				return
			}
			direct.WriteTo(answerTestDNS(b, buf[:n]), from)
		}
	}()
	capt := listenDNSCapture(b)
	w := newWorktree(b)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(capt.Addr().String())
	loop := func(p *Policy, network, server string) time.Duration {
		var out string
		if p == nil {
			o, err := exec.Command(helper, "resolveloop", network, server, "allowed.test", strconv.Itoa(lookups)).CombinedOutput()
			if err != nil {
				b.Fatalf("resolveloop: %v %s", err, o)
			}
			out = string(o)
		} else {
			r := runGuarded(b, *p, &testGate{}, "/", helper, "resolveloop", network, server, "allowed.test", strconv.Itoa(lookups))
			if r.code != 0 {
				b.Fatalf("guarded resolveloop %s: exit %d %s", network, r.code, r.out)
			}
			out = r.out
		}
		ns, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
		if err != nil {
			b.Fatalf("resolveloop output %q: %v", out, err)
		}
		return time.Duration(ns)
	}
	var plain, sealed, tcp time.Duration
	for range b.N {
		plain += loop(nil, "udp", direct.LocalAddr().String())
		sealed += loop(&p, "udp", "10.255.255.53:53")
		tcp += loop(&p, "tcp", "10.255.255.53:53")
	}
	per := func(d time.Duration) float64 { return float64(d) / float64(b.N*lookups) / 1e3 }
	b.ReportMetric(per(plain), "direct-udp-µs/lookup")
	b.ReportMetric(per(sealed), "sealed-udp-µs/lookup")
	b.ReportMetric(per(tcp), "captured-tcp-µs/lookup")
}

// sealedHelpers lists the sealed network helpers this process started
// that are still there (zombies included).
func sealedHelpers(t *testing.T) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		if pi, ok := readStat(pid); ok && pi.ppid == os.Getpid() && strings.HasPrefix(string(cmd), "fenceline-sealednet\x00") {
			out = append(out, pid)
		}
	}
	return out
}

// buildSealedEnter builds testdata/sealedenter (C: setns into a user
// namespace wants a single-threaded process).
func buildSealedEnter(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "sealedenter")
	if out, err := exec.Command("gcc", "-O2", "-o", bin, "testdata/sealedenter/enter.c").CombinedOutput(); err != nil {
		t.Fatalf("gcc: %v\n%s", err, out)
	}
	return bin
}

// TestSealedUDPEscape: the agent (the supervisor's uid, no capability:
// what it holds when that uid is not root) attacks the sealed network.
// Landlock's scopes keep it from the helper process (signals, ptrace,
// its memory, its descriptors, SIGIO from a socket it owns). As the
// owner of the helper's user namespace it gets that namespace's
// descriptors (SIOCGSKNS, NS_GET_USERNS on its sealed socket), holds
// CAP_NET_ADMIN over the sealed network and can setns into both; there a
// TCP connect reaches nothing of this machine, a veth pair or a device
// cannot be put in the machine's network namespace (that takes
// CAP_NET_ADMIN there) and Landlock refuses mounts; a datagram sent with
// IP_PKTINFO, SO_BINDTODEVICE, IP_TRANSPARENT or SO_MARK stays inside. Entering must not
// give it power over its own uid's files either (a mode 000 file stays
// unreadable): the namespace maps no uid.
func TestSealedUDPEscape(t *testing.T) {
	// Not in parallel: it counts every sealed network helper of the test
	// binary (sealedHelpers).
	helper := guardHelper(t)
	enter := buildSealedEnter(t)
	dns := listenDNSCapture(t)
	tcp := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	locked := filepath.Join(w.outside, "locked.txt")
	if err := os.WriteFile(locked, []byte("locked"), 0o000); err != nil {
		t.Fatal(err)
	}
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(dns.Addr().String())
	audit := &memAuditor{}
	out := runAudited(t, p, &testGate{}, audit, w.root, helper, "nocaps", "sealedescape", enter, locked, tcp.Addr().String()).out
	t.Logf("attack:\n%s", out)
	got := map[string]string{}
	for line := range strings.SplitSeq(out, "\n") {
		if k, v, ok := strings.Cut(line, "="); ok {
			got[k] = v
		}
	}
	for k, want := range map[string]string{
		"capeff":          "0000000000000000",
		"helper":          "found",
		"kill":            "EPERM", // Landlock signal scope
		"kill-supervisor": "EPERM",
		"ptrace":          "EPERM", // Landlock: no ptrace outside the domain
		"mem":             "EACCES",
		"nsfile":          "EACCES",
		"getfd":           "EPERM",
		"sigio":           "ok", // sent, but Landlock's scope drops the SIGKILL to the helper
		"after-sigio":     "ok", // the helper still answers: 20 new sockets
		"setns-net":       "ok",
		"tcp":             "Connection refused", // this machine's listener is not in the sealed network
		"insealed-tcp":    "ECONNREFUSED",
		"mount":           "EPERM",
	} {
		if got[k] != want {
			t.Errorf("%s: %q, want %q", k, got[k], want)
		}
	}
	if got["read"] != "Permission denied" {
		t.Errorf("in the sealed network's user namespace the agent read a mode 000 file of its uid (%s): %q, want Permission denied", locked, got["read"])
	}
	if c := got["insealed-capeff"]; c == "" || c == "0000000000000000" {
		t.Errorf("inside the sealed network the agent holds no capability (%q): the attacks there prove nothing", c)
	}
	for _, k := range []string{"veth", "move"} {
		if !strings.Contains(got[k], "Operation not permitted") {
			t.Errorf("%s into the machine's network namespace from inside: %q, want Operation not permitted", k, got[k])
		}
	}
	if n := tcp.reached(t); n != 0 {
		t.Errorf("this machine's TCP listener accepted %d connections from inside the sealed network", n)
	}

	// Options that pick a route, an interface or a source: the sealed
	// network's owner may set them all (CAP_NET_ADMIN there), and there
	// is only its loopback to pick.
	leak, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer leak.Close()
	out = runGuarded(t, p, &testGate{}, w.root, helper, "nocaps", "sealedsend", leak.LocalAddr().String()).out
	if want := "pktinfo=ok\nbindtodevice=ok\ntransparent=ok\nmark=ok"; out != want {
		t.Errorf("sends with routing options: %q, want %q (each sent, inside)", out, want)
	}
	if _, err := leak.WriteTo([]byte("sentinel"), leak.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	leak.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	if n, _, err := leak.ReadFrom(buf); err != nil || string(buf[:n]) != "sentinel" {
		t.Errorf("the machine's UDP port received %q (%v), want only the test's sentinel", buf[:n], err)
	}
	if h := sealedHelpers(t); len(h) != 0 {
		t.Errorf("sealed network helpers left after the attempts settled: %v", h)
	}
}

// garbageProxy stands for an egress proxy answering each framed DNS
// query with garbage: 20 bytes (relayed to the agent as they are) or 600
// (too long for UDP and no DNS message: dropped). It records the capture
// targets, the size of every frame and the most connections at once.
type garbageProxy struct {
	net.Listener
	mu      sync.Mutex
	targets map[string]int
	sizes   map[int]int
	open    int
	maxOpen int
	closed  chan struct{}
	wg      sync.WaitGroup
}

func listenGarbageProxy(t *testing.T) *garbageProxy {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &garbageProxy{Listener: ln, targets: map[string]int{}, sizes: map[int]int{}, closed: make(chan struct{}, 1)}
	g.wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			g.wg.Go(func() { g.serve(t, conn) })
		}
	})
	t.Cleanup(func() { ln.Close(); g.wg.Wait() })
	return g
}

func (g *garbageProxy) serve(t *testing.T, conn net.Conn) {
	g.mu.Lock()
	g.open++
	g.maxOpen = max(g.maxOpen, g.open)
	g.mu.Unlock()
	defer func() {
		conn.Close()
		g.mu.Lock()
		g.open--
		g.mu.Unlock()
		select {
		case g.closed <- struct{}{}:
		default:
		}
	}()
	conn.SetDeadline(time.Now().Add(30 * time.Second))
	br := bufio.NewReader(conn)
	req, err := http.ReadRequest(br)
	if err == io.EOF {
		// Closed before a byte was sent: a dial the attempt's end cut
		// short (stop cancels it; the kernel had completed the
		// handshake already).
		return
	}
	if err != nil || req.Method != http.MethodConnect || req.Header.Get("Fenceline-Capture") != "1" {
		t.Errorf("captured connection without the capture preamble: %v", err)
		return
	}
	g.mu.Lock()
	g.targets[req.Host]++
	g.mu.Unlock()
	for i := 0; ; i++ {
		var n [2]byte
		if _, err := io.ReadFull(br, n[:]); err != nil {
			return
		}
		q := make([]byte, binary.BigEndian.Uint16(n[:]))
		if _, err := io.ReadFull(br, q); err != nil {
			t.Errorf("a frame cut short: %v", err)
			return
		}
		g.mu.Lock()
		g.sizes[len(q)]++
		g.mu.Unlock()
		ans := make([]byte, 20+580*(i%2))
		conn.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(ans))), ans...))
	}
}

// waitIdle waits until no connection to the proxy is open.
func (g *garbageProxy) waitIdle(t *testing.T) {
	deadline := time.After(30 * time.Second)
	for {
		g.mu.Lock()
		open := g.open
		g.mu.Unlock()
		if open == 0 {
			return
		}
		select {
		case <-g.closed:
		case <-deadline:
			t.Fatalf("%d connections to the proxy still open after the attempt settled", open)
		}
	}
}

func openFDs(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// TestSealedUDPDup2Race: the agent connects a descriptor that another
// thread keeps flipping (dup2) between a TCP socket and a sealed UDP
// socket to a TCP port of this machine's loopback that the policy does
// not allow. The supervisor judges the socket it duplicated (pidfd_getfd)
// and connects that same one: a UDP socket of the sealed network
// connects there (inside it), a TCP socket is refused; the machine's
// listener is never reached.
func TestSealedUDPDup2Race(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	dns := listenDNSCapture(t)
	tcp := countingListener(t, "tcp", "127.0.0.1:0")
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(dns.Addr().String())
	out := runGuarded(t, p, &testGate{}, w.root, helper, "sealeddup", tcp.Addr().String(), "300").out
	t.Logf("connects: %s", out)
	if !strings.HasPrefix(out, "map[") || strings.Contains(out, "ECONNREFUSED") {
		t.Errorf("connects: %s, want only ok (a sealed socket) and EACCES (a TCP one)", out)
	}
	for _, s := range strings.Fields(strings.Trim(out, "map[]")) {
		if k, _, _ := strings.Cut(s, ":"); k != "ok" && k != "EACCES" {
			t.Errorf("connect answered %s", s)
		}
	}
	if n := tcp.reached(t); n != 0 {
		t.Errorf("the machine's listener accepted %d connections", n)
	}
	if got := dns.got(); len(got) != 0 {
		t.Errorf("the proxy was asked for %v", got)
	}
}

// TestSealedUDPAfterLoss: once the lease is lost the agent's lookups go
// on (they are reads) and its sealed sockets still reach nothing: a
// datagram to this machine's UDP port stays in the sealed network, a bind
// to a port the kernel chooses is made there.
func TestSealedUDPAfterLoss(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	dns := listenDNSCapture(t)
	leak, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer leak.Close()
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(dns.Addr().String())
	gate := &testGate{}
	gate.lost.Store(true)
	for _, tc := range []struct{ args, want string }{
		{"resolve 10.255.255.53:53 allowed.test", "192.0.2.7"},
		{"udp " + leak.LocalAddr().String(), "ok"},
		{"udpbind 0", "ok"},
	} {
		if got := runGuarded(t, p, gate, w.root, helper, strings.Fields(tc.args)...).out; got != tc.want {
			t.Errorf("%s after the loss: %q, want %q", tc.args, got, tc.want)
		}
	}
	if _, err := leak.WriteTo([]byte("sentinel"), leak.LocalAddr()); err != nil {
		t.Fatal(err)
	}
	leak.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 64)
	if n, _, err := leak.ReadFrom(buf); err != nil || string(buf[:n]) != "sentinel" {
		t.Errorf("the machine's UDP port received %q (%v), want only the test's sentinel", buf[:n], err)
	}
}

// TestSealedUDPSettlesWithQueriesPending: the agent sends queries to port
// 53 and exits at once, while the egress proxy has not answered them (a
// slow upstream): the attempt settles without waiting out the relay's
// timeout (captureTimeout), and the supervisor's connections to the
// proxy are closed.
func TestSealedUDPSettlesWithQueriesPending(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan struct{}, 64)
	closed := make(chan struct{}, 64)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	wg.Go(func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer conn.Close()
				got <- struct{}{}
				conn.SetDeadline(time.Now().Add(60 * time.Second))
				io.Copy(io.Discard, conn) // reads the queries, answers none
				closed <- struct{}{}
			})
		}
	})
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(ln.Addr().String())
	start := time.Now()
	if out := runGuarded(t, p, &testGate{}, w.root, helper, "sealedflood", "5").out; out != "ok" {
		t.Fatalf("sealedflood: %q", out)
	}
	took := time.Since(start)
	if n := len(got); n == 0 {
		t.Fatal("no query reached the proxy")
	}
	if took >= captureTimeout {
		t.Errorf("the attempt took %v to settle: it waited for the proxy's answers (captureTimeout %v)", took, captureTimeout)
	}
	for range len(got) {
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatal("a connection to the proxy is still open after the attempt settled")
		}
	}
}
