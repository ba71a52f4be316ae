// Package bustest starts a real lease bus for tests of the packages that
// stand on it: an in-process NATS JetStream server on 127.0.0.1 with the
// lease service, a client, and an auditor. The bus requires credentials,
// as in production: every server a test binary starts admits one shared
// set (CredsDir), and Connect and ConnectAs use them.
package bustest

import (
	"context"
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
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
)

var (
	credsOnce sync.Once
	credsDir  string
	credsErr  error
)

// CredsDir is the bus credentials (one file per role, see
// leasebus.EnsureCreds) that every server of this test binary admits. It
// is removed after the tests (testutil.Main).
func CredsDir(t testing.TB) string {
	t.Helper()
	credsOnce.Do(func() {
		credsDir, credsErr = os.MkdirTemp("", "fenceline-test-creds-")
		if credsErr == nil {
			testutil.AtExit(func() { os.RemoveAll(credsDir) })
			_, credsErr = leasebus.EnsureCreds(credsDir)
		}
	})
	if credsErr != nil {
		t.Fatal(credsErr)
	}
	return credsDir
}

// CredsFile is the path of role's credentials in CredsDir.
func CredsFile(t testing.TB, role leasebus.Role) string {
	return filepath.Join(CredsDir(t), leasebus.CredsFile(role))
}

// StartServer starts an embedded server with cfg (a temporary store and a
// free 127.0.0.1 port when unset) admitting CredsDir's identities; it
// stops when the test ends.
func StartServer(t testing.TB, cfg leasebus.ServerConfig) *server.Server {
	t.Helper()
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.StoreDir == "" {
		cfg.StoreDir = t.TempDir()
	}
	cfg.CredsDir = CredsDir(t)
	srv, err := embedded.StartServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return srv
}

// Bus is a running bus; everything stops when the test ends.
type Bus struct {
	Server *server.Server
	// Conn is the lease service's connection (every permission it has):
	// for reading the streams, not for acting as a fence would.
	Conn    *nats.Conn
	Service *leasebus.Service
	// Client and Auditor act as a runner or sidecar does, with the holder
	// role's permissions only, so a fence tested with them needs nothing
	// a real holder lacks.
	Client  *leasebus.Client
	Auditor *leasebus.Auditor
	// Operator revokes and sweeps (the operator role).
	Operator *leasebus.Client
	// FenceSecrets is the service's FenceSecretDir: a test registers a
	// storage's secret there (leasebus.WriteFenceSecret) and later leases
	// of its repository get grant keys.
	FenceSecrets string
}

// Start starts a bus for t with its store in a temporary directory.
func Start(t testing.TB) *Bus {
	t.Helper()
	srv := StartServer(t, leasebus.ServerConfig{})
	b := &Bus{Server: srv, FenceSecrets: t.TempDir()}
	b.Conn = Connect(t, srv.ClientURL())
	var err error
	b.Service, err = leasebus.StartService(context.Background(), b.Conn, leasebus.ServiceConfig{Names: Names(t), FenceSecretDir: b.FenceSecrets})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Service.Stop)
	holder := ConnectRole(t, srv.ClientURL(), leasebus.RoleHolder)
	b.Client = leasebus.NewClient(holder)
	if b.Auditor, err = leasebus.NewAuditor(holder); err != nil {
		t.Fatal(err)
	}
	b.Operator = leasebus.NewClient(ConnectRole(t, srv.ClientURL(), leasebus.RoleOperator))
	return b
}

// URL is the bus's client URL.
func (b *Bus) URL() string { return b.Server.ClientURL() }

// Names maps CredsDir's identities to their role names, for
// leasebus.ServiceConfig.Names.
func Names(t testing.TB) map[string]string {
	t.Helper()
	creds, err := leasebus.EnsureCreds(CredsDir(t))
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]string{}
	for _, c := range creds {
		names[c.Nkey] = c.Name
	}
	return names
}

// Connect opens a NATS connection as the lease service (every permission
// the service has), closed when the test ends.
func Connect(t testing.TB, url string) *nats.Conn {
	t.Helper()
	return ConnectRole(t, url, leasebus.RoleService)
}

// ConnectAs opens a connection to b with the credentials of role.
func (b *Bus) ConnectAs(t testing.TB, role leasebus.Role, opts ...nats.Option) *nats.Conn {
	t.Helper()
	return ConnectRole(t, b.URL(), role, opts...)
}

// ConnectRole opens a connection to url with the credentials of role,
// reconnecting forever, closed when the test ends.
func ConnectRole(t testing.TB, url string, role leasebus.Role, opts ...nats.Option) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(url, Options(t, role, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// Options are the nats.go options of a test connection as role
// (credentials, fast reconnects), then opts.
func Options(t testing.TB, role leasebus.Role, opts ...nats.Option) []nats.Option {
	t.Helper()
	c, err := leasebus.LoadCreds(CredsFile(t, role))
	if err != nil {
		t.Fatal(err)
	}
	copts, err := c.Options()
	if err != nil {
		t.Fatal(err)
	}
	return append(append([]nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(50 * time.Millisecond)}, copts...), opts...)
}

// Lease is a held lease: the record, its credential and its holder.
type Lease struct {
	*leasebus.Holder
	Record *lease.Lease
	Cred   leasebus.Credential
}

// Acquire takes a lease and starts holding it; the holder stops (without
// releasing) when the test ends.
func (b *Bus) Acquire(t testing.TB, req leasebus.AcquireRequest, opts leasebus.HoldOptions) *Lease {
	t.Helper()
	if req.Owner.AgentID == "" {
		req.Owner = lease.Owner{TaskID: "task-" + t.Name(), AgentID: "agent", AttemptID: lease.NewAttemptID()}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cred := leasebus.NewCredential()
	h, err := b.Client.AcquireAndHold(ctx, req, cred, opts)
	if err != nil {
		t.Fatalf("acquire and hold %s: %v", req.Scope, err)
	}
	t.Cleanup(h.Orphan)
	rec := h.Lease()
	return &Lease{Holder: h, Record: &rec, Cred: cred}
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
