package pgproxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// LeaseSource is the lease the proxy fences writes with: Fence is called
// for every write and fails once the lease is lost or unknown
// (*leasebus.Holder is one). Auditor records denied writes
// (*leasebus.Auditor is one). pgproxy links no NATS: it knows only the
// lease domain.
type (
	LeaseSource = lease.Source
	Auditor     = lease.Auditor
)

// Config configures a Proxy. The zero value listens on 127.0.0.1 (a free
// port) in front of 127.0.0.1:5432, refuses TLS and refuses every write
// (no lease).
type Config struct {
	// Listen is the host:port clients connect to (default "127.0.0.1:0").
	Listen string
	// Upstream is the Postgres server's host:port (default
	// "127.0.0.1:5432"), or the absolute path of its Unix-domain socket
	// (e.g. /var/run/postgresql/.s.PGSQL.5432) when it runs on the same
	// machine: cheaper per message for both the proxy and the server.
	Upstream string
	// Lease fences writes; nil refuses every write (reads still flow).
	Lease LeaseSource
	// Audit records every refused write; nil records nothing.
	Audit Auditor
	// Fence tokens are signed with the lease's Postgres grant key, which
	// Lease gives when it is a lease.Granter (a *leasebus.Holder is: the
	// lease service derives it from the database's secret, which the proxy
	// never holds, and gives it to the lease's acquirer). Without one the
	// proxy still refuses writes the lease does not allow, but Postgres
	// rejects every write to a fenced table (the token cannot be signed).
	// TLS terminates TLS for clients that send SSLRequest; nil answers 'N'
	// (clients with sslmode=prefer then continue in plaintext).
	TLS *tls.Config
	// AllowOpaque lets writes whose tables cannot be named from the text
	// (DO, CALL, EXECUTE of an unknown statement, GRANT, ...) through under a
	// live lease; the storage-side fence then is the only check. Off by
	// default: when in doubt, refuse.
	AllowOpaque bool
	// Policy, when set, is the security team's policy: every write is
	// asked as sql_write on each table it names, or sql_opaque when its
	// tables cannot be named (policyhook.go); it only narrows. Nil: none.
	Policy *policy.Store
	// MaxMessageSize bounds one protocol message (default 64 MiB).
	MaxMessageSize int
	// StartupTimeout bounds the startup and authentication phase (default 30 s).
	StartupTimeout time.Duration
	// DialTimeout bounds connecting to the upstream (default 10 s).
	DialTimeout time.Duration
	// AuditTimeout bounds recording one audit event (default 5 s).
	AuditTimeout time.Duration
	// LeaseCheckInterval is how often the proxy asks Lease whether it is
	// still live, to cancel the statements that run in transactions it
	// made writable once it is not (default 100 ms). A Lease with a
	// Lost() <-chan struct{} method (*leasebus.Holder) is also heard at
	// once. It bounds how long a write already running when the lease
	// is lost can still land (see the package doc, Known limits).
	LeaseCheckInterval time.Duration
	// Logger receives operational logs (nil: discard).
	Logger *slog.Logger
	// Dial connects to the upstream (default net.Dialer.DialContext).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
}

// Validate reports a configuration that cannot work, naming the field.
func (c *Config) Validate() error {
	if c.Listen != "" {
		if _, _, err := net.SplitHostPort(c.Listen); err != nil {
			return fmt.Errorf("pgproxy config: Listen %q: want host:port: %w", c.Listen, err)
		}
	}
	if c.Upstream != "" && upstreamNetwork(c.Upstream) == "tcp" {
		if _, _, err := net.SplitHostPort(c.Upstream); err != nil {
			return fmt.Errorf("pgproxy config: Upstream %q: want host:port or the absolute path of a Unix socket: %w", c.Upstream, err)
		}
	}
	if upstreamNetwork(c.Upstream) == "unix" {
		if fi, err := os.Stat(c.Upstream); err == nil && fi.IsDir() {
			return fmt.Errorf("pgproxy config: Upstream %q is a directory: name the socket in it, e.g. %s", c.Upstream, filepath.Join(c.Upstream, ".s.PGSQL.5432"))
		}
	}
	if c.MaxMessageSize < 0 || (c.MaxMessageSize > 0 && c.MaxMessageSize < 1<<16) {
		return fmt.Errorf("pgproxy config: MaxMessageSize %d: want 0 (default) or at least 65536", c.MaxMessageSize)
	}
	if c.StartupTimeout < 0 || c.DialTimeout < 0 || c.AuditTimeout < 0 || c.LeaseCheckInterval < 0 {
		return errors.New("pgproxy config: timeouts must not be negative")
	}
	return nil
}

// upstreamNetwork is "unix" for an absolute path, else "tcp".
func upstreamNetwork(upstream string) string {
	if strings.HasPrefix(upstream, "/") {
		return "unix"
	}
	return "tcp"
}

func (c Config) withDefaults() Config {
	if c.Listen == "" {
		c.Listen = "127.0.0.1:0"
	}
	if c.Upstream == "" {
		c.Upstream = "127.0.0.1:5432"
	}
	if c.MaxMessageSize == 0 {
		c.MaxMessageSize = 64 << 20
	}
	if c.StartupTimeout == 0 {
		c.StartupTimeout = 30 * time.Second
	}
	if c.DialTimeout == 0 {
		c.DialTimeout = 10 * time.Second
	}
	if c.AuditTimeout == 0 {
		c.AuditTimeout = 5 * time.Second
	}
	if c.LeaseCheckInterval == 0 {
		c.LeaseCheckInterval = 100 * time.Millisecond
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	if c.Dial == nil {
		d := &net.Dialer{KeepAlive: 30 * time.Second}
		c.Dial = d.DialContext
	}
	return c
}
