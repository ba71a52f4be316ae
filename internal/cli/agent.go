package cli

import (
	"context"
	"fmt"
	"net/url"
	"path/filepath"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/attempt"
	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/sidecar"
)

// agentFlags are the flags of fenceline agent.
type agentFlags struct {
	sidecar, tokenFile, checkout string
	root                         string // --root, the old name of --checkout
	paths                        []string
	workspace                    string
	allowWrite, allowConnect     []string
	privateState                 []string
	ports                        []uint16 // --allow-connect, parsed by check
	allowBind                    []string
	bindPorts                    []uint16 // --allow-bind, parsed by check
	allowHosts                   []string
	grace, wait, killGrace       time.Duration
	allowUnguarded, operator     bool
	logFormat                    string
}

func (a *app) agentCommand() *cobra.Command {
	var af agentFlags
	c := &cobra.Command{
		Use:   "agent --sidecar URL --checkout PATH [--scope P ...] [--workspace shared|exclusive] -- CMD [ARGS...]",
		Short: "Run the agent container's command under the file-write guard, lease state from the sidecar",
		Long: `The agent container's entrypoint wrapper in a pod: it runs CMD under the
file-write guard (Landlock, and a seccomp supervisor for what changes at run
time), with the lease state taken from the fenceline sidecar's admin API
(GET /api/v1/lease/events, server-sent events). It needs no bus access.

Writes are allowed only while the sidecar's last word is that the lease is
held and it arrived within --grace. While the lease is unknown or lost, the
stream is broken longer than --grace, or the sidecar was never reached,
every write-class call of the agent fails with EACCES (fail closed); reads go
on. Each denial is recorded as an audit event through the sidecar.

What the agent may write beneath --checkout: the lease's claim as the sidecar
reports it, or --scope paths (each inside the lease's claim):
  shared workspace      the claimed paths; never the git dir (git shim)
  exclusive workspace   the claimed paths and the git dir; the whole checkout
                        when the lease claims no paths
plus --allow-write paths, and a private HOME holding a copy of each
--private-state path (as in fenceline run: discarded at the end, what the
agent changed there named). TCP connects: the sidecar's fences (its git and
Postgres fences, whose addresses the agent's git and libpq are pointed at),
its egress proxy (HTTPS_PROXY/HTTP_PROXY; it tunnels the hosts the sidecar
allows with its --allow-host and refuses the rest; a connect elsewhere is
handed to it and judged by the name the stream carries) and --allow-connect
ports; never the admin port. CMD listens only on ports the kernel chooses
(port 0) and --allow-bind ports, never on the admin port or a fence's: the
agent shares the pod's network namespace, and after a sidecar restart the
wrapper would ask whoever listens there. --allow-host here names hosts CMD needs: the
wrapper refuses to start when the sidecar's proxy does not allow one of
them, rather than leaving CMD to fail on it later.

The wrapper waits up to --wait for the sidecar before starting CMD; without
it CMD starts anyway with every write denied until the stream is up.

On SIGTERM, CMD's process group gets SIGTERM and, after --kill-grace, every
process it started SIGKILL; once all are gone the wrapper reports the attempt
settled to the sidecar (POST /api/v1/settled), which then releases the lease.
The exit status is CMD's (128+N when signal N killed it).`,
		Example: `  fenceline agent --sidecar http://127.0.0.1:9090 --token-file /run/fenceline/admin-token \
    --checkout /workspace -- codex exec "fix the invoice rounding"`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return fmt.Errorf("%s needs the command to run after --, e.g. fenceline agent --sidecar http://127.0.0.1:9090 --checkout /workspace -- make test", cmd.CommandPath())
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runAgentWrapper(cmd.Context(), &af, args)
		},
	}
	f := c.Flags()
	f.StringVar(&af.sidecar, "sidecar", "", "base URL of the sidecar's admin server, e.g. http://127.0.0.1:9090 (required)")
	f.StringVar(&af.tokenFile, "token-file", "", "file holding the admin API's bearer token (env "+sidecar.EnvAdminToken+"); hidden from CMD")
	f.StringVar(&af.checkout, "checkout", "", "the checkout CMD works in (required)")
	f.StringVar(&af.root, "root", "", "old name of --checkout")
	// Hidden, not cobra-deprecated: cobra would print its notice to
	// stdout, which is CMD's.
	_ = f.MarkHidden("root")
	f.StringArrayVar(&af.paths, "scope", nil, "repo-relative path CMD may write, inside the lease's claim (repeatable; default the lease's claim)")
	f.StringVar(&af.workspace, "workspace", "", "shared or exclusive (default the lease's; without a lease: shared with --scope, else exclusive)")
	f.StringArrayVar(&af.allowWrite, "allow-write", nil, "existing path CMD may write besides its claim, e.g. a build cache (repeatable)")
	registerPrivateState(f, &af.privateState)
	f.StringArrayVar(&af.allowConnect, "allow-connect", nil, "TCP port CMD may connect to directly besides the sidecar's fences (repeatable); for HTTP(S) hosts use the sidecar's --allow-host: a port opens every host on it")
	f.StringArrayVar(&af.allowBind, "allow-bind", nil, "fixed TCP port the agent may listen on, e.g. a dev server's (repeatable); a port the kernel chooses (port 0, test servers) needs none; the sidecar's ports cannot be allowed")
	f.StringArrayVar(&af.allowHosts, "allow-host", nil, "host CMD needs through the sidecar's egress proxy (as the sidecar's --allow-host); the wrapper checks the sidecar allows it (repeatable)")
	f.DurationVar(&af.grace, "grace", 2*time.Second, "how long writes go on after the sidecar's last word that the lease is held (keep it well below the lease ttl's margin)")
	f.DurationVar(&af.wait, "wait", 30*time.Second, "how long to wait for the sidecar before starting CMD with writes denied")
	f.DurationVar(&af.killGrace, "kill-grace", 10*time.Second, "how long CMD's processes have between SIGTERM and SIGKILL when it is stopped")
	f.BoolVar(&af.operator, "operator", false, "an operator's shell beside the agent (kubectl exec ... -- fenceline agent --operator ... -- sh): guarded like the agent, but it reports no settle to the sidecar (the agent's own wrapper does)")
	f.BoolVar(&af.allowUnguarded, "allow-unguarded", false, "run even when the kernel cannot confine file writes (no Landlock)")
	f.StringVar(&af.logFormat, "log-format", "json", "log format on stderr: json or text")
	f.SetInterspersed(false)
	return c
}

