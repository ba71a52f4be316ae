package egress

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/net/dns/dnsmessage"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
)

// captured opens a captured connection to the proxy as the file guard's
// supervisor does (fsguard.CapturePreamble), for a connect to dst.
func captured(t testing.TB, proxy, dst string) net.Conn {
	t.Helper()
	u, err := url.Parse(proxy)
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.DialTimeout("tcp", u.Host, 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n%s: 1\r\n\r\n", dst, dst, CaptureHeader)
	return c
}

// TestCaptureJudgesByName: a captured TLS connection reaches the host its
// server name names, dialled by that name (the address the agent chose
// gains nothing); a name not allowed, no server name on an address not
// allowed, and bytes that are neither TLS nor HTTP are refused and
// audited naming the lease.
func TestCaptureJudgesByName(t *testing.T) {
	t.Parallel()
	ca := testca.New(t)
	api := apiServer(t, ca)
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow:   mustRules(t, "api.example.test"),
		Resolve: mustPins(t, "api.example.test:443="+api, "other.example.test:443="+api),
		Lease:   testLease, Audit: audit,
	})
	get := func(dst, name string) (string, error) {
		c := tls.Client(captured(t, proxy, dst), &tls.Config{ServerName: name, RootCAs: ca.Pool})
		if err := c.Handshake(); err != nil {
			return "", err
		}
		fmt.Fprintf(c, "GET /x HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", name)
		resp, err := http.ReadResponse(bufio.NewReader(c), nil)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b), nil
	}
	// The agent connected to some address; the proxy dials the name.
	if body, err := get("203.0.113.9:443", "api.example.test"); err != nil || body != "hello from api /x\n" {
		t.Fatalf("allowed name on a captured connect: %q, %v", body, err)
	}
	if _, err := get("203.0.113.9:443", "other.example.test"); err == nil {
		t.Fatal("a name not allowed reached its host through capture")
	}
	// No server name: judged by the address the agent chose.
	c := tls.Client(captured(t, proxy, "203.0.113.9:443"), &tls.Config{InsecureSkipVerify: true})
	if err := c.Handshake(); err == nil {
		t.Fatal("a ClientHello without a server name reached a host")
	}
	// Neither TLS nor HTTP.
	raw := captured(t, proxy, "203.0.113.9:443")
	raw.Write([]byte("SSH-2.0-OpenSSH_9.6\r\n"))
	raw.(*net.TCPConn).CloseWrite()
	io.Copy(io.Discard, raw)

	wantAudited(t, audit,
		`captured connection to 203.0.113.9:443 (TLS server name "other.example.test") refused for lease lease_egress1`,
		`captured connection to 203.0.113.9:443 (TLS server name "") refused for lease lease_egress1`,
		"captured connection to 203.0.113.9:443 refused for lease lease_egress1")
}

// wantAudited fails unless each of msgs begins the message of a denial
// on the net boundary naming the test lease and its fence.
func wantAudited(t *testing.T, audit *memAuditor, msgs ...string) {
	t.Helper()
	evs := audit.events()
	for _, m := range msgs {
		found := false
		for _, ev := range evs {
			if ev.Type == lease.EventDenied && ev.Boundary == lease.BoundaryNet && ev.LeaseID == "lease_egress1" && ev.Fence == 7 &&
				strings.Contains(ev.Message, m) && strings.Contains(ev.Message, "fence 7") {
				found = true
			}
		}
		if !found {
			var all []string
			for _, ev := range evs {
				all = append(all, ev.Message)
			}
			t.Errorf("no audited refusal %q among:\n%s", m, strings.Join(all, "\n"))
		}
	}
}

