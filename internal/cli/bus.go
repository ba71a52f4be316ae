package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/busserve"
	"github.com/fenceline/fenceline/runui"
)

// EnvUIToken is the token the run UI requires off loopback.
const EnvUIToken = runui.EnvToken

func (a *app) busCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "bus",
		Short: "Run the lease bus",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	c.AddCommand(a.serveCommand(), a.credsCommand(), a.fenceSecretCommand())
	return c
}

func (a *app) credsCommand() *cobra.Command {
	var dir string
	c := &cobra.Command{
		Use:   "creds [--dir DIR]",
		Short: "Make the bus identities' credentials and print the nats-server configuration that admits them",
		Long: `Make (or reuse) one credentials file per role — service, operator, holder,
viewer: an nkey user seed each, mode 0600 in a 0700 directory — and print the
authorization block a nats-server configuration needs to admit them with
exactly their roles' permissions. For a bus on an existing NATS server or
cluster: include the block in every node's configuration, then give each
machine the files its commands need (--creds DIR or ` + EnvCreds + `).
See docs/trust.md.

DIR defaults to --creds (or $` + EnvCreds + `) when it names a directory, else
the embedded default bus's own (` + defaultCredsDir() + `).`,
		Args:    cobra.NoArgs,
		Example: `  fenceline bus creds --dir /etc/fenceline/creds > /etc/nats/fenceline-auth.conf`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if dir == "" {
				p, source := a.credsSetting()
				switch fi, err := os.Stat(p); {
				case p == "":
					dir = defaultCredsDir()
				case err == nil && !fi.IsDir():
					return usagef("%s %s is a file; bus creds makes a directory of them (--dir)", source, p)
				default:
					dir = p
				}
			}
			creds, err := leasebus.EnsureCreds(dir)
			if err != nil {
				return err
			}
			var users []leasebus.ServerUser
			for _, r := range leasebus.Roles {
				users = append(users, creds[r].User())
			}
			conf, err := leasebus.AuthConfig(users)
			if err != nil {
				return err
			}
			fmt.Fprint(a.stdout, conf)
			fmt.Fprintf(a.stderr, "credentials: %s (keep them from agents; run the lease service with --creds %s)\n", dir, dir)
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "credentials directory to make or reuse")
	return c
}

type serveFlags struct {
	listen, store, name        string
	fenceSecrets               string
	clusterName, clusterListen string
	routes                     []string
	replicas                   int
	ui, logFormat, metrics     string
	debug                      bool
	embeddedOnly               []string // embedded-server flags given on the command line
}

func (a *app) serveCommand() *cobra.Command {
	var f serveFlags
	c := &cobra.Command{
		Use:   "serve",
		Short: "Serve the lease bus: an embedded NATS server and the lease service",
		Long: `Without --nats (or $` + EnvNATS + `), start an embedded NATS JetStream server
(file store, fsync on every write) and the lease service in this process, and
serve until SIGINT or SIGTERM.

With --nats URL, run only the lease service against that existing NATS
server or cluster; several services may run against one bus.

The embedded server admits only its own identities, one per role (service,
operator, holder, viewer: see docs/trust.md). It writes their credentials on
first start to <store>/creds (or the directory --creds names), files of mode
0600 in a 0700 directory, and reuses them after; fenceline commands on this
machine find the default bus's without any flag. The nodes of a cluster
share one credentials directory: copy it to each and pass --creds DIR.

--replicas sets the replication of the lease log and audit streams: by
default 3 when this process joins a cluster (--cluster-name) or the NATS
server it connects to belongs to one, else 1.`,
		Args: cobra.NoArgs,
		Example: `  fenceline bus serve
  fenceline bus serve --listen 127.0.0.1:17422 --store /var/lib/fenceline/bus
  fenceline bus serve --name n1 --listen :4222 --store /data/n1 --cluster-name fl --cluster-listen :6222 --routes nats://n2:6222,nats://n3:6222
  fenceline --nats nats://nats.internal:4222 bus serve --replicas 3`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			for _, name := range []string{"listen", "store", "name", "cluster-name", "cluster-listen", "routes"} {
				if cmd.Flags().Changed(name) {
					f.embeddedOnly = append(f.embeddedOnly, "--"+name)
				}
			}
			return a.serve(cmd.Context(), &f)
		},
	}
	fl := c.Flags()
	fl.StringVar(&f.listen, "listen", leasebus.DefaultListen, "host:port for NATS clients of the embedded server (port 0: any free port)")
	fl.StringVar(&f.store, "store", "", "JetStream store directory of the embedded server (default "+leasebus.DefaultStoreDir()+")")
	fl.StringVar(&f.name, "name", "", "server name, unique within a cluster (default \"fenceline\", or derived from --cluster-listen when clustered)")
	fl.StringVar(&f.clusterName, "cluster-name", "", "join a NATS cluster of this name (with --cluster-listen and --routes)")
	fl.StringVar(&f.clusterListen, "cluster-listen", "", "host:port for cluster routes")
	fl.StringSliceVar(&f.routes, "routes", nil, "cluster peers: nats://host:port,... (comma-separated or repeated)")
	fl.IntVar(&f.replicas, "replicas", 0, "replicas of the lease log and audit streams (default 1; 3 on a cluster)")
	fl.StringVar(&f.ui, "ui", "", "serve the run UI and its JSON API on this host:port (off loopback a token is required: $"+EnvUIToken+", or a random one printed in the URL)")
	fl.StringVar(&f.metrics, "metrics", "", "serve the lease service's Prometheus metrics at http://host:port/metrics (grants, conflicts, queue depth, append latency, active leases)")
	fl.StringVar(&f.logFormat, "log-format", "text", "log format on stderr: text or json")
	fl.StringVar(&f.fenceSecrets, "fence-secrets", leasebus.DefaultFenceSecretDir(), "directory of the storages' secrets (fenceline bus fence-secret set), from which each lease's acquirer gets its grant keys; only the service may read it")
	fl.BoolVar(&f.debug, "debug", false, "also log the embedded NATS server's own messages")
	return c
}

