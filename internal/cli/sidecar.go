package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/internal/lograte"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/shard"
	"github.com/fenceline/fenceline/sidecar"
)

// fenceFlags configure the fences of run and sidecar: the flags of a
// sidecar.FenceOptions.
type fenceFlags struct {
	gitUpstream, gitListen, gitCA string
	gitForward                    bool
	gitObjects, gitHeaders        []string
	allowForcePush, allowDelete   bool
	pgUpstream, pgListen          string
	pgSecretFile                  string
	pgAllowOpaque                 bool
	pgTLSCert, pgTLSKey           string
	stateDir                      string
	gitHookSecret                 string // --git-hook-secret: refused (sidecar.ErrHookSecretGone)
	allowHosts, egressResolve     []string
	injectFiles                   []string // --inject-header-file HOST[:PORT]=FILE
	egressCA                      string

	opts *sidecar.FenceOptions // what check parsed and read, before the lease is taken
}

// secretFiles are the fences' secret files an agent beside them may not
// read: the Postgres fence's signing secret and TLS key, the injected
// credentials.
func (ff *fenceFlags) secretFiles() []string {
	return append([]string{ff.pgSecretFile, ff.pgTLSKey}, sidecar.InjectFiles(ff.injectFiles)...)
}

func (ff *fenceFlags) register(c *cobra.Command) {
	f := c.Flags()
	f.StringVar(&ff.gitUpstream, "git-upstream", "", "URL of the agent's git repository (http or https), e.g. https://git.internal/acme/payments.git; the git fence serves only its smart-HTTP endpoints and judges every push")
	f.StringVar(&ff.gitListen, "git-listen", "127.0.0.1:0", "address of the git fence")
	f.BoolVar(&ff.gitForward, "git-forward", false, "serve an https upstream as a forward proxy with a local CA (git http.proxy) instead of a reverse proxy")
	f.StringArrayVar(&ff.gitObjects, "git-objects", nil, "git dir whose objects resolve pushed packs, e.g. the agent's repo/.git (repeatable)")
	f.StringArrayVar(&ff.gitHeaders, "git-upstream-header", nil, `header added to upstream git requests, "Name: value" (repeatable; env `+envGitUpstreamHeader+`)`)
	f.StringVar(&ff.gitHookSecret, "git-hook-secret", "", "refused: the repository's hook secret goes to the lease bus (fenceline bus fence-secret set), which gives each lease a grant key")
	_ = f.MarkHidden("git-hook-secret")
	f.StringVar(&ff.gitCA, "git-upstream-ca", "", "CA bundle for an https git upstream (default: the system's)")
	f.BoolVar(&ff.allowForcePush, "allow-force-push", false, "let path leases push non-fast-forward updates (policy)")
	f.BoolVar(&ff.allowDelete, "allow-ref-delete", false, "let path leases delete refs (policy)")
	f.StringVar(&ff.pgUpstream, "pg-upstream", "", "host:port of the agent's Postgres (or the absolute path of its Unix socket, e.g. /var/run/postgresql/.s.PGSQL.5432, on this machine); its connections go through the Postgres fence")
	f.StringVar(&ff.pgListen, "pg-listen", "127.0.0.1:0", "address of the Postgres fence")
	f.StringVar(&ff.pgSecretFile, "pg-secret-file", "", "refused: the database's fence secret goes to the lease bus (fenceline bus fence-secret set), which gives each lease a grant key")
	_ = f.MarkHidden("pg-secret-file")
	f.BoolVar(&ff.pgAllowOpaque, "pg-allow-opaque", false, "let writes whose tables cannot be named (DO, CALL, GRANT…) through under a live lease (policy)")
	f.StringVar(&ff.pgTLSCert, "pg-tls-cert", "", "PEM certificate (chain) the Postgres fence offers clients that ask for TLS, with --pg-tls-key (default: a self-signed one made at start, so sslmode=require works; verify-ca/verify-full need yours)")
	f.StringVar(&ff.pgTLSKey, "pg-tls-key", "", "PEM private key of --pg-tls-cert")
	f.StringArrayVar(&ff.allowHosts, "allow-host", nil, `host the agent may reach through the egress proxy, tunnelled untouched: api.openai.com, *.anthropic.com (not the apex), host:8443 (port 443 unless named; repeatable). The git upstream's host goes to the git fence; every other host is refused`)
	f.StringArrayVar(&ff.egressResolve, "egress-resolve", nil, "HOST:PORT=ADDR:PORT: the egress proxy and the git fence connect to ADDR:PORT for HOST:PORT, whatever DNS says (like curl --resolve; a pinned loopback address is allowed; repeatable)")
	f.StringArrayVar(&ff.injectFiles, "inject-header-file", nil, `HOST[:PORT]=FILE: the egress proxy adds FILE's "Name: value" lines (e.g. "Authorization: Bearer sk-…") to every request to HOST, which it opens with the sidecar's CA (the agent's clients trust it) and judges by the API rules fenceline ships for it (GitHub, GitLab: no ref moves or content writes past the git fence); give the agent a placeholder key. FILE is hidden from the agent (repeatable)`)
	f.StringVar(&ff.egressCA, "egress-ca", "", "PEM CA bundle that verifies the hosts of --inject-header-file (default: the system's)")
	f.StringVar(&ff.stateDir, "state-dir", "", "where the sidecar keeps mirrors, its CA and spooled packs (default <state dir>/sidecar/<lease>)")
}

