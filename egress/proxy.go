package egress

import (
	"bufio"
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/elazarl/goproxy"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// LeaseSource names the lease a refusal is recorded under (a
// lease.Source without the gate: the proxy judges hosts, not writes).
type LeaseSource interface {
	Lease() lease.Lease
}

// Config configures a Proxy. The zero value refuses everything.
type Config struct {
	// Allow are the hosts the agent may reach, tunnelled untouched.
	Allow []Rule
	// Resolve pins "host:port" to an address (see ParseResolve); a pinned
	// address is dialled even when it is loopback.
	Resolve map[string]netip.AddrPort
	// Intercept maps "host:port" to the handler that serves it instead of
	// the host (the git fence for the git upstream). A CONNECT to it is
	// answered by the proxy itself: TLS terminated with a certificate
	// minted by CA when the client starts TLS, plain HTTP otherwise.
	Intercept map[string]http.Handler
	// Inject maps "host:port" to the credentials the proxy adds to that
	// host's requests and the API rules it judges them by (Injection):
	// intercepted like the git upstream, so the CA is needed.
	Inject map[string]Injection
	// CA signs the certificates of intercepted hosts (needed for https).
	CA *tls.Certificate
	// Lease and Audit: every refusal names the lease and is recorded
	// (*leasebus.Holder and *leasebus.Auditor are both; egress links no
	// NATS: it knows only the lease domain).
	Lease LeaseSource
	Audit lease.Auditor
	// Hint is the flag a refusal tells the user to add (default
	// "--allow-host").
	Hint string
	// Policy, when set, is the security team's policy (action connect on
	// the host and port), asked after the allowlist allows a host: it
	// only narrows it. Nil: no policy.
	Policy *policy.Store
	// Dial connects to a judged address (default a net.Dialer).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// LookupIP resolves a name (default net.DefaultResolver).
	LookupIP func(ctx context.Context, host string) ([]netip.Addr, error)
	// DNSSearch are the stub resolver's search domains (nil: those of
	// /etc/resolv.conf, which the agent shares in a pod and under run).
	// A lookup of an allowed name with one appended is what a resolver
	// tries first (ndots): it is answered NXDOMAIN without an audit event.
	DNSSearch []string
	// DialTimeout bounds resolving and connecting (default 10 s).
	DialTimeout time.Duration
	Logger      *slog.Logger
}

// Proxy is the agent's HTTP(S) forward proxy: an http.Handler. Serve it on
// a listener the agent may reach, and Close it after the server.
type Proxy struct {
	cfg       Config
	log       *slog.Logger
	intercept map[string]http.Handler
	gp        *goproxy.ProxyHttpServer
	tr        *http.Transport
	mint      func(host string, ctx *goproxy.ProxyCtx) (*tls.Config, error)
	certs     sync.Map // host -> *tls.Config
	injectors []*injector

	mu     sync.Mutex
	conns  map[net.Conn]struct{} // guarded by mu: hijacked client and upstream connections
	closed bool                  // guarded by mu
	wg     sync.WaitGroup
}

// New returns the proxy of cfg.
func New(cfg Config) (*Proxy, error) {
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if cfg.Hint == "" {
		cfg.Hint = "--allow-host"
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 10 * time.Second
	}
	if cfg.Dial == nil {
		d := &net.Dialer{}
		cfg.Dial = d.DialContext
	}
	if cfg.LookupIP == nil {
		cfg.LookupIP = func(ctx context.Context, host string) ([]netip.Addr, error) {
			return net.DefaultResolver.LookupNetIP(ctx, "ip", host)
		}
	}
	if cfg.DNSSearch == nil {
		cfg.DNSSearch = resolvConfSearch("/etc/resolv.conf")
	}
	p := &Proxy{cfg: cfg, log: log, intercept: map[string]http.Handler{}, conns: map[net.Conn]struct{}{}}
	for hp, h := range cfg.Intercept {
		host, port, err := splitTarget(hp, DefaultPort)
		if err != nil {
			return nil, fmt.Errorf("egress: intercepted host %q: %w", hp, err)
		}
		p.intercept[hostPort(host, port)] = h
	}
	for hp, inj := range cfg.Inject {
		t, err := newTarget(hp, DefaultPort)
		if err != nil {
			return nil, fmt.Errorf("egress: injected host %q: %w", hp, err)
		}
		if _, dup := p.intercept[t.String()]; dup {
			return nil, fmt.Errorf("egress: %s is served by another fence already (the git upstream?): give its credentials to that fence", t)
		}
		if cfg.CA == nil {
			return nil, fmt.Errorf("egress: credentials injected for %s need a CA to terminate its TLS", t)
		}
		in := p.newInjector(t, inj)
		p.intercept[t.String()] = in
		p.injectors = append(p.injectors, in)
	}
	if cfg.CA != nil {
		if cfg.CA.PrivateKey == nil {
			return nil, errors.New("egress: the CA for intercepted hosts has no private key")
		}
		p.mint = goproxy.TLSConfigFromCA(cfg.CA)
	}
	// Plain http:// requests to allowed hosts go through goproxy, whose
	// transport dials only what dialJudged allows.
	p.tr = &http.Transport{
		Proxy:                 nil, // never chain to the sidecar's own proxy settings
		DialContext:           p.dialJudged,
		MaxIdleConns:          16,
		IdleConnTimeout:       30 * time.Second,
		TLSHandshakeTimeout:   10 * time.Second,
		ResponseHeaderTimeout: 5 * time.Minute,
	}
	p.gp = goproxy.NewProxyHttpServer()
	p.gp.Tr = p.tr
	p.gp.Logger = slogPrinter{log}
	return p, nil
}

// target is one request's destination, normalized.
type target struct {
	host string
	addr netip.Addr // valid when host is an IP literal
	port int
}

func (t target) String() string { return hostPort(t.host, t.port) }

func newTarget(hp string, defPort int) (target, error) {
	host, port, err := splitTarget(hp, defPort)
	if err != nil {
		return target{}, err
	}
	t := target{host: host, port: port}
	if a, err := netip.ParseAddr(host); err == nil {
		t.addr = a.Unmap()
		t.host = t.addr.String()
	}
	return t, nil
}

// splitTarget reads host[:port] (port defPort when absent; required when
// defPort is 0).
func splitTarget(hp string, defPort int) (string, int, error) {
	h, p, err := net.SplitHostPort(hp)
	if err != nil {
		if defPort == 0 {
			return "", 0, fmt.Errorf("want host:port: %w", err)
		}
		return normHost(hp), defPort, nil
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 1 || n > 65535 {
		return "", 0, fmt.Errorf("bad port %q", p)
	}
	if h == "" {
		return "", 0, errors.New("no host")
	}
	return normHost(h), n, nil
}

// refusal is a request the policy refuses.
type refusal struct {
	target target
	why    string
	hint   string
	reason string // the audit's reason code (default not-allowed)
}

func (r *refusal) Error() string { return r.target.String() + ": " + r.why }

// allowed judges t by name: nil when an allowlist entry covers it.
func (p *Proxy) allowed(t target) *refusal {
	for _, r := range p.cfg.Allow {
		if r.matches(t.host, t.addr, t.port) {
			return p.policyAllows(t)
		}
	}
	flag := p.cfg.Hint + " " + t.host
	if t.port != DefaultPort {
		flag = p.cfg.Hint + " " + t.String()
	}
	if t.addr.IsValid() {
		return &refusal{target: t, why: "an IP address is reached only when allowed by address",
			hint: "allow it with " + flag + " if the agent must reach it"}
	}
	return &refusal{target: t, why: "not on the egress allowlist", hint: "let the agent reach it with " + flag}
}

// resolve is where a connection to t goes, judged: a pin, an allowed IP
// literal, or a resolved address that is none of the sidecar's own
// (loopback) or link-local ones. Every address DNS gives must pass.
func (p *Proxy) resolve(ctx context.Context, t target) (netip.AddrPort, error) {
	if pin, ok := p.cfg.Resolve[t.String()]; ok {
		return pin, nil // explicitly pinned
	}
	if t.addr.IsValid() {
		return netip.AddrPortFrom(t.addr, uint16(t.port)), nil // allowed by address
	}
	addrs, err := p.cfg.LookupIP(ctx, t.host)
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("resolve %s: %w", t.host, err)
	}
	if len(addrs) == 0 {
		return netip.AddrPort{}, fmt.Errorf("resolve %s: no addresses", t.host)
	}
	for _, a := range addrs {
		why := forbidden(a)
		if why == "" && localAddr(a) {
			why = "an address of this host (its services listen there)"
		}
		if why != "" {
			return netip.AddrPort{}, &refusal{target: t, why: fmt.Sprintf("it resolves to %s, %s", a.Unmap(), why),
				hint: fmt.Sprintf("pin it with --egress-resolve %s=ADDR:PORT if that is really meant", t)}
		}
	}
	if rf := p.notTheGitUpstream(ctx, t, addrs); rf != nil {
		return netip.AddrPort{}, rf
	}
	return netip.AddrPortFrom(addrs[0].Unmap(), uint16(t.port)), nil
}

// notTheGitUpstream refuses a name that resolves to an address of an
// intercepted host (the git upstream), on any port: another name for the
// git server (a CNAME, an alias under an allowed wildcard) would carry a
// push around the git fence. When an intercepted host cannot be resolved
// now, the name is refused too (fail closed).
func (p *Proxy) notTheGitUpstream(ctx context.Context, t target, addrs []netip.Addr) *refusal {
	for hp, h := range p.intercept {
		it, err := newTarget(hp, 0)
		if err != nil || it.String() == t.String() {
			continue // itself: an injected host is dialled by its injector
		}
		what := "the git upstream"
		if _, ok := h.(*injector); ok {
			what = "the injected host"
		}
		var theirs []netip.Addr
		switch pin, ok := p.cfg.Resolve[it.String()]; {
		case ok:
			theirs = []netip.Addr{pin.Addr()}
		case it.addr.IsValid():
			theirs = []netip.Addr{it.addr}
		default:
			if theirs, err = p.cfg.LookupIP(ctx, it.host); err != nil {
				return &refusal{target: t, why: fmt.Sprintf("%s %s cannot be resolved now to tell it apart (%v)", what, it.host, err),
					hint: "retry, or pin the name with --egress-resolve"}
			}
		}
		for _, a := range addrs {
			for _, g := range theirs {
				if a.Unmap() == g.Unmap() {
					return &refusal{target: t, why: fmt.Sprintf("it resolves to %s, an address of %s %s, which is reached only through its fence", a.Unmap(), what, it.host),
						hint: map[bool]string{true: "push and fetch through ", false: "reach it by its own name, "}[what == "the git upstream"] + it.String()}
				}
			}
		}
	}
	return nil
}

// dial connects to t: judged by name, resolved once, the resolved
// address judged and dialled (never the name again: no DNS rebinding
// between the check and the connection).
func (p *Proxy) dial(ctx context.Context, t target) (net.Conn, error) {
	if rf := p.allowed(t); rf != nil {
		return nil, rf
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.DialTimeout)
	defer cancel()
	ap, err := p.resolve(ctx, t)
	if err != nil {
		return nil, err
	}
	c, err := p.cfg.Dial(ctx, "tcp", ap.String())
	if err != nil {
		return nil, fmt.Errorf("connect to %s (%s): %w", t, ap, err)
	}
	return c, nil
}

// dialJudged is the plain-HTTP transport's dialer.
func (p *Proxy) dialJudged(ctx context.Context, network, addr string) (net.Conn, error) {
	t, err := newTarget(addr, 80)
	if err != nil {
		return nil, err
	}
	if _, ok := p.intercept[t.String()]; ok {
		return nil, fmt.Errorf("%s is served by the fence, never dialled", t)
	}
	return p.dial(ctx, t)
}

// ServeHTTP serves one proxy request: CONNECT or an absolute-URI request.
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodConnect && r.Header.Get(CaptureHeader) != "" {
		p.serveCaptured(w, r)
		return
	}
	if r.Method == http.MethodConnect {
		p.serveConnect(w, r)
		return
	}
	if !r.URL.IsAbs() || r.URL.Host == "" {
		http.Error(w, "fenceline egress proxy: send requests for absolute URLs (HTTP_PROXY) or CONNECT (HTTPS_PROXY)", http.StatusBadRequest)
		return
	}
	if r.URL.Scheme != "http" {
		http.Error(w, "fenceline egress proxy: only http:// URLs are proxied as requests; https goes through CONNECT", http.StatusBadRequest)
		return
	}
	t, err := newTarget(r.URL.Host, 80)
	if err != nil {
		http.Error(w, "fenceline egress proxy: "+err.Error(), http.StatusBadRequest)
		return
	}
	if h, ok := p.intercept[t.String()]; ok {
		r2 := r.Clone(r.Context())
		r2.URL.Scheme, r2.URL.Host = "", ""
		r2.RequestURI = r2.URL.RequestURI()
		r2.Header.Del("Proxy-Connection")
		r2.Header.Del("Proxy-Authorization")
		h.ServeHTTP(w, r2)
		return
	}
	if rf := p.allowed(t); rf != nil {
		p.refuse(w, r, rf)
		return
	}
	p.shadow(r, t)
	// Judge the address now, for a clear answer; the transport's dialer
	// judges again what it actually dials.
	ctx, cancel := context.WithTimeout(r.Context(), p.cfg.DialTimeout)
	_, err = p.resolve(ctx, t)
	cancel()
	var rf *refusal
	if errors.As(err, &rf) {
		p.refuse(w, r, rf)
		return
	}
	p.gp.ServeHTTP(w, r)
}

