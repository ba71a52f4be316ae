package attempt

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// loAddrs puts two addresses of a 10.211.N.0/24 the test picks on the
// loopback interface: non-loopback addresses (the guard captures connects
// to them) whose traffic never leaves this machine. They are removed at
// cleanup. Adding them needs root, as CI runs the tests.
func loAddrs(t *testing.T) (a, b netip.Addr) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("transparent capture needs a test server on a non-loopback address: run as root (CI does), which adds one to lo")
	}
	for range 20 {
		n := byte(rand.IntN(250) + 1)
		a, b = netip.AddrFrom4([4]byte{10, 211, n, 1}), netip.AddrFrom4([4]byte{10, 211, n, 2})
		if err := exec.Command("ip", "addr", "add", a.String()+"/32", "dev", "lo").Run(); err != nil {
			continue // taken by a parallel test: pick another
		}
		t.Cleanup(func() { exec.Command("ip", "addr", "del", a.String()+"/32", "dev", "lo").Run() })
		if out, err := exec.Command("ip", "addr", "add", b.String()+"/32", "dev", "lo").CombinedOutput(); err != nil {
			t.Fatalf("ip addr add %s: %v: %s", b, err, out)
		}
		t.Cleanup(func() { exec.Command("ip", "addr", "del", b.String()+"/32", "dev", "lo").Run() })
		return a, b
	}
	t.Fatal("no free 10.211.N.0/24 for the test's addresses")
	return
}

// hostServer is a TLS server for names on addr, counting the connections
// it accepted.
type hostServer struct {
	addr  netip.AddrPort
	conns atomic.Int64
}

func serveHost(t *testing.T, ca *testca.CA, addr netip.AddrPort, body string, names ...string) *hostServer {
	t.Helper()
	ln, err := net.Listen("tcp", addr.String())
	if err != nil {
		t.Fatal(err)
	}
	h := &hostServer{addr: netip.MustParseAddrPort(ln.Addr().String())}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s (Host %s)\n", body, r.Host)
	}))
	srv.Listener.Close()
	srv.Listener = ln
	srv.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			h.conns.Add(1)
		}
	}
	srv.TLS = ca.ServerTLS(t, names...)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	return h
}

// buildCapClient builds testdata/capclient with CGO_ENABLED=0: a static
// Go binary with no proxy support and Go's own resolver.
func buildCapClient(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "capclient")
	cmd := exec.Command("go", "build", "-o", bin, "./testdata/capclient")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build capclient: %v\n%s", err, out)
	}
	return bin
}

// buildMuslResolve builds testdata/muslresolve statically with musl-gcc:
// musl's resolver asks over UDP only.
func buildMuslResolve(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "muslresolve")
	if out, err := exec.Command("musl-gcc", "-static", "-O2", "-o", bin, "testdata/muslresolve/resolve.c").CombinedOutput(); err != nil {
		t.Fatalf("musl-gcc (apt-get install musl-tools; .ci/run does): %v\n%s", err, out)
	}
	return bin
}

// buildJavaFetch compiles testdata/Fetch.java (the JDK's HttpClient,
// which ignores the proxy variables) and returns the command that runs
// it trusting caFile.
func buildJavaFetch(t *testing.T, caFile string) string {
	t.Helper()
	dir := t.TempDir()
	if out, err := exec.Command("javac", "-d", dir, "testdata/Fetch.java").CombinedOutput(); err != nil {
		t.Fatalf("javac: %v\n%s", err, out)
	}
	store := filepath.Join(dir, "trust.p12")
	if out, err := exec.Command("keytool", "-importcert", "-noprompt", "-alias", "testca", "-file", caFile,
		"-keystore", store, "-storetype", "PKCS12", "-storepass", "changeit").CombinedOutput(); err != nil {
		t.Fatalf("keytool: %v\n%s", err, out)
	}
	return "java -Djavax.net.ssl.trustStore=" + store + " -Djavax.net.ssl.trustStorePassword=changeit -cp " + dir + " Fetch"
}

