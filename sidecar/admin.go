package sidecar

import (
	"bytes"
	"context"
	"crypto/subtle"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// Admin API paths.
const (
	PathHealthz = "/healthz"
	PathReadyz  = "/readyz"
	PathMetrics = "/metrics"
	PathLease   = "/api/v1/lease"
	PathEvents  = "/api/v1/lease/events"
	PathSettled = "/api/v1/settled"
	PathAudit   = "/api/v1/audit"
	PathUI      = "/ui/"
)

// EnvAdminToken names the environment variable holding the admin API's
// bearer token (sidecar and agent wrapper alike).
const EnvAdminToken = "FENCELINE_ADMIN_TOKEN"

// AdminConfig configures the admin server. The zero value listens on a
// free loopback port with no token and reports "no lease yet" until
// SetLease.
type AdminConfig struct {
	// Listen is host:port (default "127.0.0.1:0"). Bound anywhere but
	// loopback, Token is required.
	Listen string
	// Token is the bearer token the API and /metrics require
	// ("Authorization: Bearer <token>"). /healthz and /readyz never need
	// it (kubelet probes carry none).
	Token string
	// Metrics served on /metrics (nil: a new private set).
	Metrics *Metrics
	// Audit records the file denials the agent wrapper forwards (nil:
	// they are only counted).
	Audit lease.Auditor
	// KeepAlive is how often the events stream repeats the current state
	// when nothing changes (default 1 s): a wrapper that hears nothing for
	// its grace treats the stream as broken.
	KeepAlive time.Duration
	// Poll is how often the lease state is re-read (default 100 ms): a
	// holder turns unknown or runs out of validity without an event.
	Poll time.Duration
	// UI, when set, is served under /ui/ (and / redirects there): the run
	// UI. It checks its own token — a browser cannot send a bearer header —
	// so give it the same one.
	UI http.Handler
	// Policy is the security team's policy the sidecar follows (nil:
	// none): every view carries the documents in force for the lease's
	// repo, so that the agent wrapper's file guard protects what it
	// protects (attempt.RunInPod) and follows its changes.
	Policy *policy.Store
	// Logger receives operational logs (nil: discard).
	Logger *slog.Logger
}

// Validate reports a configuration the server cannot run with.
func (c *AdminConfig) Validate() error {
	if c.KeepAlive < 0 || c.Poll < 0 {
		return errors.New("admin: KeepAlive and Poll must not be negative")
	}
	if c.Token != "" && len(c.Token) < 16 {
		return errors.New("admin: the token is shorter than 16 characters; generate one with e.g. openssl rand -hex 32")
	}
	if c.Listen != "" {
		host, _, _ := net.SplitHostPort(c.Listen)
		if err := CheckListen(c.Listen); err != nil {
			return fmt.Errorf("admin: listen address %q: %w", c.Listen, err)
		}
		if c.Token == "" && offLoopback(host) {
			return fmt.Errorf("admin: %s: %w", c.Listen, ErrNeedsToken)
		}
	}
	return nil
}

// LeaseView is what GET /api/v1/lease returns and every event of
// /api/v1/lease/events carries.
type LeaseView struct {
	// State is held, unknown or lost; "unknown" too before the sidecar has
	// a lease. Reason says why it is not held.
	State  lease.HolderState `json:"state"`
	Reason string            `json:"reason,omitempty"`
	// Ready is what /readyz answers: held and not shutting down.
	Ready bool `json:"ready"`
	// Lease is the holder's latest copy of the record (nil before one).
	Lease *lease.Lease `json:"lease,omitempty"`
	// Fence is the lease's fence token.
	Fence uint64 `json:"fence,omitempty"`
	// Fences are where the sidecar's fences listen.
	Fences Fences `json:"fences"`
	// Seq increases with every change of the view (not with repeats).
	Seq uint64 `json:"seq"`
	// Settled: the agent wrapper reported its attempt settled.
	Settled bool `json:"settled,omitempty"`
	// Policies are the security team's policy documents in force for the
	// lease's repo (the default's before a lease), removals included
	// (policy.Store.Copy): the agent wrapper's file guard follows them.
	Policies []policy.Document `json:"policies,omitempty"`
	// ValidFor is how much longer, from when this view was sent, the
	// sidecar's holder considers the lease valid without a renewal (set on
	// each event; 0 unless held). A reader must not trust "held" longer.
	ValidFor lease.Duration `json:"validFor,omitempty"`
}

// Held reports whether the view allows writes.
func (v *LeaseView) Held() bool { return v.State == lease.Held }

// SettledReport is the body of POST /api/v1/settled.
type SettledReport struct {
	ExitCode int `json:"exitCode"`
	// Denials is every call the file guard refused, for any cause.
	Denials uint64 `json:"denials"`
	// DeniedAfterLoss is the part of Denials refused because the lease
	// was lost or its state unknown; the rest were refused for what they
	// were (outside the claim, a connect not allowed) while it may have
	// held.
	DeniedAfterLoss uint64 `json:"deniedAfterLoss,omitempty"`
}

// Admin is the sidecar's admin server: probes, metrics and the lease API.
type Admin struct {
	cfg     AdminConfig
	metrics *Metrics
	ln      net.Listener
	srv     *http.Server

	mu       sync.Mutex
	log      *slog.Logger  // guarded by mu
	holder   lease.Holding // guarded by mu
	fences   Fences        // guarded by mu
	draining string        // guarded by mu: why not ready though held
	view     LeaseView     // guarded by mu: the last view published
	changed  chan struct{} // guarded by mu: closed and replaced on every change
	streams  int           // guarded by mu: events streams open now
	seen     bool          // guarded by mu: an agent wrapper connected once

	settled     chan struct{}
	settledOnce sync.Once
	poke        chan struct{}
	stop        chan struct{}
	wg          sync.WaitGroup
	closeOnce   sync.Once
}

// StartAdmin starts the admin server. It answers /healthz at once and
// reports not ready until SetLease gives it a held lease.
func StartAdmin(cfg AdminConfig) (*Admin, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.KeepAlive == 0 {
		cfg.KeepAlive = time.Second
	}
	if cfg.Poll == 0 {
		cfg.Poll = 100 * time.Millisecond
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m := cfg.Metrics
	if m == nil {
		m = NewMetrics()
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("admin: listen on %s: %w", cfg.Listen, err)
	}
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok && !tcp.IP.IsLoopback() && cfg.Token == "" {
		ln.Close()
		return nil, fmt.Errorf("admin: %s is not a loopback address: %w", ln.Addr(), ErrNeedsToken)
	}
	a := &Admin{cfg: cfg, log: log, metrics: m, ln: ln,
		changed: make(chan struct{}), settled: make(chan struct{}),
		poke: make(chan struct{}, 1), stop: make(chan struct{})}
	a.view = a.compute()
	mux := http.NewServeMux()
	mux.HandleFunc("GET "+PathHealthz, a.healthz)
	mux.HandleFunc("GET "+PathReadyz, a.readyz)
	mux.Handle("GET "+PathMetrics, a.auth(m.Handler()))
	mux.Handle("GET "+PathLease, a.auth(http.HandlerFunc(a.lease)))
	mux.Handle("GET "+PathEvents, a.auth(http.HandlerFunc(a.events)))
	mux.Handle("POST "+PathSettled, a.auth(http.HandlerFunc(a.settle)))
	mux.Handle("POST "+PathAudit, a.auth(http.HandlerFunc(a.audit)))
	if cfg.UI != nil {
		mux.Handle(PathUI, http.StripPrefix(strings.TrimSuffix(PathUI, "/"), cfg.UI))
		mux.Handle("GET /{$}", http.RedirectHandler(PathUI, http.StatusFound))
	}
	a.srv = &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second,
		ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelDebug)}
	a.wg.Go(func() {
		if err := a.srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			log.Error("admin server stopped", "err", err)
		}
	})
	a.wg.Go(a.watch)
	return a, nil
}

