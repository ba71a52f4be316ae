package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/attempt"
	"github.com/fenceline/fenceline/internal/lograte"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// What run does when the lease is lost while the agent runs (--on-lost).
const (
	onLostKeep   = "keep"   // the agent runs on; every write is refused
	onLostSignal = "signal" // SIGTERM to the agent's process group, exit 4
)

// runFlags are the flags of fenceline run.
type runFlags struct {
	checkout       string     // --checkout: the local checkout the agent works in
	lf             leaseFlags // lf.repo: --repo, then the checkout's identity
	ff             fenceFlags
	attachID, cred string
	allowUnguarded bool
	allowConnect   []string
	ports          []uint16 // --allow-connect, parsed by check
	allowBind      []string
	bindPorts      []uint16 // --allow-bind, parsed by check
	allowWrite     []string
	privateState   []string // --private-state
	onLost         string
	killGrace      time.Duration
	// commit is "fenceline shard commit": serialized or exclusive commit
	// capacity on the shard commitShard; "" for fenceline run.
	commit, commitShard string
}

func (a *app) runCommand() *cobra.Command {
	var rf runFlags
	c := &cobra.Command{
		Use:   "run --checkout PATH [--scope P ... | --whole-repo] [--workspace shared|exclusive] [--git-upstream URL] -- CMD [ARGS...]",
		Short: "Run an agent's command under a lease, behind its fences",
		Long: `Acquire a lease on a local checkout (or attach to one with --lease), keep it
alive, serve the fences the agent is routed through, and run CMD under the
file-write guard; when CMD and every process it started are gone, release
the lease. The exit status is CMD's (128+N when a signal N killed it).

The lease's repo is the checkout's origin URL, normalized (credentials,
scheme, a trailing .git and slash dropped; git@host:org/repo becomes
host/org/repo), or the checkout's absolute path without an origin. The
checkout itself is the repo's one workspace ("checkout"):
  no claim flags          exclusive workspace claiming no paths: the agent
                          writes the whole checkout and its git dir
  --scope P ...           shared workspace: the agent writes only beneath
                          its claimed paths, never the git dir; repo-wide
                          git (commit, stash, checkout, ...) is refused
  --scope P --workspace exclusive
                          claimed paths plus the git dir (commit, push)
  --whole-repo            every path and the git dir
Claimed directories that do not exist yet are created (the kernel confines
writes to existing paths).

With a shard pool declared for the repo ("fenceline shard pool"), the
attempt works in one of its shards (git worktrees) instead of the checkout:
the lease service places it in the first shard that fits — an exclusive
attempt in an empty shard, cleaned before it starts and after it settled
(commits and files it leaves are kept as refs/fenceline/attempts/<id>);
path leases beside others whose claims are disjoint, up to the pool's
--max-sharers. With every shard busy, run queues up to --wait, else exits 3
naming the pool size and who holds each shard. The attempt is recorded on
the bus ("fenceline shard list") and settled before its lease is released.

The guard (Landlock, and a seccomp supervisor for what changes at run time)
also hides fenceline's state dir (lease credentials) and the sidecar's
files from the agent, and lets it open TCP connections only to the
sidecar's fences, its egress proxy and --allow-connect ports, and listen
only on ports the kernel chooses (port 0) and --allow-bind ports. With
--git-upstream, the agent's unmodified git reaches that server only through
the git fence, which serves only that repository's smart-HTTP endpoints
(the upstream header goes nowhere else; anything else on the host is 403).

--private-state PATH (a CLI's state in your HOME: ~/.claude, ~/.claude.json,
~/.codex) gives the agent a private HOME holding a copy of each PATH, which
it may write while your own stay read-only to it. When the attempt
settles, run names every setting the agent changed there that would run a
program or widen what runs at the CLI's next start (hooks, MCP servers,
notify, statusLine, apiKeyHelper, env, permissions, ...) and discards the
copy: nothing the agent writes there reaches your next unguarded run.
Prefer it to --allow-write on a CLI's state dir.

Other hosts (a model's API) are reached through the egress proxy, which
the agent's HTTPS_PROXY/HTTP_PROXY point at (loopback stays direct through
NO_PROXY): hosts named by --allow-host are tunnelled untouched (TLS end to
end), the git upstream's host goes to the git fence, and every other host
is refused with 403 naming it, the lease and the flag to add, in the audit
trail and on stderr. A tool that ignores the proxy variables (Node 20's
fetch, a static binary) has its connects handed to the same proxy by the
guard, judged by the TLS server name or HTTP Host it sends; names resolve
over TCP DNS the proxy answers for allowed hosts only (RES_OPTIONS=use-vc:
glibc's resolver; Go's own and musl's ask over UDP and get no answer).

If the lease is lost (revoked, expired, bus unreachable past its margin),
every file write and push of the agent is refused from then on while reads
go on; with --on-lost signal the agent is also stopped (exit 4).

On SIGTERM or Ctrl-C the agent's process group gets SIGTERM, and after
--kill-grace every process it started gets SIGKILL; the lease is released
only once all of them are gone. A runner killed outright leaves its lease
to expire after its ttl; the lease service then reclaims it.

Without Landlock (Linux < 5.13, or disabled) run refuses to start unless
--allow-unguarded.`,
		Example: `  fenceline run --checkout . --scope services/billing -- codex exec "fix the invoice rounding"
  fenceline run --checkout ~/src/payments --git-upstream https://git.internal/acme/payments.git -- make release
  fenceline run --checkout . --scope services/billing --workspace exclusive --on-lost signal -- ./agent.sh
  fenceline run --checkout . --scope services/billing --allow-host api.openai.com --private-state ~/.codex -- codex exec "add a test"`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return fmt.Errorf("%s needs the command to run after --, e.g. fenceline run --checkout . --scope services/billing -- make test", cmd.CommandPath())
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runAgent(cmd.Context(), &rf, args)
		},
	}
	f := c.Flags()
	f.StringVar(&rf.checkout, "checkout", "", "local checkout the agent works in (default --repo, when it is one); the lease's repo is its normalized origin URL, else its absolute path")
	rf.lf.register(f, a.cfg.User)
	f.Lookup("repo").Usage = repoWithCheckoutUsage
	rf.ff.register(c)
	f.StringVar(&rf.attachID, "lease", "", "attach to this lease instead of acquiring one (it is not released at the end)")
	f.StringVar(&rf.cred, "credential", "", "owner credential of --lease (default: this machine's credential file)")
	f.BoolVar(&rf.allowUnguarded, "allow-unguarded", false, "run even when the kernel cannot confine file writes (no Landlock): only the fences protect anything then")
	f.StringArrayVar(&rf.allowConnect, "allow-connect", nil, "TCP port the agent may connect to directly besides the sidecar's (repeatable); for HTTP(S) hosts use --allow-host: a port opens every host on it, past the git fence")
	f.StringArrayVar(&rf.allowBind, "allow-bind", nil, "fixed TCP port the agent may listen on, e.g. a dev server's (repeatable); a port the kernel chooses (port 0, test servers) needs none; the sidecar's ports cannot be allowed")
	f.StringArrayVar(&rf.allowWrite, "allow-write", nil, "existing path the agent may write besides its claim, e.g. a build cache (repeatable)")
	registerPrivateState(f, &rf.privateState)
	f.StringVar(&rf.onLost, "on-lost", onLostKeep, "when the lease is lost: keep (the agent runs on, its writes refused) or signal (SIGTERM its processes; exit 4)")
	f.DurationVar(&rf.killGrace, "kill-grace", 10*time.Second, "how long the agent's processes have between SIGTERM and SIGKILL when it is stopped")
	f.SetInterspersed(false) // everything after CMD is CMD's
	c.MarkFlagsMutuallyExclusive("scope", "whole-repo")
	groupFlags(c, runFlagGroups)
	return c
}

