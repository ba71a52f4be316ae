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

// Start runs a nats-server configured by conf (accounts, users, anything
// a nats.conf holds but where it listens and stores) and returns it once
// it takes connections. The test fails if nats-server rejects conf.
func Start(t testing.TB, conf string) *server.Server {
	t.Helper()
	path := filepath.Join(t.TempDir(), "nats.conf")
	full := fmt.Sprintf("listen: 127.0.0.1:-1\njetstream { store_dir: %q }\n%s", t.TempDir(), conf)
	if err := os.WriteFile(path, []byte(full), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("nats-server rejects the config: %v\n%s", err, full)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatalf("nats-server: %v", err)
	}
	go srv.Start()
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if !srv.ReadyForConnections(readyWait) {
		t.Fatalf("nats-server not ready after %s", readyWait)
	}
	return srv
}