// TestCapturePlainHTTPPerRequest: plain HTTP on a captured connection is
// judged request by request: a second request on the same connection
// naming another host is refused (403, audited) and never reaches it.
func TestCapturePlainHTTPPerRequest(t *testing.T) {
	t.Parallel()
	hits := make(chan string, 4)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		hits <- r.Host
		fmt.Fprintf(w, "plain %s\n", r.Host)
	})}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	port := ln.Addr().(*net.TCPAddr).Port
	audit := &memAuditor{}
	hp := func(h string) string { return fmt.Sprintf("%s:%d", h, port) }
	proxy := startProxy(t, Config{
		Allow:   mustRules(t, hp("web.example.test")),
		Resolve: mustPins(t, hp("web.example.test")+"="+ln.Addr().String(), hp("other.example.test")+"="+ln.Addr().String()),
		Lease:   testLease, Audit: audit,
	})
	c := captured(t, proxy, fmt.Sprintf("198.51.100.7:%d", port))
	br := bufio.NewReader(c)
	for _, h := range []string{"web.example.test", "other.example.test"} {
		fmt.Fprintf(c, "GET /p HTTP/1.1\r\nHost: %s\r\n\r\n", h)
		resp, err := http.ReadResponse(br, nil)
		if err != nil {
			t.Fatalf("%s: %v", h, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		want := map[string]int{"web.example.test": 200, "other.example.test": 403}[h]
		if resp.StatusCode != want {
			t.Fatalf("%s: %d %s, want %d", h, resp.StatusCode, body, want)
		}
		if resp.Close {
			break
		}
	}
	if got := <-hits; got != "web.example.test" {
		t.Fatalf("the server saw Host %q", got)
	}
	select {
	case h := <-hits:
		t.Fatalf("a request for %s reached the server", h)
	default:
	}
	wantAudited(t, audit, fmt.Sprintf("GET http://other.example.test:%d/p refused for lease lease_egress1", port))
}

// TestCaptureInjectedHost: an injected host reached through capture (the
// agent ignores HTTPS_PROXY) gets its credential added like through the
// proxy: TLS terminated with the run's CA, the placeholder replaced.
func TestCaptureInjectedHost(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	local, localFile, err := gitproxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, Config{
		Inject: map[string]Injection{"api.github.com": {
			Header: http.Header{"Authorization": {"Bearer " + realToken}}, RootCAs: f.ca.Pool, API: GitHubRules}},
		Resolve: mustPins(t, "api.github.com:443="+f.addr),
		CA:      &local, Lease: testLease, Audit: &memAuditor{},
	})
	pem, err := os.ReadFile(localFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	c := tls.Client(captured(t, proxy, "140.82.112.6:443"), &tls.Config{ServerName: "api.github.com", RootCAs: roots})
	fmt.Fprint(c, "GET /user HTTP/1.1\r\nHost: api.github.com\r\nAuthorization: Bearer placeholder\r\nConnection: close\r\n\r\n")
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || strings.Contains(string(body), realToken) {
		t.Fatalf("captured call to the injected host: %d %s", resp.StatusCode, body)
	}
	f.mu.Lock()
	got := f.auth[len(f.auth)-1]
	f.mu.Unlock()
	if got != "Bearer "+realToken {
		t.Fatalf("the forge got %q, want the injected key", got)
	}
}

// dnsQuery asks name's type over a captured connection to port 53 and
// returns the answer's code and addresses.
func dnsQuery(t *testing.T, c net.Conn, name string, typ dnsmessage.Type) (dnsmessage.RCode, []string) {
	t.Helper()
	b := dnsmessage.NewBuilder(nil, dnsmessage.Header{ID: 7, RecursionDesired: true})
	b.StartQuestions()
	b.Question(dnsmessage.Question{Name: dnsmessage.MustNewName(name + "."), Type: typ, Class: dnsmessage.ClassINET})
	msg, err := b.Finish()
	if err != nil {
		t.Fatal(err)
	}
	c.Write(append(binary.BigEndian.AppendUint16(nil, uint16(len(msg))), msg...))
	var n [2]byte
	if _, err := io.ReadFull(c, n[:]); err != nil {
		t.Fatalf("DNS answer for %s: %v", name, err)
	}
	resp := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(c, resp); err != nil {
		t.Fatal(err)
	}
	var p dnsmessage.Parser
	h, err := p.Start(resp)
	if err != nil || h.ID != 7 || !h.Response {
		t.Fatalf("DNS answer for %s: %+v %v", name, h, err)
	}
	p.SkipAllQuestions()
	var addrs []string
	for {
		rh, err := p.AnswerHeader()
		if err != nil {
			break
		}
		switch rh.Type {
		case dnsmessage.TypeA:
			r, _ := p.AResource()
			addrs = append(addrs, netip.AddrFrom4(r.A).String())
		case dnsmessage.TypeAAAA:
			r, _ := p.AAAAResource()
			addrs = append(addrs, netip.AddrFrom16(r.AAAA).String())
		default:
			p.SkipAnswer()
		}
	}
	return h.RCode, addrs
}

// TestCaptureDNS: the proxy answers DNS over TCP on a captured connection
// to port 53: allowed names (exact, under a wildcard, injected or
// intercepted) with the addresses the proxy resolved, without the ones it
// would never dial; any other name NXDOMAIN, audited once per connection.
// Nothing is forwarded: other record types get no data. An allowed name
// under a search domain (a pod's resolver tries those first) is NXDOMAIN
// without an audit event.
func TestCaptureDNS(t *testing.T) {
	t.Parallel()
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow:   mustRules(t, "api.example.test", "*.cdn.example.test", "pinned.example.test:8443"),
		Resolve: mustPins(t, "pinned.example.test:8443=192.0.2.44:8443"),
		LookupIP: func(_ context.Context, host string) ([]netip.Addr, error) {
			return []netip.Addr{netip.MustParseAddr("198.51.100.10"), netip.MustParseAddr("2001:db8::10"), netip.MustParseAddr("127.0.0.1")}, nil
		},
		DNSSearch: []string{"default.svc.cluster.local", "svc.cluster.local"},
		Lease:     testLease, Audit: audit,
	})
	c := captured(t, proxy, "10.255.255.53:53")
	for _, tc := range []struct {
		name  string
		typ   dnsmessage.Type
		code  dnsmessage.RCode
		addrs string
	}{
		{"api.example.test", dnsmessage.TypeA, dnsmessage.RCodeSuccess, "[198.51.100.10]"},
		{"API.example.test", dnsmessage.TypeAAAA, dnsmessage.RCodeSuccess, "[2001:db8::10]"},
		{"x.cdn.example.test", dnsmessage.TypeA, dnsmessage.RCodeSuccess, "[198.51.100.10]"},
		{"pinned.example.test", dnsmessage.TypeA, dnsmessage.RCodeSuccess, "[192.0.2.44]"},
		{"api.example.test", dnsmessage.TypeTXT, dnsmessage.RCodeSuccess, "[]"},
		{"cdn.example.test", dnsmessage.TypeA, dnsmessage.RCodeNameError, "[]"},
		{"exfil-c2VjcmV0.attacker.test", dnsmessage.TypeA, dnsmessage.RCodeNameError, "[]"},
		{"exfil-c2VjcmV0.attacker.test", dnsmessage.TypeAAAA, dnsmessage.RCodeNameError, "[]"},
		// What a pod's resolver (ndots:5) asks before the name itself.
		{"api.example.test.default.svc.cluster.local", dnsmessage.TypeA, dnsmessage.RCodeNameError, "[]"},
		{"api.example.test.svc.cluster.local", dnsmessage.TypeA, dnsmessage.RCodeNameError, "[]"},
	} {
		code, addrs := dnsQuery(t, c, tc.name, tc.typ)
		if code != tc.code || fmt.Sprint(addrs) != tc.addrs {
			t.Errorf("%s %v: %v %v, want %v %s", tc.name, tc.typ, code, addrs, tc.code, tc.addrs)
		}
	}
	wantAudited(t, audit, "DNS lookup of exfil-c2vjcmv0.attacker.test refused for lease lease_egress1", "DNS lookup of cdn.example.test refused")
	n := 0
	for _, ev := range audit.events() {
		if strings.Contains(ev.Message, "attacker.test") {
			n++
		}
	}
	if n != 1 {
		t.Errorf("the refused name was audited %d times on one connection, want once", n)
	}
	for _, ev := range audit.events() {
		if strings.Contains(ev.Message, "cluster.local") {
			t.Errorf("an allowed name under a search domain was audited: %s", ev.Message)
		}
	}
	if got := resolvConfSearch("testdata/resolv.conf"); fmt.Sprint(got) != "[default.svc.cluster.local svc.cluster.local cluster.local]" {
		t.Errorf("search domains of testdata/resolv.conf: %v", got)
	}
}

