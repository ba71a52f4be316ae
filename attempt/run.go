package attempt

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/lograte"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
	"github.com/fenceline/fenceline/shard"
	"github.com/fenceline/fenceline/sidecar"
)

// Spec is one attempt of an agent's command under a lease this process
// holds.
type Spec struct {
	// Argv is the command; it runs in Checkout, or in the shard Pool
	// places it in.
	Argv     []string
	Checkout *Checkout
	Pool     *Pool // nil: the attempt works in Checkout itself

	// Holder is the lease the attempt runs under (a *leasebus.Holder),
	// held by the caller, who ends it once Run returns.
	Holder lease.Holding
	// Audit records the guard's refusals and what a shadow policy would
	// have refused (a *leasebus.Auditor; nil: none).
	Audit lease.Auditor
	// FencelineStateDir is fenceline's state dir (credentials, fence
	// secrets, the sidecars' files): hidden from the agent, and where
	// settle keeps its copies of the checkout's objects ("settle/").
	// Required; the caller decides it (the CLI: $XDG_STATE_HOME/fenceline).
	FencelineStateDir string
	// Sidecar is the fences' configuration under Holder's lease. Its
	// git object dirs default to the attempt's checkout's.
	Sidecar sidecar.Config

	AllowWrite []string // real paths the agent may write besides its claim (RealPaths)
	// State is the user's CLI state the agent gets a private copy of
	// (PrivateHome), discarded at settle.
	State      StateSpec
	AllowPorts []uint16 // TCP ports it may connect to besides the fences'
	AllowBind  []uint16 // fixed TCP ports it may listen on (a dev server's); kernel-chosen ones always
	// Reserve are ports of local services the agent may not take (bind or
	// listen on) besides the fences' and their loopback upstreams': the
	// lease bus's when it is local (LocalPorts).
	Reserve []uint16
	// Hide names secrets the agent may not read besides FencelineStateDir
	// and the sidecar's state dir (HiddenPaths).
	Hide []string

	// StopOnLost stops the agent when the lease is lost; otherwise it runs
	// on with every write refused.
	StopOnLost     bool
	KillGrace      time.Duration // between SIGTERM and SIGKILL when it is stopped
	AllowUnguarded bool          // run without Landlock (see CheckGuard)

	Stdout, Stderr io.Writer // the agent's; Stderr also gets the guard's errors
	// Say reports what the attempt does, one line each, for a person.
	Say func(line string)
	// Policy is the security team's policy in force (nil: none): the file
	// guard keeps the paths it forbids unwritable, and the fences ask it
	// (Sidecar.Policy).
	Policy *policy.Store
}

// Result is how an attempt ended.
type Result struct {
	// Started: the command ran; when false, nothing did and Code is -1.
	Started bool
	Code    int // the command's exit status (ExitStatus)
	// StoppedOnLost: the lease was lost and the agent stopped for it.
	StoppedOnLost bool
	// Denials is every call the guard refused (each is in the audit
	// trail); Refused splits them by cause, and only Refused.AfterLoss
	// were refused because the lease was lost.
	Denials  uint64
	Refused  fsguard.Refusals
	StateDir string // the sidecar's state dir
}

// auditShadowed records the paths a shadow policy would keep unwritable
// (shadow-refused, boundary file): nothing is refused.
func auditShadowed(ctx context.Context, audit fsguard.Auditor, l lease.Lease, shadowed []string, say func(string)) {
	if audit == nil {
		return
	}
	for _, s := range shadowed {
		ev := lease.AuditEvent{Time: time.Now().UTC(), Type: lease.EventShadowRefused, Boundary: lease.BoundaryFile,
			Repo: l.Repo, LeaseID: l.LeaseID, Owner: l.Owner, Scope: l.Scope, Fence: l.Fence, Reason: lease.ReasonPolicy,
			Message: "shadow policy: the file guard would keep " + s + " unwritable; nothing was refused"}
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		if err := audit.Record(actx, ev); err != nil {
			say("policy: a shadow refusal was not audited: " + err.Error()) // and refuses nothing either
		}
		cancel()
	}
}

// run is one attempt between Run's start and its settling.
type run struct {
	spec Spec
	co   *Checkout
	// home is the checkout a pooled attempt's shard was made from; co is
	// then the shard.
	home *Checkout
	// gitSnap is the checkout's executable git configuration before an
	// exclusive attempt without a pool, or the repositories under a
	// path-leased attempt's claims (gitSnapOf says which); objSnap is the
	// checkout's object stores before an exclusive attempt without a
	// pool. Settle restores them (snapshotGitDirs).
	gitSnap   *shard.GitDirSnapshot
	gitSnapOf string
	objSnap   *shard.ObjectSnapshot
	// priv is the agent's private HOME (Spec.State); settle discards it.
	priv *PrivateHome
	// project is the agent CLIs' project settings where an attempt
	// without a pool may write the user's checkout; settle names what it
	// changed there (snapshotProject).
	project *ProjectState
}

