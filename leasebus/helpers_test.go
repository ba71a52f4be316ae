package leasebus

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/internal/testutil"
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
	srv, err := StartServer(ServerConfig{Listen: listen, StoreDir: b.dir})
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

func connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
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

func owner(i int) Owner {
	return Owner{TaskID: fmt.Sprintf("task-%d", i), AgentID: fmt.Sprintf("agent-%d", i), AttemptID: fmt.Sprintf("att-%d", i)}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
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
