package attempt

import (
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
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
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
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared,
		TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
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