// check validates the flags that need no checkout or bus.
func (rf *runFlags) check() error {
	if strings.TrimSpace(rf.checkout) == "" && strings.TrimSpace(rf.lf.repo) == "" {
		return usagef("--checkout is required: name the local checkout the agent works in, e.g. --checkout .")
	}
	if rf.onLost != onLostKeep && rf.onLost != onLostSignal {
		return usagef("--on-lost %q: want keep or signal", rf.onLost)
	}
	if rf.killGrace <= 0 {
		return usagef("--kill-grace %s: want a positive duration", rf.killGrace)
	}
	if rf.attachID != "" && (len(rf.lf.paths) > 0 || rf.lf.wholeRepo || len(rf.lf.tables) > 0 || rf.lf.workspace != "" || rf.lf.workspaceID != "") {
		return usagef("--lease %s attaches to an existing lease, whose claim and workspace are given: drop --scope, --whole-repo, --table, --workspace and --workspace-id", rf.attachID)
	}
	if rf.attachID != "" {
		if err := checkLeaseID(rf.attachID); err != nil {
			return err
		}
	}
	ports, err := attempt.Ports("--allow-connect", rf.allowConnect)
	if err != nil {
		return err
	}
	rf.ports = ports
	rf.bindPorts, err = attempt.Ports("--allow-bind", rf.allowBind)
	return err
}

