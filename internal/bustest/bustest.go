// Package bustest starts a real lease bus for tests of the packages that
// stand on it: an in-process NATS JetStream server on 127.0.0.1 with the
// lease service, a client, and an auditor.
package bustest

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// Bus is a running bus; everything stops when the test ends.
type Bus struct {
	Server  *server.Server
	Conn    *nats.Conn
	Service *leasebus.Service
	Client  *leasebus.Client
	Auditor *leasebus.Auditor
}

// Start starts a bus for t with its store in a temporary directory.
func Start(t testing.TB) *Bus {
	t.Helper()
	srv, err := leasebus.StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	b := &Bus{Server: srv}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	b.Conn = Connect(t, srv.ClientURL())
	b.Service, err = leasebus.StartService(context.Background(), b.Conn, leasebus.ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Service.Stop)
	b.Client = leasebus.NewClient(b.Conn)
	if b.Auditor, err = leasebus.NewAuditor(b.Conn); err != nil {
		t.Fatal(err)
	}
	return b
}

// URL is the bus's client URL.
func (b *Bus) URL() string { return b.Server.ClientURL() }

// Connect opens a NATS connection closed when the test ends.
func Connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Lease is a held lease: the record, its credential and its holder.
type Lease struct {
	*leasebus.Holder
	Record *leasebus.Lease
	Cred   leasebus.Credential
}

// Acquire takes a lease and starts holding it; the holder stops (without
// releasing) when the test ends.
func (b *Bus) Acquire(t testing.TB, req leasebus.AcquireRequest, opts leasebus.HoldOptions) *Lease {
	t.Helper()
	if req.Owner.AgentID == "" {
		req.Owner = leasebus.Owner{TaskID: "task-" + t.Name(), AgentID: "agent", AttemptID: leasebus.NewAttemptID()}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cred := leasebus.NewCredential()
	sent := time.Now()
	rec, err := b.Client.Acquire(ctx, req, cred)
	if err != nil {
		t.Fatalf("acquire %s: %v", req.Scope, err)
	}
	h, err := b.Client.Hold(rec, cred, sent, opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Stop)
	return &Lease{Holder: h, Record: rec, Cred: cred}
}

// Claim builds a claim of paths (whole-repo for "*"), failing the test on
// bad input.
func Claim(t testing.TB, paths ...string) scope.Claim {
	t.Helper()
	whole := len(paths) == 1 && paths[0] == "*"
	if whole {
		paths = nil
	}
	c, err := scope.New(paths, whole, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}
