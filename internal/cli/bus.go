package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/lease"
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
	c.AddCommand(a.serveCommand(), a.credsCommand(), a.enrollCommand(), a.revokeIdentityCommand(), a.identitiesCommand(), a.fenceSecretCommand(), a.statusCommand())
	return c
}

func (a *app) credsCommand() *cobra.Command {
	var dir string
	c := &cobra.Command{
		Use:   "creds [--dir DIR]",
		Short: "Make the bus identities' credentials and print the nats-server configuration that admits them",
		Long: `Make (or reuse) one credentials file per role — service, operator, holder,
viewer, enroller: an nkey user seed each, mode 0600 in a 0700 directory — and
print the authorization block a nats-server configuration needs to admit them,
and every identity enrolled with "bus enroll", with exactly their roles'
permissions. For a bus on an existing NATS server or
cluster: include the block in every node's configuration, then give each
machine the files its commands need (--creds DIR or ` + EnvCreds + `).
See docs/trust.md.

DIR defaults to --creds (or $` + EnvCreds + `) when it names a directory, else
the embedded default bus's own (` + a.defaultCredsDir() + `).`,
		Args:    cobra.NoArgs,
		Example: `  fenceline bus creds --dir /etc/fenceline/creds > /etc/nats/fenceline-auth.conf`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := a.identitiesDir(dir)
			if err != nil {
				return err
			}
			conf, err := authConfigOf(d)
			if err != nil {
				return err
			}
			fmt.Fprint(a.stdout, conf)
			fmt.Fprintf(a.stderr, "credentials: %s (keep them from agents; run the lease service with --creds %s)\n", d, d)
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
	clusterAdvertise           string
	routePingInterval          time.Duration
	routePingsOut              int
	routes                     []string
	replicas                   int
	maxHeldMiB                 int
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

The embedded server admits only its own identities: one per role (service,
operator, holder, viewer, enroller: see docs/trust.md) and those enrolled with
"bus enroll". It writes the roles' credentials on first start to <store>/creds
(or the directory --creds names), files of mode 0600 in a 0700 directory, and
reuses them after; fenceline commands on this machine find the default bus's
without any flag. Each run and sidecar on this machine gets an identity of its
own (enrolled with enroller.nk, removed when it ends); "bus enroll" and "bus
revoke-identity" take effect without a restart. The nodes of a cluster
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
			for _, name := range []string{"listen", "store", "name", "cluster-name", "cluster-listen", "cluster-advertise", "route-ping-interval", "route-pings-out", "routes"} {
				if cmd.Flags().Changed(name) {
					f.embeddedOnly = append(f.embeddedOnly, "--"+name)
				}
			}
			// Unset, the route pings take the server's defaults, and a
			// single node is not told about routes it does not have.
			// Given as 0, they are refused as any value out of bounds.
			switch {
			case !cmd.Flags().Changed("route-ping-interval"):
				f.routePingInterval = 0
			case f.routePingInterval == 0:
				f.routePingInterval = -1
			}
			switch {
			case !cmd.Flags().Changed("route-pings-out"):
				f.routePingsOut = 0
			case f.routePingsOut == 0:
				f.routePingsOut = -1
			}
			return a.serve(cmd.Context(), &f)
		},
	}
	fl := c.Flags()
	fl.StringVar(&f.listen, "listen", leasebus.DefaultListen, "host:port for NATS clients of the embedded server (port 0: any free port)")
	fl.StringVar(&f.store, "store", leasebus.StoreDirIn(a.stateDir), "JetStream store directory of the embedded server")
	fl.StringVar(&f.name, "name", "", "server name, unique within a cluster (default \"fenceline\", or derived from --cluster-listen when clustered)")
	fl.StringVar(&f.clusterName, "cluster-name", "", "join a NATS cluster of this name (with --cluster-listen and --routes)")
	fl.StringVar(&f.clusterListen, "cluster-listen", "", "host:port for cluster routes")
	fl.StringVar(&f.clusterAdvertise, "cluster-advertise", "", "host:port the other nodes are told to reach this node's routes at, when not --cluster-listen's (behind a NAT)")
	fl.DurationVar(&f.routePingInterval, "route-ping-interval", leasebus.DefaultRoutePingInterval, "how often this node pings each route to a peer (with --route-pings-out: how long until it drops a silent peer's routes; raise both on a slow or busy network)")
	fl.IntVar(&f.routePingsOut, "route-pings-out", leasebus.DefaultRoutePingsOut, "unanswered route pings after which this node drops a peer's routes")
	fl.StringSliceVar(&f.routes, "routes", nil, "cluster peers: nats://host:port,... (comma-separated or repeated)")
	fl.IntVar(&f.replicas, "replicas", 0, "replicas of the lease log and audit streams (default 1; 3 on a cluster)")
	fl.IntVar(&f.maxHeldMiB, "max-held", leasebus.DefaultMaxHeldBytes>>20, "MiB one identity's leases may take across every repo, counted as 1 KB a lease plus its claim (about 900 leases of short claims a MiB), those it released included until their repos forget them (about 5 minutes); past it its acquires are refused")
	fl.StringVar(&f.ui, "ui", "", "serve the run UI and its JSON API on this host:port (off loopback a token is required: $"+EnvUIToken+", or a random one printed in the URL)")
	fl.StringVar(&f.metrics, "metrics", "", "serve the lease service's Prometheus metrics at http://host:port/metrics (grants, conflicts, queue depth, append latency, active leases) and Go profiles at http://host:port/debug/pprof/ (operators only: bind it where agents cannot reach)")
	fl.StringVar(&f.logFormat, "log-format", "text", "log format on stderr: text or json")
	fl.StringVar(&f.fenceSecrets, "fence-secrets", leasebus.FenceSecretDirIn(a.stateDir), "directory of the storages' secrets (fenceline bus fence-secret set), from which each lease's acquirer gets its grant keys; only the service may read it")
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
	if f.maxHeldMiB < 1 || f.maxHeldMiB > 1<<20 {
		return usagef("--max-held %d: want MiB from 1 to %d", f.maxHeldMiB, 1<<20)
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
	cfg := busserve.ServiceConfig{Replicas: f.replicas, MaxHeldBytes: f.maxHeldMiB << 20, Metrics: f.metrics, UI: f.ui, UIToken: a.cfg.UIToken, Debug: f.debug, Logger: logger, FenceSecretDir: f.fenceSecrets}
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
		Listen:            f.listen,
		StoreDir:          f.store,
		Name:              f.name,
		ClusterName:       f.clusterName,
		ClusterListen:     f.clusterListen,
		ClusterAdvertise:  f.clusterAdvertise,
		RoutePingInterval: f.routePingInterval,
		RoutePingsOut:     f.routePingsOut,
		Routes:            f.routes,
		Debug:             f.debug,
		CredsDir:          credsDir,
	}, cfg.Logger)
	if err != nil {
		return a.serveError(err)
	}
	defer node.Stop()
	fmt.Fprintf(a.stdout, "fenceline bus listening on %s\n", node.URL())
	fmt.Fprintf(a.stdout, "store: %s\n", node.Config.StoreDir)
	fmt.Fprintf(a.stdout, "credentials: %s (one per role and per enrolled identity; keep them from agents)\n", node.Config.CredsDir)
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
		return &usageError{err: flagError(ce.Err)}
	case errors.Is(err, leasebus.ErrStoreReadOnly):
		return fmt.Errorf("%w (--store)", err)
	case errors.As(err, &le) && le.For == "metrics":
		return fmt.Errorf("--metrics %s: %w", le.Addr, le.Err)
	case errors.As(err, &le):
		return fmt.Errorf("cannot listen on %s: %w (another \"fenceline bus serve\" running? pick another --listen)", le.Addr, le.Err)
	}
	return a.dialError(flagError(err))
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

