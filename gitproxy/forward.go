package gitproxy

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/elazarl/goproxy"
)

// Forward is the forward-proxy mode, for agents whose remotes are
// https:// URLs: git reaches the git host through it (http.proxy), it
// answers the CONNECT itself, terminates TLS with a certificate for the host
// minted by a local CA (which git trusts through http.sslCAInfo), and hands
// each request to the host's Proxy — the same fence as the reverse mode.
// CONNECTs to other hosts are tunnelled untouched.
type Forward struct {
	gp    *goproxy.ProxyHttpServer
	hosts map[string]http.Handler
	tls   func(host string, ctx *goproxy.ProxyCtx) (*tls.Config, error)
	log   *slog.Logger

	mu     sync.Mutex
	conns  map[net.Conn]struct{} // guarded by mu
	closed bool                  // guarded by mu
	wg     sync.WaitGroup
}

// ForwardConfig configures a Forward proxy.
type ForwardConfig struct {
	// Hosts maps each intercepted git host ("host:port", port 443 when
	// omitted) to the Proxy that fences it; its Upstream is https://host:port.
	Hosts map[string]http.Handler
	// CA signs the certificates presented for intercepted hosts.
	CA     tls.Certificate
	Logger *slog.Logger
}

// NewForward returns a forward proxy for cfg; serve it with an http.Server.
func NewForward(cfg ForwardConfig) (*Forward, error) {
	if len(cfg.Hosts) == 0 {
		return nil, errors.New("gitproxy: forward proxy with no git hosts to intercept")
	}
	if cfg.CA.PrivateKey == nil {
		return nil, errors.New("gitproxy: forward proxy needs a CA (see LoadOrCreateCA)")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	f := &Forward{
		gp:    goproxy.NewProxyHttpServer(),
		hosts: make(map[string]http.Handler, len(cfg.Hosts)),
		tls:   goproxy.TLSConfigFromCA(&cfg.CA),
		log:   log,
		conns: make(map[net.Conn]struct{}),
	}
	for h, p := range cfg.Hosts {
		if _, _, err := net.SplitHostPort(h); err != nil {
			h = net.JoinHostPort(h, "443")
		}
		f.hosts[h] = p
	}
	f.gp.Logger = slogPrinter{log}
	f.gp.OnRequest(goproxy.ReqConditionFunc(func(r *http.Request, _ *goproxy.ProxyCtx) bool {
		_, ok := f.hosts[r.URL.Host]
		return ok
	})).HijackConnect(f.intercept)
	return f, nil
}

// ServeHTTP serves proxy requests.
func (f *Forward) ServeHTTP(w http.ResponseWriter, r *http.Request) { f.gp.ServeHTTP(w, r) }

// intercept terminates TLS for an intercepted host and serves the fence
// on the connection until the client is done.
func (f *Forward) intercept(r *http.Request, client net.Conn, ctx *goproxy.ProxyCtx) {
	if !f.track(client) {
		client.Close()
		return
	}
	defer f.untrack(client)
	defer client.Close()
	if _, err := client.Write([]byte("HTTP/1.1 200 Connection established\r\n\r\n")); err != nil {
		return
	}
	cfg, err := f.tls(r.URL.Host, ctx)
	if err != nil {
		f.log.Error("cannot mint a certificate", "host", r.URL.Host, "err", err)
		return
	}
	conn := tls.Server(client, cfg)
	srv := &http.Server{Handler: f.hosts[r.URL.Host], ReadHeaderTimeout: time.Minute, ErrorLog: slog.NewLogLogger(f.log.Handler(), slog.LevelDebug)}
	srv.Serve(newConnListener(conn)) // returns when the connection is done
}

func (f *Forward) track(c net.Conn) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.closed {
		return false
	}
	f.conns[c] = struct{}{}
	f.wg.Add(1)
	return true
}

func (f *Forward) untrack(c net.Conn) {
	f.mu.Lock()
	delete(f.conns, c)
	f.mu.Unlock()
	f.wg.Done()
}

// Close ends every intercepted connection and waits for their handlers.
func (f *Forward) Close() error {
	f.mu.Lock()
	f.closed = true
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
	return nil
}

// connListener yields one connection, then blocks until it is closed.
type connListener struct {
	conn net.Conn
	once sync.Once
	done chan struct{}
}

func newConnListener(c net.Conn) *connListener {
	return &connListener{conn: &notifyConn{Conn: c}, done: make(chan struct{})}
}

func (l *connListener) Accept() (net.Conn, error) {
	var c net.Conn
	l.once.Do(func() {
		c = l.conn
		l.conn.(*notifyConn).onClose = func() { close(l.done) }
	})
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
	c.once.Do(func() {
		if c.onClose != nil {
			c.onClose()
		}
	})
	return err
}

// slogPrinter routes goproxy's log lines to slog at debug level.
type slogPrinter struct{ log *slog.Logger }

func (s slogPrinter) Printf(format string, v ...any) {
	s.log.Debug(fmt.Sprintf(format, v...), "component", "goproxy")
}

// LoadOrCreateCA returns the local CA kept in dir (ca.pem and ca-key.pem),
// creating it on first use. Git is told to trust ca.pem for the intercepted
// hosts only; the key never leaves dir (mode 0600).
func LoadOrCreateCA(dir string) (ca tls.Certificate, certFile string, err error) {
	certFile = filepath.Join(dir, "ca.pem")
	keyFile := filepath.Join(dir, "ca-key.pem")
	if ca, err = tls.LoadX509KeyPair(certFile, keyFile); err == nil {
		ca.Leaf, err = x509.ParseCertificate(ca.Certificate[0])
		return ca, certFile, err
	}
	if !errors.Is(err, os.ErrNotExist) {
		return ca, "", fmt.Errorf("load fenceline CA from %s: %w", dir, err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return ca, "", fmt.Errorf("generate CA key: %w", err)
	}
	serial, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	tmpl := &x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{CommonName: "fenceline local git CA", Organization: []string{"fenceline"}},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().AddDate(1, 0, 0),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return ca, "", fmt.Errorf("create CA certificate: %w", err)
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return ca, "", fmt.Errorf("encode CA key: %w", err)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return ca, "", fmt.Errorf("create CA dir: %w", err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		return ca, "", fmt.Errorf("write CA key: %w", err)
	}
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		return ca, "", fmt.Errorf("write CA certificate: %w", err)
	}
	return LoadOrCreateCA(dir)
}