// repoWithCheckoutUsage is --repo's help on a command that works in a
// local checkout.
const repoWithCheckoutUsage = "repository: its identity, a remote URL or a local checkout; without --checkout, the local checkout to work in, and with it, the repository the checkout must be of"

// localCheckout resolves the local checkout a command works in: --checkout,
// else --repo, which then must name one (the contract's "run --repo
// PATH"). --repo names a repository in every command; given with
// --checkout, it must name the checkout's.
func localCheckout(ctx context.Context, checkout, repo string) (*attempt.Checkout, error) {
	if checkout == "" {
		if _, err := os.Stat(repo); errors.Is(err, fs.ErrNotExist) {
			return nil, usagef("--repo %s is no local checkout, and this command works in one: pass it with --checkout PATH (--repo may stay, naming the repository the checkout must be of)", shownRepo(repo))
		}
		co, err := attempt.FindCheckout(ctx, repo)
		if err != nil {
			return nil, fmt.Errorf("--repo %w", err)
		}
		return co, nil
	}
	co, err := attempt.FindCheckout(ctx, checkout)
	if err != nil {
		return nil, fmt.Errorf("--checkout %w", err)
	}
	if repo != "" {
		id, err := resolveRepoFlag(ctx, repo)
		if err != nil {
			return nil, err
		}
		if id != co.Repo {
			return nil, usagef("--repo %s is %s, but --checkout %s is a checkout of %s", shownRepo(repo), id, checkout, co.Repo)
		}
	}
	return co, nil
}

