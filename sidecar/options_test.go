package sidecar

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

// optionFiles are real files for FenceOptions: a CA bundle, a git hook
// secret, a Postgres secret, a TLS certificate and key issued by a test CA,
// and junk.
type optionFiles struct {
	dir              string
	ca               *testca.CA
	hookKey          []byte
	hookFile         string
	pgSecret         []byte
	pgSecretFile     string
	tlsCert, tlsKey  string
	certDER          []byte
	junk, missing    string
	shortKey, hexBad string
}

// isolateOptions points fenceline's state dir of the environment at a
// temp dir, and returns that state dir: the options never look there.
func isolateOptions(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_STATE_HOME", dir)
	return filepath.Join(dir, "fenceline")
}

func newOptionFiles(t *testing.T) *optionFiles {
	t.Helper()
	dir := t.TempDir()
	f := &optionFiles{dir: dir, ca: testca.New(t),
		hookKey: bytes.Repeat([]byte{0xab}, 32), hookFile: filepath.Join(dir, "hook.key"),
		pgSecret: bytes.Repeat([]byte{0xcd}, 32), pgSecretFile: filepath.Join(dir, "pg-secret.key"),
		tlsCert: filepath.Join(dir, "pg.crt"), tlsKey: filepath.Join(dir, "pg.key"),
		junk: filepath.Join(dir, "junk"), missing: filepath.Join(dir, "missing"),
		shortKey: filepath.Join(dir, "short.key"), hexBad: filepath.Join(dir, "hexbad.key")}
	if err := gitproxy.WriteKeyFile(f.hookFile, f.hookKey); err != nil {
		t.Fatal(err)
	}
	if err := pgproxy.WriteSecretFile(f.pgSecretFile, f.pgSecret); err != nil {
		t.Fatal(err)
	}
	cert := f.ca.ServerTLS(t, "127.0.0.1").Certificates[0]
	f.certDER = cert.Certificate[0]
	keyDER, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	write(t, f.tlsCert, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: f.certDER})))
	write(t, f.tlsKey, string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})))
	write(t, f.junk, "not a certificate, not hex\n")
	write(t, f.shortKey, "abcd\n")
	write(t, f.hexBad, "zz-not-hex\n")
	return f
}

func write(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
}