func (a *Admin) logger() *slog.Logger {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.log
}

// Addr is where the server listens.
func (a *Admin) Addr() net.Addr { return a.ln.Addr() }

// URL is the server's base URL.
func (a *Admin) URL() string { return "http://" + a.ln.Addr().String() }

// Metrics are the metrics the server exposes.
func (a *Admin) Metrics() *Metrics { return a.metrics }

// SetLease makes h the lease the server reports and f the fences.
func (a *Admin) SetLease(h lease.Holding, f Fences) {
	a.mu.Lock()
	a.holder, a.fences = h, f
	a.log = LeaseLogger(a.log, h.Lease())
	a.mu.Unlock()
	a.refresh()
}

// SetDraining makes /readyz answer not ready with why, lease or not.
func (a *Admin) SetDraining(why string) {
	a.mu.Lock()
	a.draining = why
	a.mu.Unlock()
	a.refresh()
}

// Settled is closed once the agent wrapper reported its attempt settled.
func (a *Admin) Settled() <-chan struct{} { return a.settled }

// AgentConnected reports whether an agent wrapper ever opened the events
// stream (or reported anything), and how many streams are open now.
func (a *Admin) AgentConnected() (ever bool, now int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.seen, a.streams
}

// View is the current lease view.
func (a *Admin) View() LeaseView {
	v, _ := a.viewNow()
	return v
}

