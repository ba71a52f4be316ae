// Package busserve runs what `fenceline bus serve` runs: an embedded NATS
// JetStream server (StartNode) and, on it or on an existing bus, the lease
// service with its Prometheus metrics and the run UI (StartService). The
// command line maps its flags to a NodeConfig and a ServiceConfig and
// prints what these report; the wiring is here.
//
//	StartNode ─▶ embedded.StartServer, go embedded.KeepStore
//	StartService ─▶ leasebus.Dial ─▶ leasebus.StartService
//	             ─▶ embedded.AuditRefusals ; /metrics ; runui.Listen
package busserve

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"sync"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
)

// ConfigError is a server configuration that cannot work
// (leasebus.ServerConfig.Validate): a usage problem.
type ConfigError struct{ Err error }

func (e *ConfigError) Error() string { return e.Err.Error() }
func (e *ConfigError) Unwrap() error { return e.Err }

// ListenError is an address that cannot be listened on: the embedded
// server's client address (For "clients") or the metrics address (For
// "metrics").
type ListenError struct {
	For  string
	Addr string
	Err  error
}

func (e *ListenError) Error() string {
	return fmt.Sprintf("cannot listen on %s for %s: %v", e.Addr, e.For, e.Err)
}
func (e *ListenError) Unwrap() error { return e.Err }

// Node is a running embedded bus server.
type Node struct {
	// Server is the NATS server; the lease service talks to it without
	// TCP.
	Server *server.Server
	// Config is what the server was started with, defaults filled in
	// (StoreDir, CredsDir, a clustered node's Name).
	Config leasebus.ServerConfig

	log         *slog.Logger
	stopKeeping context.CancelFunc
	keeping     sync.WaitGroup
	stopOnce    sync.Once
}

// StartNode starts the embedded server cfg describes: its store (default
// required; leasebus.StoreDirIn names the default) and credentials (default <store>/creds, made on
// first start), and a keeper that restarts JetStream after a store fault
// on a single node (a cluster node rejoins its peers by restarting). A
// clustered node without a name is named after the host and its cluster
// port. It runs until Stop.
func StartNode(ctx context.Context, cfg leasebus.ServerConfig, log *slog.Logger) (*Node, error) {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.StoreDir == "" {
		return nil, &ConfigError{Err: &leasebus.FieldError{Field: "StoreDir", Err: errors.New("empty: the bus needs a store directory (leasebus.StoreDirIn of fenceline's state dir for the default)")}}
	}
	if err := cfg.Validate(); err != nil {
		return nil, &ConfigError{Err: err}
	}
	clustered := cfg.ClusterName != ""
	if cfg.Name == "" && clustered {
		_, port, _ := net.SplitHostPort(cfg.ClusterListen)
		cfg.Name = "fenceline-" + hostname() + "-" + port
	}
	if err := checkListen(cfg.Listen, "clients"); err != nil {
		return nil, err
	}
	if clustered {
		if err := checkListen(cfg.ClusterListen, "cluster routes"); err != nil {
			return nil, err
		}
	}
	switch {
	case cfg.CredsDir == "" && len(cfg.Users) == 0:
		cfg.CredsDir = leasebus.CredsDirOf(cfg.StoreDir)
	case cfg.CredsDir == "":
		// Node.Creds names files in CredsDir; without it they would be
		// looked for in the working directory.
		return nil, &ConfigError{Err: errors.New("bus users given without CredsDir, the directory of their credentials files")}
	}
	if cfg.Log == nil {
		cfg.Log = log
	}
	srv, err := embedded.StartServer(cfg)
	if err != nil {
		return nil, err
	}
	n := &Node{Server: srv, Config: cfg, log: log}
	keepCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
	n.stopKeeping = stop
	if !clustered {
		n.keeping.Go(func() { embedded.KeepStore(keepCtx, srv, cfg.StoreDir, log) })
	}
	log.Info("bus started", "url", srv.ClientURL(), "store", cfg.StoreDir, "cluster", cfg.ClusterName, "name", srv.Name())
	return n, nil
}

// URL is the node's client URL.
func (n *Node) URL() string { return n.Server.ClientURL() }

// Clustered reports whether the node joined a cluster.
func (n *Node) Clustered() bool { return n.Config.ClusterName != "" }

// Creds are the node's own credentials of role.
func (n *Node) Creds(role leasebus.Role) leasebus.BusCreds {
	return leasebus.BusCreds{Path: filepath.Join(n.Config.CredsDir, leasebus.CredsFile(role)), Source: "the embedded bus", Role: role}
}

// Stop stops the keeper and shuts the server down; it may be called again.
func (n *Node) Stop() {
	n.stopOnce.Do(func() {
		n.stopKeeping()
		n.keeping.Wait()
		n.Server.Shutdown()
		n.Server.WaitForShutdown()
		n.log.Info("bus stopped")
	})
}

// checkListen fails fast and plainly when the listen address is taken: the
// embedded server would only report that it never became ready.
func checkListen(listen, what string) error {
	host, port, err := net.SplitHostPort(listen)
	if err != nil || port == "0" || port == "-1" {
		return nil // Validate names a bad address; any free port is free
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return &ListenError{For: what, Addr: listen, Err: err}
	}
	return ln.Close()
}

func hostname() string {
	h, err := os.Hostname()
	if err != nil || h == "" {
		return "host"
	}
	return h
}
