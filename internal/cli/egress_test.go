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
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
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
	t.Parallel()
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
		case ev.Boundary == lease.BoundaryNet && ev.LeaseID == id && ev.Reason == lease.ReasonNotAllowed && strings.Contains(ev.Message, "other.example.test"):
			net++
		case ev.Boundary == lease.BoundaryGit && ev.LeaseID == id:
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
	t.Parallel()
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