func (r *run) say(format string, args ...any) {
	if r.spec.Say != nil {
		r.spec.Say(fmt.Sprintf(format, args...))
	}
}

// Run runs the attempt: it places it in its shard (or snapshots the
// checkout's git configuration), starts the fences and the guarded command,
// reacts to a lost lease and to ctx's end, waits until every process of
// the attempt is gone, closes the fences and settles the attempt. The
// lease stays held: giving it back is the caller's, after Run returns.
//
// When ctx ends, the agent's processes get SIGTERM, and SIGKILL after
// KillGrace or at a second interrupt (SIGINT, SIGTERM) of this process.
func Run(ctx context.Context, spec Spec) (res Result, err error) {
	r := &run{spec: spec, co: spec.Checkout}
	res.Code = -1
	if spec.FencelineStateDir == "" {
		return res, errNoStateDir("Spec")
	}
	l := spec.Holder.Lease()

	// Until the agent starts, a failure settles at once.
	var sc *sidecar.Sidecar
	defer func() {
		if res.Started {
			return
		}
		if sc != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			sc.Close(dctx)
			cancel()
		}
		r.settle(ctx, -1, false)
	}()

	if !l.Active() {
		return res, fmt.Errorf("lease %s: %w: it is %s (%s)", l.LeaseID, lease.ErrLeaseLost, l.Status, l.Reason)
	}
	if spec.Pool != nil {
		if err := r.place(ctx); err != nil {
			return res, err
		}
	}
	if err := r.snapshotGitDirs(ctx); err != nil {
		return res, err
	}
	if err := r.snapshotProject(); err != nil {
		return res, err
	}
	cfg := spec.Sidecar
	if len(cfg.GitObjectDirs) == 0 && len(r.co.GitDirs) > 0 {
		// Thin packs the agent pushes resolve against its own objects.
		cfg.GitObjectDirs = []string{r.co.GitDirs[len(r.co.GitDirs)-1]}
	}
	res.StateDir = cfg.StateDir
	if sc, err = sidecar.Start(ctx, cfg); err != nil {
		return res, err
	}
	if u := sc.GitURL(); u != "" {
		r.say("git fence %s -> %s (the agent's git goes through it)", u, cfg.GitUpstream)
	}
	if pa := sc.PGAddr(); pa != nil {
		r.say("postgres fence %s -> %s (PGHOST/PGPORT and DATABASE_URL point the agent at it)", pa, cfg.PGUpstream)
	}
	r.say("egress proxy %s (HTTPS_PROXY/HTTP_PROXY; connects that skip it are captured into it): %s", sc.EgressURL(), sc.Fences().EgressSummary())

	pol, created, err := Policy(r.co, l, spec.AllowWrite)
	if err != nil {
		return res, err
	}
	if spec.Pool != nil && spec.Pool.Mode == shard.ModeCommitSerialized {
		// Commit capacity beside path leases: the git dirs, not the files.
		pol.Writable, pol.GitDirWritable, pol.GitShim = spec.AllowWrite, true, false
	}
	for _, c := range created {
		r.say("created %s: the claim did not exist in the checkout, and writes are confined to existing paths", c)
	}
	var protected, shadowed []string
	baseWritable := pol.Writable
	if pol.Writable, protected, shadowed, err = ProtectPaths(r.co, l, pol.Writable, spec.Policy); err != nil {
		return res, err
	}
	if len(protected) > 0 {
		r.say("policy: the file guard keeps %s unwritable (protected by the security team's policy)", strings.Join(protected, ", "))
	}
	if spec.Audit != nil {
		auditShadowed(ctx, spec.Audit, l, shadowed, func(s string) { r.say("%s", s) })
	}
	if err := socketOutsideWrites("Sidecar.PGUpstream", cfg.PGUpstream, pol); err != nil {
		return res, err
	}
	env := Env(os.Environ(), nil, sc.AgentEnv, l.LeaseID)
	secrets := append([]string{spec.FencelineStateDir, cfg.StateDir}, spec.Hide...)
	if r.priv, env, err = openPrivateState(spec.State, secrets, &pol, env, func(s string) { r.say("%s", s) }); err != nil {
		return res, err
	}
	pol.Hidden = HiddenPaths(env, secrets...)
	pol.ConnectPorts = ConnectPorts(spec.AllowPorts, sc.Ports())
	pol.Capture = sc.Fences().Capture() // connects that skip the proxy are handed to it
	pol.ReservedPorts = ConnectPorts(spec.Reserve, LocalPorts(cfg.PGUpstream, cfg.GitUpstream))
	pol.BindPorts = spec.AllowBind
	pol.KillGrace = spec.KillGrace
	pol.AllowUnguarded = spec.AllowUnguarded
	polLog := lograte.New(slog.NewTextHandler(spec.Stderr, &slog.HandlerOptions{Level: slog.LevelError}), lograte.Options{})
	defer polLog.Close() // last: its counts said, and no timer writes to stderr after Run
	pol.Logger = slog.New(polLog)

	cmd, err := Command(r.co, r.home, spec.Argv, env, spec.Stdout, spec.Stderr)
	if err != nil {
		return res, err
	}
	agentCtx, stopAgent := context.WithCancel(ctx)
	defer stopAgent()
	gate, stopPolicy := watchPolicy(agentCtx, spec.Holder, spec.Policy, r.co, l, baseWritable, protected, func(s string) { r.say("%s", s) })
	defer stopPolicy()
	pr, err := Start(agentCtx, pol, gate, spec.Audit, cmd)
	if err != nil {
		return res, err
	}
	res.Started = true
	r.say("%s", Summary(r.co, pol, pr.Guarded()))

	w := &watch{r: r, pr: pr.Process, sc: sc, stopAgent: stopAgent, done: make(chan struct{})}
	go w.watch(ctx)
	code, werr := pr.Wait() // every process of the attempt is gone
	<-w.done
	res.Code, res.StoppedOnLost, res.Refused = code, w.lostStop.Load(), pr.Refusals()
	res.Denials = res.Refused.Total()

	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if cerr := sc.Close(dctx); cerr != nil {
		r.say("closing the fences: %v", cerr)
	}
	r.sayRefused(res.Refused)
	r.settle(ctx, code, ctx.Err() != nil)
	if werr != nil {
		return res, fmt.Errorf("supervise %s: %w", spec.Argv[0], werr)
	}
	return res, nil
}

