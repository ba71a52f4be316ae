package leasebus

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// bus is one in-process server with a lease service, for tests.
type bus struct {
	t   testing.TB
	srv *server.Server
	dir string
	nc  *nats.Conn
	svc *Service
	c   *Client
	// cfg configures the service start starts (zero: defaults).
	cfg ServiceConfig
}

var (
	credsOnce sync.Once
	credsDir  string
	credsErr  error
)

// testCredsDir is one set of bus credentials shared by every server the
// package's tests start (restarts, cluster nodes and proxies need no
// bookkeeping); it is removed when the tests are done.
func testCredsDir(t testing.TB) string {
	t.Helper()
	credsOnce.Do(func() {
		credsDir, credsErr = os.MkdirTemp("", "fenceline-test-creds-")
		if credsErr == nil {
			testutil.AtExit(func() { os.RemoveAll(credsDir) })
			_, credsErr = EnsureCreds(credsDir)
		}
	})
	if credsErr != nil {
		t.Fatal(credsErr)
	}
	return credsDir
}

// serverConfig is cfg with the tests' shared credentials.
func serverConfig(t testing.TB, cfg ServerConfig) ServerConfig {
	cfg.CredsDir = testCredsDir(t)
	return cfg
}

func startBus(t testing.TB) *bus {
	t.Helper()
	b := &bus{t: t, dir: t.TempDir()}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	return b
}

// start (re)starts the server on listen (keeping the store) and the service.
func (b *bus) start(listen string) {
	b.t.Helper()
	srv, err := EmbeddedStartServer(serverConfig(b.t, ServerConfig{Listen: listen, StoreDir: b.dir}))
	if err != nil {
		b.t.Fatal(err)
	}
	b.srv = srv
	b.nc = connect(b.t, srv.ClientURL())
	b.svc, err = StartService(context.Background(), b.nc, b.cfg)
	if err != nil {
		b.t.Fatal(err)
	}
	b.c = NewClient(b.nc)
}

func (b *bus) stop() {
	if b.svc != nil {
		b.svc.Stop()
		b.svc = nil
	}
	if b.nc != nil {
		b.nc.Close()
		b.nc = nil
	}
	if b.srv != nil {
		b.srv.Shutdown()
		b.srv.WaitForShutdown()
		b.srv = nil
	}
}

// connect opens a connection as the lease service.
func connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	return connectAs(t, url, RoleService)
}

// connectAs opens a connection with the credentials of role.
func connectAs(t testing.TB, url string, role Role, opts ...nats.Option) *nats.Conn {
	t.Helper()
	c, err := LoadCreds(filepath.Join(testCredsDir(t), CredsFile(role)))
	if err != nil {
		t.Fatal(err)
	}
	copts, err := c.Options()
	if err != nil {
		t.Fatal(err)
	}
	opts = append(append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, copts...), opts...)
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// checkFor polls f until it returns nil or timeout passes.
func checkFor(t testing.TB, timeout, interval time.Duration, f func() error) {
	t.Helper()
	testutil.CheckFor(t, timeout, interval, f)
}

func claim(t testing.TB, paths ...string) scope.Claim {
	t.Helper()
	c, err := scope.New(paths, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func owner(i int) lease.Owner {
	return lease.Owner{TaskID: fmt.Sprintf("task-%d", i), AgentID: fmt.Sprintf("agent-%d", i), AttemptID: fmt.Sprintf("att-%d", i)}
}

func ctxT(t testing.TB) context.Context {
	return ctxFor(t, 30*time.Second)
}

// ctxFor is a context that ends d from now or with the test: for a test
// whose own waits add up to more than ctxT's 30 s (a cluster's start, a
// fault, a stream's election).
func ctxFor(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// queued counts the acquires waiting in svc's queue for repo.
func queued(svc *Service, repo string) int {
	a := svc.actor(RepoKey(repo), repo)
	a.busy.Lock()
	defer a.busy.Unlock()
	n := 0
	for _, w := range a.waiters {
		if !w.cancelled {
			n++
		}
	}
	return n
}
