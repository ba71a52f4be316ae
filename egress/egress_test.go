package egress

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// memAuditor keeps the events it is given.
type memAuditor struct {
	mu  sync.Mutex
	evs []lease.AuditEvent
}

func (a *memAuditor) Record(_ context.Context, ev lease.AuditEvent) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.evs = append(a.evs, ev)
	return nil
}

func (a *memAuditor) events() []lease.AuditEvent {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]lease.AuditEvent(nil), a.evs...)
}

// fixedLease is a lease record for refusals to name.
type fixedLease lease.Lease

func (f fixedLease) Lease() lease.Lease { return lease.Lease(f) }

var testLease = fixedLease{LeaseID: "lease_egress1", Repo: "github.com/acme/payments", Fence: 7,
	Owner: lease.Owner{TaskID: "task-1", AgentID: "agent-1", AttemptID: "att_1"}}

// apiServer is a real TLS server on 127.0.0.1 with a certificate for
// api.example.test issued by ca; it answers "hello from api".
func apiServer(t *testing.T, ca *testca.CA) string {
	t.Helper()
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from api %s\n", r.URL.Path)
	}))
	srv.TLS = ca.ServerTLS(t, "api.example.test")
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return srv.Listener.Addr().String()
}

// startProxy serves a Proxy for cfg on 127.0.0.1 and returns its URL.
func startProxy(t testing.TB, cfg Config) string {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(func() { srv.Close(); p.Close() })
	return srv.URL
}

func mustRules(t testing.TB, ss ...string) []Rule {
	t.Helper()
	rs, err := ParseRules(ss)
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

func mustPins(t testing.TB, ss ...string) map[string]netip.AddrPort {
	t.Helper()
	pins, err := ParseResolve(ss)
	if err != nil {
		t.Fatal(err)
	}
	return pins
}

// curl runs the real curl through proxy; it returns stdout+stderr and
// the exit error.
func curl(t *testing.T, proxy string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "curl", append([]string{"-sS", "--max-time", "15", "--proxy", proxy}, args...)...)
	cmd.Env = []string{"PATH=" + os.Getenv("PATH"), "HOME=" + t.TempDir()}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// TestTunnelAllowedRefuseOthers: an allowed host is tunnelled untouched
// (curl verifies the real server's certificate with the test CA, which
// the proxy does not have: no interception), any other host gets 403
// naming the host, the lease and the flag, and the refusal is audited.
func TestTunnelAllowedRefuseOthers(t *testing.T) {
	t.Parallel()
	ca := testca.New(t)
	api := apiServer(t, ca)
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow:   mustRules(t, "api.example.test"),
		Resolve: mustPins(t, "api.example.test:443="+api, "other.example.test:443="+api),
		Lease:   testLease, Audit: audit,
	})

	out, err := curl(t, proxy, "--cacert", ca.File, "https://api.example.test/v1/responses")
	if err != nil || out != "hello from api /v1/responses\n" {
		t.Fatalf("allowed host through the proxy: %v\n%s", err, out)
	}
	if len(audit.events()) != 0 {
		t.Fatalf("an allowed request was audited: %+v", audit.events())
	}

	// Pinned too, but not allowed: the pin is no permission.
	out, err = curl(t, proxy, "--cacert", ca.File, "-v", "https://other.example.test/")
	if err == nil || !strings.Contains(out, "403") {
		t.Fatalf("other host: err=%v\n%s", err, out)
	}
	// The body, as a plain http client sees it.
	resp := proxyGet(t, proxy, "http://other.example.test/x")
	if resp.code != http.StatusForbidden {
		t.Fatalf("plain http to another host: %d %s", resp.code, resp.body)
	}
	for _, want := range []string{"other.example.test", "lease_egress1", "task=task-1 agent=agent-1 attempt=att_1", "fence 7", "--allow-host other.example.test:80"} {
		if !strings.Contains(resp.body, want) {
			t.Errorf("refusal body lacks %q:\n%s", want, resp.body)
		}
	}
	evs := audit.events()
	if len(evs) != 2 {
		t.Fatalf("audit: %d events, want 2: %+v", len(evs), evs)
	}
	for _, ev := range evs {
		if ev.Type != lease.EventDenied || ev.Boundary != lease.BoundaryNet || ev.Reason != lease.ReasonNotAllowed ||
			ev.LeaseID != "lease_egress1" || ev.Fence != 7 || ev.Owner.AgentID != "agent-1" || !strings.Contains(ev.Message, "other.example.test") {
			t.Errorf("audit event: %+v", ev)
		}
	}
	if !strings.Contains(evs[0].Message, "other.example.test:443 refused") || !strings.Contains(evs[0].Message, "--allow-host other.example.test\n") && !strings.HasSuffix(evs[0].Message, "--allow-host other.example.test") {
		t.Errorf("CONNECT refusal message: %s", evs[0].Message)
	}
}