// sayRefused reports the calls the guard refused, by cause: a loss is
// named only for writes refused because of one.
func (r *run) sayRefused(rf fsguard.Refusals) {
	if rf.Confined > 0 {
		r.say("%d calls of the agent outside its claim or its allowed connections were refused (each is in the audit trail)", rf.Confined)
	}
	if rf.AfterLoss > 0 {
		r.say("%d writes of the agent were refused after the lease was lost or could not be confirmed (each is in the audit trail)", rf.AfterLoss)
	}
}

// watch reacts to what happens while the agent runs: a lost lease, a
// cancelled run (SIGTERM, Ctrl-C), a second interrupt, a failed fence.
type watch struct {
	r         *run
	pr        *fsguard.Process
	sc        *sidecar.Sidecar
	stopAgent context.CancelFunc
	lostStop  atomic.Bool // the agent was stopped because the lease was lost
	done      chan struct{}
}

func (w *watch) watch(ctx context.Context) {
	defer close(w.done)
	r, h := w.r, w.r.spec.Holder
	lost, ctxDone, fenceErr := h.Lost(), ctx.Done(), w.sc.Err()
	var again chan os.Signal // a second interrupt kills at once
	defer func() {
		if again != nil {
			signal.Stop(again)
		}
	}()
	for {
		select {
		case <-w.pr.Settled():
			return
		case <-lost:
			lost = nil
			_, why := h.State()
			if r.spec.StopOnLost {
				w.lostStop.Store(true)
				r.say("LEASE LOST: %v; every file write and push of the agent is refused from now on; stopping the agent as asked: SIGTERM now, SIGKILL after %s", why, r.spec.KillGrace)
				w.stopAgent()
			} else {
				r.say("LEASE LOST: %v; every file write and push of the agent is refused from now on, reads go on; the agent keeps running, as asked", why)
			}
		case <-ctxDone:
			ctxDone = nil
			r.say("stopping: SIGTERM to the agent's processes, SIGKILL after %s; the lease is released once all are gone (interrupt again to kill them now)", r.spec.KillGrace)
			again = make(chan os.Signal, 1)
			signal.Notify(again, os.Interrupt, syscall.SIGTERM)
		case <-again:
			r.say("killing the agent's processes")
			w.pr.Kill()
		case err := <-fenceErr:
			fenceErr = nil
			r.say("%v: the agent's pushes fail from now on", err)
		}
	}
}
