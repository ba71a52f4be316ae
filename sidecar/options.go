package sidecar

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strings"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/pgproxy"
)

// FenceOptions are an agent's fences as a user gives them: strings, lines
// and file names, not yet parsed or read. Check parses them and reads the
// files they name before a lease is taken; Config then makes the Config
// of Start under the held lease. The zero value fences nothing; fenceline
// run and fenceline sidecar fill it from their flags.
type FenceOptions struct {
	// GitUpstream is the agent's git remote (Config.GitUpstream); empty:
	// no git fence.
	GitUpstream string
	// GitListen is where the git fence listens, host:port (checked with
	// GitUpstream).
	GitListen string
	// GitForward serves an https upstream as a forward proxy
	// (Config.GitForward).
	GitForward bool
	// GitObjectDirs are git dirs whose objects resolve pushed packs.
	GitObjectDirs []string
	// GitUpstreamHeaders are "Name: value" lines added to upstream git
	// requests, then GitUpstreamSecretHeader (UpstreamHeaders). Its
	// error is a *HeaderError, which never holds a header's value.
	GitUpstreamHeaders []string
	// GitUpstreamSecretHeader is one more such line, kept off the command
	// line, which the agent can read (the CLI takes it from
	// $EnvGitUpstreamHeader). Its HeaderError has N 0.
	GitUpstreamSecretHeader string
	// GitUpstreamCAFile is a PEM CA bundle for an https upstream (default:
	// the system's).
	GitUpstreamCAFile string
	// GitHookSecretFile is refused (ErrHookSecretGone): the git fence signs
	// pushes with the grant key the lease service gives the lease's
	// acquirer, and no runner holds the repository's hook secret.
	GitHookSecretFile string
	// AllowForcePush and AllowRefDelete are the git fence's policy
	// (gitproxy.Policy).
	AllowForcePush, AllowRefDelete bool

	// PGUpstream is the agent's Postgres, host:port or the path of its
	// Unix socket; empty: no Postgres fence.
	PGUpstream string
	// PGListen is where the Postgres fence listens.
	PGListen string
	// PGSecretFile is refused (ErrPGSecretGone): the Postgres fence signs
	// with the grant key the lease service gives the lease's acquirer.
	PGSecretFile string
	// PGAllowOpaque is Config.PGAllowOpaque (policy).
	PGAllowOpaque bool
	// PGTLSCertFile and PGTLSKeyFile are the PEM certificate (chain) and
	// key the Postgres fence offers clients asking for TLS: both or
	// neither (then a self-signed certificate is made).
	PGTLSCertFile, PGTLSKeyFile string

	// AllowHosts are the hosts the egress proxy tunnels (egress.ParseRules).
	AllowHosts []string
	// EgressResolve pins HOST:PORT=ADDR:PORT (egress.ParseResolve).
	EgressResolve []string
	// InjectHeaderFiles are HOST[:PORT]=FILE: the egress proxy adds FILE's
	// "Name: value" headers to that host's requests, which it opens (the
	// agent holds a placeholder, never the credential) and judges by the
	// API rules fenceline ships for the host.
	InjectHeaderFiles []string
	// EgressCAFile is the PEM CA bundle that verifies injected hosts
	// (default: the system's).
	EgressCAFile string

	// StateDir keeps the sidecar's files; empty: DefaultStateDir of
	// FencelineStateDir and the lease.
	StateDir string
	// FencelineStateDir is fenceline's state dir, which the caller
	// decides (the CLI: $XDG_STATE_HOME/fenceline). Config needs it, or
	// StateDir.
	FencelineStateDir string

	// What Check parsed and read.
	checked   bool
	gitHeader http.Header
	inject    map[string]egress.Injection
	pgTLS     *tls.Config
}

// OptionError is the error of FenceOptions.Check and FenceOptions.Config
// for an option that is wrong, or names a file that cannot be read.
type OptionError struct {
	// Option names the FenceOptions field at fault: "GitUpstream",
	// "PGSecretFile"… (a CLI reports it under the flag that filled it).
	Option string
	// Value is the value given (an address, a file) when Err does not
	// name it already; empty for credentials (header lines).
	Value string
	// Default reports that the option was not given and Value is its
	// default file, which exists but cannot be used.
	Default bool
	Err     error
}