// splitConn sends its first write's first byte alone, then the rest.
type splitConn struct {
	net.Conn
	split bool
}

func (c *splitConn) Write(b []byte) (int, error) {
	if c.split || len(b) < 2 {
		return c.Conn.Write(b)
	}
	c.split = true
	if _, err := c.Conn.Write(b[:1]); err != nil {
		return 0, err
	}
	n, err := c.Conn.Write(b[1:])
	return n + 1, err
}

// TestCaptureClientHelloInPieces: a ClientHello whose first byte arrives
// alone is still judged as TLS. (The proxy once kept the slice Peek gave
// for that byte; reading the rest refilled the buffer under it, and the
// stream was served as HTTP: "server gave HTTP response to HTTPS
// client", Node's ERR_SSL_WRONG_VERSION_NUMBER.)
func TestCaptureClientHelloInPieces(t *testing.T) {
	t.Parallel()
	ca := testca.New(t)
	api := apiServer(t, ca)
	proxy := startProxy(t, Config{Allow: mustRules(t, "api.example.test"), Resolve: mustPins(t, "api.example.test:443="+api)})
	for i := range 200 {
		raw := captured(t, proxy, "203.0.113.9:443")
		raw.(*net.TCPConn).SetNoDelay(true)
		c := tls.Client(&splitConn{Conn: raw}, &tls.Config{ServerName: "api.example.test", RootCAs: ca.Pool})
		if err := c.Handshake(); err != nil {
			t.Fatalf("connection %d: %v", i, err)
		}
		c.Close()
	}
}