// envGitUpstreamHeader holds one more --git-upstream-header, kept off
// the command line (the agent can read that).
const envGitUpstreamHeader = sidecar.EnvGitUpstreamHeader

// fenceEnv is what the fences take from the environment, read once by
// the command.
type fenceEnv struct {
	stateDir     string // fenceline's state dir
	secretHeader string // $FENCELINE_GIT_UPSTREAM_HEADER
	adminToken   string // $FENCELINE_ADMIN_TOKEN
}

func (a *app) fenceEnv() fenceEnv {
	return fenceEnv{stateDir: a.stateDir, secretHeader: a.cfg.GitUpstreamHeader, adminToken: a.cfg.AdminToken}
}

// options are the fence flags as sidecar.FenceOptions.
func (ff *fenceFlags) options(env fenceEnv) *sidecar.FenceOptions {
	return &sidecar.FenceOptions{
		GitUpstreamSecretHeader: env.secretHeader,
		FencelineStateDir:       env.stateDir,
		GitUpstream:             ff.gitUpstream,
		GitListen:               ff.gitListen,
		GitForward:              ff.gitForward,
		GitObjectDirs:           ff.gitObjects,
		GitUpstreamHeaders:      ff.gitHeaders,
		GitUpstreamCAFile:       ff.gitCA,
		GitHookSecretFile:       ff.gitHookSecret,
		AllowForcePush:          ff.allowForcePush,
		AllowRefDelete:          ff.allowDelete,
		PGUpstream:              ff.pgUpstream,
		PGListen:                ff.pgListen,
		PGSecretFile:            ff.pgSecretFile,
		PGAllowOpaque:           ff.pgAllowOpaque,
		PGTLSCertFile:           ff.pgTLSCert,
		PGTLSKeyFile:            ff.pgTLSKey,
		AllowHosts:              ff.allowHosts,
		EgressResolve:           ff.egressResolve,
		InjectHeaderFiles:       ff.injectFiles,
		EgressCAFile:            ff.egressCA,
		StateDir:                ff.stateDir,
	}
}

