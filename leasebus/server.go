package leasebus

import (
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
)

// DefaultListen is where the embedded bus listens and where every other
// command looks for it.
const DefaultListen = "127.0.0.1:7422"

// DefaultURL is the NATS URL of the embedded bus at DefaultListen.
const DefaultURL = "nats://" + DefaultListen

// ServerConfig configures the embedded NATS server (embedded.StartServer).
// The zero value is a single node on DefaultListen storing under
// DefaultStoreDir.
type ServerConfig struct {
	// Listen is host:port for clients; port 0 (or -1) picks a free port.
	Listen string
	// StoreDir holds JetStream's file store.
	StoreDir string
	// Name of this server (default "fenceline").
	Name string
	// ClusterName, ClusterListen and Routes join a NATS cluster (all three,
	// for a clustered JetStream with R3 streams).
	ClusterName   string
	ClusterListen string
	Routes        []string
	// Debug turns on the server's own log on stderr.
	Debug bool
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

// DefaultStoreDir is the embedded bus's state directory:
// $XDG_STATE_HOME/fenceline/bus, else ~/.local/state/fenceline/bus.
func DefaultStoreDir() string {
	return filepath.Join(StateDir(), "bus")
}

// StateDir is fenceline's per-user state directory.
func StateDir() string {
	if d := os.Getenv("XDG_STATE_HOME"); d != "" {
		return filepath.Join(d, "fenceline")
	}
	if home, err := os.UserHomeDir(); err == nil {
		return filepath.Join(home, ".local", "state", "fenceline")
	}
	return filepath.Join(os.TempDir(), "fenceline-state")
}

// Validate reports a configuration that cannot work, naming the field.
func (c *ServerConfig) Validate() error {
	if c.Listen != "" {
		if _, _, err := splitHostPort(c.Listen); err != nil {
			return fmt.Errorf("listen %q: %w", c.Listen, err)
		}
	}
	clustered := c.ClusterName != "" || c.ClusterListen != "" || len(c.Routes) > 0
	if clustered && (c.ClusterName == "" || c.ClusterListen == "") {
		return errors.New("a cluster needs --cluster-name and --cluster-listen (and --routes to its peers)")
	}
	if c.ClusterListen != "" {
		if _, _, err := splitHostPort(c.ClusterListen); err != nil {
			return fmt.Errorf("cluster listen %q: %w", c.ClusterListen, err)
		}
	}
	for _, r := range c.Routes {
		if u, err := url.Parse(r); err != nil || u.Scheme != "nats" || u.Host == "" {
			return fmt.Errorf("route %q: want nats://host:port", r)
		}
	}
	return nil
}

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