type answer struct {
	code int
	body string
}

// proxyGet sends a plain http request through proxy with Go's client.
func proxyGet(t *testing.T, proxy, target string) answer {
	t.Helper()
	pu, _ := http.NewRequest(http.MethodGet, proxy, nil)
	c := &http.Client{Transport: &http.Transport{Proxy: http.ProxyURL(pu.URL)}, Timeout: 10 * time.Second}
	defer c.CloseIdleConnections()
	resp, err := c.Get(target)
	if err != nil {
		t.Fatalf("GET %s through the proxy: %v", target, err)
	}
	defer resp.Body.Close()
	var b bytes.Buffer
	b.ReadFrom(resp.Body)
	return answer{resp.StatusCode, b.String()}
}

// TestRefuseAddresses: IP literals are refused unless an entry names the
// address; a name that resolves to loopback (the sidecar's own ports,
// the bus) is refused even when allowed; only a pin reaches loopback.
func TestRefuseAddresses(t *testing.T) {
	t.Parallel()
	ca := testca.New(t)
	api := apiServer(t, ca)
	_, apiPort, _ := net.SplitHostPort(api)
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow: mustRules(t, "localhost:"+apiPort, "api.example.test", "api.example.test:"+apiPort),
		Lease: testLease, Audit: audit,
	})
	for _, tc := range []struct{ url, why string }{
		{"https://127.0.0.1:" + apiPort + "/", "an IP address is reached only when allowed by address"},
		{"https://[::1]:" + apiPort + "/", "an IP address is reached only when allowed by address"},
		{"https://169.254.169.254/", "an IP address is reached only when allowed by address"},
		{"https://localhost:" + apiPort + "/", "a loopback address"},
	} {
		out, err := curl(t, proxy, "-k", "-v", tc.url)
		if err == nil || !strings.Contains(out, "403") {
			t.Errorf("%s: err=%v\n%s", tc.url, err, out)
		}
		evs := audit.events()
		if len(evs) == 0 || !strings.Contains(evs[len(evs)-1].Message, tc.why) {
			t.Errorf("%s: last refusal does not say %q: %+v", tc.url, tc.why, evs)
		}
	}
	// Without a pin, api.example.test means nothing to DNS: the proxy
	// resolves it for real and never finds the test server.
	if out, err := curl(t, proxy, "--cacert", ca.File, "https://api.example.test:"+apiPort+"/"); err == nil || strings.Contains(out, "hello from api") {
		t.Fatalf("unpinned test name reached the test server: %v\n%s", err, out)
	}

	// Allowed by address: that address (and only it) is reached.
	proxy2 := startProxy(t, Config{Allow: mustRules(t, "127.0.0.1:"+apiPort)})
	if out, err := curl(t, proxy2, "-k", "https://127.0.0.1:"+apiPort+"/ip"); err != nil || !strings.Contains(out, "hello from api /ip") {
		t.Fatalf("IP allowed by address: %v\n%s", err, out)
	}
}

