package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
)

// Proxy is a running Postgres wire fence. Close stops it.
type Proxy struct {
	cfg        Config
	ln         net.Listener
	log        *slog.Logger
	classifier *Classifier

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	sessions map[*session]struct{} // guarded by mu
	keys     map[backendKey]bool   // live backends, for CancelRequest; guarded by mu
	closed   bool                  // guarded by mu

	// The token for one lease and fence, or why there is none (made and
	// logged once per lease and fence, not per write). Guarded by tokMu.
	tokMu    sync.Mutex
	tokLease string
	tokFence uint64
	tokStr   string
	tokErr   error
}

type backendKey struct{ pid, secret uint32 }

var errNoSecret = errors.New(`no fence secret configured: the proxy needs the key "fenceline pg install" wrote`)

// Listen starts a proxy on cfg.Listen in front of cfg.Upstream. It returns
// once the listener is open; connections are served until Close or until
// ctx ends.
func Listen(ctx context.Context, cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	var lc net.ListenConfig
	ln, err := lc.Listen(ctx, "tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("pgproxy: listen on %s: %w", cfg.Listen, err)
	}
	pctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	p := &Proxy{
		cfg: cfg, ln: ln, log: cfg.Logger, classifier: NewClassifier(0),
		ctx: pctx, cancel: cancel,
		sessions: map[*session]struct{}{}, keys: map[backendKey]bool{},
	}
	p.wg.Add(1)
	go p.acceptLoop()
	if ctx.Done() != nil {
		p.wg.Add(1)
		go func() {
			defer p.wg.Done()
			select {
			case <-ctx.Done():
				p.shutdown()
			case <-pctx.Done():
			}
		}()
	}
	p.log.Info("postgres fence listening", "addr", ln.Addr().String(), "upstream", cfg.Upstream)
	return p, nil
}

// Addr is the address clients connect to.
func (p *Proxy) Addr() net.Addr { return p.ln.Addr() }

// Close stops accepting, ends every session (each backend gets Terminate and
// rolls back whatever it had open) and waits for every goroutine the proxy
// started.
func (p *Proxy) Close() error {
	p.shutdown()
	p.wg.Wait()
	return nil
}

func (p *Proxy) shutdown() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	ss := make([]*session, 0, len(p.sessions))
	for s := range p.sessions {
		ss = append(ss, s)
	}
	p.mu.Unlock()
	p.cancel()
	p.ln.Close()
	for _, s := range ss {
		s.abort()
	}
}

func (p *Proxy) acceptLoop() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if p.ctx.Err() == nil && !errors.Is(err, net.ErrClosed) {
				p.log.Error("accept failed; the fence stops listening", "err", err)
			}
			return
		}
		s := newSession(p, c)
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			c.Close()
			return
		}
		p.sessions[s] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go func() {
			defer p.wg.Done()
			s.serve()
			p.mu.Lock()
			delete(p.sessions, s)
			if s.key != (backendKey{}) {
				delete(p.keys, s.key)
			}
			p.mu.Unlock()
		}()
	}
}

func (p *Proxy) registerKey(k backendKey) {
	p.mu.Lock()
	p.keys[k] = true
	p.mu.Unlock()
}

func (p *Proxy) knownKey(k backendKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.keys[k]
}

// token returns the signed fence token for the lease at fence. A token
// that cannot be made is logged once per lease and fence.
func (p *Proxy) token(l leaseInfo) (string, error) {
	p.tokMu.Lock()
	defer p.tokMu.Unlock()
	if (p.tokStr != "" || p.tokErr != nil) && p.tokFence == l.fence && p.tokLease == l.id {
		return p.tokStr, p.tokErr
	}
	t, err := "", errNoSecret
	if len(p.cfg.Secret) > 0 {
		t, err = MakeToken(p.cfg.Secret, l.id, l.fence, l.tables)
	}
	if err != nil {
		p.log.Warn("no fence token: writes to fenced tables will fail", "lease", l.id, "fence", l.fence, "err", err)
	}
	p.tokLease, p.tokFence, p.tokStr, p.tokErr = l.id, l.fence, t, err
	return t, err
}