// check validates every fence flag and reads the files they name
// (sidecar.FenceOptions.Check), keeping what it read for config: nothing
// is dialed, listened on or acquired before it passed. repo is the
// lease's repo when known ("" when attaching). A bad flag, or a file it
// names that cannot be read, is a usage error naming the flag.
func (ff *fenceFlags) check(repo string, env fenceEnv) error {
	opts := ff.options(env)
	if err := opts.Check(repo); err != nil {
		return ff.flagError(err)
	}
	ff.opts = opts
	return nil
}

// fenceFlag is the flag (without dashes) that fills each field of
// sidecar.FenceOptions an OptionError may name.
var fenceFlag = map[string]string{
	"GitUpstream":        "git-upstream",
	"GitListen":          "git-listen",
	"GitUpstreamHeaders": "git-upstream-header",
	"GitUpstreamCAFile":  "git-upstream-ca",
	"GitHookSecretFile":  "git-hook-secret",
	"PGUpstream":         "pg-upstream",
	"PGListen":           "pg-listen",
	"PGSecretFile":       "pg-secret-file",
	"PGTLSCertFile":      "pg-tls-cert",
	"PGTLSKeyFile":       "pg-tls-key",
	"AllowHosts":         "allow-host",
	"EgressResolve":      "egress-resolve",
	"InjectHeaderFiles":  "inject-header-file",
	"EgressCAFile":       "egress-ca",
}

// flagError words an error of sidecar.FenceOptions: an option that is
// wrong is a usage error naming its flag; a default file that cannot be
// read is not.
func (ff *fenceFlags) flagError(err error) error {
	var oe *sidecar.OptionError
	if !errors.As(err, &oe) {
		return err
	}
	flag, ok := fenceFlag[oe.Option]
	if !ok {
		flag = oe.Option // GitUpstreamSecretHeader: worded below
	}
	var he *sidecar.HeaderError // header values are credentials: named at most
	switch {
	case oe.Default && flag == "pg-secret-file":
		return fmt.Errorf("%w (the default of --pg-secret-file: run fenceline pg install again, or pass --pg-secret-file)", oe.Err)
	case oe.Default:
		return oe.Err // the git hook secret's default file names itself
	case errors.As(err, &he) && he.N == 0:
		return usagef("$%s (the --git-upstream-header kept off the command line): %v", envGitUpstreamHeader, he.Err)
	case errors.As(err, &he):
		return usagef("--git-upstream-header (number %d): %v", he.N, he.Err)
	case errors.Is(err, sidecar.ErrHookSecretGone):
		return usagef("--git-hook-secret: %v", sidecar.ErrHookSecretGone)
	case errors.Is(err, sidecar.ErrPGSecretGone):
		return usagef("--pg-secret-file: %v", sidecar.ErrPGSecretGone)
	case errors.Is(err, sidecar.ErrPGTLSPair):
		return usagef("--pg-tls-cert and --pg-tls-key go together: give both, or neither for a self-signed certificate")
	case flag == "pg-tls-cert":
		return usagef("--pg-tls-cert %s, --pg-tls-key %s: %v", ff.pgTLSCert, ff.pgTLSKey, oe.Err)
	case errors.Is(err, sidecar.ErrForwardHTTP):
		return usagef("--git-upstream %s: forward mode (--git-forward) is for https remotes; an http remote goes through the reverse proxy", ff.gitUpstream)
	case errors.Is(err, sidecar.ErrGitHostInjected):
		return usagef("--inject-header-file: %s is the git upstream's host, served by the git fence: give its credential with --git-upstream-header", oe.Value)
	case flag == "egress-ca" && errors.Is(err, sidecar.ErrEgressCAUnused):
		return usagef("--egress-ca %s: only the hosts of --inject-header-file are verified with it", oe.Value)
	case oe.Value != "":
		return usagef("--%s %s: %v", flag, oe.Value, oe.Err)
	}
	return usagef("--%s: %v", flag, oe.Err)
}

