package cli

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/shard"
)

// EnvUIToken is the token the run UI requires off loopback.
const EnvUIToken = "FENCELINE_UI_TOKEN"

func (a *app) busCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "bus",
		Short: "Run the lease bus",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	c.AddCommand(a.serveCommand(), a.credsCommand())
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
	clusterName, clusterListen string
	routes                     []string
	replicas                   int
	ui, logFormat, metrics     string
	debug                      bool

	embeddedOnly        []string       // embedded-server flags given on the command line
	natsURL, natsSource string         // the bus the lease service connects to
	clustered           bool           // this process joins a cluster
	inProcess           *server.Server // the embedded server, when there is one
	storeDir            string         // its store
	credsDir            string         // the embedded server's credentials
	logger              *slog.Logger
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
	fl.BoolVar(&f.debug, "debug", false, "also log the embedded NATS server's own messages")
	return c
}

func (a *app) serve(ctx context.Context, f *serveFlags) error {
	switch f.logFormat {
	case "text":
		f.logger = slog.New(slog.NewTextHandler(a.stderr, nil))
	case "json":
		f.logger = slog.New(slog.NewJSONHandler(a.stderr, nil))
	default:
		return usagef("--log-format %q: want text or json", f.logFormat)
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
	if _, source := a.busURL(); source != "" {
		f.natsURL, f.natsSource = a.busURL()
		if len(f.embeddedOnly) > 0 {
			return usagef("%v only apply to the embedded server, but %s selects an existing bus (%s); drop one or the other", f.embeddedOnly, f.natsSource, f.natsURL)
		}
		return a.serveService(ctx, f)
	}
	return a.serveEmbedded(ctx, f)
}

// serveEmbedded runs the embedded NATS server and the lease service.
func (a *app) serveEmbedded(ctx context.Context, f *serveFlags) error {
	cfg := leasebus.ServerConfig{
		Listen:        f.listen,
		StoreDir:      f.store,
		Name:          f.name,
		ClusterName:   f.clusterName,
		ClusterListen: f.clusterListen,
		Routes:        f.routes,
		Debug:         f.debug,
	}
	if cfg.StoreDir == "" {
		cfg.StoreDir = leasebus.DefaultStoreDir()
	}
	if err := cfg.Validate(); err != nil {
		return &usageError{err: err}
	}
	f.clustered = cfg.ClusterName != ""
	if cfg.Name == "" && f.clustered {
		_, port, _ := net.SplitHostPort(cfg.ClusterListen)
		cfg.Name = "fenceline-" + hostname() + "-" + port
	}
	if err := checkListen(cfg.Listen); err != nil {
		return err
	}
	credsDir, err := a.embeddedCredsDir(cfg.StoreDir)
	if err != nil {
		return err
	}
	cfg.CredsDir = credsDir
	f.credsDir = cfg.CredsDir
	srv, err := embedded.StartServer(cfg)
	if err != nil {
		return err
	}
	keepCtx, stopKeeping := context.WithCancel(ctx)
	var keeping sync.WaitGroup
	if !f.clustered { // a cluster node rejoins its peers by restarting
		keeping.Go(func() { embedded.KeepStore(keepCtx, srv, cfg.StoreDir, f.logger) })
	}
	defer func() {
		stopKeeping()
		keeping.Wait()
		srv.Shutdown()
		srv.WaitForShutdown()
		f.logger.Info("bus stopped")
	}()
	url := srv.ClientURL()
	fmt.Fprintf(a.stdout, "fenceline bus listening on %s\n", url)
	fmt.Fprintf(a.stdout, "store: %s\n", cfg.StoreDir)
	fmt.Fprintf(a.stdout, "credentials: %s (one per role; keep them from agents)\n", cfg.CredsDir)
	f.logger.Info("bus started", "url", url, "store", cfg.StoreDir, "cluster", cfg.ClusterName, "name", srv.Name())
	f.natsURL, f.natsSource = url, "embedded server"
	f.inProcess = srv // the service talks to its own server without TCP
	f.storeDir = cfg.StoreDir
	return a.serveService(ctx, f)
}

// serveService runs the lease service on the bus at f.natsURL until ctx ends.
func (a *app) serveService(ctx context.Context, f *serveFlags) error {
	opts := []nats.Option{nats.Name("fenceline-lease-service"),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(250 * time.Millisecond),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: we closed it
				f.logger.Warn("disconnected from bus", "url", f.natsURL, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			f.logger.Info("reconnected to bus", "url", nc.ConnectedUrl())
		}),
	}
	svcCreds, uiCreds, names, err := a.serviceCreds(f)
	if err != nil {
		return err
	}
	if f.inProcess != nil {
		opts = append(opts, nats.InProcessServer(f.inProcess))
	}
	nc, err := a.connectWith(svcCreds, f.natsURL, f.natsSource, opts...)
	if err != nil {
		return err
	}
	defer nc.Close()
	replicas := f.replicas
	if replicas == 0 {
		replicas = 1
		if f.clustered || nc.ConnectedClusterName() != "" {
			replicas = 3
		}
	}
	scfg := leasebus.ServiceConfig{Replicas: replicas, Logger: f.logger, Names: names}
	if f.inProcess != nil {
		scfg.StoreProbe = embedded.StoreProbe(f.inProcess, f.storeDir)
	}
	var metricsLn net.Listener
	if f.metrics != "" {
		// Listen before the service starts: a taken port is a usage
		// problem, found before anything is served.
		if metricsLn, err = net.Listen("tcp", f.metrics); err != nil {
			return fmt.Errorf("--metrics %s: %w", f.metrics, err)
		}
		defer metricsLn.Close()
		scfg.Metrics = leasebus.NewServiceMetrics()
	}
	svc, err := startService(ctx, nc, scfg)
	if err != nil {
		if ctx.Err() != nil {
			return fmt.Errorf("interrupted while starting the lease service: %w", err)
		}
		return fmt.Errorf("start lease service on %s: %w", f.natsURL, err)
	}
	stopRefusals := func() {}
	if f.inProcess != nil {
		// What the embedded server itself refuses (credentials, permissions)
		// goes to the audit stream too.
		stopRefusals = embedded.AuditRefusals(svc, f.inProcess, f.debug, false)
	}
	stop := func() {
		stopRefusals()
		svc.Stop()
	}
	if metricsLn != nil {
		mux := http.NewServeMux()
		mux.Handle("/metrics", scfg.Metrics.Handler())
		msrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(f.logger.Handler(), slog.LevelDebug)}
		served := make(chan struct{})
		go func() {
			defer close(served)
			msrv.Serve(metricsLn)
		}()
		defer func() {
			msrv.Close()
			<-served
		}()
		fmt.Fprintf(a.stdout, "metrics: http://%s/metrics\n", metricsLn.Addr())
	}
	fmt.Fprintf(a.stdout, "lease service ready on %s (replicas %d); stop with Ctrl-C\n", f.natsURL, replicas)
	if f.ui != "" {
		// The run UI reads as a viewer.
		var uopts []nats.Option
		if f.inProcess != nil {
			uopts = append(uopts, nats.InProcessServer(f.inProcess))
		}
		unc, err := a.connectWith(uiCreds, f.natsURL, f.natsSource, append(uopts, nats.Name("fenceline-run-ui"), nats.MaxReconnects(-1), nats.ReconnectWait(250*time.Millisecond))...)
		if err != nil {
			stop()
			return err
		}
		defer unc.Close()
		shards, err := shard.Open(unc, shard.Config{Logger: f.logger})
		if err != nil {
			stop()
			return err
		}
		ui, err := runui.Listen(f.ui, runui.Config{NC: unc, Token: os.Getenv(EnvUIToken), Shards: runui.StoreSource(shards), Logger: f.logger})
		if err != nil {
			stop()
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			if err := ui.Close(sctx); err != nil {
				f.logger.Warn("stop the run UI", "err", err)
			}
		}()
		fmt.Fprintf(a.stdout, "run UI: %s\n", ui.URL())
	}
	<-ctx.Done()
	f.logger.Info("stopping", "cause", context.Cause(ctx))
	stop()
	fmt.Fprintln(a.stdout, "lease service stopped")
	return nil
}

