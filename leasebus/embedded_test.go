package leasebus

import (
	"context"
	"log/slog"

	"github.com/nats-io/nats-server/v2/server"
)

// The embedded server lives in package embedded, which imports this
// package, so the tests of this package cannot import it; the external
// test file embedded_ext_test.go, built into the same test binary, sets
// these to its functions.
var (
	EmbeddedStartServer   func(ServerConfig) (*server.Server, error)
	EmbeddedStoreProbe    func(*server.Server, string) StoreProbe
	EmbeddedKeepStore     func(context.Context, *server.Server, string, *slog.Logger)
	EmbeddedAuditRefusals func(*Service, *server.Server, bool, bool) func()
)