// identitiesDir is the credentials directory the identity commands work
// on: dir, else --creds (or $FENCELINE_CREDS) when it names a directory,
// else the embedded default bus's own.
func (a *app) identitiesDir(dir string) (string, error) {
	if dir != "" {
		return dir, nil
	}
	p, source := a.credsSetting()
	switch fi, err := os.Stat(p); {
	case p == "":
		return a.defaultCredsDir(), nil
	case err == nil && !fi.IsDir():
		return "", usagef("%s %s is a file; the bus's identities live in a credentials directory (--dir)", source, p)
	}
	return p, nil
}

// authConfigOf is the nats-server authorization block that admits every
// identity of the credentials directory dir (its roles' files made when
// missing).
func authConfigOf(dir string) (string, error) {
	users, err := leasebus.ServerUsers(dir)
	if err != nil {
		return "", err
	}
	return leasebus.AuthConfig(users)
}

// applyIdentities makes a change to dir's identities take effect: it
// rewrites authConfig (when set) for an external NATS server, and asks the
// running embedded bus to reload its users (as dir's operator). It says on
// stderr what happened and what is left to do.
func (a *app) applyIdentities(dir, authConfig string) error {
	if authConfig != "" {
		conf, err := authConfigOf(dir)
		if err != nil {
			return err
		}
		tmp := authConfig + ".tmp"
		if err := os.WriteFile(tmp, []byte(conf), 0o600); err != nil {
			return fmt.Errorf("write --auth-config: %w", err)
		}
		if err := os.Rename(tmp, authConfig); err != nil {
			return fmt.Errorf("write --auth-config: %w", err)
		}
		fmt.Fprintf(a.stderr, "wrote %s: reload every NATS server that includes it (nats-server --signal reload)\n", authConfig)
	}
	url, source := a.busURL()
	bc, err := leasebus.ChooseCreds(dir, "--dir", "", leasebus.RoleOperator)
	if err != nil {
		fmt.Fprintf(a.stderr, "no running bus was asked to reload (%v); the embedded bus reads its identities when it starts\n", err)
		return nil
	}
	nc, err := a.connectWith(bc, url, source)
	if err != nil {
		fmt.Fprintf(a.stderr, "no running bus took the change (%v); the embedded bus reads its identities when it starts\n", err)
		return nil
	}
	defer nc.Close()
	if err := leasebus.ReloadIdentities(nc); errors.Is(err, leasebus.ErrNoEnrolment) {
		fmt.Fprintf(a.stderr, "the bus at %s is not an embedded one: regenerate its servers' configuration (fenceline bus creds --dir %s, or --auth-config) and reload them\n", url, dir)
		return nil
	} else if err != nil {
		return err
	}
	fmt.Fprintf(a.stderr, "the bus at %s reloaded its identities\n", url)
	return nil
}