// runAgent is fenceline run: lease, fences, guarded command, settle,
// release — in that order, and undone in reverse.
func (a *app) runAgent(ctx context.Context, rf *runFlags, argv []string) error {
	if err := rf.check(); err != nil {
		return err
	}
	if _, err := exec.LookPath(argv[0]); err != nil {
		return fmt.Errorf("command %s: %w", argv[0], err) // before the lease, not after
	}
	co, err := localCheckout(ctx, rf.checkout, rf.lf.repo)
	if err != nil {
		return err
	}
	extra, err := attempt.RealPaths("--allow-write", rf.allowWrite)
	if err != nil {
		return err
	}
	state, err := privateState(a.cfg.Home, rf.privateState, extra)
	if err != nil {
		return err
	}
	if len(rf.ff.gitHeaders) > 0 {
		fmt.Fprintf(a.stderr, "fenceline: warning: the agent can read this process's command line, --git-upstream-header included; pass upstream credentials in FENCELINE_GIT_UPSTREAM_HEADER instead\n")
	}
	if warn, err := attempt.CheckGuard(argv[0], rf.allowUnguarded); err != nil {
		return unguardedHint(err)
	} else if warn != nil {
		fmt.Fprintf(a.stderr, "fenceline: WARNING: %v\nfenceline: WARNING: running %s UNGUARDED (--allow-unguarded): its file writes are NOT confined to the lease and it may connect anywhere\n", warn, argv[0])
	}
	var req leasebus.AcquireRequest
	if rf.attachID == "" {
		rf.lf.repo = co.Repo
		if rf.lf.attempt == "" {
			rf.lf.attempt = lease.NewAttemptID() // the attempt record's id, when there is a pool
		}
		if len(rf.lf.paths) == 0 && !rf.lf.wholeRepo && rf.lf.workspace == "" {
			rf.lf.workspace = string(lease.WorkspaceExclusive) // no claim: the checkout to itself
		}
		if req, err = rf.lf.request(); err != nil {
			return err // a usage error, before the bus is dialed
		}
		for _, rel := range req.Scope.Paths {
			if _, err := attempt.ClaimPath(co.Root, rel); err != nil {
				return &usageError{err: err}
			}
		}
	}
	if err := rf.ff.check(co.Repo, a.fenceEnv()); err != nil { // every fence flag, before the bus is dialed
		return err
	}

	out, errw := a.outputs()
	say := func(line string) { fmt.Fprintf(errw, "fenceline: %s\n", line) }
	identity := "" // attached: the lease's acquirer's credentials (the lease is bound to its identity)
	if rf.attachID == "" {
		identity = "run-" + rf.lf.attempt
	}
	s, err := a.dialHolder(identity)
	if err != nil {
		return err
	}
	defer s.Close()
	pf := policyFlags(req, &rf.ff, co.Root, extra)
	pf.Attached = rf.attachID != ""
	pol, stopPolicy, err := a.followPolicy(ctx, s, co.Repo, pf)
	if err != nil {
		return err // a flag the policy forbids: before any lease
	}
	defer stopPolicy()
	pool, err := a.findPool(ctx, s, rf, co)
	if err != nil {
		return err
	}
	var held *heldLease
	if pool != nil {
		held, err = a.holdPoolLease(ctx, s, rf, pool)
	} else {
		held, err = a.holdLease(ctx, s, &rf.lf, rf.attachID, leasebus.Credential(rf.cred))
	}
	if err != nil {
		return err
	}
	l := held.holder.Lease()
	verb := "acquired"
	if held.holder.Attached() {
		verb = "attached"
	}
	say(fmt.Sprintf("lease %s %s: repo %s, scope %s, workspace %s (%s), fence %d, ttl %s",
		l.LeaseID, verb, l.Repo, l.Scope, l.WorkspaceID, l.WorkspaceMode, l.Fence, l.TTL))

	spec := attempt.Spec{
		Argv: argv, Checkout: co, Pool: pool, Holder: held.holder, FencelineStateDir: a.stateDir,
		AllowWrite: extra, AllowPorts: rf.ports, AllowBind: rf.bindPorts, State: state,
		StopOnLost: rf.onLost == onLostSignal, KillGrace: rf.killGrace, AllowUnguarded: rf.allowUnguarded,
		Stdout: out, Stderr: errw, Say: say, Policy: pol,
	}
	var res attempt.Result
	if err = a.prepareAttempt(rf, s, held, &spec); err == nil {
		res, err = attempt.Run(ctx, spec)
		err = attemptError(err)
	}
	why := "the agent never started"
	if res.Started {
		why = fmt.Sprintf("the agent exited %d and its processes are gone", res.Code)
	}
	a.finishLease(ctx, held, say, res.StateDir, rf.ff.stateDir == "", why)

	switch {
	case err != nil:
		return err
	case res.StoppedOnLost:
		_, why := held.holder.State()
		return &exitError{code: ExitLost, err: fmt.Errorf("%v; the agent was stopped (--on-lost signal) and exited %d", why, res.Code)}
	case res.Code != 0:
		return &exitError{code: res.Code, err: errReported}
	}
	return nil
}