// Close stops the server: events streams end, in-flight requests finish
// (bounded by ctx).
func (a *Admin) Close(ctx context.Context) error {
	var err error
	a.closeOnce.Do(func() {
		close(a.stop)
		a.refresh() // one last view to every stream
		err = a.srv.Shutdown(ctx)
		if err != nil {
			a.srv.Close()
		}
		a.wg.Wait()
	})
	return err
}

// watch re-reads the lease state on a timer and when the lease is lost.
func (a *Admin) watch() {
	t := time.NewTicker(a.cfg.Poll)
	defer t.Stop()
	var lost <-chan struct{}
	for {
		a.mu.Lock()
		if a.holder != nil && lost == nil {
			lost = a.holder.Lost()
		}
		a.mu.Unlock()
		select {
		case <-a.stop:
			return
		case <-t.C:
		case <-lost:
			lost = make(chan struct{}) // once is enough: lost is terminal
		case <-a.poke:
		}
		a.refresh()
	}
}

// compute is the view as it is now, without Seq. It reads the holder
// outside mu: the holder has its own lock.
func (a *Admin) compute() LeaseView {
	a.mu.Lock()
	h, f, draining := a.holder, a.fences, a.draining
	a.mu.Unlock()
	v := LeaseView{State: lease.Unknown, Reason: "no lease yet: the sidecar is acquiring it", Fences: f}
	if h != nil {
		st, err := h.State()
		l := h.Lease()
		v.State, v.Lease, v.Fence, v.Reason = st, &l, l.Fence, ""
		if err != nil {
			v.Reason = err.Error()
		}
	}
	if a.cfg.Policy != nil {
		repo := ""
		if v.Lease != nil {
			repo = v.Lease.Repo
		}
		v.Policies = a.cfg.Policy.Copy(repo)
	}
	select {
	case <-a.settled:
		v.Settled = true
	default:
	}
	v.Ready = v.State == lease.Held && draining == ""
	if draining != "" && v.Reason == "" {
		v.Reason = draining
	}
	return v
}

// refresh publishes the current view when it differs from the last one.
func (a *Admin) refresh() {
	v := a.compute()
	a.mu.Lock()
	defer a.mu.Unlock()
	old := a.view
	v.Seq = old.Seq
	if sameView(old, v) {
		return
	}
	v.Seq++
	a.view = v
	close(a.changed)
	a.changed = make(chan struct{})
	if old.State != v.State || old.Ready != v.Ready {
		a.log.Info("lease state", "state", v.State, "ready", v.Ready, "reason", v.Reason)
	}
}