func (e *OptionError) Error() string {
	switch {
	case e.Default:
		return fmt.Sprintf("%s (default %s): %v", e.Option, e.Value, e.Err)
	case e.Value != "":
		return fmt.Sprintf("%s %s: %v", e.Option, e.Value, e.Err)
	}
	return fmt.Sprintf("%s: %v", e.Option, e.Err)
}

func (e *OptionError) Unwrap() error { return e.Err }

// ErrHookSecretGone is the OptionError of GitHookSecretFile: whoever holds
// the repository's hook secret can mint any fence, so runners no longer
// hold it; the lease service does, and gives each lease's acquirer a
// grant key for that lease alone.
var ErrHookSecretGone = errors.New("the sidecar no longer takes the repository's git hook secret (whoever holds it can mint any fence): register it with the lease bus instead, fenceline bus fence-secret set --repo REPO --git HOOK-SECRET-FILE, and the sidecar signs each push with the grant key the service gives its lease")

// ErrPGSecretGone is the OptionError of PGSecretFile: whoever holds the
// database's fence secret can mint any fence for any table, so runners no
// longer hold it.
var ErrPGSecretGone = errors.New("the sidecar no longer takes the database's fence secret (whoever holds it can mint any fence): register it with the lease bus instead, fenceline bus fence-secret set --repo REPO --postgres SECRET-FILE, and the sidecar signs with the grant key the service gives its lease")

// ErrGitHostInjected is the OptionError of InjectHeaderFiles naming the
// git upstream's host (its Value).
var ErrGitHostInjected = errors.New("the git upstream's host is served by the git fence: give its credential as a git upstream header (GitUpstreamHeaders)")

// ErrPGTLSPair is the OptionError of PGTLSCertFile given without
// PGTLSKeyFile, or of PGTLSKeyFile without PGTLSCertFile.
var ErrPGTLSPair = errors.New("the Postgres fence's TLS certificate and key go together: give both, or neither for a self-signed certificate")

// Check parses every option and reads the files they name (the git
// upstream's CA, the Postgres fence's secret and TLS files), keeping what
// it read for Config; nothing is dialed or listened on. repo is the
// lease's repository when known (unused since the git hook secret left
// the runners; kept for callers).
// An option that is wrong is an *OptionError naming it.
func (o *FenceOptions) Check(repo string) error {
	o.checked = false
	if _, err := egress.ParseRules(o.AllowHosts); err != nil {
		return &OptionError{Option: "AllowHosts", Err: err}
	}
	if _, err := egress.ParseResolve(o.EgressResolve); err != nil {
		return &OptionError{Option: "EgressResolve", Err: err}
	}
	if err := o.checkGit(); err != nil {
		return err
	}
	if err := o.checkPG(); err != nil {
		return err
	}
	inject, err := injections(o.InjectHeaderFiles, o.EgressCAFile)
	if err != nil {
		return err
	}
	if u, err := url.Parse(o.GitUpstream); err == nil && o.GitUpstream != "" {
		port := u.Port()
		if port == "" {
			port = map[string]string{"http": "80", "https": "443"}[u.Scheme]
		}
		if _, clash := inject[net.JoinHostPort(strings.ToLower(u.Hostname()), port)]; clash {
			return &OptionError{Option: "InjectHeaderFiles", Value: u.Host, Err: ErrGitHostInjected}
		}
	}
	o.inject = inject
	if o.GitHookSecretFile != "" {
		return &OptionError{Option: "GitHookSecretFile", Err: ErrHookSecretGone}
	}
	o.checked = true
	return nil
}