// embeddedCredsDir is where the embedded server keeps its credentials:
// the directory --creds or $FENCELINE_CREDS names (made if missing), else
// <store>/creds.
func (a *app) embeddedCredsDir(store string) (string, error) {
	p, source := a.credsSetting()
	if p == "" {
		return leasebus.CredsDirOf(store), nil
	}
	if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
		return "", usagef("%s %s is a file: the embedded bus keeps one credentials file per role in a directory; name a directory (or leave %s unset for <store>/creds)", source, p, source)
	}
	return p, nil
}

// serviceCreds picks the lease service's and the run UI's credentials,
// and the names the audit gives the identities it knows.
func (a *app) serviceCreds(f *serveFlags) (svc, ui busCreds, names map[string]string, err error) {
	if f.credsDir != "" { // the embedded server's own
		at := func(r leasebus.Role) busCreds {
			return busCreds{Path: filepath.Join(f.credsDir, leasebus.CredsFile(r)), Source: "the embedded bus", Role: r}
		}
		return at(leasebus.RoleService), at(leasebus.RoleViewer), leasebus.NamesIn(f.credsDir), nil
	}
	if svc, err = a.credsFor(leasebus.RoleService); err != nil {
		return
	}
	ui = svc
	if f.ui != "" {
		if ui, err = a.credsFor(leasebus.RoleViewer); err != nil {
			return
		}
	}
	if p, _ := a.credsSetting(); p != "" {
		if fi, serr := os.Stat(p); serr == nil && fi.IsDir() {
			names = leasebus.NamesIn(p)
		}
	}
	return svc, ui, names, nil
}

// serviceStartTimeout bounds starting the lease service: on a fresh
// cluster StartService waits for JetStream to elect its leaders.
const serviceStartTimeout = 2 * time.Minute

func startService(ctx context.Context, nc *nats.Conn, cfg leasebus.ServiceConfig) (*leasebus.Service, error) {
	ctx, cancel := context.WithTimeout(ctx, serviceStartTimeout)
	defer cancel()
	return leasebus.StartService(ctx, nc, cfg)
}

// checkListen fails fast and plainly when the listen address is taken: the
// embedded server would only report "not ready after 15s".
func checkListen(listen string) error {
	host, port, err := net.SplitHostPort(listen)
	if err != nil || port == "0" || port == "-1" {
		return nil // Validate names a bad address; any free port is free
	}
	ln, err := net.Listen("tcp", net.JoinHostPort(host, port))
	if err != nil {
		return fmt.Errorf("cannot listen on %s: %w (another \"fenceline bus serve\" running? pick another --listen)", listen, err)
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
