package egress

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync"
	"testing"
)

// Attacks of the second pass on issue 17: where an allowed name leads.

// judgedProxy serves a proxy whose DNS answers are answers and whose
// network dials nothing; it returns the proxy's URL and what was dialled.
func judgedProxy(t *testing.T, cfg Config, answers map[string][]netip.Addr) (string, func() []string) {
	t.Helper()
	var mu sync.Mutex
	var dialled []string
	cfg.LookupIP = func(_ context.Context, host string) ([]netip.Addr, error) {
		if a, ok := answers[host]; ok {
			return a, nil
		}
		return nil, fmt.Errorf("test DNS: no such host %s", host)
	}
	cfg.Dial = func(_ context.Context, _, addr string) (net.Conn, error) {
		mu.Lock()
		defer mu.Unlock()
		dialled = append(dialled, addr)
		return nil, fmt.Errorf("test network: %s unreachable", addr)
	}
	return startProxy(t, cfg), func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), dialled...)
	}
}

// TestAttackAllowedNameIntoThePrivateNetwork: a name on the allowlist
// whose DNS the agent's side controls (a wildcard over a domain that hands
// out names) answers with a private address: in a pod that is where the
// bus, the Postgres upstream and the git server live, reached past their
// fences. Private, shared (CGNAT) and this host's own addresses are refused
// like loopback unless pinned or allowed by address.
func TestAttackAllowedNameIntoThePrivateNetwork(t *testing.T) {
	t.Parallel()
	answers := map[string][]netip.Addr{
		"ten.tunnel.example.test": {netip.MustParseAddr("10.1.2.3")},
		"rfc.tunnel.example.test": {netip.MustParseAddr("192.168.7.7")},
		"ula.tunnel.example.test": {netip.MustParseAddr("fd00::5")},
		"cgn.tunnel.example.test": {netip.MustParseAddr("100.64.1.1")},
		// IPv6 addresses a translator turns into IPv4 ones (issue 28.6):
		// NAT64's well-known prefix to loopback and to cloud metadata, its
		// local-use prefix, 6to4 and an IPv4-compatible address to a
		// private one, Teredo.
		"nat64-lo.tunnel.example.test": {netip.MustParseAddr("64:ff9b::7f00:1")},
		"nat64-md.tunnel.example.test": {netip.MustParseAddr("64:ff9b::a9fe:a9fe")},
		"nat64-lu.tunnel.example.test": {netip.MustParseAddr("64:ff9b:1::a00:1")},
		"6to4.tunnel.example.test":     {netip.MustParseAddr("2002:a00:1::1")},
		"compat.tunnel.example.test":   {netip.MustParseAddr("::a00:1")},
		"teredo.tunnel.example.test":   {netip.MustParseAddr("2001:0:4136:e378:8000:63bf:3fff:fdd2")},
		"pub.tunnel.example.test":      {netip.MustParseAddr("192.0.2.20")},
		"host.tunnel.example.test":     nil,
	}
	// This host's own non-loopback address reaches every service bound to
	// all interfaces (the bus, a local Postgres).
	if addrs, err := net.InterfaceAddrs(); err == nil {
		for _, a := range addrs {
			if p, err := netip.ParsePrefix(a.String()); err == nil && !p.Addr().IsLoopback() && !p.Addr().IsLinkLocalUnicast() {
				answers["host.tunnel.example.test"] = []netip.Addr{p.Addr()}
				break
			}
		}
	}
	audit := &memAuditor{}
	proxy, dialled := judgedProxy(t, Config{Allow: mustRules(t, "*.tunnel.example.test"), Lease: testLease, Audit: audit}, answers)
	for name, addrs := range answers {
		if name == "pub.tunnel.example.test" || len(addrs) == 0 {
			continue
		}
		out, err := curl(t, proxy, "-v", "https://"+name+"/")
		if err == nil || !strings.Contains(out, "403") {
			t.Errorf("%s (%v): want 403, got %v\n%s", name, addrs, err, out)
		}
	}
	if out, err := curl(t, proxy, "-v", "https://pub.tunnel.example.test/"); err == nil || !strings.Contains(out, "502") {
		t.Errorf("a public answer: want it dialled (502 from the test network), got %v\n%s", err, out)
	}
	if got := dialled(); len(got) != 1 || got[0] != "192.0.2.20:443" {
		t.Errorf("dialled %v, want only the public address", got)
	}
	if evs := audit.events(); len(evs) == 0 || !strings.Contains(evs[0].Message, "resolves to") {
		t.Errorf("refusals audited: %+v", evs)
	}
}

// TestAttackGitUpstreamByAnotherName: the git upstream is served by the
// git fence only under its own name; another allowed name (a wildcard
// over the git host's domain, a CNAME, an alias) that resolves to the
// same server would tunnel the agent's push around the fence.
func TestAttackGitUpstreamByAnotherName(t *testing.T) {
	t.Parallel()
	git := netip.MustParseAddr("192.0.2.50")
	answers := map[string][]netip.Addr{
		"git.example.test":   {git},
		"alias.example.test": {netip.MustParseAddr("192.0.2.51"), git},
		"api.example.test":   {netip.MustParseAddr("192.0.2.60")},
	}
	audit := &memAuditor{}
	proxy, dialled := judgedProxy(t, Config{
		Allow:     mustRules(t, "*.example.test", "*.example.test:22"),
		Intercept: map[string]http.Handler{"git.example.test:443": http.NotFoundHandler()},
		Lease:     testLease, Audit: audit,
	}, answers)
	for _, u := range []string{"https://alias.example.test/", "https://alias.example.test:22/"} {
		out, err := curl(t, proxy, "-v", u)
		if err == nil || !strings.Contains(out, "403") {
			t.Errorf("%s (the git server's address): want 403, got %v\n%s", u, err, out)
		}
	}
	if out, err := curl(t, proxy, "-v", "https://api.example.test/"); err == nil || !strings.Contains(out, "502") {
		t.Errorf("another allowed host: want it dialled, got %v\n%s", err, out)
	}
	if got := dialled(); len(got) != 1 || got[0] != "192.0.2.60:443" {
		t.Errorf("dialled %v, want only api.example.test's address", got)
	}
	evs := audit.events()
	if len(evs) != 2 || !strings.Contains(evs[0].Message, "git upstream") {
		t.Errorf("refusals audited: %+v, want two naming the git upstream", evs)
	}
}