// config is the sidecar's configuration under the held lease, from what
// check read.
func (ff *fenceFlags) config(held *heldLease, s *session, audit lease.Auditor, log *slog.Logger) (sidecar.Config, error) {
	if ff.opts == nil {
		return sidecar.Config{}, errors.New("internal error: the fence flags were not checked before the lease was taken")
	}
	cfg, err := ff.opts.Config(held.holder, s.client, audit, log)
	if err != nil {
		return sidecar.Config{}, ff.flagError(err)
	}
	if g := held.holder.GrantKeys(); cfg.GitUpstream != "" && (g == nil || g.Git == nil) {
		log.Warn("the lease service gave this lease no git grant key: pushes go out unsigned, and a git server with fenceline's pre-receive hook refuses them (register the repository's hook secret with the bus: fenceline bus fence-secret set --repo REPO --git HOOK-SECRET-FILE)",
			"lease", held.holder.Lease().LeaseID, "repo", held.holder.Lease().Repo)
	}
	if g := held.holder.GrantKeys(); cfg.PGUpstream != "" && (g == nil || g.Postgres == nil) {
		log.Warn("the lease service gave this lease no Postgres grant key: writes to fenced tables will be rejected by Postgres (register the database's fence secret with the bus: fenceline bus fence-secret set --repo REPO --postgres SECRET-FILE)",
			"lease", held.holder.Lease().LeaseID, "repo", held.holder.Lease().Repo)
	}
	return cfg, nil
}

// sidecarFlags are the flags of fenceline sidecar.
type sidecarFlags struct {
	lf            leaseFlags
	ff            fenceFlags
	attachID      string
	cred          string
	envFile       string
	admin         string
	tokenFile     string
	logFormat     string
	settleTimeout time.Duration
}

func (a *app) sidecarCommand() *cobra.Command {
	var sf sidecarFlags
	c := &cobra.Command{
		Use:   "sidecar --repo R [claim flags] [--git-upstream URL] [--pg-upstream HOST:PORT] [--admin ADDR] [--env-file FILE]",
		Short: "Hold an agent's lease and serve its fences (the pod mode)",
		Long: `Acquire the agent's lease (or attach to one with --lease), keep it alive, and
serve the fences the agent is routed through until SIGTERM or Ctrl-C.

The agent needs no change: the environment it must run with (git config
entries passed as GIT_CONFIG_COUNT/GIT_CONFIG_KEY_n/GIT_CONFIG_VALUE_n that
route its git remote through the git fence; PGHOST/PGPORT, and DATABASE_URL
rewritten, for the Postgres fence) is printed, written to --env-file
(KEY=VALUE lines), and served by the admin API, where "fenceline agent"
(the agent container's entrypoint wrapper) reads it.

The agent's other HTTP(S) traffic goes through the egress proxy
(HTTPS_PROXY, HTTP_PROXY and NO_PROXY in that environment): hosts named by
--allow-host are tunnelled untouched, the git upstream's host is served by
the git fence, every other host is refused (403 naming the host, the lease
and the flag to add; audited).

While the lease is lost or its state unknown, every write is refused at
the fences; reads keep flowing.

Admin server (--admin, default a free loopback port, printed):
  GET  /healthz              200 while the process serves
  GET  /readyz               200 only while the lease is held (503 and why
                             while it is unknown or lost, or shutting down)
  GET  /metrics              Prometheus metrics
  GET  /api/v1/lease         the lease record, holder state, fence, fences
  GET  /api/v1/lease/events  server-sent events: the state now, then changes
  POST /api/v1/settled       the agent wrapper: the attempt has settled
  POST /api/v1/audit         the agent wrapper: a denied file write
Off loopback it needs a bearer token (--admin-token-file or $` + sidecar.EnvAdminToken + `)
for everything but /healthz and /readyz.

Shutdown (SIGTERM): /readyz turns 503, the fences stop accepting and drain,
then the lease is released once the agent wrapper has reported the attempt
settled (POST /api/v1/settled). A wrapper that was connected but reports
nothing within --settle-timeout leaves the lease to expire by its ttl (it is
never released under processes that may still write); with no wrapper ever
connected, the drained fences were the only writers and the lease is
released at once.`,
		Args: cobra.NoArgs,
		Example: `  fenceline sidecar --repo github.com/acme/payments --scope services/billing --workspace exclusive \
    --git-upstream http://git.internal/payments.git --admin 0.0.0.0:9090 --admin-token-file /run/secrets/admin-token`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return a.runSidecar(cmd.Context(), &sf)
		},
	}
	f := c.Flags()
	sf.lf.register(f, a.cfg.User)
	sf.ff.register(c)
	f.StringVar(&sf.attachID, "lease", "", "attach to this lease instead of acquiring one")
	f.StringVar(&sf.cred, "credential", "", "owner credential of --lease (default: this machine's credential file)")
	f.StringVar(&sf.envFile, "env-file", "", "write the agent's environment to this file")
	f.StringVar(&sf.admin, "admin", "127.0.0.1:0", "address of the admin server (probes, metrics, lease API); off loopback it needs a token")
	f.StringVar(&sf.tokenFile, "admin-token-file", "", "file holding the admin API's bearer token (env "+sidecar.EnvAdminToken+")")
	f.StringVar(&sf.logFormat, "log-format", "json", "log format on stderr: json or text")
	f.DurationVar(&sf.settleTimeout, "settle-timeout", 30*time.Second, "on SIGTERM, how long to wait for the agent wrapper to report its attempt settled before leaving the lease to expire")
	c.MarkFlagsMutuallyExclusive("scope", "whole-repo")
	return c
}

