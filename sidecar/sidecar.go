package sidecar

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/pgproxy"
	"github.com/fenceline/fenceline/policy"
)

// Config configures a Sidecar.
type Config struct {
	// Lease is the agent's held lease (a *leasebus.Holder): every fence
	// asks it for the fence before each write.
	Lease lease.Source
	// Bus is read when a push is decided (a *leasebus.Client); Audit
	// records refusals (a *leasebus.Auditor; nil: refusals are only
	// logged).
	Bus   lease.View
	Audit lease.Auditor

	// GitUpstream is the URL of the agent's git remote, http or https: its
	// repository (the git fence serves that repository's smart-HTTP
	// endpoints only), or the server base (every repository's, and then
	// no GitUpstreamHeader). Empty: no git fence.
	GitUpstream string
	// GitListen is where the git fence listens (default 127.0.0.1:0).
	GitListen string
	// GitForward routes the agent's git to an https:// upstream through the
	// egress proxy (git's http.proxy), which serves the upstream's host
	// with the git fence behind a certificate from a local CA, instead of
	// rewriting the remote to a plain reverse proxy (insteadOf).
	GitForward bool
	// GitPolicy is the history-rewrite policy of the git fence.
	GitPolicy gitproxy.Policy
	// GitObjectDirs: git dirs whose objects resolve pushed packs (the
	// agent's repository).
	GitObjectDirs []string
	// GitUpstreamHeader is added to every upstream git request (the
	// credential the agent never sees).
	GitUpstreamHeader http.Header
	// GitUpstreamCAFile is the CA bundle for an https upstream (default: system).
	GitUpstreamCAFile string
	// The git fence signs pushes for the git server's pre-receive hook
	// with the lease's git grant key (Lease.GrantKeys, from the lease
	// service); without one they go out unsigned.

	// PGUpstream is the Postgres server (host:port, or the path of its Unix
	// socket) the agent's database connections go to. Empty: no Postgres
	// fence.
	PGUpstream string
	// PGListen is where the Postgres fence listens (default 127.0.0.1:0).
	PGListen string
	// The Postgres fence signs its tokens with the lease's Postgres grant
	// key (Lease.GrantKeys, from the lease service); the database's secret
	// stays with the database and the service.
	// PGTLS terminates TLS for agents that ask for it (nil: refused).
	PGTLS *tls.Config
	// PGAllowOpaque lets writes whose tables cannot be named (DO, CALL…)
	// through under a live lease; Postgres's fence is then the only check.
	PGAllowOpaque bool

	// AllowHosts are the hosts the agent may reach through the egress
	// proxy, tunnelled untouched (egress.ParseRule: "api.openai.com",
	// "*.anthropic.com", "host:8443"). The git upstream's host is served by
	// the git fence whatever the list says; every other host is refused.
	AllowHosts []string
	// EgressResolve pins names to addresses ("HOST:PORT=ADDR:PORT", like
	// curl --resolve) for the egress proxy's dialer and the git fence's
	// upstream connections.
	EgressResolve []string
	// EgressListen is where the egress proxy listens (default GitListen
	// with GitForward, else 127.0.0.1:0).
	EgressListen string
	// Inject are the hosts whose requests the egress proxy opens to add
	// credentials the agent never holds (egress.Config.Inject); their TLS
	// is terminated with the sidecar's CA, which the agent's clients trust
	// (Fences.CABundle).
	Inject map[string]egress.Injection

	// Policy is the security team's policy in force (nil: none), which
	// every fence asks before what it allows: it only narrows.
	Policy *policy.Store

	// StateDir keeps the sidecar's files: mirrors, the local CA, temp packs.
	StateDir string
	// Metrics, when set, counts the fences' requests, bytes and refusals.
	Metrics *Metrics
	Logger  *slog.Logger
}

