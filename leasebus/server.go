package leasebus

import (
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"path/filepath"
	"strconv"
	"time"
)

// DefaultListen is where the embedded bus listens and where every other
// command looks for it.
const DefaultListen = "127.0.0.1:7422"

// DefaultURL is the NATS URL of the embedded bus at DefaultListen.
const DefaultURL = "nats://" + DefaultListen

// ServerConfig configures the embedded NATS server (embedded.StartServer).
// With StoreDir set, the rest's zero values are a single node on
// DefaultListen.
type ServerConfig struct {
	// Listen is host:port for clients; port 0 (or -1) picks a free port.
	Listen string
	// StoreDir holds JetStream's file store (required; StoreDirIn names
	// the default in fenceline's state dir).
	StoreDir string
	// Name of this server (default "fenceline").
	Name string
	// ClusterName, ClusterListen and Routes join a NATS cluster (all three,
	// for a clustered JetStream with R3 streams).
	ClusterName   string
	ClusterListen string
	Routes        []string
	// ClusterAdvertise is the host:port the other nodes are told to
	// reach this one's routes at (default: ClusterListen's). Gossiped, it
	// is where a node dials a peer it learnt of rather than was given in
	// Routes: behind a NAT, the address the others see; in a test cluster
	// whose routes go through relays that cut them (a partition), an
	// address nothing listens on, so that no route goes around a relay.
	ClusterAdvertise string
	// RoutePingInterval and RoutePingsOut are how a node finds a peer's
	// routes dead: a PING every RoutePingInterval, the routes dropped
	// after RoutePingsOut go unanswered (defaults DefaultRoutePingInterval
	// and DefaultRoutePingsOut: 6-8 s). NATS pings a route even while it
	// is busy and only a PONG resets the count, so on a slow network or
	// under a backlog that holds a PONG up longer than their product,
	// raise them; the cluster's raft heartbeats travel the same routes.
	RoutePingInterval time.Duration
	RoutePingsOut     int
	// Debug turns on the server's own log on stderr.
	Debug bool
	// Log, when set (and Debug is not), gets the server's warnings and
	// errors, and the notices that say it is falling behind (a slow
	// consumer); its other notices at debug level. Nil: the server logs
	// nothing (its last error still explains a failed start).
	Log *slog.Logger
	// Users are the identities the server admits, each with its role's
	// permissions. Empty: the credentials in CredsDir, made on first start
	// (EnsureCreds), and the identities enrolled there (ServerUsers), read
	// again on every reload (embedded.ReloadUsers). Nobody connects without
	// credentials.
	Users []ServerUser
	// CredsDir holds the server's credentials when Users is empty (default
	// CredsDirOf(StoreDir)). The nodes of a cluster share one.
	CredsDir string
}

// StoreDirIn is the embedded bus's store directory in fenceline's state
// directory stateDir: <stateDir>/bus. The caller names stateDir (the CLI
// reads it from the environment once); nothing in leasebus reads the
// environment.
func StoreDirIn(stateDir string) string {
	return filepath.Join(stateDir, "bus")
}

// FieldError is a configuration that cannot work, naming the field of the
// config struct that is wrong (ServerConfig.ClusterName...), so a caller
// can name its own spelling of that setting (the CLI its flag).
type FieldError struct {
	Field string // the config struct's field, e.g. "ClusterListen"
	Err   error
}

func (e *FieldError) Error() string { return e.Field + ": " + e.Err.Error() }
func (e *FieldError) Unwrap() error { return e.Err }

func fieldErrorf(field, format string, args ...any) error {
	return &FieldError{Field: field, Err: fmt.Errorf(format, args...)}
}

// Validate reports a configuration that cannot work, naming the field.
func (c *ServerConfig) Validate() error {
	if c.Listen != "" {
		if _, _, err := splitHostPort(c.Listen); err != nil {
			return &FieldError{Field: "Listen", Err: fmt.Errorf("%q: %w", c.Listen, err)}
		}
	}
	clustered := c.ClusterName != "" || c.ClusterListen != "" || len(c.Routes) > 0
	if clustered && c.ClusterName == "" {
		return fieldErrorf("ClusterName", "a cluster needs a name, a listen address (ClusterListen) and routes to its peers (Routes)")
	}
	if clustered && c.ClusterListen == "" {
		return fieldErrorf("ClusterListen", "a cluster needs a name (ClusterName), a listen address and routes to its peers (Routes)")
	}
	if c.ClusterListen != "" {
		if _, _, err := splitHostPort(c.ClusterListen); err != nil {
			return &FieldError{Field: "ClusterListen", Err: fmt.Errorf("%q: %w", c.ClusterListen, err)}
		}
	}
	if c.ClusterAdvertise != "" {
		if c.ClusterListen == "" {
			return fieldErrorf("ClusterAdvertise", "only a cluster's node advertises its routes (ClusterListen)")
		}
		host, port, err := splitHostPort(c.ClusterAdvertise)
		if err == nil && (host == "" || port <= 0) {
			err = errors.New("want the host and port the other nodes reach this one's routes at")
		}
		if err != nil {
			return &FieldError{Field: "ClusterAdvertise", Err: fmt.Errorf("%q: %w", c.ClusterAdvertise, err)}
		}
	}
	if c.RoutePingInterval != 0 || c.RoutePingsOut != 0 {
		if c.ClusterListen == "" {
			field := "RoutePingInterval"
			if c.RoutePingInterval == 0 {
				field = "RoutePingsOut"
			}
			return fieldErrorf(field, "only a cluster's node pings routes (ClusterListen)")
		}
		if c.RoutePingInterval != 0 && (c.RoutePingInterval < minRoutePingInterval || c.RoutePingInterval > maxRoutePingInterval) {
			return fieldErrorf("RoutePingInterval", "%s: want %s to %s", c.RoutePingInterval, minRoutePingInterval, maxRoutePingInterval)
		}
		if c.RoutePingsOut < 0 || c.RoutePingsOut > maxRoutePingsOut {
			return fieldErrorf("RoutePingsOut", "%d: want 1 to %d unanswered pings", c.RoutePingsOut, maxRoutePingsOut)
		}
	}
	for _, r := range c.Routes {
		if u, err := url.Parse(r); err != nil || u.Scheme != "nats" || u.Host == "" {
			return fieldErrorf("Routes", "%q: want nats://host:port", r)
		}
	}
	return nil
}

// The route keepalive's defaults and bounds (ServerConfig.RoutePingInterval
// and RoutePingsOut).
const (
	DefaultRoutePingInterval = 2 * time.Second
	DefaultRoutePingsOut     = 3
	minRoutePingInterval     = 250 * time.Millisecond
	maxRoutePingInterval     = 5 * time.Minute
	maxRoutePingsOut         = 100
)

func splitHostPort(hp string) (string, int, error) {
	host, p, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < -1 || port > 65535 {
		return "", 0, fmt.Errorf("bad port %q", p)
	}
	if port == 0 {
		port = -1 // nats-server: -1 picks a free port
	}
	return host, port, nil
}