func (p *Proxy) serveConnect(w http.ResponseWriter, r *http.Request) {
	t, err := newTarget(r.Host, 0)
	if err != nil {
		http.Error(w, "fenceline egress proxy: CONNECT "+r.Host+": "+err.Error(), http.StatusBadRequest)
		return
	}
	if h, ok := p.intercept[t.String()]; ok {
		client, br, ok := p.hijack(w)
		if !ok {
			return
		}
		defer p.untrack(client)
		if _, err := client.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
			return
		}
		p.serveIntercepted(r, t, &bufConn{Conn: client, r: br}, h)
		return
	}
	up, err := p.dial(r.Context(), t)
	var rf *refusal
	switch {
	case errors.As(err, &rf):
		p.refuse(w, r, rf)
		return
	case err != nil:
		p.log.Warn("fenceline egress: cannot reach an allowed host", "target", t.String(), "err", err)
		http.Error(w, "fenceline egress proxy: "+err.Error(), http.StatusBadGateway)
		return
	}
	p.shadow(r, t)
	if !p.track(up) {
		up.Close()
		http.Error(w, "fenceline egress proxy: shutting down", http.StatusServiceUnavailable)
		return
	}
	defer p.untrack(up)
	client, br, ok := p.hijack(w)
	if !ok {
		return
	}
	defer p.untrack(client)
	if _, err := client.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		return
	}
	p.pipe(client, br, up)
}