// Sidecar runs the fences of one agent.
type Sidecar struct {
	cfg Config
	log *slog.Logger

	git        *http.Server
	gitAddr    net.Addr
	gitBase    string       // upstream base URL the agent's git config maps
	gitHost    string       // its host:port, which the egress proxy serves with the fence
	gitFence   http.Handler // the git fence (counted when Metrics is set)
	ca         *tls.Certificate
	caFile     string // local CA certificate, for an https upstream or injected hosts
	caBundle   string // the system's roots and the CA, for the agent's clients (with Inject)
	pins       map[string]netip.AddrPort
	egress     *egress.Proxy
	egressSrv  *http.Server
	egressAddr net.Addr
	pg         *pgproxy.Proxy
	pgCancel   context.CancelFunc
	serveErr   chan error
	wg         sync.WaitGroup
	closeOnce  sync.Once
	closeError error
}

// Start starts the configured fences.
func Start(ctx context.Context, cfg Config) (*Sidecar, error) {
	if cfg.Lease == nil || cfg.Bus == nil {
		return nil, errors.New("sidecar: a held lease and a bus client are required")
	}
	if cfg.StateDir == "" {
		return nil, errors.New("sidecar: no state dir")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = LeaseLogger(log, cfg.Lease.Lease())
	s := &Sidecar{cfg: cfg, log: log, serveErr: make(chan error, 4)}
	var err error
	if s.pins, err = egress.ParseResolve(cfg.EgressResolve); err != nil {
		return nil, fmt.Errorf("sidecar: %w", err)
	}
	rules, err := egress.ParseRules(cfg.AllowHosts)
	if err != nil {
		return nil, fmt.Errorf("sidecar: %w", err)
	}
	if cfg.GitUpstream != "" {
		if err := s.startGit(); err != nil {
			s.Close(ctx)
			return nil, err
		}
	}
	if err := s.startEgress(rules); err != nil {
		s.Close(ctx)
		return nil, err
	}
	if cfg.PGUpstream != "" {
		if err := s.startPG(); err != nil {
			s.Close(ctx)
			return nil, err
		}
	}
	return s, nil
}

func (s *Sidecar) startPG() error {
	var dial func(ctx context.Context, network, addr string) (net.Conn, error)
	if s.cfg.Metrics != nil {
		dial = s.cfg.Metrics.countDial(lease.BoundaryPostgres, nil)
	}
	ctx, cancel := context.WithCancel(context.Background())
	pg, err := pgproxy.Listen(ctx, pgproxy.Config{
		Listen:      s.cfg.PGListen,
		Upstream:    s.cfg.PGUpstream,
		Lease:       s.cfg.Lease,
		Audit:       s.auditor(),
		TLS:         s.cfg.PGTLS,
		AllowOpaque: s.cfg.PGAllowOpaque,
		Policy:      s.cfg.Policy,
		Logger:      s.log.With("boundary", "postgres"),
		Dial:        dial,
	})
	if err != nil {
		cancel()
		return fmt.Errorf("postgres fence: %w", err)
	}
	s.pg, s.pgCancel = pg, cancel
	s.log.Info("postgres fence serving", "listen", pg.Addr().String(), "upstream", s.cfg.PGUpstream)
	return nil
}

// PGAddr is the Postgres fence's address (nil without one).
func (s *Sidecar) PGAddr() net.Addr {
	if s.pg == nil {
		return nil
	}
	return s.pg.Addr()
}

// Ports are the TCP ports the agent must be able to reach: the fences'
// and the egress proxy's.
func (s *Sidecar) Ports() []uint16 {
	var ports []uint16
	for _, a := range []net.Addr{s.gitAddr, s.PGAddr(), s.egressAddr} {
		if t, ok := a.(*net.TCPAddr); ok && !slices.Contains(ports, uint16(t.Port)) {
			ports = append(ports, uint16(t.Port))
		}
	}
	return ports
}

// EgressURL is the egress proxy's URL ("" before it started).
func (s *Sidecar) EgressURL() string {
	if s.egressAddr == nil {
		return ""
	}
	return "http://" + s.egressAddr.String()
}

// startEgress serves the agent's forward proxy: rules tunnelled, the git
// upstream's host into the git fence, everything else refused.
func (s *Sidecar) startEgress(rules []egress.Rule) error {
	if len(s.cfg.Inject) > 0 {
		if err := s.ensureCA(); err != nil {
			return err
		}
		bundle, err := writeCABundle(s.caFile)
		if err != nil {
			return fmt.Errorf("egress proxy: the agent's CA bundle: %w", err)
		}
		s.caBundle = bundle
	}
	cfg := egress.Config{
		Inject:  s.cfg.Inject,
		Allow:   rules,
		Resolve: s.pins,
		CA:      s.ca,
		Lease:   s.cfg.Lease,
		Policy:  s.cfg.Policy,
		Logger:  s.log.With("boundary", lease.BoundaryNet),
	}
	if a := s.auditor(); a != nil {
		cfg.Audit = a
	}
	if s.gitFence != nil {
		cfg.Intercept = map[string]http.Handler{s.gitHost: s.gitFence}
	}
	if s.cfg.Metrics != nil {
		cfg.Dial = s.cfg.Metrics.countDial(lease.BoundaryNet, nil)
	}
	p, err := egress.New(cfg)
	if err != nil {
		return err
	}
	listen := s.cfg.EgressListen
	if listen == "" && s.cfg.GitForward && s.gitFence != nil {
		listen = s.cfg.GitListen // where the forward-mode git fence listened before
	}
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		p.Close()
		return fmt.Errorf("egress proxy: listen on %s: %w", listen, err)
	}
	s.egress, s.egressAddr = p, ln.Addr()
	s.egressSrv = &http.Server{Handler: p, ReadHeaderTimeout: time.Minute, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	s.wg.Go(func() {
		if err := s.egressSrv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.serveErr <- fmt.Errorf("egress proxy: %w", err)
		}
	})
	if s.cfg.GitForward && s.gitFence != nil {
		s.gitAddr = s.egressAddr // the agent's git reaches its fence through the proxy
	}
	s.log.Info("egress proxy serving", "listen", s.egressAddr.String(), "allow", strings.Join(s.cfg.AllowHosts, ","), "git", s.gitHost)
	return nil
}