// TestFenceOptionsCheckErrors: every option that is wrong, or names a file
// that cannot be used, is an *OptionError naming it (with its value when
// its error does not, never a header's); options of a fence that is not
// asked for are not looked at.
func TestFenceOptionsCheckErrors(t *testing.T) {
	isolateOptions(t)
	f := newOptionFiles(t)
	const repo = "github.com/acme/payments"
	git := func(o FenceOptions) FenceOptions {
		o.GitUpstream = "https://git.example.test/acme/payments.git"
		if o.GitListen == "" {
			o.GitListen = "127.0.0.1:0"
		}
		return o
	}
	pg := func(o FenceOptions) FenceOptions {
		o.PGUpstream = "db.example.test:5432"
		if o.PGListen == "" {
			o.PGListen = "127.0.0.1:0"
		}
		return o
	}
	for _, tc := range []struct {
		name    string
		opts    FenceOptions
		env     string                    // GitUpstreamSecretHeader
		setup   func(t *testing.T) string // writes a default file, returns it (the value)
		option  string
		value   string
		def     bool
		is      error
		header  int // HeaderError.N, for the header options
		message string
	}{
		{name: "allow-host", opts: FenceOptions{AllowHosts: []string{"api.example.test", "https://x/"}},
			option: "AllowHosts", message: `"https://x/"`},
		{name: "egress-resolve", opts: FenceOptions{EgressResolve: []string{"nope"}},
			option: "EgressResolve", message: "HOST:PORT=ADDR:PORT"},
		{name: "git-upstream", opts: FenceOptions{GitUpstream: "ftp://x", GitListen: "127.0.0.1:0"},
			option: "GitUpstream", message: "http:// or https://"},
		{name: "git-forward-http", opts: FenceOptions{GitUpstream: "http://git.example.test/p.git", GitListen: "127.0.0.1:0", GitForward: true},
			option: "GitUpstream", message: "forward mode"},
		{name: "git-listen", opts: git(FenceOptions{GitListen: "nope"}),
			option: "GitListen", value: "nope", message: "host:port"},
		{name: "git-upstream-header", opts: git(FenceOptions{GitUpstreamHeaders: []string{"A: b", "NoColon secret"}}),
			option: "GitUpstreamHeaders", header: 2, message: "Name: value"},
		{name: "git-upstream-header-no-repo", opts: FenceOptions{GitUpstream: "https://git.example.test/", GitListen: "127.0.0.1:0",
			GitUpstreamHeaders: []string{"Authorization: Bearer secret"}}, option: "GitUpstream", message: "names no repository"},
		{name: "git-upstream-header-env", opts: git(FenceOptions{}), env: "Bad Name: secret",
			option: "GitUpstreamSecretHeader", header: 0, message: "Name: value"},
		{name: "git-upstream-ca-missing", opts: git(FenceOptions{GitUpstreamCAFile: f.missing}),
			option: "GitUpstreamCAFile", value: f.missing, is: os.ErrNotExist, message: "want the PEM CA bundle"},
		{name: "git-upstream-ca-junk", opts: git(FenceOptions{GitUpstreamCAFile: f.junk}),
			option: "GitUpstreamCAFile", value: f.junk, message: "no PEM certificate"},
		{name: "pg-upstream", opts: FenceOptions{PGUpstream: "db.example.test", PGListen: "127.0.0.1:0"},
			option: "PGUpstream", value: "db.example.test", message: "host:port"},
		{name: "pg-listen", opts: pg(FenceOptions{PGListen: "nope"}),
			option: "PGListen", value: "nope", message: "host:port"},
		// The database's secret mints any fence: runners no longer take it.
		{name: "pg-secret-file-refused", opts: pg(FenceOptions{PGSecretFile: f.pgSecretFile}),
			option: "PGSecretFile", is: ErrPGSecretGone},
		{name: "pg-tls-cert-alone", opts: pg(FenceOptions{PGTLSCertFile: f.tlsCert}),
			option: "PGTLSKeyFile", is: ErrPGTLSPair},
		{name: "pg-tls-key-alone", opts: pg(FenceOptions{PGTLSKeyFile: f.tlsKey}),
			option: "PGTLSCertFile", is: ErrPGTLSPair},
		{name: "pg-tls-junk", opts: pg(FenceOptions{PGTLSCertFile: f.junk, PGTLSKeyFile: f.tlsKey}),
			option: "PGTLSCertFile", value: f.junk},
		// The hook secret mints any fence: runners no longer take it.
		{name: "git-hook-secret-refused", opts: git(FenceOptions{GitHookSecretFile: f.hookFile}),
			option: "GitHookSecretFile", is: ErrHookSecretGone},
		{name: "git-hook-secret-refused-without-git", opts: FenceOptions{GitHookSecretFile: f.hookFile, AllowHosts: []string{"api.example.test"}},
			option: "GitHookSecretFile", is: ErrHookSecretGone},
	} {
		t.Run(tc.name, func(t *testing.T) {
			isolateOptions(t)
			if tc.setup != nil {
				tc.value = tc.setup(t)
			}
			opts := tc.opts
			opts.GitUpstreamSecretHeader = tc.env
			err := opts.Check(repo)
			var oe *OptionError
			if !errors.As(err, &oe) {
				t.Fatalf("Check = %v, want an *OptionError", err)
			}
			if oe.Option != tc.option || oe.Value != tc.value || oe.Default != tc.def {
				t.Errorf("Check = %#v, want option %q, value %q, default %v", oe, tc.option, tc.value, tc.def)
			}
			if tc.is != nil && !errors.Is(err, tc.is) {
				t.Errorf("Check = %v, want it to wrap %v", err, tc.is)
			}
			if tc.option == "GitUpstreamHeaders" || tc.option == "GitUpstreamSecretHeader" {
				var he *HeaderError
				if !errors.As(err, &he) || he.N != tc.header {
					t.Errorf("Check = %v, want a *HeaderError number %d", err, tc.header)
				}
				if strings.Contains(err.Error(), "secret") {
					t.Errorf("Check = %v: it holds a header's value", err)
				}
			}
			if !strings.Contains(err.Error(), tc.option) || !strings.Contains(err.Error(), tc.message) {
				t.Errorf("Check = %q, want it to name %s and say %q", err, tc.option, tc.message)
			}
		})
	}
}