// TestPlainHTTP: absolute-URI requests follow the same policy: an
// allowed host:80 is forwarded (to its pinned address), the git host's
// requests go to its fence, and the client's proxy headers stay behind.
func TestPlainHTTP(t *testing.T) {
	t.Parallel()
	web := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "web %s %s proxy-auth=%q", r.Host, r.URL.Path, r.Header.Get("Proxy-Authorization"))
	}))
	t.Cleanup(web.Close)
	fence := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "fence %s abs=%v", r.URL.Path, r.URL.IsAbs())
	})
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow:     mustRules(t, "web.example.test:80"),
		Resolve:   mustPins(t, "web.example.test:80="+web.Listener.Addr().String()),
		Intercept: map[string]http.Handler{"git.example.test:80": fence},
		Lease:     testLease, Audit: audit,
	})
	if got := proxyGet(t, proxy, "http://web.example.test/page"); got.code != 200 || got.body != `web web.example.test /page proxy-auth=""` {
		t.Errorf("allowed http host: %d %s", got.code, got.body)
	}
	if got := proxyGet(t, proxy, "http://git.example.test/payments.git/info/refs"); got.code != 200 || got.body != "fence /payments.git/info/refs abs=false" {
		t.Errorf("git host over http: %d %s", got.code, got.body)
	}
	// curl's CONNECT to an http git host (proxytunnel) reaches the fence too.
	if out, err := curl(t, proxy, "--proxytunnel", "http://git.example.test/x"); err != nil || out != "fence /x abs=false" {
		t.Errorf("tunnelled http to the git host: %v %s", err, out)
	}
	if got := proxyGet(t, proxy, "http://web.example.test:8080/"); got.code != http.StatusForbidden {
		t.Errorf("another port of an allowed host: %d %s", got.code, got.body)
	}
	if n := len(audit.events()); n != 1 {
		t.Errorf("%d refusals audited, want 1", n)
	}
}

// TestResolveOnce: a name is resolved once per connection, every address
// it resolves to must pass, and what is dialled is the judged address,
// never the name (DNS rebinding between check and connect gains nothing).
func TestResolveOnce(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var lookups int
	var dialled []string
	answers := map[string][]netip.Addr{
		"mixed.example.test":  {netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("127.0.0.1")},
		"public.example.test": {netip.MustParseAddr("192.0.2.20")},
	}
	audit := &memAuditor{}
	proxy := startProxy(t, Config{
		Allow: mustRules(t, "mixed.example.test", "public.example.test"),
		LookupIP: func(_ context.Context, host string) ([]netip.Addr, error) {
			mu.Lock()
			defer mu.Unlock()
			lookups++
			return answers[host], nil
		},
		Dial: func(_ context.Context, _, addr string) (net.Conn, error) {
			mu.Lock()
			defer mu.Unlock()
			dialled = append(dialled, addr)
			return nil, fmt.Errorf("test network: %s unreachable", addr)
		},
		Lease: testLease, Audit: audit,
	})
	out, err := curl(t, proxy, "-v", "https://mixed.example.test/")
	if err == nil || !strings.Contains(out, "403") {
		t.Fatalf("a name with a loopback address among its answers: %v\n%s", err, out)
	}
	if evs := audit.events(); len(evs) != 1 || !strings.Contains(evs[0].Message, "resolves to 127.0.0.1, a loopback address") {
		t.Fatalf("audit: %+v", evs)
	}
	out, err = curl(t, proxy, "-v", "https://public.example.test/")
	if err == nil || !strings.Contains(out, "502") {
		t.Fatalf("unreachable allowed host: %v\n%s", err, out)
	}
	mu.Lock()
	defer mu.Unlock()
	if lookups != 2 || len(dialled) != 1 || dialled[0] != "192.0.2.20:443" {
		t.Errorf("lookups %d, dialled %v: want one lookup per CONNECT and only the judged address dialled", lookups, dialled)
	}
}