// check validates every flag of fenceline sidecar and reads the files
// they name, before anything is dialed, listened on or acquired: a bad
// one is a usage error naming the flag. It returns the logger on stderr
// and the admin token.
func (sf *sidecarFlags) check(ctx context.Context, stderr io.Writer, env fenceEnv) (*slog.Logger, string, error) {
	if sf.ff.gitUpstream == "" && sf.ff.pgUpstream == "" && len(sf.ff.allowHosts) == 0 && len(sf.ff.injectFiles) == 0 {
		return nil, "", usagef("nothing to fence: give --git-upstream URL, --pg-upstream HOST:PORT and/or --allow-host HOST")
	}
	if sf.settleTimeout < 0 {
		return nil, "", usagef("--settle-timeout %s: want a duration >= 0", sf.settleTimeout)
	}
	if sf.attachID != "" {
		if err := checkLeaseID(sf.attachID); err != nil {
			return nil, "", err
		}
	}
	if err := sf.lf.resolveRepo(ctx); err != nil {
		return nil, "", err
	}
	if sf.attachID == "" {
		if _, err := sf.lf.request(); err != nil {
			return nil, "", err // the claim flags
		}
	}
	if err := sf.ff.check(sf.lf.repo, env); err != nil {
		return nil, "", err
	}
	log, err := newLogger(stderr, sf.logFormat)
	if err != nil {
		return nil, "", err
	}
	token, err := readToken(sf.tokenFile, env.adminToken)
	if err != nil {
		return nil, "", err
	}
	if err := sidecar.CheckListen(sf.admin); err != nil {
		return nil, "", usagef("--admin %s: %v", sf.admin, err)
	}
	if err := (&sidecar.AdminConfig{Listen: sf.admin, Token: token}).Validate(); errors.Is(err, sidecar.ErrNeedsToken) {
		return nil, "", usagef("--admin %s: the admin API needs a bearer token off loopback: pass --admin-token-file or set %s, or listen on loopback (--admin 127.0.0.1:PORT)", sf.admin, sidecar.EnvAdminToken)
	} else if err != nil {
		return nil, "", usagef("%v", err) // the token's length: it names no flag
	}
	if sf.envFile != "" {
		if fi, err := os.Stat(filepath.Dir(sf.envFile)); err != nil || !fi.IsDir() {
			return nil, "", usagef("--env-file %s: its directory %s does not exist", sf.envFile, filepath.Dir(sf.envFile))
		}
	}
	return log, token, nil
}