// TestFenceOptionsUnusedIgnored: the listen addresses, TLS files and
// secrets of a fence that is not asked for are not looked at.
func TestFenceOptionsUnusedIgnored(t *testing.T) {
	state := isolateOptions(t)
	f := newOptionFiles(t)
	write(t, pgproxy.DefaultSecretFile(state), "junk\n")
	opts := FenceOptions{AllowHosts: []string{"api.example.test"}, GitListen: "nope", PGListen: "nope",
		PGTLSCertFile: f.junk}
	if err := opts.Check("github.com/acme/payments"); err != nil {
		t.Fatalf("Check: %v", err)
	}
}

// acquireFor holds a lease on repo on a test bus.
func acquireFor(t *testing.T, repo string) (*bustest.Bus, *bustest.Lease) {
	t.Helper()
	bus := bustest.Start(t)
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: repo, Scope: bustest.Claim(t, "services/billing"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	return bus, l
}

// TestFenceOptionsConfig: good options make the Config of Start: the
// files read, the headers parsed (the environment's last), the policy, the
// values passed through, the lease's default state dir.
func TestFenceOptionsConfig(t *testing.T) {
	isolateOptions(t)
	f := newOptionFiles(t)
	const repo = "github.com/acme/payments"
	state := t.TempDir()
	opts := FenceOptions{
		GitUpstreamSecretHeader: "X-Env: from-env",
		FencelineStateDir:       state,
		GitUpstream:             "https://git.example.test/acme/payments.git", GitListen: "127.0.0.1:0", GitForward: true,
		GitObjectDirs:      []string{"/src/.git"},
		GitUpstreamHeaders: []string{"Authorization: Bearer t0ken"},
		GitUpstreamCAFile:  f.ca.File,
		AllowForcePush:     true,
		PGUpstream:         "db.example.test:5432", PGListen: "127.0.0.1:0",
		PGAllowOpaque: true,
		PGTLSCertFile: f.tlsCert, PGTLSKeyFile: f.tlsKey,
		AllowHosts:    []string{"api.example.test"},
		EgressResolve: []string{"api.example.test:443=127.0.0.1:8443"},
	}
	if err := opts.Check(repo); err != nil {
		t.Fatalf("Check: %v", err)
	}
	bus, l := acquireFor(t, repo)
	cfg, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil)
	if err != nil {
		t.Fatalf("Config: %v", err)
	}
	if cfg.Lease != l.Holder || cfg.Bus != bus.Client || cfg.Audit != bus.Auditor {
		t.Error("Config: not the lease, bus and auditor given")
	}
	if cfg.GitUpstream != opts.GitUpstream || cfg.GitListen != "127.0.0.1:0" || !cfg.GitForward ||
		cfg.GitUpstreamCAFile != f.ca.File || cfg.GitObjectDirs[0] != "/src/.git" {
		t.Errorf("Config git: %+v", cfg)
	}
	if !cfg.GitPolicy.AllowForcePush || cfg.GitPolicy.AllowRefDelete {
		t.Errorf("Config.GitPolicy = %+v, want force pushes only", cfg.GitPolicy)
	}
	if got := cfg.GitUpstreamHeader.Get("Authorization"); got != "Bearer t0ken" {
		t.Errorf("Config.GitUpstreamHeader Authorization = %q", got)
	}
	if got := cfg.GitUpstreamHeader.Get("X-Env"); got != "from-env" {
		t.Errorf("Config.GitUpstreamHeader X-Env = %q, want the secret header's", got)
	}
	if cfg.PGUpstream != opts.PGUpstream || cfg.PGListen != "127.0.0.1:0" || !cfg.PGAllowOpaque {
		t.Errorf("Config pg: upstream %q listen %q opaque %v", cfg.PGUpstream, cfg.PGListen, cfg.PGAllowOpaque)
	}
	if cfg.PGTLS == nil || len(cfg.PGTLS.Certificates) != 1 || !bytes.Equal(cfg.PGTLS.Certificates[0].Certificate[0], f.certDER) {
		t.Error("Config.PGTLS: not the certificate of the TLS files")
	}
	if len(cfg.AllowHosts) != 1 || len(cfg.EgressResolve) != 1 {
		t.Errorf("Config egress: %v %v", cfg.AllowHosts, cfg.EgressResolve)
	}
	if want := DefaultStateDir(state, l.Holder.Lease().LeaseID); cfg.StateDir != want {
		t.Errorf("Config.StateDir = %q, want %q", cfg.StateDir, want)
	}
	opts.StateDir = f.dir
	if cfg, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil); err != nil || cfg.StateDir != f.dir {
		t.Errorf("Config.StateDir = %q, %v; want %q", cfg.StateDir, err, f.dir)
	}
	opts.StateDir, opts.FencelineStateDir = "", ""
	if _, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil); err == nil || !strings.Contains(err.Error(), "FencelineStateDir") {
		t.Errorf("Config with no state dir = %v, want an error naming FencelineStateDir", err)
	}
}