// TestRules: allowlist entries and what they match.
func TestRules(t *testing.T) {
	for _, tc := range []struct {
		rule, target string
		want         bool
	}{
		{"api.openai.com", "api.openai.com:443", true},
		{"api.openai.com", "API.OpenAI.com.:443", true},
		{"api.openai.com", "api.openai.com:80", false},
		{"api.openai.com:8443", "api.openai.com:8443", true},
		{"api.openai.com", "x.api.openai.com:443", false},
		{"*.anthropic.com", "api.anthropic.com:443", true},
		{"*.anthropic.com", "a.b.anthropic.com:443", true},
		{"*.anthropic.com", "anthropic.com:443", false},
		{"*.anthropic.com", "evilanthropic.com:443", false},
		{"*.anthropic.com", "anthropic.com.evil.io:443", false},
		{"10.0.0.5", "10.0.0.5:443", true},
		{"10.0.0.5", "10.0.0.6:443", false},
		{"[::1]:8443", "[::1]:8443", true},
		{"api.openai.com", "1.2.3.4:443", false},
	} {
		r, err := ParseRule(tc.rule)
		if err != nil {
			t.Fatalf("%s: %v", tc.rule, err)
		}
		tg, err := newTarget(tc.target, 0)
		if err != nil {
			t.Fatalf("%s: %v", tc.target, err)
		}
		if got := r.matches(tg.host, tg.addr, tg.port); got != tc.want {
			t.Errorf("%s matches %s: %v, want %v", tc.rule, tc.target, got, tc.want)
		}
	}
	for _, tc := range []struct {
		r, o string
		want bool
	}{
		{"*.anthropic.com", "api.anthropic.com", true},
		{"*.anthropic.com", "*.x.anthropic.com", true},
		{"*.anthropic.com", "anthropic.com", false},
		{"api.openai.com", "api.openai.com", true},
		{"api.openai.com", "api.openai.com:8443", false},
		{"api.openai.com", "*.openai.com", false},
	} {
		r, _ := ParseRule(tc.r)
		o, _ := ParseRule(tc.o)
		if got := r.Covers(o); got != tc.want {
			t.Errorf("%s covers %s: %v, want %v", tc.r, tc.o, got, tc.want)
		}
	}
	for _, bad := range []string{"", "*", "*.com", "api.openai.com:0", "api.openai.com:x", "http://api.openai.com", "a b", "*.*.x.com", "fe80::1%eth0"} {
		if _, err := ParseRule(bad); err == nil {
			t.Errorf("ParseRule(%q) accepted", bad)
		}
	}
	for _, bad := range []string{"api.example.test=127.0.0.1:1", "api.example.test:443", "api.example.test:443=localhost:1", "api.example.test:443=127.0.0.1"} {
		if _, err := ParseResolve([]string{bad}); err == nil {
			t.Errorf("ParseResolve(%q) accepted", bad)
		}
	}
	for a, want := range map[string]bool{"127.0.0.1": true, "127.9.9.9": true, "::1": true, "::ffff:127.0.0.1": true, "0.0.0.0": true, "0.1.2.3": true,
		"::": true, "169.254.169.254": true, "fe80::1": true, "224.0.0.1": true, "10.0.0.1": true, "100.64.0.1": true, "fd00::1": true, "93.184.216.34": false, "2606:4700::1": false,
		"64:ff9b::7f00:1": true, "64:ff9b::a9fe:a9fe": true, "64:ff9b::a00:1": true, "64:ff9b::5db8:d822": false, "64:ff9b:1::1": true,
		"2002:7f00:1::1": true, "2002:5db8:d822::1": false, "::a00:1": true, "2001:0:4136:e378::1": true} {
		if got := forbidden(netip.MustParseAddr(a)) != ""; got != want {
			t.Errorf("forbidden(%s) = %v, want %v", a, got, want)
		}
	}
}