func (s *Sidecar) startGit() error {
	base, err := splitUpstream(s.cfg.GitUpstream, s.cfg.GitForward)
	if err != nil {
		return fmt.Errorf("git %w", err)
	}
	repoURL := base.String() // the fence serves this repository's git endpoints only
	base.Path = ""
	s.gitBase = base.String()
	s.gitHost = base.Host
	if base.Port() == "" {
		s.gitHost = net.JoinHostPort(base.Hostname(), map[string]string{"http": "80", "https": "443"}[base.Scheme])
	}
	var transport http.RoundTripper
	if s.cfg.GitUpstreamCAFile != "" || len(s.pins) > 0 {
		tr, err := upstreamTransport(s.cfg.GitUpstreamCAFile, s.pins)
		if err != nil {
			return err
		}
		transport = tr
	}
	fence, err := gitproxy.New(gitproxy.Config{
		Upstream:       repoURL,
		Lease:          s.cfg.Lease,
		Repo:           s.cfg.Lease.Lease().Repo,
		Bus:            s.cfg.Bus,
		Audit:          s.auditor(),
		Policy:         s.cfg.GitPolicy,
		Cedar:          s.cfg.Policy,
		ObjectDirs:     s.cfg.GitObjectDirs,
		MirrorDir:      filepath.Join(s.cfg.StateDir, "git-mirrors"),
		TempDir:        filepath.Join(s.cfg.StateDir, "tmp"),
		UpstreamHeader: s.cfg.GitUpstreamHeader,
		UpstreamCAFile: s.cfg.GitUpstreamCAFile,
		Transport:      transport,
		Logger:         s.log.With("boundary", "git"),
	})
	if err != nil {
		return err
	}
	if err := mkdirs(filepath.Join(s.cfg.StateDir, "tmp")); err != nil {
		return err
	}
	s.gitFence = fence
	if s.cfg.Metrics != nil {
		s.gitFence = s.cfg.Metrics.countHTTP(lease.BoundaryGit, fence)
	}
	if base.Scheme == "https" {
		// The egress proxy serves the upstream's host with the fence,
		// behind certificates this CA mints.
		if err := s.ensureCA(); err != nil {
			return err
		}
	}
	if s.cfg.GitForward {
		return nil // reached through the egress proxy (startEgress)
	}
	listen := s.cfg.GitListen
	if listen == "" {
		listen = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return fmt.Errorf("git fence: listen on %s: %w", listen, err)
	}
	s.gitAddr = ln.Addr()
	s.git = &http.Server{Handler: s.gitFence, ReadHeaderTimeout: time.Minute, ErrorLog: slog.NewLogLogger(s.log.Handler(), slog.LevelDebug)}
	s.wg.Go(func() {
		if err := s.git.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			s.serveErr <- fmt.Errorf("git fence: %w", err)
		}
	})
	s.log.Info("git fence serving", "listen", s.gitAddr.String(), "upstream", s.gitBase)
	return nil
}

