package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Proxy is a running Postgres wire fence. Close stops it.
type Proxy struct {
	cfg        Config
	ln         net.Listener
	log        *slog.Logger // cfg.Logger, written through logq
	logq       *logQueue
	classifier *Classifier
	catalog    *catalog // what the proxy learned of tables and functions (reach.go)

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	sessions map[*session]struct{} // guarded by mu
	keys     map[backendKey]bool   // live backends, for CancelRequest; guarded by mu
	closed   bool                  // guarded by mu

	// Why there is no token for one lease and fence (logged once per
	// lease and fence, not per write). Guarded by tokMu.
	tokMu    sync.Mutex
	tokLease string
	tokFence uint64
	tokErr   error

	noBindWarned atomic.Bool // a server connection could not be bound (logged once)

	// loop runs the plain sessions after startup (loop_linux.go); nil
	// when they run on goroutines.
	loop         *eventLoop
	loopSessions atomic.Int64 // sessions moved to the loop so far
	parsingAside atomic.Int64 // long texts being parsed off the loop now
}

type backendKey struct{ pid, secret uint32 }

var errNoSecret = errors.New(`the lease service gave this lease no Postgres grant key: register the database's fence secret (from "fenceline pg install") with the bus, fenceline bus fence-secret set --repo REPO --postgres FILE`)

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
	log, logq := queuedLogger(cfg.Logger)
	p := &Proxy{
		cfg: cfg, ln: ln, log: log, logq: logq, classifier: NewClassifier(0), catalog: newCatalog(),
		ctx: pctx, cancel: cancel,
		sessions: map[*session]struct{}{}, keys: map[backendKey]bool{},
	}
	p.startLoop()
	p.wg.Add(1)
	go p.acceptLoop()
	if cfg.Lease != nil {
		p.wg.Add(1)
		go p.watchLease()
	}
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
// started (its log's writer: at most a second more, see logQueue.close).
func (p *Proxy) Close() error {
	p.shutdown()
	p.wg.Wait()
	p.waitLoop()
	p.logq.close(time.Second)
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
	p.closeLoopIfIdle()
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
			p.closeLoopIfIdle()
			p.mu.Unlock()
		}()
	}
}

// watchLease cancels the running statements of transactions the proxy made
// writable as soon as the lease is not live, and again at every check while
// they run, so that a write already in flight when the lease is lost cannot
// land later than one LeaseCheckInterval after the proxy could know it.
// (New units are refused by the client loop itself.)
func (p *Proxy) watchLease() {
	defer p.wg.Done()
	var lost <-chan struct{}
	if l, ok := p.cfg.Lease.(interface{ Lost() <-chan struct{} }); ok {
		lost = l.Lost()
	}
	tick := time.NewTicker(p.cfg.LeaseCheckInterval)
	defer tick.Stop()
	for {
		select {
		case <-p.ctx.Done():
			return
		case <-lost:
			lost = nil // closed for good; the ticker goes on
		case <-tick.C:
		}
		if _, err := p.cfg.Lease.Fence(); err != nil {
			p.cancelWritable(err)
		}
	}
}

// cancelWritable cancels the statement each session runs in a transaction
// the proxy made writable, in parallel, and waits for the cancels to be
// delivered.
func (p *Proxy) cancelWritable(why error) {
	p.mu.Lock()
	var busy []*session
	for s := range p.sessions {
		if s.rw.Load() && s.busy() {
			busy = append(busy, s)
		}
	}
	p.mu.Unlock()
	var wg sync.WaitGroup
	for _, s := range busy {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l := p.cfg.Lease.Lease()
			if err := p.cancelUpstream(s.key); err != nil {
				p.log.Warn("statement of a lost lease's writable transaction not cancelled", "lease", l.LeaseID, "pid", s.key.pid, "err", err)
				return
			}
			p.log.Info("cancelled the statement of a writable transaction: the lease is not live", "lease", l.LeaseID,
				"fence", l.Fence, "owner", l.Owner.String(), "pid", s.key.pid, "user", s.user, "reason", why.Error())
		}()
	}
	wg.Wait()
}

func (p *Proxy) registerKey(k backendKey) {
	p.mu.Lock()
	p.keys[k] = true
	p.mu.Unlock()
}

// ownPID: a live session of this proxy has backend pid.
func (p *Proxy) ownPID(pid uint32) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for k := range p.keys {
		if k.pid == pid {
			return true
		}
	}
	return false
}

func (p *Proxy) knownKey(k backendKey) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.keys[k]
}

// grantKey is the Postgres grant key of the proxy's lease, nil when its
// source holds none.
func (p *Proxy) grantKey() []byte {
	if g, ok := p.cfg.Lease.(lease.Granter); ok {
		if k := g.GrantKeys(); k != nil {
			return k.Postgres
		}
	}
	return nil
}

// token returns the fence token for the lease at fence, bound to session
// number session. Tokens are made per session (each connection has its
// own); a token that cannot be made is logged once per lease and fence.
func (p *Proxy) token(l leaseInfo, session int64) (string, error) {
	p.tokMu.Lock()
	defer p.tokMu.Unlock()
	known := p.tokFence == l.fence && p.tokLease == l.id
	if known && p.tokErr != nil {
		return "", p.tokErr
	}
	t, err := "", errNoSecret
	if key := p.grantKey(); len(key) > 0 {
		t, err = MakeToken(key, l.id, l.fence, session, l.tables)
	}
	if err != nil && !known {
		p.log.Warn("no fence token: writes to fenced tables will fail", "lease", l.id, "fence", l.fence, "err", err)
	}
	p.tokLease, p.tokFence, p.tokErr = l.id, l.fence, err
	return t, err
}