func (a *app) enrollCommand() *cobra.Command {
	var dir, out, role, authConfig string
	c := &cobra.Command{
		Use:   "enroll NAME [--role holder] [--out FILE] [--dir DIR] [--auth-config FILE]",
		Short: "Give one runner, sidecar or pod a bus identity of its own",
		Long: `Make a fresh nkey for NAME (one runner, sidecar or pod), record its public key
among the bus's identities (DIR/identities/NAME.id) and write its seed to FILE
(default DIR/holders/NAME.nk), mode 0600: the credentials that machine or pod
passes with --creds FILE or $` + EnvCreds + `. It hears only its own answers, and the
leases it acquires are its own: no other holder renews or releases them.

A running embedded bus admits NAME at once (it reloads its users when asked,
without a restart). For a bus on an existing NATS server or cluster, pass
--auth-config with the file every node's configuration includes (or run
"fenceline bus creds --dir DIR" again), then reload the servers.

Runs and sidecars on the embedded default bus need no enrolment: each gets an
identity of its own automatically, for as long as it runs.

DIR defaults to --creds (or $` + EnvCreds + `) when it names a directory, else the
embedded default bus's own (` + a.defaultCredsDir() + `).`,
		Args: cobra.ExactArgs(1),
		Example: `  fenceline bus enroll pod-agent-billing-17 --out /tmp/bus-identity.nk
  fenceline bus enroll runner-ci-4 --dir /etc/fenceline/creds --auth-config /etc/nats/fenceline-auth.conf`,
		RunE: func(cmd *cobra.Command, args []string) error {
			name := args[0]
			if !leasebus.ValidIdentityName(name) || strings.HasPrefix(name, "eph-") {
				return usagef("identity name %q: use 1 to 64 letters, digits, '-', '_' or '.' (names starting eph- are the ephemeral identities runs enrol)", name)
			}
			d, err := a.identitiesDir(dir)
			if err != nil {
				return err
			}
			if _, err := leasebus.EnsureCreds(d); err != nil {
				return err
			}
			id, seedPath, err := leasebus.EnrollIdentity(d, name, leasebus.Role(role), out)
			if errors.Is(err, lease.ErrInvalid) {
				return &usageError{err: err}
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "identity enrolled: %s\nrole: %s\nnkey: %s\ncredentials: %s\n", id.Name, id.Role, id.Nkey, seedPath)
			return a.applyIdentities(d, authConfig)
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "the bus's credentials directory")
	c.Flags().StringVar(&out, "out", "", "write the identity's credentials (its nkey seed) to this file, which must not exist (default DIR/holders/NAME.nk)")
	c.Flags().StringVar(&role, "role", string(leasebus.RoleHolder), "the identity's role: holder, viewer or operator")
	c.Flags().StringVar(&authConfig, "auth-config", "", "also rewrite this nats-server authorization include (for a bus on an existing NATS server)")
	return c
}

func (a *app) revokeIdentityCommand() *cobra.Command {
	var dir, authConfig string
	c := &cobra.Command{
		Use:   "revoke-identity NAME [--dir DIR] [--auth-config FILE]",
		Short: "Remove one bus identity: its connections close and it is refused from then on",
		Long: `Remove the enrolled identity NAME (or the identity whose public key is NAME)
from the bus's identities, and its seed if "bus enroll" kept it in DIR. A
running embedded bus reloads its users at once: NATS closes the identity's
connections and refuses it when it reconnects; no other identity is touched.
Its leases stay until they expire or an operator revokes them (lease revoke).

For a bus on an existing NATS server or cluster, pass --auth-config (or run
"fenceline bus creds --dir DIR" again) and reload the servers.`,
		Args:    cobra.ExactArgs(1),
		Example: `  fenceline bus revoke-identity pod-agent-billing-17`,
		RunE: func(cmd *cobra.Command, args []string) error {
			d, err := a.identitiesDir(dir)
			if err != nil {
				return err
			}
			id, ok, err := leasebus.FindIdentity(d, args[0])
			if err != nil {
				return err
			}
			if !ok {
				return &exitError{code: ExitError, err: fmt.Errorf("no identity %s in %s (fenceline bus identities lists them)", args[0], d)}
			}
			if err := leasebus.RemoveIdentity(d, id); err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "identity revoked: %s (%s)\n", id.Name, id.Nkey)
			return a.applyIdentities(d, authConfig)
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "the bus's credentials directory")
	c.Flags().StringVar(&authConfig, "auth-config", "", "also rewrite this nats-server authorization include (for a bus on an existing NATS server)")
	return c
}

func (a *app) identitiesCommand() *cobra.Command {
	var dir string
	var asJSON bool
	c := &cobra.Command{
		Use:   "identities [--dir DIR] [--json]",
		Short: "List the enrolled bus identities",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			d, err := a.identitiesDir(dir)
			if err != nil {
				return err
			}
			ids, err := leasebus.Identities(d)
			if err != nil {
				return err
			}
			if asJSON {
				if ids == nil {
					ids = []leasebus.Identity{}
				}
				return writeJSON(a.stdout, ids)
			}
			for _, i := range ids {
				kind := ""
				if i.Ephemeral {
					kind = " (ephemeral: a run's own)"
				}
				fmt.Fprintf(a.stdout, "%s\t%s\t%s%s\n", i.Name, i.Role, i.Nkey, kind)
			}
			return nil
		},
	}
	c.Flags().StringVar(&dir, "dir", "", "the bus's credentials directory")
	c.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

func (a *app) statusCommand() *cobra.Command {
	var (
		wait   time.Duration
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "status [--wait 1s] [--json]",
		Short: "Say which lease service instance serves, and what lease requests wait for",
		Long: `Asks every lease service instance the connected server reaches what it knows
of the election (which instance is the primary, how long its claim has gone
unrenewed, when a standby takes over) and of the streams a lease request waits
on (their leaders and which replicas they do not hear), and says from that what
a lease request waits for now. An instance that does not answer within --wait
is cut off from this server, paused or down.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if wait <= 0 {
				return usagef("--wait must be positive (how long to collect the instances' answers), got %s", wait)
			}
			s, err := a.dial(leasebus.RoleViewer)
			if err != nil {
				return err
			}
			defer s.Close()
			sts, err := leasebus.NewClient(s.nc).Status(cmd.Context(), wait)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(a.stdout, sts)
			}
			printStatus(a.stdout, sts)
			fmt.Fprintf(a.stdout, "now: %s\n", leasebus.Explain(sts))
			return nil
		},
	}
	c.Flags().DurationVar(&wait, "wait", time.Second, "how long to collect the instances' answers")
	c.Flags().BoolVar(&asJSON, "json", false, "print each instance's answer as JSON")
	return c
}

// printStatus prints one line per instance and, under each, the streams'
// leaders as it read them.
func printStatus(out io.Writer, sts []leasebus.Status) {
	for _, st := range sts {
		role := "alone"
		switch {
		case st.Elected && st.Serving:
			role = "primary"
		case st.Lapsed:
			role = "primary, term lapsed"
		case st.Elected:
			role = "standby"
		}
		fmt.Fprintf(out, "instance %s on %s: %s", st.Instance, st.Server, role)
		if st.Elected && !st.Serving {
			switch {
			case st.ClaimErr != "":
				fmt.Fprintf(out, "; claim unreadable: %s", st.ClaimErr)
			case st.ClaimFree:
				fmt.Fprint(out, "; claim free")
			case st.Primary != "":
				fmt.Fprintf(out, "; primary %s, claim unrenewed for %s", st.Primary, time.Duration(st.Unrenewed).Round(time.Millisecond))
			}
		}
		fmt.Fprintln(out)
		for _, ss := range st.Streams {
			switch {
			case ss.Err != "":
				fmt.Fprintf(out, "  %s: %s\n", ss.Name, ss.Err)
			case ss.Leader == "":
				fmt.Fprintf(out, "  %s: single server\n", ss.Name)
			default:
				fmt.Fprintf(out, "  %s: led by %s", ss.Name, ss.Leader)
				for _, r := range ss.Replicas {
					state := "current"
					switch {
					case r.Offline:
						state = "offline"
					case !r.Current:
						state = fmt.Sprintf("behind by %d", r.Lag)
					}
					fmt.Fprintf(out, ", %s %s (heard %s ago)", r.Server, state, time.Duration(r.Active).Round(time.Millisecond))
				}
				fmt.Fprintln(out)
			}
		}
	}
}
