package sidecar

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/shard"
)

// PodConfig configures a Pod. Bus, Hold and Fences are required.
type PodConfig struct {
	// Bus is the lease bus client. Its connection (a holder's, one that
	// reconnects forever) also carries the audit events, the shard store
	// and the run UI.
	Bus *leasebus.Client
	// Admin configures the admin server: its address, token and timings.
	// The pod sets its Metrics, Audit, UI and Logger.
	Admin AdminConfig
	// Hold takes the agent's lease, passing opts (the pod's metrics hook)
	// to the holder: it acquires the lease, or attaches to one acquired
	// elsewhere and says so (attached): the pod then never releases it,
	// it only stops renewing it. Its error is Start's, as is.
	Hold func(ctx context.Context, opts leasebus.HoldOptions) (h *leasebus.Holder, attached bool, err error)
	// Fences is the fences' configuration under the held lease h, whose
	// refusals audit records; the pod sets its Metrics. Its error is
	// Start's, as is.
	Fences func(h *leasebus.Holder, audit *leasebus.Auditor) (Config, error)
	// BaseEnv is the agent's environment that the fences' entries are
	// added to (Fences.Env), e.g. the DATABASE_URL it is to use.
	BaseEnv []string
	// EnvFile, when set, receives the agent's environment (WriteEnvFile)
	// before Start returns.
	EnvFile string
	// SettleTimeout is how long Shutdown waits for the settle report of an
	// agent wrapper that connected (Admin.WaitSettled).
	SettleTimeout time.Duration
	// Logger gets the pod's log lines (nil: discard).
	Logger *slog.Logger
}

// AdminError is NewPod's error when the admin server cannot start (its
// address cannot be listened on, or needs a token). Its text is the
// admin server's error, as is.
type AdminError struct{ Err error }

func (e *AdminError) Error() string { return e.Err.Error() }

// Unwrap returns the admin server's error.
func (e *AdminError) Unwrap() error { return e.Err }

// Pod is what fenceline sidecar runs for one agent: the admin server (with
// the run UI), the agent's lease and its fences. NewPod starts the admin
// server; Start takes the lease and starts the fences; Wait returns once
// the pod is to stop; Shutdown drains the fences, awaits the agent's
// settle report and releases the lease or leaves it to expire; Close
// stops the admin server.
type Pod struct {
	cfg     PodConfig
	log     *slog.Logger
	audit   *leasebus.Auditor
	metrics *Metrics
	ui      *runui.Server
	admin   *Admin

	// Set by Start.
	holder   *leasebus.Holder
	attached bool         // the lease is its owner's (PodConfig.Hold): never released here
	lease    lease.Lease  // as when the fences started
	llog     *slog.Logger // log with the lease's ids
	sc       *Sidecar
}

// Ready is what a started pod serves: the lease, the fences and the
// environment the agent must run with.
type Ready struct {
	// Lease is the lease record as when the fences started.
	Lease lease.Lease
	// Fences says where the fences listen.
	Fences Fences
	// Env is the agent's environment: PodConfig.BaseEnv and the fences'
	// entries (written to PodConfig.EnvFile when set).
	Env []string
}

// LeaseEnd is how the pod's lease ended at Shutdown.
type LeaseEnd int

const (
	// LeaseLeftToOwner: the lease was attached to; it is no longer
	// renewed, and its owner decides.
	LeaseLeftToOwner LeaseEnd = iota
	// LeaseReleased: the agent settled (or none ever connected) and the
	// lease was released.
	LeaseReleased
	// LeaseLeftToExpire: an agent wrapper connected but did not report its
	// attempt settled in time; the lease is no longer renewed, and the
	// lease service reclaims it once the sidecar's session falls silent
	// (leasebus.DefaultSessionGrace after the sidecar exits), at the latest
	// at the end of its ttl.
	LeaseLeftToExpire
	// LeaseNotReleased: the release failed (Ending.Err); the lease expires
	// by its ttl.
	LeaseNotReleased
	// LeaseEnded: the lease had ended before the shutdown (revoked,
	// expired or reclaimed: Ending.Err says which); there was nothing to
	// release.
	LeaseEnded
)

// Ending is how Shutdown ended the pod's lease, and why.
type Ending struct {
	// Lease is the lease record as when the fences started.
	Lease lease.Lease
	// End is what became of the lease.
	End LeaseEnd
	// Why says why the lease was, or was not, released (the settle
	// outcome).
	Why string
	// Err is why the release failed (LeaseNotReleased), or how the lease
	// had ended (LeaseEnded).
	Err error
}

