//go:build integration

package attempt

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"net/netip"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

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
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})

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
				if ev.Type == lease.EventDenied && ev.Boundary == lease.BoundaryNet && ev.LeaseID == l.Holder.Lease().LeaseID &&
					strings.Contains(ev.Message, want) && strings.Contains(ev.Message, "fence ") && ev.Reason == lease.ReasonNotAllowed {
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
