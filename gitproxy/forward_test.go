//go:build integration

package gitproxy

import (
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/lease"
)

// TestForwardProxyHTTPS: an agent with an https:// remote reaches the git
// host through the forward proxy (the sidecar's egress proxy); it never holds the upstream credential
// (the sidecar adds it), and the same fence applies.
func TestForwardProxyHTTPS(t *testing.T) {
	e := newEnv(t)
	const token = "Bearer sidecar-secret"
	// The real git host: https, and it wants a credential.
	backend, err := gitserver.Handler(e.gs.root, gitEnv(t.TempDir())...)
	if err != nil {
		t.Fatal(err)
	}
	host := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Authorization") != token {
			http.Error(w, "credential required", http.StatusUnauthorized)
			return
		}
		backend.ServeHTTP(w, r)
	}))
	t.Cleanup(host.Close)
	hostCA := filepath.Join(t.TempDir(), "host-ca.pem")
	os.WriteFile(hostCA, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: host.Certificate().Raw}), 0o644)

	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	fence, err := New(Config{
		Upstream:       host.URL + "/payments.git",
		Lease:          l,
		Repo:           testRepo,
		Bus:            e.bus.Client,
		Audit:          e.bus.Auditor,
		MirrorDir:      t.TempDir(),
		TempDir:        t.TempDir(),
		UpstreamHeader: http.Header{"Authorization": {token}},
		UpstreamCAFile: hostCA,
		Transport:      host.Client().Transport,
	})
	if err != nil {
		t.Fatal(err)
	}
	ca, caFile, err := LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	hostPort := strings.TrimPrefix(host.URL, "https://")
	fwd, err := egress.New(egress.Config{Intercept: map[string]http.Handler{hostPort: fence}, CA: &ca})
	if err != nil {
		t.Fatal(err)
	}
	proxySrv := httptest.NewServer(fwd)
	t.Cleanup(func() { proxySrv.Close(); fwd.Close() })

	// The agent's git: the remote is the real https URL; only the proxy and
	// the CA to trust for that host are configured, as the sidecar's env does.
	agentEnv := []string{
		"GIT_CONFIG_COUNT=2",
		"GIT_CONFIG_KEY_0=http." + host.URL + "/.proxy", "GIT_CONFIG_VALUE_0=" + proxySrv.URL,
		"GIT_CONFIG_KEY_1=http." + host.URL + "/.sslCAInfo", "GIT_CONFIG_VALUE_1=" + caFile,
	}
	dir := filepath.Join(t.TempDir(), "work")
	if out, err := gitCmd(t, "", agentEnv, "clone", "--quiet", host.URL+"/payments.git", dir); err != nil {
		t.Fatalf("clone through the forward proxy: %v\n%s", err, out)
	}
	head := e.commit(dir, "in scope", "services/billing/x.go", "x\n")
	if out, err := gitCmd(t, dir, agentEnv, "push", "origin", "main"); err != nil {
		t.Fatalf("in-scope push through the forward proxy: %v\n%s", err, out)
	}
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("push through the forward proxy did not land")
	}
	e.commit(dir, "out of scope", "libs/tax/rates.go", "x\n")
	out, err := gitCmd(t, dir, agentEnv, "push", "origin", "main")
	if err == nil || !strings.Contains(out, "libs/tax/rates.go is outside lease "+l.Record.LeaseID) {
		t.Fatalf("out-of-scope push through the forward proxy: err=%v\n%s", err, out)
	}
	// Without the proxy, the agent has no credential for the host.
	if out, err := gitCmd(t, "", []string{"GIT_SSL_CAINFO=" + hostCA}, "ls-remote", host.URL+"/payments.git"); err == nil {
		t.Fatalf("direct access worked without a credential:\n%s", out)
	}
}