// TestCaptureUnderRun (issue 31): under `fenceline run`, with the proxy
// variables unset, curl, Node's fetch, the JDK's HttpClient and a static
// Go binary reach an
// allowed host through transparent capture and are refused for another;
// an allowed name's TLS server name on a connect to another address
// reaches only the allowed host; glibc's resolver (getent, curl, Node)
// gets answers for allowed names over captured TCP and NXDOMAIN for
// others, and so do Go's own resolver and a static musl program over UDP
// (the sealed network). Every refusal is audited naming the lease.
//
// The attacks first: a client that ignores HTTPS_PROXY and connects to
// the other host's address directly (by name or with --resolve), or
// sends the allowed host's name in its ClientHello while connecting to
// the other host's address.
func TestCaptureUnderRun(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	addrA, addrB := loAddrs(t)
	ca := testca.New(t)
	hostA := serveHost(t, ca, netip.AddrPortFrom(addrA, 0), "served by A", "allowed.test")
	port := hostA.addr.Port()
	hostB := serveHost(t, ca, netip.AddrPortFrom(addrB, port), "served by B", "other.test", "allowed.test")
	capclient := "SSL_CERT_FILE=" + ca.File + " " + buildCapClient(t)
	musl := buildMuslResolve(t)

	b := bustest.Start(t)
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: leasebus.WorkspaceShared, TTL: leasebus.Duration(30 * time.Second)}, leasebus.HoldOptions{})

	java := buildJavaFetch(t, ca.File)
	p := strconv.Itoa(int(port))
	allowed, other := "https://allowed.test:"+p+"/", "https://other.test:"+p+"/"
	curl := "curl -sS --max-time 20 --noproxy '*' --cacert " + ca.File + " "
	fetch := func(u string) string {
		return `node -e 'fetch("` + u + `").then(r => r.text()).then(t => console.log(t)).catch(e => { console.log("error:", (e.cause && e.cause.code) || e.message); process.exit(1) })'`
	}
	checks := []struct {
		name, cmd string
		ok        bool   // exit status 0 wanted
		want      string // in the output
	}{
		{"curl", curl + allowed, true, "served by A (Host allowed.test:" + p + ")"},
		{"curl-other-by-name", curl + other, false, "Could not resolve host: other.test"},
		{"curl-other-by-address", curl + "--resolve other.test:" + p + ":" + addrB.String() + " " + other, false, ""},
		{"curl-allowed-sni-to-other-address", curl + "--resolve allowed.test:" + p + ":" + addrB.String() + " " + allowed, true, "served by A"},
		{"node-fetch", fetch(allowed), true, "served by A"},
		{"node-fetch-other", fetch(other), false, "error: ENOTFOUND"},
		{"go-static", capclient + " get " + allowed + " " + hostA.addr.String(), true, "200 served by A"},
		{"go-static-other", capclient + " get " + other + " " + hostB.addr.String(), false, "error:"},
		{"go-static-allowed-sni-to-other-address", capclient + " get " + allowed + " " + hostB.addr.String(), true, "200 served by A"},
		{"java-httpclient", java + " " + allowed, true, "200 served by A"},
		{"java-httpclient-other", java + " " + other, false, "error: java.net.ConnectException"},
		{"getent-allowed", "getent ahostsv4 allowed.test", true, addrA.String()},
		{"getent-other", "getent ahostsv4 other.test", false, ""},
		{"python-getaddrinfo", `python3 -c 'import socket; print(socket.getaddrinfo("allowed.test", 443, socket.AF_INET)[0][4][0])'`, true, addrA.String()},
		{"node-cares-resolve4", `node -e 'require("dns").resolve4("allowed.test", (e, a) => { console.log(e ? "error: " + e.code : a.join(",")); process.exit(e ? 1 : 0) })'`, true, addrA.String()},
		// Go's own resolver and musl's ask over UDP: their socket is made
		// in the sealed network, whose port 53 the egress proxy answers.
		{"go-resolver", capclient + " lookup allowed.test", true, "[" + addrA.String() + "]"},
		{"go-resolver-other", capclient + " lookup other.test", false, "no such host"},
		{"go-static-by-name", capclient + " fetch " + allowed, true, "200 served by A"},
		{"go-static-other-by-name", capclient + " fetch " + other, false, "no such host"},
		{"musl-getaddrinfo", musl + " allowed.test", true, addrA.String()},
		{"musl-getaddrinfo-other", musl + " other.test", false, "error:"},
	}
	var script strings.Builder
	script.WriteString("unset HTTPS_PROXY https_proxy HTTP_PROXY http_proxy NODE_USE_ENV_PROXY\nexport NODE_EXTRA_CA_CERTS=" + ca.File + "\n")
	for _, c := range checks {
		fmt.Fprintf(&script, "echo '== %s'; %s 2>&1; echo \"== exit $?\"\n", c.name, c.cmd)
	}
	spec, said := runSpec(t, b, co, l, "sh", "-c", script.String())
	spec.Sidecar.AllowHosts = []string{"allowed.test:" + p}
	spec.Sidecar.EgressResolve = []string{"allowed.test:" + p + "=" + hostA.addr.String()}
	var out bytes.Buffer
	spec.Stdout, spec.Stderr = &out, &out
	var proxyLog syncBuf // the egress proxy's log, shown when a check fails
	spec.Sidecar.Logger = slog.New(slog.NewTextHandler(&proxyLog, &slog.HandlerOptions{Level: slog.LevelDebug}))
	res, err := Run(context.Background(), spec)
	if err != nil {
		t.Fatalf("run: %v\n%s", err, said.text())
	}
	t.Logf("the agent's output:\n%s", out.String())
	if res.Code != 0 {
		t.Errorf("the script exited %d", res.Code)
	}
	got, exits := map[string]string{}, map[string]string{}
	var cur string
	for _, line := range strings.Split(out.String(), "\n") {
		switch {
		case strings.HasPrefix(line, "== exit "):
			exits[cur] = strings.TrimPrefix(line, "== exit ")
		case strings.HasPrefix(line, "== "):
			cur = strings.TrimPrefix(line, "== ")
		default:
			got[cur] += line + "\n"
		}
	}
	for _, c := range checks {
		o, code := got[c.name], exits[c.name]
		if (code == "0") != c.ok || !strings.Contains(o, c.want) {
			t.Errorf("%s: exit %s, output:\n%s\nwant exit 0 = %v and %q", c.name, code, o, c.ok, c.want)
		}
	}
	if n := hostB.conns.Load(); n != 0 {
		t.Errorf("the other host's server accepted %d connections: a captured connect reached the address the agent chose", n)
	}
	if t.Failed() {
		t.Logf("the sidecar's log:\n%s", proxyLog.String())
	}

	viewer := b.ConnectAs(t, leasebus.RoleViewer)
	testutil.CheckFor(t, 20*time.Second, 100*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(context.Background(), viewer, co.Repo, 0)
		if err != nil {
			return err
		}
		var missing []string
		for _, want := range []string{
			"DNS lookup of other.test refused",
			fmt.Sprintf("captured connection to %s (TLS server name \"other.test\") refused", hostB.addr),
		} {
			found := false
			for _, ev := range evs {
				if ev.Type == leasebus.EventDenied && ev.Boundary == leasebus.BoundaryNet && ev.LeaseID == l.Holder.Lease().LeaseID &&
					strings.Contains(ev.Message, want) && strings.Contains(ev.Message, "fence ") && ev.Reason == leasebus.ReasonNotAllowed {
					found = true
				}
			}
			if !found {
				missing = append(missing, want)
			}
		}
		if len(missing) > 0 {
			return fmt.Errorf("no audited refusal naming the lease for %q", missing)
		}
		return nil
	})
}