func sameView(a, b LeaseView) bool {
	ja, _ := json.Marshal(a)
	jb, _ := json.Marshal(b)
	return string(ja) == string(jb)
}

// auth requires the token when one is configured: as a bearer token, or
// proven by the agent wrapper's request HMAC (adminauth.go), after which
// the answer proves it back (the request's context carries its nonce).
func (a *Admin) auth(h http.Handler) http.Handler {
	if a.cfg.Token == "" {
		return h
	}
	want := []byte("Bearer " + a.cfg.Token)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := r.Header.Get("Authorization")
		if mac, ok := strings.CutPrefix(got, hmacScheme); ok {
			nonce := r.Header.Get(headerNonce)
			body, err := io.ReadAll(io.LimitReader(r.Body, maxAdminBody+1))
			if err != nil || len(body) > maxAdminBody {
				http.Error(w, "fenceline: request body unreadable or over 64 KiB", http.StatusRequestEntityTooLarge)
				return
			}
			if !validNonce(nonce) || !macEqual(mac, requestMAC(a.cfg.Token, r.Method, r.URL.Path, nonce, body)) {
				http.Error(w, "fenceline: the request's "+strings.TrimSpace(hmacScheme)+" does not prove the admin token", http.StatusUnauthorized)
				return
			}
			r.Body = io.NopCloser(bytes.NewReader(body))
			h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), nonceKey{}, nonce)))
			return
		}
		if subtle.ConstantTimeCompare([]byte(got), want) != 1 {
			w.Header().Set("WWW-Authenticate", `Bearer realm="fenceline"`)
			http.Error(w, "fenceline: the admin API needs \"Authorization: Bearer <token>\" (the sidecar's admin token)", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// nonceKey carries a signed request's nonce to its handler.
type nonceKey struct{}

// maxAdminBody bounds a signed request's body.
const maxAdminBody = 64 << 10

func (a *Admin) healthz(w http.ResponseWriter, _ *http.Request) {
	fmt.Fprintln(w, "ok")
}

func (a *Admin) readyz(w http.ResponseWriter, _ *http.Request) {
	v := a.View()
	if v.Ready {
		fmt.Fprintf(w, "ready: lease %s held, fence %d\n", v.Lease.LeaseID, v.Fence)
		return
	}
	w.WriteHeader(http.StatusServiceUnavailable)
	id := "none yet"
	if v.Lease != nil {
		id = v.Lease.LeaseID
	}
	fmt.Fprintf(w, "not ready: lease %s is %s: %s\n", id, v.State, v.Reason)
}

func (a *Admin) lease(w http.ResponseWriter, _ *http.Request) {
	v := a.View()
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(v)
}

// viewNow refreshes the view and returns it with the holder's remaining
// validity as of now, and the channel closed at the view's next change.
func (a *Admin) viewNow() (LeaseView, <-chan struct{}) {
	a.refresh()
	a.mu.Lock()
	v, changed, h := a.view, a.changed, a.holder
	a.mu.Unlock()
	if h != nil && v.State == lease.Held {
		v.ValidFor = lease.Duration(h.Remaining())
	}
	return v, changed
}

// events streams the lease view as server-sent events: the view now, then
// every change, and the view again every KeepAlive.
//
//	event: lease
//	id: <seq>
//	data: {"state":"held",...}
func (a *Admin) events(w http.ResponseWriter, r *http.Request) {
	rc := http.NewResponseController(w)
	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no")
	a.mu.Lock()
	a.seen = true
	a.streams++
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		a.streams--
		a.mu.Unlock()
	}()
	keep := time.NewTicker(a.cfg.KeepAlive)
	defer keep.Stop()
	// A signed request's stream proves the token on each event.
	s := &viewStream{w: w, rc: rc}
	if nonce, ok := r.Context().Value(nonceKey{}).(string); ok {
		s.token, s.nonce = a.cfg.Token, nonce
	}
	for {
		changed, ok := a.sendView(s)
		if !ok {
			return
		}
		select {
		case <-r.Context().Done():
			return
		case <-a.stop:
			a.sendView(s) // the last word: what the lease is as the server stops
			return
		case <-changed:
		case <-keep.C:
		}
	}
}

// viewStream is one events stream being answered: with a token and a
// nonce, each event carries its proof (eventMAC).
type viewStream struct {
	w            http.ResponseWriter
	rc           *http.ResponseController
	token, nonce string
	n            uint64 // events sent
}

// sendView writes the current view as one event and returns the channel
// closed at its next change.
func (a *Admin) sendView(s *viewStream) (changed <-chan struct{}, ok bool) {
	v, changed := a.viewNow()
	data, err := json.Marshal(v)
	if err != nil {
		return nil, false
	}
	s.n++
	mac := ""
	if s.nonce != "" {
		mac = "mac: " + eventMAC(s.token, s.nonce, s.n, data) + "\n"
	}
	if _, err := fmt.Fprintf(s.w, "event: lease\nid: %d\n%sdata: %s\n\n", v.Seq, mac, data); err != nil {
		return nil, false
	}
	return changed, s.rc.Flush() == nil
}

func (a *Admin) settle(w http.ResponseWriter, r *http.Request) {
	var rep SettledReport
	if err := json.NewDecoder(io.LimitReader(r.Body, 4<<10)).Decode(&rep); err != nil && !errors.Is(err, io.EOF) {
		http.Error(w, "fenceline: want {\"exitCode\":N,\"denials\":N}: "+err.Error(), http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	a.seen = true
	a.mu.Unlock()
	a.settledOnce.Do(func() {
		a.logger().Info("agent settled: every process of the attempt is gone", "exitCode", rep.ExitCode, "denials", rep.Denials, "deniedAfterLoss", rep.DeniedAfterLoss)
		close(a.settled)
	})
	a.refresh()
	w.WriteHeader(http.StatusNoContent)
}

// audit takes a file denial from the agent wrapper, names this sidecar's
// lease in it (the wrapper's word is not trusted for that), counts it and
// records it.
func (a *Admin) audit(w http.ResponseWriter, r *http.Request) {
	var ev lease.AuditEvent
	if err := json.NewDecoder(io.LimitReader(r.Body, 64<<10)).Decode(&ev); err != nil {
		http.Error(w, "fenceline: want one audit event as JSON: "+err.Error(), http.StatusBadRequest)
		return
	}
	if ev.Boundary != lease.BoundaryFile || (ev.Type != lease.EventDenied && ev.Type != lease.EventShadowRefused) {
		http.Error(w, fmt.Sprintf("fenceline: only file denials and shadow refusals are taken here, not %s %s", ev.Boundary, ev.Type), http.StatusBadRequest)
		return
	}
	a.mu.Lock()
	h := a.holder
	a.seen = true
	a.mu.Unlock()
	if h != nil {
		l := h.Lease()
		ev.Repo, ev.LeaseID, ev.Owner, ev.Scope, ev.Fence = l.Repo, l.LeaseID, l.Owner, l.Scope, l.Fence
	}
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	ev.Message = strings.ToValidUTF8(ev.Message, "?")
	a.logger().Warn("file write denied in the agent container", "reason", ev.Reason, "detail", ev.Message)
	if err := a.metrics.Auditor(a.cfg.Audit).Record(r.Context(), ev); err != nil {
		a.logger().Error("audit of a file denial not recorded", "err", err)
		http.Error(w, "fenceline: audit not recorded: "+err.Error(), http.StatusBadGateway)
		return
	}
	w.WriteHeader(http.StatusNoContent)
}
