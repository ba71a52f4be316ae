package cli

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/leasebus"
)

// egressWorld is a model API and a git host, both real TLS servers on
// 127.0.0.1 with certificates for made-up names from a test CA, and a
// checkout whose origin is the git host by name.
type egressWorld struct {
	ca       *testca.CA
	api      string // api server's 127.0.0.1:port
	gitAddr  string // git server's 127.0.0.1:port
	gitPort  string
	upstream string // https://git.example.test:PORT/payments.git
	bare     string
	co       string
}

func newEgressWorld(t *testing.T) *egressWorld {
	t.Helper()
	w := &egressWorld{ca: testca.New(t)}
	api := httptest.NewUnstartedServer(http.HandlerFunc(func(rw http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(rw, "model says hi on %s\n", r.URL.Path)
	}))
	api.TLS = w.ca.ServerTLS(t, "api.example.test")
	api.StartTLS()
	t.Cleanup(api.Close)
	w.api = api.Listener.Addr().String()

	root := t.TempDir()
	bare, err := gitserver.NewBare(filepath.Join(root, "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	w.bare = bare
	backend, err := gitserver.Handler(root, gitserver.ClientEnv(t.TempDir(), "server")...)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewUnstartedServer(backend)
	gs.TLS = w.ca.ServerTLS(t, "git.example.test")
	gs.StartTLS()
	t.Cleanup(gs.Close)
	w.gitAddr = gs.Listener.Addr().String()
	_, w.gitPort, _ = net.SplitHostPort(w.gitAddr)
	w.upstream = "https://git.example.test:" + w.gitPort + "/payments.git"

	seed := t.TempDir()
	mustGitRun(t, seed, nil, "init", "--quiet", "--initial-branch=main")
	for p, c := range map[string]string{"services/billing/invoice.go": "package billing\n", "libs/tax/rates.go": "package tax\n"} {
		os.MkdirAll(filepath.Join(seed, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(seed, p), []byte(c), 0o644)
	}
	mustGitRun(t, seed, nil, "add", "-A")
	mustGitRun(t, seed, nil, "commit", "--quiet", "-m", "seed")
	mustGitRun(t, seed, nil, "push", "--quiet", bare, "main")
	// The user's clone, by name (git resolves the made-up name here only).
	w.co = filepath.Join(t.TempDir(), "payments")
	mustGitRun(t, "", []string{"GIT_SSL_CAINFO=" + w.ca.File}, "-c", "http.curloptResolve=git.example.test:"+w.gitPort+":127.0.0.1",
		"clone", "--quiet", w.upstream, w.co)
	return w
}

// args are run's flags for this world: the scope, the git fence for the
// upstream, api.example.test allowed, both names pinned to their servers.
func (w *egressWorld) args(extra ...string) []string {
	return append([]string{"--checkout", w.co, "--scope", "services/billing", "--workspace", "exclusive",
		"--git-upstream", w.upstream, "--git-upstream-ca", w.ca.File,
		"--allow-host", "api.example.test",
		"--egress-resolve", "api.example.test:443=" + w.api,
		"--egress-resolve", "other.example.test:443=" + w.api,
		"--egress-resolve", "git.example.test:" + w.gitPort + "=" + w.gitAddr}, extra...)
}

func (w *egressWorld) upstreamMain(t *testing.T) string {
	t.Helper()
	return strings.TrimSpace(mustGitRun(t, "", nil, "--git-dir", w.bare, "log", "-1", "--format=%s", "main"))
}

// TestRunEgress is issue 17's done-when: under fenceline run with
// --allow-host api.example.test, the agent's curl reaches that host
// through the egress proxy (TLS verified end to end against the test CA),
// another host is refused with the proxy's message (and audited), the
// git host's port is not reachable directly, and git pushes reach the
// upstream only through the git fence (an out-of-scope one refused), even
// a git that drops the insteadOf routing: the proxy hands the git host to
// the fence.
func TestRunEgress(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	script := `curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/v1/responses && echo api=ok || echo api=failed
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://other.example.test/ && echo other=reached || echo other=refused
exec 3<>/dev/tcp/127.0.0.1/` + w.gitPort + ` && echo git-direct=connected || echo git-direct=refused
echo '// v2' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "in scope" && git push -q origin main && echo push=ok
blob=$(echo 'package tax // mine now' | git hash-object -w --stdin)
git update-index --cacheinfo 100644,$blob,libs/tax/rates.go
git -c user.name=agent -c user.email=agent@example.com commit -qm "out of scope" && git push -q origin main 2>/dev/null && echo out-push=landed || echo out-push=refused
GIT_CONFIG_COUNT=0 GIT_SSL_NO_VERIFY=1 git push origin HEAD:refs/heads/viaproxy 2>&1 | grep -q "rates.go is outside lease" && echo bypass-push=fenced || echo bypass-push=other
GIT_SSL_NO_VERIFY=1 git push -q https://127.0.0.1:` + w.gitPort + `/payments.git HEAD:refs/heads/direct 2>/dev/null && echo direct-push=landed || echo direct-push=refused`
	start := time.Now()
	r := runFL(t, busURL, append(w.args(), "--", "bash", "-c", script)...).want(t, ExitOK)
	t.Logf("run took %s", time.Since(start).Round(time.Millisecond))
	const want = "model says hi on /v1/responses api=ok other=refused git-direct=refused push=ok out-push=refused bypass-push=fenced direct-push=refused"
	if got := strings.Join(strings.Fields(r.stdout), " "); got != want {
		t.Errorf("agent: %s\nwant   %s\nstderr:\n%s", got, want, r.stderr)
	}
	id := leaseOf(t, r.stderr)
	mustContain(t, "run stderr", r.stderr,
		"egress proxy http://127.0.0.1:", "tunnels api.example.test:443",
		"CONNECT tunnel failed, response 403",
		"other.example.test:443 refused for lease "+id, "let the agent reach it with --allow-host other.example.test")
	if got := w.upstreamMain(t); got != "in scope" {
		t.Errorf("upstream main: %q, want the in-scope commit", got)
	}
	for _, ref := range []string{"refs/heads/direct", "refs/heads/viaproxy"} {
		if out, err := gitRun(t, "", nil, "--git-dir", w.bare, "rev-parse", "--verify", "--quiet", ref); err == nil {
			t.Errorf("%s landed: %s", ref, out)
		}
	}
	_, nc := busClient(t, busURL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs, err := leasebus.ReadAudit(ctx, nc, "git.example.test:"+w.gitPort+"/payments", 0)
	if err != nil {
		t.Fatal(err)
	}
	var net, git int
	for _, ev := range evs {
		switch {
		case ev.Boundary == leasebus.BoundaryNet && ev.LeaseID == id && ev.Reason == leasebus.ReasonNotAllowed && strings.Contains(ev.Message, "other.example.test"):
			net++
		case ev.Boundary == leasebus.BoundaryGit && ev.LeaseID == id:
			git++
		}
	}
	if net != 1 || git == 0 {
		t.Errorf("audit: %d net refusals (want 1), %d git refusals (want some): %+v", net, git, evs)
	}
}

// TestRunEgressUsage: bad --allow-host and --egress-resolve are usage
// errors, before any bus is dialled.
func TestRunEgressUsage(t *testing.T) {
	isolate(t)
	co := newCheckout(t, "")
	for _, args := range [][]string{
		{"--allow-host", "*"},
		{"--allow-host", "api.example.test:0"},
		{"--egress-resolve", "api.example.test=127.0.0.1:1"},
	} {
		r := fl(t, append(append([]string{"--nats", closedURL(t), "run", "--checkout", co}, args...), "--", "true")...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, args[0]) {
			t.Errorf("%v: exit %d, want %d naming the flag\n%s", args, r.code, ExitUsage, r.stderr)
		}
	}
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