// TestFenceOptionsDefaults: without secret or TLS files, the repo's
// default hook secret and the default Postgres secret are read when they
// exist, a self-signed certificate is made, and an attached lease (Check
// with no repo) has its repo's hook secret read by Config. Config checks
// options that were not.
func TestFenceOptionsDefaults(t *testing.T) {
	isolateOptions(t)
	const repo = "github.com/acme/payments"
	bus, l := acquireFor(t, repo)
	state := t.TempDir()
	git := FenceOptions{GitUpstream: "http://git.example.test/acme/payments.git", GitListen: "127.0.0.1:0", FencelineStateDir: state}

	// No default files: nothing read, nothing refused.
	opts := git
	if err := opts.Check(repo); err != nil {
		t.Fatalf("Check: %v", err)
	}
	if _, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil); err != nil {
		t.Errorf("Config: %v", err)
	}

	// A hook secret in the repo's old default file is never read: the
	// sidecar signs with its lease's grant key.
	key := bytes.Repeat([]byte{0x11}, 32)
	if err := gitproxy.WriteSidecarKey(gitproxy.SidecarKeyFile(state, repo), key); err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte{0x22}, 32)
	if err := pgproxy.WriteSecretFile(pgproxy.DefaultSecretFile(state), secret); err != nil {
		t.Fatal(err)
	}
	opts = git
	opts.PGUpstream, opts.PGListen = "/var/run/postgresql/.s.PGSQL.5432", "127.0.0.1:0"
	if err := opts.Check(repo); err != nil {
		t.Fatalf("Check: %v", err)
	}
	cfg, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil)
	if err != nil {
		t.Fatal(err)
	}
	if cfg.PGTLS == nil || len(cfg.PGTLS.Certificates) != 1 {
		t.Error("Config.PGTLS: want a self-signed certificate")
	}

	// Attached: no repo before the lease.
	opts = git
	if err := opts.Check(""); err != nil {
		t.Fatalf("Check(\"\") = %v", err)
	}
	if _, err = opts.Config(l.Holder, bus.Client, bus.Auditor, nil); err != nil {
		t.Errorf("Config attached: %v", err)
	}

	// Not checked: Config checks.
	opts = git
	opts.GitListen = "nope"
	var oe *OptionError
	if _, err := opts.Config(l.Holder, bus.Client, bus.Auditor, nil); !errors.As(err, &oe) || oe.Option != "GitListen" {
		t.Errorf("Config unchecked = %v, want the git-listen OptionError", err)
	}
}

// TestOptionErrorMessage: the message names the option, then the value
// (or the default file), then the error.
func TestOptionErrorMessage(t *testing.T) {
	err := errors.New("boom")
	for _, tc := range []struct {
		e    OptionError
		want string
	}{
		{OptionError{Option: "GitUpstream", Err: err}, "GitUpstream: boom"},
		{OptionError{Option: "GitListen", Value: "nope", Err: err}, "GitListen nope: boom"},
		{OptionError{Option: "PGSecretFile", Value: "/s/pg.key", Default: true, Err: err}, "PGSecretFile (default /s/pg.key): boom"},
	} {
		if got := tc.e.Error(); got != tc.want {
			t.Errorf("Error() = %q, want %q", got, tc.want)
		}
		if !errors.Is(&tc.e, err) {
			t.Errorf("%v does not unwrap to its Err", &tc.e)
		}
	}
}