func (a *app) serve(ctx context.Context, f *serveFlags) error {
	logger, err := newLogger(a.stderr, f.logFormat)
	if err != nil {
		return err
	}
	if f.replicas < 0 || f.replicas > 5 {
		return usagef("--replicas %d: want 1, 3 or 5", f.replicas)
	}
	if f.ui != "" {
		if _, _, err := net.SplitHostPort(f.ui); err != nil {
			return usagef("--ui %q: want host:port (127.0.0.1:7480; port 0 picks a free one)", f.ui)
		}
	}
	if f.metrics != "" {
		if _, _, err := net.SplitHostPort(f.metrics); err != nil {
			return usagef("--metrics %q: want host:port (127.0.0.1:9480; port 0 picks a free one)", f.metrics)
		}
	}
	cfg := busserve.ServiceConfig{Replicas: f.replicas, Metrics: f.metrics, UI: f.ui, UIToken: os.Getenv(EnvUIToken), Debug: f.debug, Logger: logger, FenceSecretDir: f.fenceSecrets}
	if url, source := a.busURL(); source != "" {
		if len(f.embeddedOnly) > 0 {
			return usagef("%v only apply to the embedded server, but %s selects an existing bus (%s); drop one or the other", f.embeddedOnly, source, url)
		}
		cfg.URL, cfg.Source = url, source
		if err := a.serviceCreds(&cfg); err != nil {
			return err
		}
		return a.serveService(ctx, cfg)
	}
	return a.serveEmbedded(ctx, f, cfg)
}

// serveEmbedded runs the embedded NATS server and the lease service.
func (a *app) serveEmbedded(ctx context.Context, f *serveFlags, cfg busserve.ServiceConfig) error {
	credsDir, err := a.embeddedCredsDir()
	if err != nil {
		return err
	}
	node, err := busserve.StartNode(ctx, leasebus.ServerConfig{
		Listen:        f.listen,
		StoreDir:      f.store,
		Name:          f.name,
		ClusterName:   f.clusterName,
		ClusterListen: f.clusterListen,
		Routes:        f.routes,
		Debug:         f.debug,
		CredsDir:      credsDir,
	}, cfg.Logger)
	if err != nil {
		return a.serveError(err)
	}
	defer node.Stop()
	fmt.Fprintf(a.stdout, "fenceline bus listening on %s\n", node.URL())
	fmt.Fprintf(a.stdout, "store: %s\n", node.Config.StoreDir)
	fmt.Fprintf(a.stdout, "credentials: %s (one per role; keep them from agents)\n", node.Config.CredsDir)
	cfg.Node = node
	return a.serveService(ctx, cfg)
}

// serveService runs the lease service cfg describes until ctx ends.
func (a *app) serveService(ctx context.Context, cfg busserve.ServiceConfig) error {
	s, err := busserve.StartService(ctx, cfg)
	if err != nil {
		return a.serveError(err)
	}
	if s.MetricsURL != "" {
		fmt.Fprintf(a.stdout, "metrics: %s\n", s.MetricsURL)
	}
	fmt.Fprintf(a.stdout, "lease service ready on %s (replicas %d); stop with Ctrl-C\n", s.URL, s.Replicas)
	if s.UIURL != "" {
		fmt.Fprintf(a.stdout, "run UI: %s\n", s.UIURL)
	}
	<-ctx.Done()
	cfg.Logger.Info("stopping", "cause", context.Cause(ctx))
	s.Stop()
	fmt.Fprintln(a.stdout, "lease service stopped")
	return nil
}

// serveError words what busserve reports in terms of the flags.
func (a *app) serveError(err error) error {
	var ce *busserve.ConfigError
	var le *busserve.ListenError
	switch {
	case errors.As(err, &ce):
		return &usageError{err: ce.Err}
	case errors.As(err, &le) && le.For == "metrics":
		return fmt.Errorf("--metrics %s: %w", le.Addr, le.Err)
	case errors.As(err, &le):
		return fmt.Errorf("cannot listen on %s: %w (another \"fenceline bus serve\" running? pick another --listen)", le.Addr, le.Err)
	}
	return a.dialError(err)
}

// embeddedCredsDir is where the embedded server keeps its credentials:
// the directory --creds or $FENCELINE_CREDS names (made if missing), else
// "" for <store>/creds.
func (a *app) embeddedCredsDir() (string, error) {
	p, source := a.credsSetting()
	if p == "" {
		return "", nil
	}
	if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
		return "", usagef("%s %s is a file: the embedded bus keeps one credentials file per role in a directory; name a directory (or leave %s unset for <store>/creds)", source, p, source)
	}
	return p, nil
}

// serviceCreds sets the lease service's and the run UI's credentials on an
// existing bus, and the names the audit gives the identities it knows.
func (a *app) serviceCreds(cfg *busserve.ServiceConfig) (err error) {
	if cfg.Creds, err = a.credsFor(leasebus.RoleService); err != nil {
		return err
	}
	cfg.ViewerCreds = cfg.Creds
	if cfg.UI != "" {
		if cfg.ViewerCreds, err = a.credsFor(leasebus.RoleViewer); err != nil {
			return err
		}
	}
	if p, _ := a.credsSetting(); p != "" {
		if fi, serr := os.Stat(p); serr == nil && fi.IsDir() {
			cfg.Names = leasebus.NamesIn(p)
		}
	}
	return nil
}
