// Package natstest starts a plain nats-server, as an operator would run
// one, for tests: loaded from a configuration text through nats-server's
// own parser, on a free loopback port, with JetStream on a temporary
// store, and shut down when the test ends. (internal/bustest starts the
// embedded bus instead: fenceline's own server and lease service.)
package natstest

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// readyWait bounds a test server's start.
const readyWait = 10 * time.Second

// Server is a nats-server Start started.
type Server struct {
	*server.Server
	store   string // its JetStream store_dir
	path    string // its configuration file
	reloads int    // how many times Reload ran
}

// Start runs a nats-server configured by conf (accounts, users, anything
// a nats.conf holds but where it listens and stores) and returns it once
// it takes connections. The test fails if nats-server rejects conf.
func Start(t testing.TB, conf string) *Server {
	t.Helper()
	store, path := t.TempDir(), filepath.Join(t.TempDir(), "nats.conf")
	opts := options(t, path, "127.0.0.1:-1", store, conf)
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats-server: %v", err)
	}
	go srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if !srv.ReadyForConnections(readyWait) {
		t.Fatalf("nats-server not ready after %s", readyWait)
	}
	return &Server{Server: srv, store: store, path: path}
}

// options writes conf, listening on listen and storing in store, to the
// file path, and parses it as nats-server does.
func options(t testing.TB, path, listen, store, conf string) *server.Options {
	t.Helper()
	full := fmt.Sprintf("listen: %s\njetstream { store_dir: %q }\n%s", listen, store, conf)
	if err := os.WriteFile(path, []byte(full), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("nats-server rejects the config: %v\n%s", err, full)
	}
	opts.NoLog, opts.NoSigs = true, true
	return opts
}

// Reload has srv take conf instead of the configuration it was started
// with (where it listens and stores stay), as an operator's `nats-server
// --signal reload` would: connections stay, and their accounts and
// permissions become conf's.
//
// Each reload marks its nkey users apart (Issued, which nats-server reads
// only from a user JWT): it sorts them by nkey and compares the old options
// with the new through reflect.DeepEqual, skipping accounts and users,
// which hold live state, but not nkeys, whose users point at their live
// accounts and on to every connection's counters. Alike up to there, the
// comparison walked into them while connections counted, a data race under
// -race (CI at 0775855 and 922adad; another order did not help, the sort
// undoes it); marked apart it stops at the first user.
func (srv *Server) Reload(t testing.TB, conf string) {
	t.Helper()
	opts := options(t, srv.path, srv.Addr().String(), srv.store, conf)
	srv.reloads++
	for _, u := range opts.Nkeys {
		u.Issued = int64(srv.reloads)
	}
	if err := srv.ReloadOptions(opts); err != nil {
		t.Fatalf("nats-server does not reload: %v", err)
	}
}