// ensureCA loads or makes the sidecar's CA, in its state dir (hidden from
// the agent, which may read only the certificate).
func (s *Sidecar) ensureCA() error {
	if s.ca != nil {
		return nil
	}
	ca, caFile, err := gitproxy.LoadOrCreateCA(filepath.Join(s.cfg.StateDir, "ca"))
	if err != nil {
		return err
	}
	s.ca, s.caFile = &ca, caFile
	return nil
}

// GitURL is the git fence's address ("" without one).
func (s *Sidecar) GitURL() string {
	if s.gitAddr == nil {
		return ""
	}
	return "http://" + s.gitAddr.String()
}

// Err reports a fence that stopped serving on its own.
func (s *Sidecar) Err() <-chan error { return s.serveErr }

// Fences says where the sidecar's fences listen, for the agent's
// environment (Env) and its connect allowlist (Ports).
type Fences struct {
	// Git is the git fence's URL ("" without one); GitUpstream the server
	// base URL it stands for; GitCAFile, in forward mode, the local CA
	// certificate the agent's git must trust (then Git is its HTTP proxy).
	Git         string `json:"git,omitempty"`
	GitUpstream string `json:"gitUpstream,omitempty"`
	GitCAFile   string `json:"gitCAFile,omitempty"`
	// Postgres is the Postgres fence's host:port ("" without one).
	Postgres string `json:"postgres,omitempty"`
	// Egress is the egress proxy's URL, the agent's HTTPS_PROXY and
	// HTTP_PROXY ("" without one); EgressAllow the hosts it tunnels.
	Egress      string   `json:"egress,omitempty"`
	EgressAllow []string `json:"egressAllow,omitempty"`
	// EgressInject are the hosts whose requests the egress proxy opens to
	// add credentials; CAFile is then the certificate of the CA it mints
	// their certificates with, and CABundle the system's roots with it,
	// for the agent's clients (Env sets SSL_CERT_FILE and the like).
	EgressInject []string `json:"egressInject,omitempty"`
	CAFile       string   `json:"caFile,omitempty"`
	CABundle     string   `json:"caBundle,omitempty"`
	// CAPEM is CAFile's certificate, for an agent in another container
	// (LocalCA writes it where that agent can read it).
	CAPEM string `json:"caPEM,omitempty"`
}

// EgressSummary says what the egress proxy lets through, for a person.
func (f Fences) EgressSummary() string {
	allowed := "no host (none is allowed)"
	if len(f.EgressAllow) > 0 {
		allowed = strings.Join(f.EgressAllow, ", ")
	}
	s := "tunnels " + allowed
	if len(f.EgressInject) > 0 {
		s += "; opens " + strings.Join(f.EgressInject, ", ") + " to add their credentials (the agent holds placeholders)"
	}
	if f.GitUpstream != "" {
		s += "; " + f.GitUpstream + " goes to the git fence"
	}
	return s + "; every other host is refused"
}