// hijack takes the client connection over and tracks it.
func (p *Proxy) hijack(w http.ResponseWriter) (net.Conn, *bufio.Reader, bool) {
	hj, ok := w.(http.Hijacker)
	if !ok {
		http.Error(w, "fenceline egress proxy: cannot tunnel on this connection", http.StatusInternalServerError)
		return nil, nil, false
	}
	c, rw, err := hj.Hijack()
	if err != nil {
		p.log.Warn("fenceline egress: hijack", "err", err)
		return nil, nil, false
	}
	if !p.track(c) {
		c.Close()
		return nil, nil, false
	}
	return c, rw.Reader, true
}

// pipe copies bytes both ways until both directions end. Bytes the
// client sent with its CONNECT (buffered in br) go first.
func (p *Proxy) pipe(client net.Conn, br *bufio.Reader, up net.Conn) {
	done := make(chan struct{})
	p.wg.Go(func() {
		defer close(done)
		io.Copy(up, br)
		if cw, ok := up.(interface{ CloseWrite() error }); ok {
			cw.CloseWrite()
		} else {
			up.Close()
		}
	})
	io.Copy(client, up)
	client.Close()
	up.Close()
	<-done
}

// serveIntercepted serves h on the tunnel: TLS with a minted certificate
// when the client starts TLS, plain HTTP otherwise.
func (p *Proxy) serveIntercepted(r *http.Request, t target, c *bufConn, h http.Handler) {
	c.SetReadDeadline(time.Now().Add(30 * time.Second))
	first, err := c.r.Peek(1)
	c.SetReadDeadline(time.Time{})
	if err != nil {
		return
	}
	conn := net.Conn(c)
	if first[0] == 0x16 { // a TLS handshake record
		cfg, err := p.tlsConfig(r, t)
		if err != nil {
			p.log.Error("fenceline egress: cannot serve an intercepted host over TLS", "target", t.String(), "err", err)
			return
		}
		conn = tls.Server(c, cfg)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: time.Minute, ErrorLog: slog.NewLogLogger(p.log.Handler(), slog.LevelDebug)}
	srv.Serve(newConnListener(conn)) // returns once the connection is done
}