// runSidecar is fenceline sidecar: the flags mapped to a sidecar.Pod
// (admin server, lease, fences; on SIGTERM not ready, fences drained,
// settle awaited, lease released), and what it serves printed.
func (a *app) runSidecar(ctx context.Context, sf *sidecarFlags) error {
	log, token, err := sf.check(ctx, a.stderr, a.fenceEnv())
	if err != nil {
		return err
	}
	// Every flag is checked: from here on things are dialed and acquired.
	identity := "" // attached: the lease's acquirer's credentials (the lease is bound to its identity)
	if sf.attachID == "" {
		identity = "sidecar-" + lease.NewAttemptID()
	}
	s, err := a.dialHolder(identity)
	if err != nil {
		return err
	}
	defer s.Close()
	var req leasebus.AcquireRequest
	if sf.attachID == "" {
		if req, err = sf.lf.request(); err != nil {
			return err
		}
	}
	pf := policyFlags(req, &sf.ff, "", nil)
	pf.Attached = sf.attachID != ""
	pol, stopPolicy, err := a.followPolicy(ctx, s, repoid.Normalize(sf.lf.repo), pf)
	if err != nil {
		return err // a flag the policy forbids: before any lease
	}
	defer stopPolicy()
	var base []string
	if v, ok := os.LookupEnv("DATABASE_URL"); ok {
		base = append(base, "DATABASE_URL="+v)
	}
	audit, err := leasebus.NewAuditor(s.nc)
	if err != nil {
		return err
	}
	ui, err := runUI(s, token, log)
	if err != nil {
		return err
	}
	var held *heldLease // set by Hold, before Fences
	pod, err := sidecar.NewPod(sidecar.PodConfig{
		Audit: audit,
		UI:    ui,
		Admin: sidecar.AdminConfig{Listen: sf.admin, Token: token, Policy: pol},
		Hold: func(ctx context.Context, onRenew func(time.Duration, error)) (sidecar.Holder, error) {
			h, err := a.holdWith(ctx, s, &sf.lf, sf.attachID, leasebus.Credential(sf.cred), leasebus.HoldOptions{OnRenew: onRenew})
			if err != nil {
				return nil, err
			}
			held = h
			return h.holder, nil
		},
		Fences: func(_ lease.Holding, audit lease.Auditor) (sidecar.Config, error) {
			cfg, err := sf.ff.config(held, s, audit, log)
			cfg.Policy = pol
			return cfg, err
		},
		BaseEnv:       base,
		EnvFile:       sf.envFile,
		SettleTimeout: sf.settleTimeout,
		Logger:        log,
	})
	var ae *sidecar.AdminError
	switch {
	case errors.As(err, &ae) && errors.Is(err, sidecar.ErrNeedsToken):
		return usagef("--admin %s resolves off loopback: the admin API needs a bearer token there: pass --admin-token-file or set %s, or listen on loopback (--admin 127.0.0.1:PORT)", sf.admin, sidecar.EnvAdminToken)
	case errors.As(err, &ae):
		return usagef("--admin %s: %v", sf.admin, ae.Err)
	}
	if err != nil {
		return err
	}
	defer pod.Close(ctx)
	fmt.Fprintf(a.stdout, "admin: %s (/healthz /readyz /metrics /api/v1/lease /ui/)\n", pod.AdminURL())

	r, err := pod.Start(ctx)
	if err != nil {
		return err
	}
	a.printSidecarReady(sf, r)
	err = pod.Wait(ctx)
	end, serr := pod.Shutdown(ctx)
	if err == nil {
		err = serr
	}
	l := end.Lease
	switch end.End {
	case sidecar.LeaseLeftToOwner:
		fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s left to its owner\n", l.LeaseID)
	case sidecar.LeaseLeftToExpire:
		fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s NOT released (%s): the lease service reclaims it once this sidecar's session has been silent for its grace (10 s by default), at the latest within its ttl (%s)\n", l.LeaseID, end.Why, l.TTL)
	case sidecar.LeaseEnded:
		fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s had already ended (%v): nothing to release\n", l.LeaseID, end.Err)
	case sidecar.LeaseNotReleased:
		fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s not released: %v; it expires within its ttl (%s)\n", l.LeaseID, end.Err, l.TTL)
	default: // sidecar.LeaseReleased
		fmt.Fprintf(a.stdout, "sidecar stopping: fences drained, lease %s released (%s)\n", l.LeaseID, end.Why)
	}
	return err
}

