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
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/gitsafe"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
	"github.com/fenceline/fenceline/sidecar"
)

// What run does when the lease is lost while the agent runs (--on-lost).
const (
	onLostKeep   = "keep"   // the agent runs on; every write is refused
	onLostSignal = "signal" // SIGTERM to the agent's process group, exit 4
)

// runFlags are the flags of fenceline run.
type runFlags struct {
	lf             leaseFlags // --repo is the checkout's path here
	ff             fenceFlags
	attachID, cred string
	allowUnguarded bool
	allowConnect   []string
	allowWrite     []string
	onLost         string
	killGrace      time.Duration
	// commit is "fenceline shard commit": serialized or exclusive commit
	// capacity on the shard commitShard; "" for fenceline run.
	commit, commitShard string
}

func (a *app) runCommand() *cobra.Command {
	var rf runFlags
	c := &cobra.Command{
		Use:   "run --repo PATH [--scope P ... | --whole-repo] [--workspace shared|exclusive] [--git-upstream URL] -- CMD [ARGS...]",
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
sidecar's fences, its egress proxy and --allow-connect ports. With
--git-upstream, the agent's unmodified git reaches that server only through
the git fence.

Other hosts (a model's API) are reached through the egress proxy, which
the agent's HTTPS_PROXY/HTTP_PROXY point at (loopback stays direct through
NO_PROXY): hosts named by --allow-host are tunnelled untouched (TLS end to
end), the git upstream's host goes to the git fence, and every other host
is refused with 403 naming it, the lease and the flag to add, in the audit
trail and on stderr.

If the lease is lost (revoked, expired, bus unreachable past its margin),
every file write and push of the agent is refused from then on while reads
go on; with --on-lost signal the agent is also stopped (exit 4).

On SIGTERM or Ctrl-C the agent's process group gets SIGTERM, and after
--kill-grace every process it started gets SIGKILL; the lease is released
only once all of them are gone. A runner killed outright leaves its lease
to expire after its ttl; the lease service then reclaims it.

Without Landlock (Linux < 5.13, or disabled) run refuses to start unless
--allow-unguarded.`,
		Example: `  fenceline run --repo . --scope services/billing -- codex exec "fix the invoice rounding"
  fenceline run --repo ~/src/payments --git-upstream https://git.internal/acme/payments.git -- make release
  fenceline run --repo . --scope services/billing --workspace exclusive --on-lost signal -- ./agent.sh
  fenceline run --repo . --scope services/billing --allow-host api.openai.com -- codex exec "add a test"`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return fmt.Errorf("%s needs the command to run after --, e.g. fenceline run --repo . --scope services/billing -- make test", cmd.CommandPath())
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runAgent(cmd.Context(), &rf, args)
		},
	}
	f := c.Flags()
	rf.lf.register(f)
	f.Lookup("repo").Usage = "local checkout the agent works in (required); the lease's repo is its normalized origin URL, else its absolute path"
	rf.ff.register(c)
	f.StringVar(&rf.attachID, "lease", "", "attach to this lease instead of acquiring one (it is not released at the end)")
	f.StringVar(&rf.cred, "credential", "", "owner credential of --lease (default: this machine's credential file)")
	f.BoolVar(&rf.allowUnguarded, "allow-unguarded", false, "run even when the kernel cannot confine file writes (no Landlock): only the fences protect anything then")
	f.StringArrayVar(&rf.allowConnect, "allow-connect", nil, "TCP port the agent may connect to directly besides the sidecar's (repeatable); for HTTP(S) hosts use --allow-host: a port opens every host on it, past the git fence")
	f.StringArrayVar(&rf.allowWrite, "allow-write", nil, "existing path the agent may write besides its claim, e.g. a build cache (repeatable)")
	f.StringVar(&rf.onLost, "on-lost", onLostKeep, "when the lease is lost: keep (the agent runs on, its writes refused) or signal (SIGTERM its processes; exit 4)")
	f.DurationVar(&rf.killGrace, "kill-grace", 10*time.Second, "how long the agent's processes have between SIGTERM and SIGKILL when it is stopped")
	f.SetInterspersed(false) // everything after CMD is CMD's
	c.MarkFlagsMutuallyExclusive("scope", "whole-repo")
	groupFlags(c, runFlagGroups)
	return c
}

// check validates the flags that need no checkout or bus.
func (rf *runFlags) check() error {
	if strings.TrimSpace(rf.lf.repo) == "" {
		return usagef("--repo is required: name the local checkout the agent works in, e.g. --repo .")
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
	if _, err := allowedPorts(rf.allowConnect); err != nil {
		return err
	}
	return nil
}

// allowedPorts parses --allow-connect ports.
func allowedPorts(allowConnect []string) ([]uint16, error) {
	var ps []uint16
	for _, s := range allowConnect {
		n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 16)
		if err != nil || n == 0 {
			return nil, usagef("--allow-connect %q: want a TCP port number (1-65535)", s)
		}
		ps = append(ps, uint16(n))
	}
	return ps, nil
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
	co, err := findCheckout(ctx, rf.lf.repo)
	if err != nil {
		return err
	}
	extra, err := existingPaths("--allow-write", rf.allowWrite)
	if err != nil {
		return err
	}
	if len(rf.ff.gitHeaders) > 0 {
		fmt.Fprintf(a.stderr, "fenceline: warning: the agent can read this process's command line, --git-upstream-header included; pass upstream credentials in FENCELINE_GIT_UPSTREAM_HEADER instead\n")
	}
	if _, err := fsguard.Available(); err != nil {
		if !rf.allowUnguarded {
			return fmt.Errorf("refusing to run %s: %w; pass --allow-unguarded to run it without a file-write guard (the agent could then write anywhere it may)", argv[0], err)
		}
		fmt.Fprintf(a.stderr, "fenceline: WARNING: %v\nfenceline: WARNING: running %s UNGUARDED (--allow-unguarded): its file writes are NOT confined to the lease and it may connect anywhere\n", err, argv[0])
	}
	if rf.attachID == "" {
		rf.lf.repo = co.repo
		if rf.lf.attempt == "" {
			rf.lf.attempt = leasebus.NewAttemptID() // the attempt record's id, when there is a pool
		}
		if len(rf.lf.paths) == 0 && !rf.lf.wholeRepo && rf.lf.workspace == "" {
			rf.lf.workspace = string(leasebus.WorkspaceExclusive) // no claim: the checkout to itself
		}
		req, err := rf.lf.request()
		if err != nil {
			return err // a usage error, before the bus is dialed
		}
		// The lease service compares claims as spelled; the disk decides
		// what they are. A claim through a symlink is refused before it
		// is asked for.
		for _, rel := range req.Scope.Paths {
			if _, err := claimPath(co.root, rel); err != nil {
				return &usageError{err: err}
			}
		}
	}
	if err := rf.ff.check(co.repo); err != nil { // every fence flag, before the bus is dialed
		return err
	}

	out, errw := a.outputs()
	s, err := a.dialHolder()
	if err != nil {
		return err
	}
	defer s.Close()
	pr, err := a.findPool(ctx, s, rf, co)
	if err != nil {
		return err
	}
	var held *heldLease
	if pr != nil {
		held, err = a.holdPoolLease(ctx, s, rf, pr)
	} else {
		held, err = a.holdLease(ctx, s, &rf.lf, rf.attachID, leasebus.Credential(rf.cred))
	}
	if err != nil {
		return err
	}
	r := &runner{a: a, rf: rf, co: co, held: held, s: s, errw: errw, pool: pr, argv: argv}
	return r.run(ctx, argv, extra, out)
}

// runner is one fenceline run between taking its lease and giving it back.
type runner struct {
	a    *app
	rf   *runFlags
	co   *checkout
	held *heldLease
	s    *session
	errw io.Writer // stderr, safe for concurrent use
	// pool is set when the run works in a shard of its repo's pool; co is
	// then the shard once placed, and home the checkout.
	pool *pooledRun
	home *checkout
	argv []string
	// gitSnap is the checkout's executable git configuration before an
	// exclusive attempt without a pool; settle restores it.
	gitSnap *shard.GitDirSnapshot
}

func (r *runner) say(format string, args ...any) {
	fmt.Fprintf(r.errw, "fenceline: "+format+"\n", args...)
}

func (r *runner) run(ctx context.Context, argv, extra []string, out io.Writer) (err error) {
	l := r.held.holder.Lease()
	verb := "acquired"
	if !r.held.acquired {
		verb = "attached"
	}
	r.say("lease %s %s: repo %s, scope %s, workspace %s (%s), fence %d, ttl %s",
		l.LeaseID, verb, l.Repo, l.Scope, l.WorkspaceID, l.WorkspaceMode, l.Fence, l.TTL)

	// Until the agent starts, a failure gives the lease back at once.
	started := false
	var sc *sidecar.Sidecar
	stateDir := r.rf.ff.stateDir
	defer func() {
		if started {
			return
		}
		if sc != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			sc.Close(dctx)
			cancel()
		}
		r.settle(ctx, -1, false)
		r.finish(ctx, stateDir, "the agent never started")
	}()

	if !r.held.acquired && l.Repo != r.co.repo {
		return fmt.Errorf("lease %s is for repo %s, but the checkout %s is %s: attach to a lease of this checkout's repo", l.LeaseID, l.Repo, r.co.root, r.co.repo)
	}
	if !l.Active() {
		return fmt.Errorf("lease %s: %w: it is %s (%s)", l.LeaseID, leasebus.ErrLeaseLost, l.Status, l.Reason)
	}
	audit, err := leasebus.NewAuditor(r.s.nc)
	if err != nil {
		return err
	}
	if r.pool != nil {
		if err := r.place(ctx, audit); err != nil {
			return err
		}
	} else if err := r.snapshotGitDirs(); err != nil {
		return err
	}
	log := slog.New(slog.NewTextHandler(r.errw, &slog.HandlerOptions{Level: slog.LevelWarn}))
	if len(r.rf.ff.gitObjects) == 0 && len(r.co.gitDirs) > 0 {
		// Thin packs the agent pushes resolve against its own objects.
		r.rf.ff.gitObjects = []string{r.co.gitDirs[len(r.co.gitDirs)-1]}
	}
	cfg, err := r.rf.ff.config(r.held, r.s, audit, log)
	if err != nil {
		return err
	}
	stateDir = cfg.StateDir
	if sc, err = sidecar.Start(ctx, cfg); err != nil {
		return err
	}
	if u := sc.GitURL(); u != "" {
		r.say("git fence %s -> %s (the agent's git goes through it)", u, r.rf.ff.gitUpstream)
	}
	if pa := sc.PGAddr(); pa != nil {
		r.say("postgres fence %s -> %s (PGHOST/PGPORT and DATABASE_URL point the agent at it)", pa, r.rf.ff.pgUpstream)
	}
	r.say("egress proxy %s (HTTPS_PROXY/HTTP_PROXY): %s", sc.EgressURL(), egressSummary(sc.Fences()))

	pol, created, err := guardPolicy(r.co, l, extra)
	if err != nil {
		return err
	}
	if r.pool != nil && r.pool.mode == shard.ModeCommitSerialized {
		// Commit capacity beside path leases: the git dirs, not the files.
		pol.Writable, pol.GitDirWritable, pol.GitShim = extra, true, false
	}
	for _, c := range created {
		r.say("created %s: the claim did not exist in the checkout, and writes are confined to existing paths", c)
	}
	env := agentEnv(sc, l)
	pol.Hidden = hiddenPaths(env, append([]string{cfg.StateDir, r.rf.ff.pgSecretFile, r.rf.ff.gitHookSecret}, r.a.credsToHide()...)...)
	if pol.ConnectPorts, err = r.connectPorts(sc); err != nil {
		return err
	}
	pol.KillGrace = r.rf.killGrace
	pol.AllowUnguarded = r.rf.allowUnguarded
	pol.Logger = slog.New(slog.NewTextHandler(r.errw, &slog.HandlerOptions{Level: slog.LevelError}))

	cmd, err := agentExec(r.co, r.home, argv, env, out, r.errw)
	if err != nil {
		return err
	}
	agentCtx, stopAgent := context.WithCancel(ctx)
	defer stopAgent()
	pr, err := fsguard.Start(agentCtx, pol, r.held.holder, audit, cmd)
	if err != nil {
		return err
	}
	started = true
	restoreTTY := foreground(pr.Pid())
	r.say("%s", guardSummary(r.co, pol, pr.Guarded()))

	w := &runWatch{r: r, pr: pr, sc: sc, stopAgent: stopAgent, done: make(chan struct{})}
	go w.watch(ctx)
	st, werr := pr.Wait() // every process of the attempt is gone
	<-w.done
	restoreTTY()

	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if cerr := sc.Close(dctx); cerr != nil {
		r.say("closing the fences: %v", cerr)
	}
	if n := pr.Denials(); n > 0 {
		r.say("%d file writes of the agent were refused after the lease was lost (each is in the audit trail)", n)
	}
	code := exitStatus(st)
	r.settle(ctx, code, ctx.Err() != nil)
	r.finish(ctx, stateDir, fmt.Sprintf("the agent exited %d and its processes are gone", code))

	switch {
	case werr != nil:
		return fmt.Errorf("supervise %s: %w", argv[0], werr)
	case w.lostStop.Load():
		_, why := r.held.holder.State()
		return &exitError{code: ExitLost, err: fmt.Errorf("%v; the agent was stopped (--on-lost signal) and exited %d", why, code)}
	case code != 0:
		return &exitError{code: code, err: errReported}
	}
	return nil
}

// finish gives the lease back (once the attempt settled) and says so.
func (r *runner) finish(ctx context.Context, stateDir, why string) {
	l := r.held.holder.Lease()
	state, lostWhy := r.held.holder.State()
	ferr := r.held.finish(ctx)
	if stateDir != "" && r.rf.ff.stateDir == "" {
		os.RemoveAll(stateDir) // the default one is this lease's alone
	}
	switch {
	case !r.held.acquired:
		r.say("lease %s no longer renewed here (%s); its owner releases it", l.LeaseID, why)
	case state == leasebus.Lost:
		r.say("lease %s ended before the agent did (%v); nothing to release", l.LeaseID, lostWhy)
	case ferr != nil:
		r.say("lease %s not released: %v; it expires within its ttl (%s) and is then reclaimed", l.LeaseID, ferr, l.TTL)
	default:
		r.say("lease %s released (%s)", l.LeaseID, why)
	}
}

// runWatch reacts to what happens while the agent runs: a lost lease, a
// cancelled run (SIGTERM, Ctrl-C), a second interrupt, a failed fence.
type runWatch struct {
	r         *runner
	pr        *fsguard.Process
	sc        *sidecar.Sidecar
	stopAgent context.CancelFunc
	lostStop  atomic.Bool // the agent was stopped because the lease was lost
	done      chan struct{}
}

func (w *runWatch) watch(ctx context.Context) {
	defer close(w.done)
	r := w.r
	lost, ctxDone, fenceErr := r.held.holder.Lost(), ctx.Done(), w.sc.Err()
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
			_, why := r.held.holder.State()
			if r.rf.onLost == onLostSignal {
				w.lostStop.Store(true)
				r.say("LEASE LOST: %v; every file write and push of the agent is refused from now on; stopping the agent (--on-lost signal): SIGTERM now, SIGKILL after %s", why, r.rf.killGrace)
				w.stopAgent()
			} else {
				r.say("LEASE LOST: %v; every file write and push of the agent is refused from now on, reads go on; the agent keeps running (--on-lost keep)", why)
			}
		case <-ctxDone:
			ctxDone = nil
			r.say("stopping: SIGTERM to the agent's processes, SIGKILL after %s; the lease is released once all are gone (interrupt again to kill them now)", r.rf.killGrace)
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

// agentExec is the agent's command, run in the checkout co: in the
// caller's directory when it lies in co (or, for a shard, the same
// directory of the shard when it lies in home, the checkout), else in co's
// root.
func agentExec(co, home *checkout, argv, env []string, out, errw io.Writer) (*exec.Cmd, error) {
	name := argv[0]
	if strings.Contains(name, "/") {
		abs, err := filepath.Abs(name)
		if err != nil {
			return nil, fmt.Errorf("command %s: %w", name, err)
		}
		name = abs
	}
	cmd := exec.Command(name, argv[1:]...)
	if cmd.Err != nil {
		return nil, fmt.Errorf("command %s: %w", argv[0], cmd.Err)
	}
	cmd.Dir = co.root
	if wd, err := os.Getwd(); err == nil {
		if real, err := filepath.EvalSymlinks(wd); err == nil && pathWithin(real, co.root) {
			cmd.Dir = real
		} else if err == nil && home != nil && pathWithin(real, home.root) {
			// The same directory in the shard, when it is there.
			rel, _ := filepath.Rel(home.root, real)
			if fi, err := os.Stat(filepath.Join(co.root, rel)); err == nil && fi.IsDir() {
				cmd.Dir = filepath.Join(co.root, rel)
			}
		}
	}
	cmd.Env = env
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, out, errw
	return cmd, nil
}

// connectPorts are the TCP ports the agent may connect to: the sidecar's
// fences and --allow-connect.
func (r *runner) connectPorts(sc *sidecar.Sidecar) ([]uint16, error) {
	ports, err := allowedPorts(r.rf.allowConnect)
	if err != nil {
		return nil, err
	}
	ports = append(ports, sc.Ports()...)
	slices.Sort(ports)
	return slices.Compact(ports), nil
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

// exitStatus is the shell's view of how a command ended: its exit code, or
// 128+N when signal N killed it.
func exitStatus(st *os.ProcessState) int {
	if st == nil {
		return ExitError
	}
	if ws, ok := st.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal())
	}
	return st.ExitCode()
}

// agentEnv is the agent's environment: this one, minus what only the
// sidecar may know, plus what routes its git through the fences.
func agentEnv(sc *sidecar.Sidecar, l leasebus.Lease) []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, envGitUpstreamHeader+"=") // the upstream credential
	})
	env = sc.AgentEnv(env)
	env = setEnvVar(env, "GIT_OPTIONAL_LOCKS", "0") // read-only git must not refresh the index
	return setEnvVar(env, "FENCELINE_LEASE_ID", l.LeaseID)
}

func setEnvVar(env []string, key, val string) []string {
	env = slices.DeleteFunc(env, func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
	return append(env, key+"="+val)
}

// hiddenPaths are what the agent may not read: fenceline's state dir (lease
// credentials, the embedded bus's store and its bus credentials, the
// Postgres fence secret, the sidecar's CA key and spooled packs) and the
// sidecar's other secrets (its state dir, a fence secret file kept
// elsewhere, bus credentials named by --creds) — except files the agent's
// env points git at (the local CA certificate of the forward proxy).
func hiddenPaths(env []string, secrets ...string) []string {
	var keep []string
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "GIT_CONFIG_VALUE_") && filepath.IsAbs(v) {
			keep = append(keep, filepath.Clean(v))
		}
	}
	var roots []string
	for _, p := range append([]string{leasebus.StateDir()}, secrets...) {
		if p == "" {
			continue
		}
		if abs, err := filepath.Abs(p); err == nil && !slices.ContainsFunc(roots, func(r string) bool { return pathWithin(abs, r) }) {
			roots = append(roots, abs)
		}
	}
	var hidden []string
	for _, root := range roots {
		hidden = append(hidden, hideExcept(topMissing(root), keep)...)
	}
	return hidden
}

// topMissing is p, or, when p's parent does not exist, its topmost missing
// ancestor: hiding that hides p once it is created, and the guard needs
// the directories above a hidden path to exist.
func topMissing(p string) string {
	for {
		parent := filepath.Dir(p)
		if parent == p {
			return p
		}
		if _, err := os.Lstat(parent); err == nil {
			return p
		}
		p = parent
	}
}

// hideExcept lists paths that hide root but for the paths in keep: root
// itself when none lies inside it, else every entry along the way that
// leads to none of them. Entries created later stay unreadable.
func hideExcept(root string, keep []string) []string {
	var inside []string
	for _, k := range keep {
		if k != root && pathWithin(k, root) {
			inside = append(inside, k)
		}
	}
	if len(inside) == 0 {
		return []string{root}
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return []string{root}
	}
	var out []string
	for _, e := range ents {
		p := filepath.Join(root, e.Name())
		switch {
		case slices.Contains(inside, p):
		case slices.ContainsFunc(inside, func(k string) bool { return pathWithin(k, p) }):
			out = append(out, hideExcept(p, inside)...)
		default:
			out = append(out, p)
		}
	}
	return out
}

// guardPolicy is the file-write guard a lease gives the agent in its
// checkout:
//
//	shared workspace, path claim     the claimed paths; not the git dir; git shim
//	exclusive workspace, path claim  the claimed paths and the git dir
//	exclusive, whole-repo or none    the whole checkout and the git dir
//
// plus extra (--allow-write). A claimed path that does not exist is
// created as a directory (Landlock grants rights only on existing paths);
// one that resolves outside the checkout, or into the git dir of a shared
// workspace, is refused. Hidden and ConnectPorts are the caller's.
func guardPolicy(co *checkout, l leasebus.Lease, extra []string) (p fsguard.Policy, created []string, err error) {
	p = fsguard.Policy{Root: co.root, GitDirs: co.gitDirs, Lease: l}
	shared := l.WorkspaceMode == leasebus.WorkspaceShared
	switch {
	case l.Scope.Kind == scope.KindPaths:
		for _, rel := range l.Scope.Paths {
			path, made, err := ensureClaimPath(co.root, rel)
			if err != nil {
				return p, nil, err
			}
			if shared {
				for _, g := range co.gitDirs {
					if pathWithin(path, g) || pathWithin(g, path) {
						return p, nil, fmt.Errorf("claim %s resolves to %s, which holds the git dir %s: a shared workspace never writes it; claim paths of the worktree", rel, path, g)
					}
				}
			}
			if made {
				created = append(created, rel)
			}
			p.Writable = append(p.Writable, path)
		}
	case shared:
		return p, nil, fmt.Errorf("lease %s: a shared workspace needs a path claim (it has %s); lease an exclusive workspace to write the whole checkout", l.LeaseID, l.Scope)
	default: // whole-repo, or an exclusive workspace claiming no paths
		p.Writable = []string{co.root}
	}
	p.Writable = append(p.Writable, extra...)
	p.GitDirWritable = !shared && len(co.gitDirs) > 0
	p.GitShim = shared && len(co.gitDirs) > 0
	return p, created, nil
}

// ensureClaimPath returns the path of the claim rel in root, creating it as
// a directory when it does not exist (see claimPath).
func ensureClaimPath(root, rel string) (path string, created bool, err error) {
	path, err = claimPath(root, rel)
	if err != nil {
		return "", false, err
	}
	if _, err := os.Lstat(path); err == nil {
		return path, false, nil
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		return "", false, fmt.Errorf("claim %s: create it: %w", rel, err)
	}
	// The guard checks again, on the descriptor it grants, that nothing
	// swapped a symlink in meanwhile.
	return path, true, nil
}

// claimPath is the path of the claim rel in the checkout root (real and
// absolute), provided the claim is what it says: whatever exists of it
// resolves to its own spelling. A symlink anywhere along it — to another
// agent's claim, or out of the checkout — would make the guard grant what
// the lease service never compared, so it is refused, naming what to
// claim instead.
func claimPath(root, rel string) (string, error) {
	path := filepath.Join(root, filepath.FromSlash(rel))
	if !pathWithin(path, root) {
		return "", fmt.Errorf("claim %s lies outside the checkout %s", rel, root)
	}
	existing := path
	for {
		_, err := os.Lstat(existing)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || existing == root {
			return "", fmt.Errorf("claim %s: %w", rel, err)
		}
		existing = filepath.Dir(existing)
	}
	real, err := filepath.EvalSymlinks(existing)
	if err != nil {
		return "", fmt.Errorf("claim %s: %w", rel, err)
	}
	if real == existing {
		return path, nil
	}
	spelled, _ := filepath.Rel(root, existing)
	if r, err := filepath.Rel(root, real); err == nil && pathWithin(real, root) {
		return "", fmt.Errorf("claim %s goes through a symlink: %s resolves to %s; a claim is judged by what it resolves to, so claim %s instead", rel, spelled, r, filepath.ToSlash(r))
	}
	return "", fmt.Errorf("claim %s goes through a symlink: %s resolves to %s, outside the checkout %s: refusing to make it writable", rel, spelled, real, root)
}

// existingPaths makes each path absolute and real; it must exist.
func existingPaths(flag string, ps []string) ([]string, error) {
	var out []string
	for _, p := range ps {
		abs, err := filepath.Abs(p)
		if err == nil {
			abs, err = filepath.EvalSymlinks(abs)
		}
		if err != nil {
			return nil, usagef("%s %s: %v (it must exist)", flag, p, err)
		}
		if abs == "/" {
			return nil, usagef("%s %s: the whole filesystem cannot be writable", flag, p)
		}
		out = append(out, abs)
	}
	return out, nil
}

// guardSummary says in one line what the guard lets the agent do.
func guardSummary(co *checkout, p fsguard.Policy, guarded bool) string {
	if !guarded {
		return "file guard: NONE (no Landlock): writes and connects are not confined; writes stop only when the lease is lost"
	}
	var ws []string
	for _, w := range p.Writable {
		if rel, err := filepath.Rel(co.root, w); err == nil && !strings.HasPrefix(rel, "..") {
			ws = append(ws, rel)
		} else {
			ws = append(ws, w)
		}
	}
	gitDir := "read-only"
	if p.GitDirWritable {
		gitDir = "writable"
	}
	ports := "none"
	if len(p.ConnectPorts) > 0 {
		var ss []string
		for _, n := range p.ConnectPorts {
			ss = append(ss, strconv.Itoa(int(n)))
		}
		ports = strings.Join(ss, ", ")
	}
	what := strings.Join(ws, ", ")
	if what == "" {
		what = "no files" // commit capacity: the git dirs only
	}
	return fmt.Sprintf("file guard: the agent writes %s in %s (git dir %s) and its own temp dir; TCP connects to ports: %s",
		what, co.root, gitDir, ports)
}

// pathWithin reports whether p is dir or lies beneath it (both absolute).
func pathWithin(p, dir string) bool {
	p, dir = filepath.Clean(p), filepath.Clean(dir)
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}

// foreground hands the terminal on stdin to the agent's process group when
// this process has it, so an interactive agent can read it and gets the
// terminal's Ctrl-C itself, and returns what takes it back.
func foreground(pgid int) (restore func()) {
	fd := int(os.Stdin.Fd())
	own, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP)
	if err != nil || own != unix.Getpgrp() {
		return func() {}
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TIOCSPGRP, pgid); err != nil {
		return func() {}
	}
	unix.Kill(-pgid, unix.SIGCONT) // it may have stopped on reading the terminal first
	return func() {
		// A background process group changing the foreground gets SIGTTOU.
		signal.Ignore(unix.SIGTTOU)
		defer signal.Reset(unix.SIGTTOU)
		unix.IoctlSetPointerInt(fd, unix.TIOCSPGRP, own)
	}
}

// checkout is the local repository a run works in.
type checkout struct {
	root    string   // real absolute path of its top directory
	repo    string   // bus identity: normalized origin URL, else root
	origin  string   // remote.origin.url as configured, "" without one
	gitDirs []string // real git dirs: the worktree's, then the common one
}

// findCheckout resolves --repo PATH: a directory, the top of a git
// checkout when it is in one.
func findCheckout(ctx context.Context, path string) (*checkout, error) {
	abs, err := filepath.Abs(path)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return nil, usagef("--repo %s: %v (want the local checkout the agent works in)", path, err)
	}
	if fi, err := os.Stat(abs); err != nil || !fi.IsDir() {
		return nil, usagef("--repo %s is not a directory (want the local checkout the agent works in)", path)
	}
	co := &checkout{root: abs, repo: abs}
	top, err := gitOutput(ctx, abs, "rev-parse", "--show-toplevel", "--absolute-git-dir", "--git-common-dir")
	if err != nil {
		if _, serr := os.Lstat(filepath.Join(abs, ".git")); serr == nil {
			return nil, fmt.Errorf("--repo %s: %w", path, err)
		}
		return co, nil // a plain directory: its path is the repo
	}
	lines := strings.Split(strings.TrimSpace(top), "\n")
	if len(lines) != 3 {
		return nil, fmt.Errorf("--repo %s: unexpected git rev-parse output %q", path, top)
	}
	if t, err := filepath.EvalSymlinks(lines[0]); err != nil || t != abs {
		return nil, usagef("--repo %s is inside the checkout %s: pass its top directory", path, lines[0])
	}
	for _, d := range lines[1:] {
		if !filepath.IsAbs(d) {
			d = filepath.Join(abs, d)
		}
		if real, err := filepath.EvalSymlinks(d); err == nil && !slices.Contains(co.gitDirs, real) {
			co.gitDirs = append(co.gitDirs, real)
		}
	}
	if origin, err := gitOutput(ctx, abs, "config", "--get", "remote.origin.url"); err == nil && strings.TrimSpace(origin) != "" {
		co.origin = strings.TrimSpace(origin)
		co.repo = normalizeRemote(co.origin, abs)
	}
	return co, nil
}

// gitOutput runs git in dir through gitsafe: no hook and no program the
// repository's configuration names runs (an earlier attempt may have
// planted them).
func gitOutput(ctx context.Context, dir string, args ...string) (string, error) {
	return gitsafe.Git{Dir: dir}.Output(ctx, args...)
}

// normalizeRemote turns a git remote URL into a repo identity (package
// repoid: host/path for network remotes, the cleaned absolute path,
// relative to base, for local ones).
func normalizeRemote(raw, base string) string { return repoid.FromRemote(raw, base) }