// Fences reports where the fences listen.
func (s *Sidecar) Fences() Fences {
	f := Fences{Git: s.GitURL(), Egress: s.EgressURL()}
	if f.Git != "" {
		f.GitUpstream = s.gitBase
		if s.cfg.GitForward {
			f.GitCAFile = s.caFile
		}
	}
	if s.egress != nil {
		f.EgressAllow = s.egress.Rules()
	}
	if s.caBundle != "" {
		for hp := range s.cfg.Inject {
			f.EgressInject = append(f.EgressInject, hp)
		}
		slices.Sort(f.EgressInject)
		f.CAFile, f.CABundle = s.caFile, s.caBundle
		if pem, err := os.ReadFile(s.caFile); err == nil {
			f.CAPEM = string(pem)
		}
	}
	if a := s.PGAddr(); a != nil {
		f.Postgres = a.String()
	}
	return f
}

// AgentEnv is what the agent's environment needs so that unmodified git
// goes through the fences: git config entries passed as
// GIT_CONFIG_COUNT/GIT_CONFIG_KEY_n/GIT_CONFIG_VALUE_n, no change to the
// agent or its repository's config. base is the agent's environment,
// whose own GIT_CONFIG_* entries are kept.
func (s *Sidecar) AgentEnv(base []string) []string { return s.Fences().Env(base) }

// Env is base with what routes the agent's git and Postgres clients
// through the fences (see Sidecar.AgentEnv).
func (f Fences) Env(base []string) []string {
	var keys, values []string
	if f.Git != "" {
		if f.GitCAFile != "" {
			keys = append(keys, "http."+f.GitUpstream+"/.proxy", "http."+f.GitUpstream+"/.sslCAInfo")
			values = append(values, f.Git, f.GitCAFile)
		} else {
			// insteadOf routes fetches too: the file guard lets the agent
			// reach the sidecar, not the git server.
			keys = append(keys, "url."+f.Git+"/.insteadOf", "url."+f.Git+"/.pushInsteadOf")
			values = append(values, f.GitUpstream+"/", f.GitUpstream+"/")
		}
	}
	if f.Git != "" && f.GitCAFile != "" {
		// GIT_SSL_CAINFO would override http.<upstream>.sslCAInfo (git
		// lets the environment win over config) and the intercepted git
		// host would fail verification.
		base = slices.DeleteFunc(slices.Clone(base), func(kv string) bool { return strings.HasPrefix(kv, "GIT_SSL_CAINFO=") })
	}
	env := withGitConfig(base, keys, values)
	if host, port, err := net.SplitHostPort(f.Postgres); err == nil {
		env = withPG(env, host, port)
	}
	if f.Egress != "" {
		env = withProxy(env, f.Egress)
		env = withResolverTCP(env)
	}
	if f.CABundle != "" {
		env = withCABundle(env, f.CABundle, f.CAFile)
	}
	return env
}

// noProxy are the hosts the agent's clients reach directly, not through
// the egress proxy: the sidecar's fences (git's insteadOf URL, Postgres)
// listen on loopback. Tools spell them differently; localhost does not
// cover 127.0.0.1 for all of them.
var noProxy = []string{"127.0.0.1", "localhost", "::1"}

// withProxy points every HTTP client convention at the egress proxy:
// HTTPS_PROXY and HTTP_PROXY in both cases (curl and git, Go, Python,
// the agent CLIs), NO_PROXY with the loopback names added, and
// NODE_USE_ENV_PROXY=1 for Node's built-in fetch (Node 24, late 22.x;
// older Node ignores it, and the guard then captures its direct
// connection into the proxy). ALL_PROXY is dropped: it would name a
// proxy the guard does not let the agent reach.
func withProxy(env []string, proxyURL string) []string {
	var noProxyVals []string
	out := make([]string, 0, len(env)+8)
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy", "NODE_USE_ENV_PROXY":
			continue
		case "NO_PROXY", "no_proxy":
			for _, h := range strings.Split(v, ",") {
				if h = strings.TrimSpace(h); h != "" && !slices.Contains(noProxyVals, h) {
					noProxyVals = append(noProxyVals, h)
				}
			}
			continue
		}
		out = append(out, kv)
	}
	for _, h := range noProxy {
		if !slices.Contains(noProxyVals, h) {
			noProxyVals = append(noProxyVals, h)
		}
	}
	np := strings.Join(noProxyVals, ",")
	return append(out, "HTTPS_PROXY="+proxyURL, "https_proxy="+proxyURL, "HTTP_PROXY="+proxyURL, "http_proxy="+proxyURL,
		"NO_PROXY="+np, "no_proxy="+np, "NODE_USE_ENV_PROXY=1")
}