// NewPod opens what the pod serves beside the lease (the auditor, the
// metrics, the shard store, the run UI) and starts the admin server: it
// answers /healthz at once, /readyz once Start holds the lease. An admin
// server that cannot start is an *AdminError. Close the pod when done.
func NewPod(cfg PodConfig) (*Pod, error) {
	if cfg.Bus == nil || cfg.Hold == nil || cfg.Fences == nil {
		return nil, errors.New("sidecar pod: a bus client, Hold and Fences are required")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	nc := cfg.Bus.Conn()
	audit, err := leasebus.NewAuditor(nc)
	if err != nil {
		return nil, err
	}
	metrics := NewMetrics()
	shards, err := shard.Open(leasebus.NewShardRecords(nc), shard.Config{Logger: log})
	if err != nil {
		return nil, err
	}
	ui, err := runui.New(runui.Config{Source: leasebus.NewUIReader(nc), Token: cfg.Admin.Token, Shards: runui.StoreSource(shards), Logger: log})
	if err != nil {
		return nil, err
	}
	acfg := cfg.Admin
	acfg.Metrics, acfg.Audit, acfg.UI, acfg.Logger = metrics, audit, ui.Handler(), log
	admin, err := StartAdmin(acfg)
	if err != nil {
		ui.Close()
		return nil, &AdminError{Err: err}
	}
	return &Pod{cfg: cfg, log: log, audit: audit, metrics: metrics, ui: ui, admin: admin}, nil
}

// AdminURL is the admin server's base URL.
func (p *Pod) AdminURL() string { return p.admin.URL() }

// Start takes the lease (PodConfig.Hold), starts the fences under it,
// makes the admin server report it, and writes the agent's environment to
// PodConfig.EnvFile. When a step after Hold fails, the lease is released
// (or, attached, no longer renewed) before the error returns. Call it
// once.
func (p *Pod) Start(ctx context.Context) (*Ready, error) {
	if p.sc != nil {
		return nil, errors.New("sidecar pod: started twice")
	}
	h, attached, err := p.cfg.Hold(ctx, p.metrics.HoldOptions(leasebus.HoldOptions{}))
	if err != nil {
		return nil, err
	}
	p.attached = attached
	p.metrics.TrackLease(h)
	l := h.Lease()
	cfg, err := p.cfg.Fences(h, p.audit)
	if err != nil {
		p.finish(ctx, h)
		return nil, err
	}
	cfg.Metrics = p.metrics
	sc, err := Start(ctx, cfg)
	if err != nil {
		p.finish(ctx, h)
		return nil, err
	}
	p.admin.SetLease(h, sc.Fences())
	env := sc.AgentEnv(p.cfg.BaseEnv)
	// The file first: whoever reads the announcement may read the file.
	if p.cfg.EnvFile != "" {
		if err := WriteEnvFile(p.cfg.EnvFile, env); err != nil {
			sc.Close(ctx)
			p.finish(ctx, h)
			return nil, err
		}
	}
	p.holder, p.lease, p.llog, p.sc = h, l, LeaseLogger(p.log, l), sc
	p.llog.Info("sidecar ready", "admin", p.admin.URL(), "git", sc.GitURL(), "postgres", fmt.Sprint(sc.PGAddr()), "egress", sc.EgressURL())
	return &Ready{Lease: l, Fences: sc.Fences(), Env: env}, nil
}

// Wait returns when ctx ends (nil) or a fence stops serving on its own
// (its error); then call Shutdown. Start must have succeeded.
func (p *Pod) Wait(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return nil
	case err := <-p.sc.Err():
		return err
	}
}

// Shutdown stops the pod's lease and fences: /readyz answers not ready,
// the fences stop accepting and drain (in-flight requests finish, up to
// 10 s), then the agent wrapper's settle report is awaited (at most
// PodConfig.SettleTimeout once one connected). A settled (or never
// connected) agent's lease is released; one that may still write leaves
// it to expire; an attached lease is left to its owner. It runs to the
// end even when ctx is done, returns how the lease ended and the fences'
// drain error, and is called once, after a successful Start.
func (p *Pod) Shutdown(ctx context.Context) (*Ending, error) {
	if p.sc == nil {
		return nil, errors.New("sidecar pod: shut down before it started")
	}
	p.admin.SetDraining("shutting down")
	p.llog.Info("sidecar stopping: not ready, draining the fences")
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	err := p.sc.Close(dctx)
	settled, why := p.waitSettled()
	end := &Ending{Lease: p.lease, Why: why}
	st, lostErr := p.holder.State()
	switch {
	case p.attached:
		p.finish(ctx, p.holder)
		end.End = LeaseLeftToOwner
	case st == leasebus.Lost:
		// A release would answer with the ended record: no release.
		p.holder.Stop()
		p.llog.Warn("lease had already ended: nothing to release", "err", lostErr, "settle", why)
		end.End, end.Err = LeaseEnded, lostErr
	case !settled:
		p.holder.Stop()
		p.llog.Warn("lease left to expire: the agent did not report its attempt settled", "why", why, "ttl", p.lease.TTL.String())
		end.End = LeaseLeftToExpire
	default:
		if ferr := p.finish(ctx, p.holder); ferr != nil {
			p.llog.Error("lease not released", "err", ferr)
			end.End, end.Err = LeaseNotReleased, ferr
		} else {
			p.llog.Info("lease released", "why", why)
			end.End = LeaseReleased
		}
	}
	p.admin.View() // streams hear the final state before the server closes
	return end, err
}

// Close stops the run UI's event streams and the admin server (in-flight
// requests get up to 5 s, even when ctx is done).
func (p *Pod) Close(ctx context.Context) error {
	p.ui.Close() // first: its event streams would hold the admin server open
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	return p.admin.Close(cctx)
}

// finish ends holding h: an acquired lease is released (up to 5 s, even
// when ctx is done), an attached one only no longer renewed.
func (p *Pod) finish(ctx context.Context, h *leasebus.Holder) error {
	return h.End(ctx, !p.attached)
}

// waitSettled waits for the agent wrapper's settle report
// (Admin.WaitSettled) and says why the lease may, or may not, be
// released.
func (p *Pod) waitSettled() (bool, string) {
	timeout := p.cfg.SettleTimeout
	switch s := p.admin.WaitSettled(timeout); s {
	case SettleReported:
		return true, "the agent reported its attempt settled"
	case SettleNoAgent:
		return true, "no agent wrapper ever connected; the fences are drained"
	default:
		return s.Settled(), fmt.Sprintf("no settle report from the agent wrapper within the settle timeout, %s", timeout)
	}
}