// TestGitHostIntoTheFence: the git upstream's host is never tunnelled:
// its CONNECT is answered by the proxy with a certificate from the local
// CA and served by the git fence, which refuses an out-of-scope push and
// lets an in-scope one land, both from the real git CLI through
// HTTPS_PROXY.
func TestGitHostIntoTheFence(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	ca := testca.New(t)
	// The real git host: git http-backend over TLS, a certificate for
	// git.example.test, listening on 127.0.0.1.
	root := t.TempDir()
	bare, err := gitserver.NewBare(filepath.Join(root, "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	backend, err := gitserver.Handler(root, gitserver.ClientEnv(t.TempDir(), "server")...)
	if err != nil {
		t.Fatal(err)
	}
	host := httptest.NewUnstartedServer(backend)
	host.TLS = ca.ServerTLS(t, "git.example.test")
	host.StartTLS()
	t.Cleanup(host.Close)
	_, port, _ := net.SplitHostPort(host.Listener.Addr().String())
	gitHost := "git.example.test:" + port
	upstream := "https://" + gitHost
	seed := t.TempDir()
	git(t, seed, nil, "init", "--quiet", "--initial-branch=main")
	for p, c := range map[string]string{"services/billing/invoice.go": "package billing\n", "libs/tax/rates.go": "package tax\n"} {
		os.MkdirAll(filepath.Join(seed, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(seed, p), []byte(c), 0o644)
	}
	git(t, seed, nil, "add", "-A")
	git(t, seed, nil, "commit", "--quiet", "-m", "seed")
	git(t, seed, nil, "push", "--quiet", bare, "main")

	lease := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "services/billing"),
		WorkspaceMode: lease.WorkspaceExclusive, WorkspaceID: "ws-egress", TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	// The fence reaches the host through the same pin the proxy has.
	tr := http.DefaultTransport.(*http.Transport).Clone()
	tr.TLSClientConfig.RootCAs = ca.Pool
	tr.DialContext = func(ctx context.Context, network, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, network, host.Listener.Addr().String())
	}
	t.Cleanup(tr.CloseIdleConnections)
	work := filepath.Join(t.TempDir(), "work")
	fence, err := gitproxy.New(gitproxy.Config{Upstream: upstream, Lease: lease, Repo: "github.com/acme/payments",
		Bus: bus.Client, Audit: bus.Auditor, TempDir: t.TempDir(), Transport: tr, ObjectDirs: []string{filepath.Join(work, ".git")}})
	if err != nil {
		t.Fatal(err)
	}
	local, localFile, err := gitproxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	audit := &memAuditor{}
	proxy := startProxy(t, Config{Intercept: map[string]http.Handler{gitHost: fence}, CA: &local, Lease: lease, Audit: audit})

	// The agent's git: HTTPS_PROXY and the local CA for that host only.
	env := []string{"HTTPS_PROXY=" + proxy, "GIT_CONFIG_COUNT=1",
		"GIT_CONFIG_KEY_0=http." + upstream + "/.sslCAInfo", "GIT_CONFIG_VALUE_0=" + localFile}
	git(t, "", env, "clone", "--quiet", upstream+"/payments.git", work)
	os.WriteFile(filepath.Join(work, "services/billing/invoice.go"), []byte("package billing // v2\n"), 0o644)
	git(t, work, env, "commit", "--quiet", "-am", "in scope")
	git(t, work, env, "push", "--quiet", "origin", "main")
	head := strings.TrimSpace(git(t, work, nil, "rev-parse", "HEAD"))
	if got := strings.TrimSpace(git(t, bare, nil, "rev-parse", "main")); got != head {
		t.Fatalf("in-scope push through the proxy did not land: upstream %s, pushed %s", got, head)
	}
	os.WriteFile(filepath.Join(work, "libs/tax/rates.go"), []byte("package tax // v2\n"), 0o644)
	git(t, work, env, "commit", "--quiet", "-am", "out of scope")
	out, err := gitErr(t, work, env, "push", "origin", "main")
	if err == nil || !strings.Contains(out, "libs/tax/rates.go is outside lease "+lease.Record.LeaseID) {
		t.Fatalf("out-of-scope push through the proxy: err=%v\n%s", err, out)
	}
	if got := strings.TrimSpace(git(t, bare, nil, "rev-parse", "main")); got != head {
		t.Fatal("the out-of-scope push landed")
	}
	// The git host's real certificate never reaches the client: trusting
	// only the test CA, git fails (the proxy intercepts).
	env2 := []string{"HTTPS_PROXY=" + proxy, "GIT_SSL_CAINFO=" + ca.File}
	if out, err := gitErr(t, "", env2, "ls-remote", upstream+"/payments.git"); err == nil {
		t.Fatalf("the git host was tunnelled, not intercepted:\n%s", out)
	}
	if len(audit.events()) != 0 {
		t.Fatalf("the git host's requests were refused by the proxy: %+v", audit.events())
	}
}

func git(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	out, err := gitErr(t, dir, env, args...)
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

func gitErr(t *testing.T, dir string, env []string, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	cmd.Env = append(gitserver.ClientEnv(t.TempDir(), "agent"), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}
