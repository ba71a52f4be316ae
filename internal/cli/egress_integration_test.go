//go:build integration

package cli

import (
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/fenceline/fenceline/internal/testca"
)

// TestRunEgressGitForward: with --git-forward the agent's git keeps its
// https remote and reaches it through the egress proxy, which serves the
// git host with the git fence (a local CA's certificate, trusted for that
// host only).
func TestRunEgressGitForward(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	script := `echo '// v3' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "forwarded" && git push -q origin main && echo push=ok
env | grep -c '^GIT_CONFIG_KEY_.*=http\..*\.proxy$'`
	r := runFL(t, busURL, append(w.args("--git-forward"), "--", "bash", "-c", script)...).want(t, ExitOK)
	if got := strings.Fields(r.stdout); len(got) != 2 || got[0] != "push=ok" || got[1] != "1" {
		t.Errorf("agent: %q, want push=ok and one http.<upstream>.proxy entry\nstderr:\n%s", r.stdout, r.stderr)
	}
	if got := w.upstreamMain(t); got != "forwarded" {
		t.Errorf("upstream main: %q, want the pushed commit", got)
	}
}

// TestAgentEgressThroughSidecar: in a pod, the sidecar's egress proxy
// travels to "fenceline agent" with its fences: the agent's curl reaches
// the allowed host through it (TLS verified end to end), is refused for
// another, and cannot connect to the host's port directly. An agent
// --allow-host the sidecar does not allow stops the wrapper before CMD.
func TestAgentEgressThroughSidecar(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	co := newCheckout(t, "")
	sc := startSidecar(t, busURL, "--repo", testRepo, "--scope", "in", "--state-dir", t.TempDir(),
		"--allow-host", "api.example.test", "--egress-resolve", "api.example.test:443="+w.api,
		"--egress-resolve", "other.example.test:443="+w.api)
	mustContain(t, "sidecar stdout", sc.out.String(), "egress proxy: http://127.0.0.1:", "HTTPS_PROXY=http://127.0.0.1:")
	_, apiPort, _ := net.SplitHostPort(w.api)
	script := `curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/pod && echo api=ok || echo api=failed
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://other.example.test/ 2>/dev/null && echo other=reached || echo other=refused
exec 3<>/dev/tcp/127.0.0.1/` + apiPort + ` 2>/dev/null && echo api-direct=connected || echo api-direct=refused`
	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--allow-host", "api.example.test", "--", "bash", "-c", script)
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d\n%s", code, r.errOut)
	}
	const want = "model says hi on /pod api=ok other=refused api-direct=refused"
	if got := strings.Join(strings.Fields(r.out.String()), " "); got != want {
		t.Errorf("agent: %s\nwant   %s\nstderr:\n%s\nsidecar:\n%s", got, want, r.errOut, sc.errOut)
	}

	r2 := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--allow-host", "api.openai.com", "--", "true")
	if code := r2.wait(t); code != ExitUsage {
		t.Fatalf("agent with a host the sidecar does not allow: exit %d, want %d\n%s", code, ExitUsage, r2.errOut)
	}
	mustContain(t, "agent stderr", r2.errOut.String(), "--allow-host api.openai.com: the sidecar's egress proxy does not allow it", "start the sidecar with --allow-host api.openai.com")
}

// TestRunInjectedCredential (issue 31): with --inject-header-file the
// agent's clients reach the host with a placeholder key (curl and Python
// trust the run's CA through the bundle variables run sets), the forge
// gets the real key, a contents write through the API is refused, and the
// agent finds the key nowhere: not in its environment, not in the header
// file (hidden), not in any process's environ or command line, and the
// CA's private key beside the certificate it trusts is hidden too.
func TestRunInjectedCredential(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	const realToken = "fenceline-injected-secret-7177"
	ca := testca.New(t)
	var mu sync.Mutex
	var got []string
	forge := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got = append(got, r.Method+" "+r.URL.Path+" "+r.Header.Get("Authorization"))
		mu.Unlock()
		if r.Header.Get("Authorization") != "Bearer "+realToken {
			http.Error(w, "bad credentials", http.StatusUnauthorized)
			return
		}
		fmt.Fprintf(w, "forge-ok-%s\n", strings.ReplaceAll(strings.Trim(r.URL.Path, "/"), "/", "-"))
	}))
	forge.TLS = ca.ServerTLS(t, "api.github.com")
	forge.StartTLS()
	t.Cleanup(forge.Close)
	hdr := filepath.Join(t.TempDir(), "github.headers")
	if err := os.WriteFile(hdr, []byte("# the bot's token\nAuthorization: Bearer "+realToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	co := newCheckout(t, "")
	// The agent looks for the key by content from a file of its own, so
	// that no command line it runs holds it.
	script := `printf '%s%s' fenceline-injected- secret-7177 > "$TMPDIR/pat"
curl -sS --max-time 10 -H "Authorization: Bearer placeholder" https://api.github.com/user && echo curl=ok || echo curl=failed
python3 -c 'import urllib.request as u; print(u.urlopen(u.Request("https://api.github.com/repos/acme/payments", headers={"Authorization": "Bearer placeholder"}), timeout=10).read().decode().strip())' 2>&1 | tail -1
curl -sS --max-time 10 -o /dev/null -w "put=%{http_code}\n" -X PUT -H "Authorization: Bearer placeholder" -d '{}' https://api.github.com/repos/acme/payments/contents/libs/tax/rates.go
cat ` + hdr + ` >/dev/null 2>&1 && echo header=read || echo header=hidden
cat "$(dirname "$SSL_CERT_FILE")/ca-key.pem" >/dev/null 2>&1 && echo cakey=read || echo cakey=hidden
grep -q "BEGIN CERTIFICATE" "$SSL_CERT_FILE" "$NODE_EXTRA_CA_CERTS" && echo bundle=read
echo envhits=$(env | grep -c -F -f "$TMPDIR/pat")
echo prochits=$(cat /proc/[0-9]*/environ /proc/[0-9]*/cmdline 2>/dev/null | tr '\0' '\n' | grep -c -F -f "$TMPDIR/pat")`
	r := runFL(t, busURL, "--checkout", co, "--scope", "in",
		"--inject-header-file", "api.github.com="+hdr, "--egress-ca", ca.File,
		"--egress-resolve", "api.github.com:443="+forge.Listener.Addr().String(),
		"--", "bash", "-c", script).want(t, ExitOK)
	const want = "forge-ok-user curl=ok forge-ok-repos-acme-payments put=403 header=hidden cakey=hidden bundle=read envhits=0 prochits=0"
	if g := strings.Join(strings.Fields(r.stdout), " "); g != want {
		t.Errorf("agent: %s\nwant   %s\nstderr:\n%s", g, want, r.stderr)
	}
	if strings.Contains(r.stdout+r.stderr, realToken) {
		t.Errorf("the real key is in run's output:\n%s\n%s", r.stdout, r.stderr)
	}
	mustContain(t, "run stderr", r.stderr, "opens api.github.com:443 to add their credentials", "refused by API rule github-contents")
	mu.Lock()
	defer mu.Unlock()
	for _, g := range got {
		if !strings.HasSuffix(g, " Bearer "+realToken) || strings.HasPrefix(g, "PUT ") {
			t.Errorf("the forge got %q: want only reads, each with the real key", g)
		}
	}
	if len(got) != 2 {
		t.Errorf("the forge got %d calls (%v), want the two reads", len(got), got)
	}
}
