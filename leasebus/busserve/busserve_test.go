package busserve

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestMain fails the package if a server, service or connection a test
// started is still running after the tests.
func TestMain(m *testing.M) { testutil.Main(m) }

// logBuffer is a log destination the server's goroutines may write to
// while the test reads it.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

func startNode(t *testing.T, log *slog.Logger) *Node {
	t.Helper()
	n, err := StartNode(t.Context(), leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), CredsDir: bustest.CredsDir(t)}, log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(n.Stop)
	return n
}

func acquire(t *testing.T, url string) *lease.Lease {
	t.Helper()
	c := leasebus.NewClient(bustest.ConnectRole(t, url, leasebus.RoleHolder))
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	l, err := c.Acquire(ctx, leasebus.AcquireRequest{
		Repo:  "github.com/acme/billing",
		Scope: bustest.Claim(t, "services/billing"),
		Owner: lease.Owner{TaskID: "task", AgentID: "agent", AttemptID: lease.NewAttemptID()},
		TTL:   lease.Duration(time.Minute),
	}, leasebus.NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// A node and the lease service on it, with metrics and the run UI: leases
// are granted and counted, the UI answers, and after Stop nothing does.
func TestNodeAndService(t *testing.T) {
	logs := &logBuffer{}
	log := slog.New(slog.NewJSONHandler(logs, nil))
	n := startNode(t, log)
	if n.Config.CredsDir != bustest.CredsDir(t) || n.Server.Name() != "fenceline" || n.Clustered() {
		t.Errorf("node config %+v", n.Config)
	}
	if c := n.Creds(leasebus.RoleViewer); c.Path != bustest.CredsFile(t, leasebus.RoleViewer) || c.Role != leasebus.RoleViewer {
		t.Errorf("viewer creds %+v", c)
	}
	s, err := StartService(t.Context(), ServiceConfig{Node: n, Metrics: "127.0.0.1:0", UI: "127.0.0.1:0", Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	defer s.Stop()
	if s.URL != n.URL() || s.Replicas != 1 || !strings.HasPrefix(s.MetricsURL, "http://127.0.0.1:") || !strings.HasPrefix(s.UIURL, "http://127.0.0.1:") {
		t.Errorf("service %+v", s)
	}

	l := acquire(t, n.URL())
	if l.Fence == 0 {
		t.Errorf("lease %+v: no fence", l)
	}
	code, body := testutil.HTTPGet(t, s.MetricsURL, "")
	if code != http.StatusOK || !strings.Contains(body, `fenceline_bus_requests_total{op="acquire",result="ok"} 1`) || !strings.Contains(body, "fenceline_bus_active_leases 1") {
		t.Errorf("metrics: %d\n%s", code, body)
	}
	if code, body := testutil.HTTPGet(t, s.UIURL, ""); code != http.StatusOK {
		t.Errorf("run UI: %d %.200q", code, body)
	}
	// Profiles on demand, on the metrics address.
	base := strings.TrimSuffix(s.MetricsURL, "/metrics")
	if code, body := testutil.HTTPGet(t, base+"/debug/pprof/", ""); code != http.StatusOK || !strings.Contains(body, "goroutine") || !strings.Contains(body, "heap") {
		t.Errorf("pprof index: %d %.300q", code, body)
	}
	if code, body := testutil.HTTPGet(t, base+"/debug/pprof/goroutine?debug=1", ""); code != http.StatusOK || !strings.Contains(body, "goroutine profile:") {
		t.Errorf("goroutine profile: %d %.300q", code, body)
	}
	if code, body := testutil.HTTPGet(t, base+"/debug/pprof/profile?seconds=1", ""); code != http.StatusOK || len(body) == 0 {
		t.Errorf("cpu profile: %d, %d bytes", code, len(body))
	}

	metricsURL := s.MetricsURL
	s.Stop()
	s.Stop()
	if resp, err := http.Get(metricsURL); err == nil {
		resp.Body.Close()
		t.Error("metrics still served after Stop")
	}
	c := leasebus.NewClient(bustest.ConnectRole(t, n.URL(), leasebus.RoleViewer))
	c.Timeout, c.Tries = time.Second, 1
	if _, err := c.List(t.Context(), "github.com/acme/billing", false); err == nil {
		t.Error("a lease service still answers after Stop")
	}
	url := n.URL()
	n.Stop()
	n.Stop()
	var noBus *leasebus.NoBusError
	if _, err := leasebus.Dial(url, "", n.Creds(leasebus.RoleService)); !errors.As(err, &noBus) {
		t.Errorf("dial a stopped node: %v, want no bus", err)
	}
	for _, msg := range []string{`"msg":"bus started"`, `"msg":"bus stopped"`} {
		if !strings.Contains(logs.String(), msg) {
			t.Errorf("log lacks %s:\n%s", msg, logs)
		}
	}
}

// On an existing bus the service connects with the credentials it is
// given; the bus's refusal and a bus that is not there come back as
// leasebus.Dial's errors.
func TestServiceOnExistingBus(t *testing.T) {
	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	svcCreds := leasebus.BusCreds{Path: bustest.CredsFile(t, leasebus.RoleService), Source: "test", Role: leasebus.RoleService}
	s, err := StartService(t.Context(), ServiceConfig{URL: srv.ClientURL(), Source: "--nats", Creds: svcCreds, Names: bustest.Names(t)})
	if err != nil {
		t.Fatal(err)
	}
	if s.URL != srv.ClientURL() || s.Replicas != 1 || s.MetricsURL != "" || s.UIURL != "" {
		t.Errorf("service %+v", s)
	}
	acquire(t, srv.ClientURL())
	s.Stop()

	var refused *leasebus.CredsRefusedError
	_, err = StartService(t.Context(), ServiceConfig{URL: srv.ClientURL(), Source: "--nats", Creds: leasebus.BusCreds{Role: leasebus.RoleService, Looked: "/nowhere"}})
	if !errors.As(err, &refused) {
		t.Errorf("no credentials: %v, want refused", err)
	}
	var noBus *leasebus.NoBusError
	addr := testutil.FreeAddr(t)
	_, err = StartService(t.Context(), ServiceConfig{URL: "nats://" + addr, Source: "--nats", Creds: svcCreds})
	if !errors.As(err, &noBus) || noBus.Source != "--nats" {
		t.Errorf("no bus: %v", err)
	}
}

// Addresses that are taken and configurations that cannot work are
// reported before anything runs, as typed errors the command line words.
func TestStartErrors(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()

	var le *ListenError
	_, err = StartNode(t.Context(), leasebus.ServerConfig{Listen: addr, StoreDir: t.TempDir(), CredsDir: bustest.CredsDir(t)}, nil)
	if !errors.As(err, &le) || le.For != "clients" || le.Addr != addr || !errors.Is(err, syscall.EADDRINUSE) {
		t.Errorf("client port taken: %v", err)
	}
	var ce *ConfigError
	var fe *leasebus.FieldError
	_, err = StartNode(t.Context(), leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), ClusterName: "fl"}, nil)
	if !errors.As(err, &ce) || !errors.As(err, &fe) || fe.Field != "ClusterListen" || strings.Contains(err.Error(), "--") {
		t.Errorf("cluster without listen: %v, want a ConfigError naming the field ClusterListen and no flag", err)
	}
	_, err = StartNode(t.Context(), leasebus.ServerConfig{Listen: "127.0.0.1:0"}, nil)
	if !errors.As(err, &ce) || !errors.As(err, &fe) || fe.Field != "StoreDir" {
		t.Errorf("no store: %v, want a ConfigError naming the field StoreDir", err)
	}
	users := []leasebus.ServerUser{{Nkey: "UA", Role: leasebus.RoleHolder}}
	_, err = StartNode(t.Context(), leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), Users: users}, nil)
	if !errors.As(err, &ce) || !strings.Contains(err.Error(), "without CredsDir") {
		t.Errorf("users without their credentials dir: %v", err)
	}
	store := t.TempDir()
	n, err := StartNode(t.Context(), leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: store}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer n.Stop()
	if n.Config.CredsDir != filepath.Join(store, "creds") {
		t.Errorf("creds dir %s, want <store>/creds", n.Config.CredsDir)
	}
	_, err = StartService(t.Context(), ServiceConfig{Node: n, Metrics: addr})
	if !errors.As(err, &le) || le.For != "metrics" || le.Addr != addr {
		t.Errorf("metrics port taken: %v", err)
	}
	// Nothing of the failed start is left serving: a service starts anew.
	s, err := StartService(t.Context(), ServiceConfig{Node: n})
	if err != nil {
		t.Fatal(err)
	}
	s.Stop()
}
