package attempt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/url"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/sidecar"
)

// PodSpec is an attempt in an agent's container whose lease a sidecar in
// another container holds (fenceline sidecar): the guard follows the
// sidecar's word on the lease, and the attempt reports its end to it.
type PodSpec struct {
	Argv     []string
	Checkout *Checkout

	SidecarURL string // the sidecar's admin URL
	Token      string // its admin token
	// Grace is how long the sidecar's last word on the lease is trusted;
	// Wait how long to wait for its first before starting with every
	// write refused.
	Grace, Wait time.Duration

	// Paths and Workspace narrow the lease the guard is built from (see
	// Narrow); empty, the sidecar's lease as it is.
	Paths     []string
	Workspace lease.WorkspaceMode
	// AllowHosts must each be allowed by the sidecar's egress proxy (the
	// proxy, not the attempt, decides what the agent reaches).
	AllowHosts []string

	AllowWrite []string  // real paths the agent may write besides its claim
	State      StateSpec // CLI state the agent gets a private copy of (PrivateHome)
	AllowPorts []uint16  // TCP ports it may connect to besides the fences'
	AllowBind  []uint16  // fixed TCP ports it may listen on (a dev server's); kernel-chosen ones always
	Hide       []string  // secrets it may not read besides FencelineStateDir
	// FencelineStateDir is fenceline's state dir in the agent's
	// container: hidden from the agent. Required; the caller decides it
	// (the CLI: $XDG_STATE_HOME/fenceline).
	FencelineStateDir string

	KillGrace      time.Duration
	AllowUnguarded bool
	// Operator marks an operator's shell beside the agent (kubectl exec):
	// guarded like the agent, but it reports no settle, which is the
	// agent's own wrapper's to report (the sidecar releases the lease on
	// the first report).
	Operator       bool
	Stdout, Stderr io.Writer
	Log            *slog.Logger // what the attempt does, structured
}

// RunInPod runs the attempt beside its sidecar: it follows the sidecar's
// lease stream, builds the guard from the lease it names (narrowed), runs
// the command under it, and reports the end (exit status, refused writes)
// to the sidecar, which releases the lease only then. A sidecar that says
// nothing within Wait leaves the attempt running with every write refused.
func RunInPod(ctx context.Context, spec PodSpec) (res Result, err error) {
	res.Code = -1
	if spec.FencelineStateDir == "" {
		return res, errNoStateDir("PodSpec")
	}
	log := spec.Log
	sc := sidecar.NewClient(spec.SidecarURL, spec.Token)
	gate := sidecar.NewGate(spec.SidecarURL, spec.Grace)
	streamCtx, stopStream := context.WithCancel(context.WithoutCancel(ctx))
	streamDone := make(chan struct{})
	go func() {
		defer close(streamDone)
		sc.Follow(streamCtx, gate, log)
	}()
	defer func() {
		stopStream()
		<-streamDone
	}()

	view := gate.WaitFirst(ctx, spec.Wait)
	if view == nil {
		why := fmt.Sprintf("the sidecar at %s named no lease within %s", spec.SidecarURL, spec.Wait)
		gate.Unbound(why)
		log.Warn("no word from the sidecar: starting the agent with every write denied for this run", "why", why)
	}
	l, known := lease.Lease{Repo: spec.Checkout.Repo, Scope: scope.Claim{Kind: scope.KindNone}, WorkspaceMode: lease.WorkspaceExclusive}, false
	var fences sidecar.Fences
	if view != nil {
		fences = view.Fences
		if view.Lease != nil {
			l, known = *view.Lease, true
		}
	}
	if l, err = Narrow(l, known, spec.Paths, spec.Workspace); err != nil {
		return res, err
	}
	pol, created, err := Policy(spec.Checkout, l, spec.AllowWrite)
	if err != nil {
		return res, err
	}
	say := func(s string) { log.Info(s) }
	for _, c := range created {
		log.Info("created the claimed directory: writes are confined to existing paths", "path", c)
	}
	// The security team's policy, as the sidecar's views carry it: the
	// kernel keeps what it protects unwritable, as under run.
	baseWritable := pol.Writable
	var protected, shadowed []string
	if pol.Writable, protected, shadowed, err = ProtectPaths(spec.Checkout, l, pol.Writable, gate.Policy()); err != nil {
		return res, err
	}
	if len(protected) > 0 {
		log.Info("policy: the file guard keeps these paths unwritable (protected by the security team's policy)", "paths", strings.Join(protected, ", "))
	}
	auditShadowed(ctx, sc.Auditor(), l, shadowed, say)
	if err := egressAllows(fences, spec.AllowHosts); err != nil {
		return res, err
	}
	if fences.CAPEM != "" {
		// The sidecar's CA, for hosts whose credentials it adds: its
		// files are in the sidecar's container.
		dir, err := os.MkdirTemp("", "fenceline-ca-")
		if err != nil {
			return res, fmt.Errorf("the sidecar's CA: %w", err)
		}
		defer os.RemoveAll(dir)
		if err := sidecar.LocalCA(&fences, dir); err != nil {
			return res, err
		}
	}
	env := Env(os.Environ(), nil, fences.Env, l.LeaseID)
	secrets := append([]string{spec.FencelineStateDir}, spec.Hide...)
	priv, env, err := openPrivateState(spec.State, secrets, &pol, env, say)
	if err != nil {
		return res, err
	}
	defer settlePrivateState(priv, say) // after every process is gone: Start's failure, or Wait
	pol.Hidden = HiddenPaths(env, secrets...)
	pol.ConnectPorts = ConnectPorts(spec.AllowPorts, fences.Ports())
	pol.Capture = fences.Capture() // connects that skip the proxy are handed to it
	// The sidecar's admin port: once the sidecar is gone, whoever listens
	// there is asked for the lease (and its restart would fail).
	pol.ReservedPorts = sidecarPorts(spec.SidecarURL)
	pol.BindPorts = spec.AllowBind
	pol.KillGrace = spec.KillGrace
	pol.AllowUnguarded = spec.AllowUnguarded
	pol.Logger = sidecar.LeaseLogger(log, l) // its denials name the lease

	cmd, err := Command(spec.Checkout, nil, spec.Argv, env, spec.Stdout, spec.Stderr)
	if err != nil {
		return res, err
	}
	llog := sidecar.LeaseLogger(log, l)
	agentCtx, stopAgent := context.WithCancel(ctx)
	defer stopAgent()
	pgate, stopPolicy := watchPolicy(agentCtx, gate, gate.Policy(), spec.Checkout, l, baseWritable, protected, say)
	defer stopPolicy()
	pr, err := Start(agentCtx, pol, pgate, sc.Auditor(), cmd)
	if err != nil {
		return res, err
	}
	res.Started = true
	llog.Info(Summary(spec.Checkout, pol, pr.Guarded()), "sidecar", spec.SidecarURL, "egress", fences.Egress, "egressAllow", strings.Join(fences.EgressAllow, ","))
	code, werr := pr.Wait()
	res.Code, res.Refused = code, pr.Refusals()
	res.Denials = res.Refused.Total()
	rep := sidecar.SettledReport{ExitCode: code, Denials: res.Denials, DeniedAfterLoss: res.Refused.AfterLoss}
	if spec.Operator {
		llog.Info("operator shell ended (no settle report: the agent's wrapper reports its attempt)", "exitCode", code, "denials", rep.Denials)
		if werr != nil {
			return res, fmt.Errorf("supervise %s: %w", spec.Argv[0], werr)
		}
		return res, nil
	}
	tries := 10 * time.Second
	if !gate.EverHeard() {
		tries = 0 // one try: a sidecar never reached is not waited for again
	}
	if err := sc.Settled(context.WithoutCancel(ctx), rep, tries); err != nil {
		llog.Error("settle report not delivered: the sidecar leaves the lease to expire", "err", err)
	} else {
		llog.Info("attempt settled and reported to the sidecar", "exitCode", code, "denials", rep.Denials, "deniedAfterLoss", rep.DeniedAfterLoss)
	}
	if werr != nil {
		return res, fmt.Errorf("supervise %s: %w", spec.Argv[0], werr)
	}
	return res, nil
}