func (p *Proxy) tlsConfig(r *http.Request, t target) (*tls.Config, error) {
	if cfg, ok := p.certs.Load(t.host); ok {
		return cfg.(*tls.Config), nil
	}
	if p.mint == nil {
		return nil, errors.New("no CA to mint its certificate")
	}
	cfg, err := p.mint(t.host, &goproxy.ProxyCtx{Req: r, Proxy: p.gp})
	if err != nil {
		return nil, err
	}
	cfg.NextProtos = []string{"http/1.1"}
	p.certs.Store(t.host, cfg)
	return cfg, nil
}

// refuse answers 403 naming the host, the lease and what to do, logs it
// and records it in the audit.
func (p *Proxy) refuse(w http.ResponseWriter, r *http.Request, rf *refusal) {
	what := rf.target.String()
	if r.Method != http.MethodConnect {
		what = r.Method + " " + r.URL.Redacted()
	}
	msg := p.recordRefusal(r.Context(), what, rf)
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Proxy-Status", fmt.Sprintf("fenceline; error=http_request_denied; details=%q", rf.why))
	w.Header().Set("Connection", "close")
	w.WriteHeader(http.StatusForbidden)
	io.WriteString(w, msg+"\n")
}

// recordRefusal logs the refusal of what and records it in the audit
// (boundary net, naming the lease, owner and fence); it returns the
// message.
func (p *Proxy) recordRefusal(ctx context.Context, what string, rf *refusal) string {
	l := p.lease()
	msg := fmt.Sprintf("fenceline egress: %s refused for lease %s (%s, fence %d): %s", what, orNone(l.LeaseID), l.Owner, l.Fence, rf.why)
	if rf.hint != "" {
		msg += "; " + rf.hint
	}
	reason := cmp.Or(rf.reason, lease.ReasonNotAllowed)
	p.log.Warn(msg, "target", rf.target.String(), "reason", reason)
	if p.cfg.Audit != nil {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		ev := lease.AuditEvent{
			Time: time.Now().UTC(), Type: lease.EventDenied, Boundary: lease.BoundaryNet,
			Repo: l.Repo, LeaseID: l.LeaseID, Owner: l.Owner, Scope: l.Scope, Fence: l.Fence,
			Reason: reason, Message: msg,
		}
		if err := p.cfg.Audit.Record(ctx, ev); err != nil {
			p.log.Error("fenceline egress: refusal not recorded in the audit", "err", err)
		}
		cancel()
	}
	return msg
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func (p *Proxy) track(c net.Conn) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return false
	}
	p.conns[c] = struct{}{}
	p.wg.Add(1)
	return true
}