// withResolverTCP adds use-vc to RES_OPTIONS: glibc's resolver (curl,
// Node's dns.lookup and fetch, Python, cgo Go programs) then asks its
// name server over TCP, which the file guard captures and the egress
// proxy answers (names the agent may reach only). UDP never leaves the
// sandbox: the guard refuses datagram sockets.
func withResolverTCP(env []string) []string {
	out := make([]string, 0, len(env)+1)
	opts := "use-vc"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "RES_OPTIONS="); ok {
			if !slices.Contains(strings.Fields(v), "use-vc") {
				opts = strings.TrimSpace(v + " use-vc")
			} else {
				opts = v
			}
			continue
		}
		out = append(out, kv)
	}
	return append(out, "RES_OPTIONS="+opts)
}

// Capture is where the file guard hands the agent's TCP connects that
// skip the egress proxy (fsguard.Policy.Capture): the proxy's address,
// on the loopback when it listens on every address. Zero without a proxy.
func (f Fences) Capture() netip.AddrPort {
	u, err := url.Parse(f.Egress)
	if err != nil || f.Egress == "" {
		return netip.AddrPort{}
	}
	ap, err := netip.ParseAddrPort(u.Host)
	if err != nil {
		return netip.AddrPort{}
	}
	if ap.Addr().IsUnspecified() {
		ap = netip.AddrPortFrom(netip.AddrFrom4([4]byte{127, 0, 0, 1}), ap.Port())
	}
	return ap
}

// Ports are the TCP ports of the fences and the egress proxy.
func (f Fences) Ports() []uint16 {
	var ports []uint16
	for _, raw := range []string{f.Git, f.Egress} {
		if u, err := url.Parse(raw); err == nil && u.Port() != "" {
			if n, err := strconv.ParseUint(u.Port(), 10, 16); err == nil && !slices.Contains(ports, uint16(n)) {
				ports = append(ports, uint16(n))
			}
		}
	}
	if _, p, err := net.SplitHostPort(f.Postgres); err == nil {
		if n, err := strconv.ParseUint(p, 10, 16); err == nil {
			ports = append(ports, uint16(n))
		}
	}
	return ports
}

// withPG points libpq's environment (PGHOST, PGPORT) and a DATABASE_URL at
// the Postgres fence; everything else in the URL (user, database,
// options) stays.
func withPG(env []string, host, port string) []string {
	out := make([]string, 0, len(env)+2)
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		switch k {
		case "PGHOST", "PGPORT", "PGHOSTADDR":
			continue
		case "DATABASE_URL":
			kv = k + "=" + rewriteDSN(v, host, port)
		}
		out = append(out, kv)
	}
	return append(out, "PGHOST="+host, "PGPORT="+port)
}

// rewriteDSN replaces the server of a postgres:// URL or a keyword/value
// connection string with host:port.
func rewriteDSN(dsn, host, port string) string {
	if u, err := url.Parse(dsn); err == nil && (u.Scheme == "postgres" || u.Scheme == "postgresql") {
		u.Host = net.JoinHostPort(host, port)
		q := u.Query()
		q.Del("host")
		q.Del("port")
		q.Del("hostaddr")
		u.RawQuery = q.Encode()
		return u.String()
	}
	var kept []string
	for _, f := range strings.Fields(dsn) {
		k, _, _ := strings.Cut(f, "=")
		if k != "host" && k != "port" && k != "hostaddr" {
			kept = append(kept, f)
		}
	}
	return strings.Join(append(kept, "host="+host, "port="+port), " ")
}

