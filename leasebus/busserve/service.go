package busserve

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"slices"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/shard"
)

// StartTimeout bounds starting the lease service: on a fresh cluster
// leasebus.StartService waits for JetStream to elect its leaders.
const StartTimeout = 2 * time.Minute

// reconnectWait is how soon the service's and the run UI's connections
// try again after a drop; they try forever.
const reconnectWait = 250 * time.Millisecond

// ServiceConfig configures StartService.
type ServiceConfig struct {
	// Node is the embedded server to run on, or nil for the existing bus
	// at URL. On a node the service connects in-process with the node's
	// own credentials, probes its store, and audits what the server
	// itself refuses.
	Node *Node
	// URL and Source (where URL came from, for errors) name the bus when
	// Node is nil.
	URL, Source string
	// Creds are the service's credentials and ViewerCreds the run UI's,
	// when Node is nil; Names maps identities to the names the audit gives
	// them (on a node: its credentials' names).
	Creds, ViewerCreds leasebus.BusCreds
	Names              map[string]string
	// Replicas of the lease log and audit streams; 0: 3 when the node or
	// the bus belongs to a cluster, else 1.
	Replicas int
	// Metrics, when set, is the host:port to serve Prometheus metrics on
	// (http://Metrics/metrics), and Go's profiles (net/http/pprof, under
	// http://Metrics/debug/pprof/): an operator's address, never an
	// agent's.
	Metrics string
	// UI, when set, is the host:port of the run UI, which requires
	// UIToken off loopback (empty: a random one).
	UI, UIToken string
	// FenceSecretDir is leasebus.ServiceConfig.FenceSecretDir: the
	// storages' secrets, from which each acquirer gets grant keys.
	FenceSecretDir string
	// SessionGrace is leasebus.ServiceConfig.SessionGrace (0: the
	// default); on a node, an ephemeral identity is collected after
	// embedded.CollectAfter of it.
	SessionGrace time.Duration
	// MaxHeldBytes is leasebus.ServiceConfig.MaxHeldBytes (0: the
	// default).
	MaxHeldBytes int
	// Debug keeps the embedded server's debug log on while its refusals
	// are audited.
	Debug  bool
	Logger *slog.Logger
}

// Service is a running lease service, with its metrics and run UI.
type Service struct {
	// URL is the bus the service runs on.
	URL string
	// Replicas of the lease log and audit streams.
	Replicas int
	// MetricsURL is where the metrics are served ("" when not).
	MetricsURL string
	// UIURL is the run UI's URL, token included ("" when not served).
	UIURL string

	log         *slog.Logger
	stopService func()   // nil until the service started
	closers     []func() // what else Stop ends, last first
}