func (p *Proxy) untrack(c net.Conn) {
	c.Close()
	p.mu.Lock()
	delete(p.conns, c)
	p.mu.Unlock()
	p.wg.Done()
}

// Close ends every tunnel and intercepted connection and waits for their
// handlers; close the http.Server serving the proxy first.
func (p *Proxy) Close() error {
	p.mu.Lock()
	p.closed = true
	conns := slices.Collect(func(yield func(net.Conn) bool) {
		for c := range p.conns {
			if !yield(c) {
				return
			}
		}
	})
	p.mu.Unlock()
	for _, c := range conns {
		c.Close()
	}
	p.wg.Wait()
	p.tr.CloseIdleConnections()
	for _, in := range p.injectors {
		in.tr.CloseIdleConnections()
	}
	return nil
}

// bufConn reads through r, which holds what the client sent with its
// CONNECT.
type bufConn struct {
	net.Conn
	r *bufio.Reader
}

func (c *bufConn) Read(b []byte) (int, error) { return c.r.Read(b) }

// connListener yields one connection, then blocks until it is closed.
type connListener struct {
	conn *notifyConn
	once sync.Once
	done chan struct{}
}

func newConnListener(c net.Conn) *connListener {
	l := &connListener{done: make(chan struct{})}
	l.conn = &notifyConn{Conn: c, onClose: func() { close(l.done) }}
	return l
}

func (l *connListener) Accept() (net.Conn, error) {
	var c net.Conn
	l.once.Do(func() { c = l.conn })
	if c != nil {
		return c, nil
	}
	<-l.done
	return nil, net.ErrClosed
}

func (l *connListener) Close() error   { return nil }
func (l *connListener) Addr() net.Addr { return l.conn.LocalAddr() }

// notifyConn calls onClose once when closed.
type notifyConn struct {
	net.Conn
	once    sync.Once
	onClose func()
}

func (c *notifyConn) Close() error {
	err := c.Conn.Close()
	c.once.Do(c.onClose)
	return err
}

// slogPrinter routes goproxy's log lines to slog at debug level.
type slogPrinter struct{ log *slog.Logger }

func (s slogPrinter) Printf(format string, v ...any) {
	s.log.Debug(fmt.Sprintf(format, v...), "component", "goproxy")
}

// Rules reports the allowlist, for messages.
func (p *Proxy) Rules() []string {
	var out []string
	for _, r := range p.cfg.Allow {
		out = append(out, r.String())
	}
	return out
}

// lease is the lease refusals are recorded under (zero without one).
func (p *Proxy) lease() lease.Lease {
	if p.cfg.Lease == nil {
		return lease.Lease{}
	}
	return p.cfg.Lease.Lease()
}