// TestCaptureInPod: in a pod the agent's wrapper (RunInPod) hands the
// connects that skip the proxy to the sidecar's egress proxy it learnt
// from the sidecar, and points glibc's resolver at TCP: curl with the
// proxy variables ignored reaches the allowed host by name and is refused
// another; Go's own resolver gets its answer over UDP (the sealed network).
func TestCaptureInPod(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	addrA, addrB := loAddrs(t)
	ca := testca.New(t)
	hostA := serveHost(t, ca, netip.AddrPortFrom(addrA, 0), "served by A", "allowed.test")
	port := hostA.addr.Port()
	hostB := serveHost(t, ca, netip.AddrPortFrom(addrB, port), "served by B", "other.test")
	b := bustest.Start(t)
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: leasebus.WorkspaceShared,
		TTL: leasebus.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	p := strconv.Itoa(int(port))
	rules, err := egress.ParseRules([]string{"allowed.test:" + p})
	if err != nil {
		t.Fatal(err)
	}
	pins, err := egress.ParseResolve([]string{"allowed.test:" + p + "=" + hostA.addr.String()})
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := egress.New(egress.Config{Allow: rules, Resolve: pins, Lease: l.Holder, Audit: b.Auditor})
	if err != nil {
		t.Fatal(err)
	}
	psrv := httptest.NewServer(proxy)
	t.Cleanup(func() { psrv.Close(); proxy.Close() })

	const token = "0123456789abcdef0123"
	admin, err := sidecar.StartAdmin(sidecar.AdminConfig{Token: token, Audit: b.Auditor, KeepAlive: 50 * time.Millisecond, Poll: 20 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	admin.SetLease(l.Holder, sidecar.Fences{Egress: psrv.URL, EgressAllow: proxy.Rules()})

	curl := "curl -sS --max-time 20 --noproxy '*' --cacert " + ca.File + " "
	script := "echo \"== $RES_OPTIONS\"; " + curl + "https://allowed.test:" + p + "/ 2>&1; echo \"== $?\"; " +
		curl + "--resolve other.test:" + p + ":" + addrB.String() + " https://other.test:" + p + "/ 2>&1; echo \"== $?\"; " +
		buildCapClient(t) + " lookup allowed.test 2>&1; echo \"== $?\""
	out := &syncBuf{}
	res, err := RunInPod(context.Background(), PodSpec{
		Argv: []string{"sh", "-c", script}, Checkout: co,
		SidecarURL: admin.URL(), Token: token, Grace: time.Second, Wait: 10 * time.Second,
		KillGrace: 5 * time.Second, Stdout: out, Stderr: out, FencelineStateDir: t.TempDir(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	got := out.String()
	t.Logf("the agent's output:\n%s", got)
	want := regexp.MustCompile(`^== use-vc\nserved by A \(Host allowed\.test:` + p + `\)\n== 0\n(?s:.*)== [1-9][0-9]*\n\[` +
		regexp.QuoteMeta(addrA.String()) + `\]\n== 0\n$`)
	if res.Code != 0 || !want.MatchString(got) {
		t.Errorf("in a pod: exit %d, output:\n%s\nwant RES_OPTIONS=use-vc, A reached by name, the other host refused and Go's resolver (UDP) answered %s", res.Code, got, addrA)
	}
	if n := hostB.conns.Load(); n != 0 {
		t.Errorf("the other host accepted %d connections", n)
	}
}