// runUI is the run UI of a sidecar (runui.Server) on s's connection:
// leases, the audit stream, and the shards and attempts of the shard
// store.
func runUI(s *session, token string, log *slog.Logger) (*runui.Server, error) {
	shards, err := shard.Open(leasebus.NewShardRecords(s.nc), shard.Config{Logger: log})
	if err != nil {
		return nil, err
	}
	return runui.New(runui.Config{Source: leasebus.NewUIReader(s.nc), Token: token, Shards: runui.StoreSource(shards), Logger: log})
}

// printSidecarReady prints the lease, the fences and the agent's
// environment of a started pod.
func (a *app) printSidecarReady(sf *sidecarFlags, r *sidecar.Ready) {
	l := r.Lease
	fmt.Fprintf(a.stdout, "sidecar: lease %s %s, workspace %s (%s), fence %d\n", l.LeaseID, l.Scope, l.WorkspaceID, l.WorkspaceMode, l.Fence)
	if r.Fences.Git != "" {
		fmt.Fprintf(a.stdout, "git fence: %s -> %s\n", r.Fences.Git, sf.ff.gitUpstream)
	}
	if r.Fences.Postgres != "" {
		fmt.Fprintf(a.stdout, "postgres fence: %s -> %s\n", r.Fences.Postgres, sf.ff.pgUpstream)
	}
	fmt.Fprintf(a.stdout, "egress proxy: %s (%s)\n", r.Fences.Egress, r.Fences.EgressSummary())
	fmt.Fprintln(a.stdout, "agent environment:")
	for _, kv := range r.Env {
		fmt.Fprintf(a.stdout, "  %s\n", kv)
	}
	if sf.envFile != "" {
		fmt.Fprintf(a.stdout, "written to %s\n", sf.envFile)
	}
}

// newLogger is the slog logger of --log-format on w, at most
// lograte.DefaultBurst records of a kind a second (a refusal the agent
// repeats, a stranger's connections the bus refuses: internal/lograte).
func newLogger(w io.Writer, format string) (*slog.Logger, error) {
	opts := &slog.HandlerOptions{Level: slog.LevelInfo}
	var h slog.Handler
	switch format {
	case "json":
		h = slog.NewJSONHandler(w, opts)
	case "text":
		h = slog.NewTextHandler(w, opts)
	default:
		return nil, usagef("--log-format %q: want json or text", format)
	}
	return slog.New(lograte.New(h, lograte.Options{})), nil
}

// readToken reads the admin bearer token from file
// (sidecar.ReadAdminToken), else it is fromEnv ($FENCELINE_ADMIN_TOKEN,
// "" when unset). A file that cannot be read, or holds none, is a usage
// error.
func readToken(file, fromEnv string) (string, error) {
	if file == "" {
		return fromEnv, nil
	}
	tok, err := sidecar.ReadAdminToken(file)
	switch {
	case errors.Is(err, sidecar.ErrEmptyAdminToken):
		return "", usagef("--admin-token-file %s is empty: write the admin API's bearer token in it", file)
	case err != nil:
		return "", usagef("--admin-token-file: %v", err)
	}
	return tok, nil
}