// sidecarPorts is the port of the sidecar's admin URL, on whatever host:
// the agent shares its network namespace with the sidecar.
func sidecarPorts(adminURL string) []uint16 {
	u, err := url.Parse(adminURL)
	if err != nil {
		return nil
	}
	port := u.Port()
	if port == "" {
		port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
	}
	n, err := strconv.ParseUint(port, 10, 16)
	if err != nil || n == 0 {
		return nil
	}
	return []uint16{uint16(n)}
}

// Narrow is the lease a pod's guard is built from: l, the sidecar's
// record when known, narrowed to paths (which must lie in its claim) and
// to mode (which may not widen a shared workspace to an exclusive one).
// Without a known lease, paths make the workspace shared.
func Narrow(l lease.Lease, known bool, paths []string, mode lease.WorkspaceMode) (lease.Lease, error) {
	if mode != "" {
		if known && l.WorkspaceMode == lease.WorkspaceShared && mode == lease.WorkspaceExclusive {
			return l, fieldInvalid("Workspace", string(mode), fmt.Errorf("lease %s has a shared workspace; its agent never writes the git dir", l.LeaseID))
		}
		l.WorkspaceMode = mode
	} else if !known && len(paths) > 0 {
		l.WorkspaceMode = lease.WorkspaceShared
	}
	if len(paths) == 0 {
		return l, nil
	}
	claim, err := scope.New(paths, false, nil)
	if err != nil {
		return l, fieldInvalid("Paths", "", err)
	}
	if known && l.Scope.Kind != scope.KindNone {
		for _, p := range claim.Paths {
			if !l.Scope.ContainsPath(p) {
				return l, fieldInvalid("Paths", p, fmt.Errorf("is outside lease %s's claim %s: the agent may only write what its lease claims", l.LeaseID, l.Scope))
			}
		}
	}
	claim.Tables = l.Scope.Tables
	l.Scope = claim
	return l, nil
}

// egressAllows makes sure the sidecar's egress proxy allows every host
// the attempt was started to reach.
func egressAllows(f sidecar.Fences, hosts []string) error {
	if len(hosts) == 0 {
		return nil
	}
	if f.Egress == "" {
		return &FieldError{Field: "AllowHosts", Value: strings.Join(hosts, ", "), Err: errors.New("the sidecar serves no egress proxy (it predates it, or never answered): the command could reach no host")}
	}
	for _, h := range hosts {
		want, err := egress.ParseRule(h)
		if err != nil {
			return fieldInvalid("AllowHosts", h, err)
		}
		hp, _ := egress.HostPort(h)
		if !slices.Contains(f.EgressInject, hp) && !slices.ContainsFunc(f.EgressAllow, func(s string) bool {
			r, err := egress.ParseRule(s)
			return err == nil && r.Covers(want)
		}) {
			return fieldInvalid("AllowHosts", h, fmt.Errorf("%w (it allows: %s)", ErrHostNotAllowed, strings.Join(f.EgressAllow, ", ")))
		}
	}
	return nil
}