// prepareAttempt checks the held lease fits the checkout and completes
// spec with the bus's auditor and the fences' configuration.
func (a *app) prepareAttempt(rf *runFlags, s *session, held *heldLease, spec *attempt.Spec) error {
	l, co := held.holder.Lease(), spec.Checkout
	if held.holder.Attached() && l.Repo != co.Repo {
		return fmt.Errorf("lease %s is for repo %s, but the checkout %s is %s: attach to a lease of this checkout's repo", l.LeaseID, l.Repo, co.Root, co.Repo)
	}
	audit, err := leasebus.NewAuditor(s.nc)
	if err != nil {
		return err
	}
	fenceLog := lograte.New(slog.NewTextHandler(spec.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}), lograte.Options{})
	defer fenceLog.Close() // last: its counts said, and no timer writes to stderr after the run
	log := slog.New(fenceLog)
	cfg, err := rf.ff.config(held, s, audit, log)
	if err != nil {
		return err
	}
	cfg.Policy = spec.Policy
	spec.Audit, spec.Sidecar = audit, cfg
	spec.Hide = append(rf.ff.secretFiles(), a.credsToHide()...) // after config: it may read a default secret file
	// A local bus that restarts must not find the agent on its port.
	spec.Reserve = attempt.LocalPorts(strings.Join(s.nc.Servers(), ","))
	return nil
}

// finishLease gives the lease back (once the attempt settled) and says
// so; a sidecar state dir of its own (ownState) goes with it.
func (a *app) finishLease(ctx context.Context, held *heldLease, say func(string), stateDir string, ownState bool, why string) {
	l := held.holder.Lease()
	state, lostWhy := held.holder.State()
	ferr := held.finish(ctx)
	if stateDir != "" && ownState {
		os.RemoveAll(stateDir) // the default one is this lease's alone
	}
	switch {
	case held.holder.Attached():
		say(fmt.Sprintf("lease %s no longer renewed here (%s); its owner releases it", l.LeaseID, why))
	case state == lease.Lost:
		say(fmt.Sprintf("lease %s ended before the agent did (%v); nothing to release", l.LeaseID, lostWhy))
	case ferr != nil:
		say(fmt.Sprintf("lease %s not released: %v; it expires within its ttl (%s) and is then reclaimed", l.LeaseID, ferr, l.TTL))
	default:
		say(fmt.Sprintf("lease %s released (%s)", l.LeaseID, why))
	}
}

// outputs returns the streams the agent and run's messages share. A
// writer that is not a file (a test's buffer) is locked, since the agent's
// output is copied into it while run writes its own lines.
func (a *app) outputs() (stdout, stderr io.Writer) {
	var mu sync.Mutex
	wrap := func(w io.Writer) io.Writer {
		if _, ok := w.(*os.File); ok {
			return w
		}
		return &lockedWriter{mu: &mu, w: w}
	}
	return wrap(a.stdout), wrap(a.stderr)
}

type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// attemptFlag is the flag (without dashes) that fills each field of
// attempt.Spec and attempt.PodSpec an attempt.FieldError may name.
var attemptFlag = map[string]string{
	"Paths":              "scope",
	"Workspace":          "workspace",
	"AllowHosts":         "allow-host",
	"Sidecar.PGUpstream": "pg-upstream",
}

// attemptError reports an attempt's FieldError under the flag that
// filled its field; whether it is a usage error stays the attempt's to
// say (attempt.ErrInvalid).
func attemptError(err error) error {
	var fe *attempt.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	flag, ok := attemptFlag[fe.Field]
	if !ok {
		return err
	}
	name := "--" + flag
	if fe.Value != "" {
		name += " " + fe.Value
	}
	if errors.Is(fe.Err, attempt.ErrHostNotAllowed) {
		return fmt.Errorf("%s: %w; start the sidecar with --allow-host %s", name, fieldOnly{fe}, fe.Value)
	}
	return fmt.Errorf("%s: %w", name, fieldOnly{fe})
}

// fieldOnly is a FieldError that reads as its error alone (the flag that
// names its field is said before it) and still matches what it matches.
type fieldOnly struct{ fe *attempt.FieldError }

func (f fieldOnly) Error() string { return f.fe.Err.Error() }
func (f fieldOnly) Unwrap() error { return f.fe }

// unguardedHint says which flag runs an agent without the file-write
// guard when attempt.CheckGuard refuses.
func unguardedHint(err error) error {
	return fmt.Errorf("%w; pass --allow-unguarded to run it without a file-write guard (the agent could then write anywhere it may)", err)
}
