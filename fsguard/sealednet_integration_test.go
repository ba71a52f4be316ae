//go:build integration && linux && (amd64 || arm64)

package fsguard

import (
	"net/netip"
	"slices"
	"strings"
	"testing"
)

// TestSealedUDPFlood: the agent floods the relay with datagrams that are
// no DNS (empty, one byte, a header's worth, 512 bytes, the largest UDP
// carries) to port 53 of 3000 addresses, and makes 600 UDP sockets from
// 8 threads at once. The relay passes each datagram to the proxy as one
// whole frame (the agent cannot write past the framing), holds no more
// connections than its bounds, and once the attempt settled the
// supervisor holds no descriptor more than before, the helper is gone
// and no connection to the proxy is left.
func TestSealedUDPFlood(t *testing.T) {
	helper := guardHelper(t)
	proxy := listenGarbageProxy(t)
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(proxy.Addr().String())
	run := func(args ...string) string {
		t.Helper()
		return runGuarded(t, p, &testGate{}, w.root, helper, args...).out
	}
	if got := run("sealedsockets", "1", "1"); got != "1" { // the first sealed network: lazily made runtime state
		t.Fatalf("one UDP socket: %q", got)
	}
	proxy.waitIdle(t)
	before := openFDs(t)
	dnsConnsHigh.Store(dnsConnsOpen.Load())

	if got := run("sealedflood", "3000"); got != "ok" {
		t.Errorf("sealedflood: %q", got)
	}
	if got := run("sealedsockets", "600", "8"); got != "600" {
		t.Errorf("600 UDP sockets from 8 threads: %q, want 600 distinct non-blocking UDP sockets", got)
	}
	proxy.waitIdle(t)
	if after := openFDs(t); after != before {
		t.Errorf("the supervisor holds %d descriptors after the attempts, %d before", after, before)
	}
	if h := sealedHelpers(t); len(h) != 0 {
		t.Errorf("sealed network helpers left after the attempts settled: %v", h)
	}
	// Counted where they are opened and closed: the proxy sees one end
	// only when it next reads, so its own count runs ahead on a busy
	// machine (25-28 seen).
	if high := dnsConnsHigh.Load(); high > maxDNSRelays+maxIdleDNSConns {
		t.Errorf("the relay held %d connections to the proxy at once, want at most %d", high, maxDNSRelays+maxIdleDNSConns)
	}
	if open := dnsConnsOpen.Load(); open != 0 {
		t.Errorf("the relay holds %d connections to the proxy after the attempts settled", open)
	}
	proxy.mu.Lock()
	defer proxy.mu.Unlock()
	for size := range proxy.sizes {
		if !slices.Contains([]int{0, 1, 12, 512, 65507}, size) {
			t.Errorf("the proxy read a frame of %d bytes, which the agent never sent", size)
		}
	}
	for target := range proxy.targets {
		if !strings.HasPrefix(target, "10.77.") || !strings.HasSuffix(target, ":53") {
			t.Errorf("the relay announced %s to the proxy", target)
		}
	}
	if len(proxy.sizes) == 0 {
		t.Error("no datagram reached the proxy")
	}
	t.Logf("frames by size %v, %d targets, at most %d connections", proxy.sizes, len(proxy.targets), proxy.maxOpen)
}

// TestSealedUDPSignals: the supervisor's thread asking the helper for
// sockets waits in recvmsg with a timeout, which a signal interrupts
// (EINTR, SA_RESTART or not). The agent makes 4000 UDP sockets (a
// request to the helper every 8) while making orphans that die at once,
// a SIGCHLD to the supervisor (their subreaper) each: every socket() is
// answered with a socket.
func TestSealedUDPSignals(t *testing.T) {
	helper := guardHelper(t)
	dns := listenDNSCapture(t)
	w := newWorktree(t)
	p := w.policy()
	p.Capture = netip.MustParseAddrPort(dns.Addr().String())
	audit := &memAuditor{}
	if got := runAudited(t, p, &testGate{}, audit, w.root, helper, "sealedsigchld", "4000").out; got != "map[ok:4000]" {
		why := ""
		if evs := audit.all(); len(evs) > 0 {
			why = evs[0].Message
		}
		t.Errorf("4000 UDP sockets under SIGCHLD: %s, want map[ok:4000]; first refusal: %s", got, why)
	}
}