func (af *agentFlags) check() error {
	u, err := url.Parse(af.sidecar)
	if af.sidecar == "" || err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return usagef("--sidecar %q: want the sidecar's admin URL, e.g. http://127.0.0.1:9090", af.sidecar)
	}
	if af.root != "" {
		if af.checkout != "" && !samePath(af.checkout, af.root) {
			return usagef("--root is the old name of --checkout, and they differ: drop --root")
		}
		af.checkout = af.root
	}
	if strings.TrimSpace(af.checkout) == "" {
		return usagef("--checkout is required: name the checkout the agent works in")
	}
	if af.workspace != "" && af.workspace != string(lease.WorkspaceShared) && af.workspace != string(lease.WorkspaceExclusive) {
		return usagef("--workspace %q: want shared or exclusive", af.workspace)
	}
	if af.grace <= 0 || af.killGrace <= 0 || af.wait < 0 {
		return usagef("--grace and --kill-grace must be positive, --wait not negative")
	}
	if af.ports, err = attempt.Ports("--allow-connect", af.allowConnect); err != nil {
		return err
	}
	if af.bindPorts, err = attempt.Ports("--allow-bind", af.allowBind); err != nil {
		return err
	}
	if _, err := egress.ParseRules(af.allowHosts); err != nil {
		return usagef("--allow-host: %v", err)
	}
	return nil
}

// runAgentWrapper is fenceline agent: stream, policy, guarded command,
// settle report (package attempt, RunInPod).
func (a *app) runAgentWrapper(ctx context.Context, af *agentFlags, argv []string) error {
	if err := af.check(); err != nil {
		return err
	}
	log, err := newLogger(a.stderr, af.logFormat)
	if err != nil {
		return err
	}
	if af.root != "" {
		log.Warn("--root is deprecated: use --checkout (the same meaning as in run and shard)")
	}
	token, err := readToken(af.tokenFile, a.cfg.AdminToken)
	if err != nil {
		return err
	}
	co, err := localCheckout(ctx, af.checkout, "")
	if err != nil {
		return err
	}
	extra, err := attempt.RealPaths("--allow-write", af.allowWrite)
	if err != nil {
		return err
	}
	state, err := privateState(a.cfg.Home, af.privateState, extra)
	if err != nil {
		return err
	}
	if warn, err := attempt.CheckGuard(argv[0], af.allowUnguarded); err != nil {
		return unguardedHint(err)
	} else if warn != nil {
		log.Warn("running UNGUARDED (--allow-unguarded): file writes are not confined", "err", warn)
	}
	out, errw := a.outputs()
	res, err := attempt.RunInPod(ctx, attempt.PodSpec{
		Argv: argv, Checkout: co,
		SidecarURL: af.sidecar, Token: token, Grace: af.grace, Wait: af.wait,
		Paths: af.paths, Workspace: lease.WorkspaceMode(af.workspace), AllowHosts: af.allowHosts,
		AllowWrite: extra, AllowPorts: af.ports, AllowBind: af.bindPorts, State: state,
		Hide:      append([]string{af.tokenFile}, a.credsToHide()...),
		KillGrace: af.killGrace, AllowUnguarded: af.allowUnguarded, Operator: af.operator,
		Stdout: out, Stderr: errw, Log: log, FencelineStateDir: a.stateDir,
	})
	switch {
	case err != nil:
		return attemptError(err)
	case res.Code != 0:
		return &exitError{code: res.Code, err: errReported}
	}
	return nil
}

// samePath reports whether a and b name the same path (made absolute and
// clean; not resolved).
func samePath(a, b string) bool {
	aa, err1 := filepath.Abs(a)
	bb, err2 := filepath.Abs(b)
	return err1 == nil && err2 == nil && aa == bb
}