// withGitConfig appends git config entries to env's GIT_CONFIG_* list.
func withGitConfig(env []string, keys, values []string) []string {
	if len(keys) == 0 {
		return env
	}
	n := 0
	out := make([]string, 0, len(env)+2*len(keys)+1)
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "GIT_CONFIG_COUNT="); ok {
			n, _ = strconv.Atoi(v)
			continue
		}
		out = append(out, kv)
	}
	for i := range keys {
		out = append(out, fmt.Sprintf("GIT_CONFIG_KEY_%d=%s", n+i, keys[i]), fmt.Sprintf("GIT_CONFIG_VALUE_%d=%s", n+i, values[i]))
	}
	return append(out, fmt.Sprintf("GIT_CONFIG_COUNT=%d", n+len(keys)))
}

// Close stops the fences: in-flight requests finish (bounded by ctx), new
// ones are refused. It does not release the lease; the caller does, once
// the agent has settled.
func (s *Sidecar) Close(ctx context.Context) error {
	s.closeOnce.Do(func() {
		var errs []error
		if s.git != nil {
			if err := s.git.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("git fence: %w", err))
				s.git.Close()
			}
		}
		if s.egressSrv != nil {
			if err := s.egressSrv.Shutdown(ctx); err != nil {
				errs = append(errs, fmt.Errorf("egress proxy: %w", err))
				s.egressSrv.Close()
			}
		}
		if s.egress != nil {
			s.egress.Close() // tunnels and intercepted connections
		}
		if s.pg != nil {
			if err := s.pg.Close(); err != nil {
				errs = append(errs, fmt.Errorf("postgres fence: %w", err))
			}
			s.pgCancel()
		}
		s.wg.Wait()
		s.closeError = errors.Join(errs...)
	})
	return s.closeError
}

// auditor is the fences' Auditor: Config.Audit (when set), counted by
// Config.Metrics (when set); nil when neither is.
func (s *Sidecar) auditor() lease.Auditor {
	var a lease.Auditor
	if s.cfg.Audit != nil {
		a = s.cfg.Audit
	}
	if s.cfg.Metrics != nil {
		a = s.cfg.Metrics.Auditor(a)
	}
	return a
}

// LeaseLogger is log with the ids every line about the lease carries:
// lease, attempt, fence. A line that names one of them itself (a fence's
// refusal names the lease and fence it judged) carries its own value
// alone: no key twice in a line.
func LeaseLogger(log *slog.Logger, l lease.Lease) *slog.Logger {
	return slog.New(&leaseHandler{h: log.Handler(), attrs: []slog.Attr{
		slog.String("lease", l.LeaseID), slog.String("attempt", l.Owner.AttemptID), slog.Uint64("fence", l.Fence)}})
}

// leaseHandler adds attrs (the lease's ids and what was added with With)
// to each record but those the record names itself.
type leaseHandler struct {
	h     slog.Handler
	attrs []slog.Attr
}

func (d *leaseHandler) Enabled(ctx context.Context, l slog.Level) bool { return d.h.Enabled(ctx, l) }

func (d *leaseHandler) Handle(ctx context.Context, r slog.Record) error {
	own := map[string]bool{}
	r.Attrs(func(a slog.Attr) bool { own[a.Key] = true; return true })
	nr := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	for _, a := range d.attrs {
		if !own[a.Key] {
			nr.AddAttrs(a)
		}
	}
	r.Attrs(func(a slog.Attr) bool { nr.AddAttrs(a); return true })
	return d.h.Handle(ctx, nr)
}

func (d *leaseHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &leaseHandler{h: d.h, attrs: append(slices.Clip(d.attrs), as...)}
}

// WithGroup: the attrs so far go outside the group, as with any handler.
func (d *leaseHandler) WithGroup(name string) slog.Handler {
	return d.h.WithAttrs(d.attrs).WithGroup(name)
}