// StartService connects to the bus, starts the lease service and, as
// configured, its metrics endpoint and the run UI. It returns the errors of
// leasebus.Dial as they are (*leasebus.NoBusError,
// *leasebus.CredsRefusedError), a metrics address that cannot be listened
// on as a *ListenError. The service runs until Stop.
func StartService(ctx context.Context, cfg ServiceConfig) (_ *Service, err error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	url, source, svcCreds, uiCreds := cfg.URL, cfg.Source, cfg.Creds, cfg.ViewerCreds
	var inProcess []nats.Option
	if n := cfg.Node; n != nil {
		url, source = n.URL(), "embedded server"
		svcCreds, uiCreds = n.Creds(leasebus.RoleService), n.Creds(leasebus.RoleViewer)
		cfg.Names = leasebus.NamesIn(n.Config.CredsDir)
		inProcess = append(inProcess, nats.InProcessServer(n.Server))
	}
	s := &Service{URL: url, log: log}
	defer func() {
		if err != nil {
			s.Stop()
		}
	}()

	nc, err := leasebus.Dial(url, source, svcCreds, slices.Concat(inProcess, leasebus.ServiceConnOptions(), []nats.Option{
		nats.Name("fenceline-lease-service"),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(reconnectWait),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil { // nil: we closed it
				log.Warn("disconnected from bus", "url", url, "err", err)
			}
		}),
		nats.ReconnectHandler(func(nc *nats.Conn) {
			log.Info("reconnected to bus", "url", nc.ConnectedUrl())
		}),
		// A subscription that falls behind drops what the server sends it
		// (a request never answered, a record never read): say so, once
		// per episode, rather than leave it to the askers' timeouts.
		nats.ErrorHandler(func(_ *nats.Conn, sub *nats.Subscription, err error) {
			if sub == nil {
				log.Warn("bus connection error", "err", err)
				return
			}
			dropped, _ := sub.Dropped()
			log.Warn("bus subscription error", "subject", sub.Subject, "err", err, "dropped", dropped)
		}),
	})...)
	if err != nil {
		return nil, err
	}
	s.closers = append(s.closers, nc.Close)
	s.Replicas = cfg.Replicas
	if s.Replicas == 0 {
		s.Replicas = 1
		if (cfg.Node != nil && cfg.Node.Clustered()) || nc.ConnectedClusterName() != "" {
			s.Replicas = 3
		}
	}
	// On a cluster the nodes' instances elect one to serve the lease
	// requests (leasebus/primary.go); a single server's is the only one.
	scfg := leasebus.ServiceConfig{Replicas: s.Replicas, Logger: log, Names: cfg.Names, FenceSecretDir: cfg.FenceSecretDir, SessionGrace: cfg.SessionGrace,
		MaxHeldBytes: cfg.MaxHeldBytes, Primary: s.Replicas > 1}
	if cfg.Node != nil {
		scfg.StoreProbe = embedded.StoreProbe(cfg.Node.Server, cfg.Node.Config.StoreDir)
	}
	var metricsLn net.Listener
	if cfg.Metrics != "" {
		// Listen before the service starts: a taken port is found before
		// anything is served.
		if metricsLn, err = net.Listen("tcp", cfg.Metrics); err != nil {
			return nil, &ListenError{For: "metrics", Addr: cfg.Metrics, Err: err}
		}
		s.closers = append(s.closers, func() { metricsLn.Close() })
		scfg.Metrics = leasebus.NewServiceMetrics()
	}
	svc, err := startService(ctx, nc, scfg)
	if err != nil {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("interrupted while starting the lease service: %w", err)
		}
		return nil, fmt.Errorf("start lease service on %s: %w", url, err)
	}
	stopRefusals := func() {}
	if cfg.Node != nil {
		// Runs enrol an identity of their own here, and the operator's
		// enrolments and revocations take effect without a restart.
		ids, err := embedded.ServeIdentities(svc.FleetConn(), cfg.Node.Server, cfg.Node.Config, log)
		if err != nil {
			svc.Stop()
			return nil, err
		}
		ids.Audit(svc) // enrolments and revocations are audited, new identities named
		// A run killed before it could leave leaves its identity behind:
		// collected once none of its sessions has been heard for long.
		ids.Collect(svc, embedded.CollectAfter(cmp.Or(scfg.SessionGrace, leasebus.DefaultSessionGrace)))
		s.closers = append(s.closers, ids.Stop)
	}
	if cfg.Node != nil {
		// What the embedded server itself refuses (credentials,
		// permissions) goes to the audit stream too.
		stopRefusals = embedded.AuditRefusals(svc, cfg.Node.Server, cfg.Debug, false)
	}
	s.stopService = func() {
		stopRefusals()
		svc.Stop()
	}
	if metricsLn != nil {
		s.serveMetrics(metricsLn, scfg.Metrics)
	}
	if cfg.UI != "" {
		if err := s.startUI(ctx, &cfg, url, source, uiCreds, inProcess); err != nil {
			return nil, err
		}
	}
	return s, nil
}

func startService(ctx context.Context, nc *nats.Conn, cfg leasebus.ServiceConfig) (*leasebus.Service, error) {
	ctx, cancel := context.WithTimeout(ctx, StartTimeout)
	defer cancel()
	return leasebus.StartService(ctx, nc, cfg)
}

// serveMetrics serves m at http://ln/metrics, and the profiles of
// net/http/pprof under http://ln/debug/pprof/, until Stop.
func (s *Service) serveMetrics(ln net.Listener, m *leasebus.ServiceMetrics) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", m.Handler())
	mux.HandleFunc("/debug/pprof/", pprof.Index) // and every named profile: heap, goroutine, block, mutex...
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	msrv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	served := make(chan struct{})
	go func() {
		defer close(served)
		if err := msrv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			s.log.Warn("serve metrics", "addr", ln.Addr().String(), "err", err)
		}
	}()
	s.closers = append(s.closers, func() {
		msrv.Close()
		<-served
	})
	s.MetricsURL = "http://" + ln.Addr().String() + "/metrics"
}

// startUI starts the run UI, reading the bus as a viewer.
func (s *Service) startUI(ctx context.Context, cfg *ServiceConfig, url, source string, creds leasebus.BusCreds, inProcess []nats.Option) error {
	unc, err := leasebus.Dial(url, source, creds, append(inProcess, nats.Name("fenceline-run-ui"), nats.MaxReconnects(-1), nats.ReconnectWait(reconnectWait))...)
	if err != nil {
		return err
	}
	s.closers = append(s.closers, unc.Close)
	shards, err := shard.Open(leasebus.NewShardRecords(unc), shard.Config{Logger: s.log})
	if err != nil {
		return err
	}
	ui, err := runui.Listen(cfg.UI, runui.Config{Source: leasebus.NewUIReader(unc), Token: cfg.UIToken, Shards: runui.StoreSource(shards), Logger: s.log})
	if err != nil {
		return err
	}
	s.closers = append(s.closers, func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		if err := ui.Close(sctx); err != nil {
			s.log.Warn("stop the run UI", "err", err)
		}
	})
	s.UIURL = ui.URL()
	return nil
}

// Stop stops the lease service, then the run UI, the metrics endpoint
// and the connections; it may be called again.
func (s *Service) Stop() {
	if s.stopService != nil {
		s.stopService()
		s.stopService = nil
	}
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
	s.closers = nil
}