// checkGit checks the git fence's options: the upstream URL and the
// listen address (with GitUpstream), the upstream headers and CA bundle
// (whenever given).
func (o *FenceOptions) checkGit() error {
	if o.GitUpstream != "" {
		if err := CheckGitUpstream(o.GitUpstream, o.GitForward); err != nil {
			return &OptionError{Option: "GitUpstream", Err: err}
		}
		if err := CheckListen(o.GitListen); err != nil {
			return &OptionError{Option: "GitListen", Value: o.GitListen, Err: err}
		}
	}
	// Header values are credentials: the error names the header at most.
	h, err := UpstreamHeaders(o.GitUpstreamHeaders, o.GitUpstreamSecretHeader)
	if err != nil {
		option := "GitUpstreamHeaders"
		if he := (*HeaderError)(nil); errors.As(err, &he) && he.N == 0 {
			option = "GitUpstreamSecretHeader"
		}
		return &OptionError{Option: option, Err: err}
	}
	o.gitHeader = h
	if o.GitUpstream != "" && len(h) > 0 {
		if u, err := url.Parse(o.GitUpstream); err != nil || strings.Trim(u.Path, "/") == "" {
			return &OptionError{Option: "GitUpstream", Err: errors.New("the URL names no repository, and the git fence adds the upstream header only to one repository's git requests: give the repository's URL, e.g. https://git.example.com/acme/payments.git")}
		}
	}
	if o.GitUpstreamCAFile != "" {
		if _, err := ReadCAFile(o.GitUpstreamCAFile); err != nil {
			return &OptionError{Option: "GitUpstreamCAFile", Value: o.GitUpstreamCAFile,
				Err: fmt.Errorf("%w (want the PEM CA bundle that signed the git server's certificate)", err)}
		}
	}
	return nil
}

// checkPG checks the Postgres fence's options and reads its secret and
// TLS files (or makes its self-signed certificate).
func (o *FenceOptions) checkPG() error {
	o.pgTLS = nil
	if o.PGSecretFile != "" {
		return &OptionError{Option: "PGSecretFile", Err: ErrPGSecretGone}
	}
	if o.PGUpstream == "" {
		return nil
	}
	if err := (&pgproxy.Config{Upstream: o.PGUpstream}).Validate(); err != nil {
		return &OptionError{Option: "PGUpstream", Value: o.PGUpstream, Err: err}
	}
	if err := (&pgproxy.Config{Listen: o.PGListen}).Validate(); err != nil {
		return &OptionError{Option: "PGListen", Value: o.PGListen, Err: err}
	}
	var err error
	switch {
	case o.PGTLSCertFile != "" && o.PGTLSKeyFile == "":
		return &OptionError{Option: "PGTLSKeyFile", Err: ErrPGTLSPair}
	case o.PGTLSCertFile == "" && o.PGTLSKeyFile != "":
		return &OptionError{Option: "PGTLSCertFile", Err: ErrPGTLSPair}
	case o.PGTLSCertFile != "":
		if o.pgTLS, err = pgproxy.LoadTLS(o.PGTLSCertFile, o.PGTLSKeyFile); err != nil {
			return &OptionError{Option: "PGTLSCertFile", Value: o.PGTLSCertFile, Err: err}
		}
	default:
		if o.pgTLS, err = pgproxy.SelfSignedTLS(); err != nil {
			return err
		}
	}
	return nil
}

// Config is the configuration of Start under the held lease, from what
// Check read (Check runs first, with the lease's repository, when it has
// not). The git and Postgres fences sign with the lease's grant keys
// (lease.GrantKeys); without one pushes go out unsigned and Postgres
// refuses writes to fenced tables: the caller may want to warn.
func (o *FenceOptions) Config(held lease.Source, bus lease.View, audit lease.Auditor, log *slog.Logger) (Config, error) {
	l := held.Lease()
	if !o.checked {
		if err := o.Check(l.Repo); err != nil {
			return Config{}, err
		}
	}
	state := o.StateDir
	if state == "" {
		if o.FencelineStateDir == "" {
			return Config{}, errors.New("sidecar: FenceOptions.StateDir and FenceOptions.FencelineStateDir are both empty: the sidecar's files need a place")
		}
		state = DefaultStateDir(o.FencelineStateDir, l.LeaseID)
	}
	return Config{
		Lease:             held,
		Bus:               bus,
		Audit:             audit,
		GitUpstream:       o.GitUpstream,
		GitListen:         o.GitListen,
		GitForward:        o.GitForward,
		GitPolicy:         gitproxy.Policy{AllowForcePush: o.AllowForcePush, AllowRefDelete: o.AllowRefDelete},
		GitObjectDirs:     o.GitObjectDirs,
		GitUpstreamHeader: o.gitHeader,
		GitUpstreamCAFile: o.GitUpstreamCAFile,
		PGUpstream:        o.PGUpstream,
		PGListen:          o.PGListen,
		PGAllowOpaque:     o.PGAllowOpaque,
		PGTLS:             o.pgTLS,
		AllowHosts:        o.AllowHosts,
		EgressResolve:     o.EgressResolve,
		Inject:            o.inject,
		StateDir:          state,
		Logger:            log,
	}, nil
}
