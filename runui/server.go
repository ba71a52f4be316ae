package runui

import (
	"context"
	"crypto/subtle"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

//go:embed static
var static embed.FS

// ShardSource lists the shards and attempts of a repo (every repo when
// repo is empty), as JSON-encodable values. The shard package provides one.
type ShardSource func(ctx context.Context, repo string) (any, error)

// Source is what the UI shows, read from the lease bus:
// *leasebus.UIReader is the bus's. The UI only reads.
type Source interface {
	// List lists the leases of repo (every repo when empty); all:
	// recently ended ones too.
	List(ctx context.Context, repo string, all bool) ([]*lease.Lease, error)
	// Watch calls fn with every lease record of repo (every repo when
	// empty) as it is committed, until stop.
	Watch(repo string, fn func(*lease.Lease)) (stop func() error, err error)
	// AuditEnd is the position of the audit's last message (0: none);
	// ReadAudit and FollowAudit start at a position counted back from it.
	AuditEnd(ctx context.Context) (uint64, error)
	// ReadAudit returns the audit events of repo (every repo when empty)
	// from position from on, in the order they were stored.
	ReadAudit(ctx context.Context, repo string, from uint64) ([]lease.AuditEvent, error)
	// FollowAudit calls fn with the events of each audit message of repo
	// (every repo when empty) from position from on, then of each new one,
	// until stop; a message that does not decode comes as an error.
	FollowAudit(ctx context.Context, repo string, from uint64, fn func(evs []lease.AuditEvent, err error)) (stop func(), err error)
	// PolicyHistory returns every version of repo's policy in mode ("":
	// the default), oldest first.
	PolicyHistory(ctx context.Context, repo string, mode policy.Mode) ([]policy.Document, error)
}

// Config configures a Server. Source is required; the rest may be zero.
type Config struct {
	// Source is where the UI reads leases, the audit and the policies
	// (leasebus.NewUIReader of a bus connection).
	Source Source
	// Token, when set, is required on every request (see the package doc).
	Token string
	// Shards lists shards and attempts (StoreSource); nil leaves that part
	// of the UI empty. The stream sends them again after lease records,
	// which every placement, settle and release writes.
	Shards ShardSource
	// AuditBacklog is how many recent audit events a new page starts
	// with (default 100).
	AuditBacklog int
	// Logger gets request errors (nil: discard).
	Logger *slog.Logger
}

// Validate reports a config that cannot work.
func (c *Config) Validate() error {
	if c.Source == nil {
		return errors.New("run UI: no source to read the bus")
	}
	if c.AuditBacklog < 0 {
		return fmt.Errorf("run UI: audit backlog %d is negative", c.AuditBacklog)
	}
	return nil
}

// Server is the run UI and its API. Its handlers are safe for concurrent use.
type Server struct {
	cfg Config
	src Source
	log *slog.Logger
	mux *http.ServeMux

	ctx    context.Context // ends every event stream on Close
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	closed bool // guarded by mu; no stream starts once set

	fmu     sync.Mutex
	flights map[string]*shardsFlight // by repo: the latest shard listing; guarded by fmu
}

// shardsFlight is one listing of a repo's shards, shared by every stream
// that needs one begun no earlier than its start.
type shardsFlight struct {
	started time.Time
	done    chan struct{}
	v       any
	err     error
}

// flightKept is how long a finished listing stays for streams to share.
const flightKept = time.Minute

func (f *shardsFlight) finished() bool {
	select {
	case <-f.done:
		return true
	default:
		return false
	}
}

// EnvToken names the environment variable that holds the run UI's token
// (required off loopback).
const EnvToken = "FENCELINE_UI_TOKEN"

// New returns a Server for cfg.
func New(cfg Config) (*Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.AuditBacklog == 0 {
		cfg.AuditBacklog = 100
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, src: cfg.Source, log: log, mux: http.NewServeMux()}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	page, err := fs.Sub(static, "static")
	if err != nil {
		return nil, fmt.Errorf("run UI: embedded page: %w", err)
	}
	s.mux.Handle("GET /", http.FileServerFS(page))
	s.mux.HandleFunc("GET /api/v1/repos", s.repos)
	s.mux.HandleFunc("GET /api/v1/leases", s.leases)
	s.mux.HandleFunc("GET /api/v1/audit", s.audit)
	s.mux.HandleFunc("GET /api/v1/shards", s.shards)
	s.mux.HandleFunc("GET /api/v1/events", s.events)
	s.mux.HandleFunc("GET /api/v1/policy", s.policy)
	return s, nil
}

// Handler serves the page and the API, behind the token check when a
// token is configured.
func (s *Server) Handler() http.Handler {
	if s.cfg.Token == "" {
		return s.mux
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !s.authorized(w, r) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="fenceline"`)
			http.Error(w, "fenceline run UI: a token is required off loopback: open the URL fenceline printed (it carries ?token=), or send Authorization: Bearer TOKEN", http.StatusUnauthorized)
			return
		}
		s.mux.ServeHTTP(w, r)
	})
}

const tokenCookie = "fenceline_ui_token"

func (s *Server) authorized(w http.ResponseWriter, r *http.Request) bool {
	ok := func(got string) bool {
		return got != "" && subtle.ConstantTimeCompare([]byte(got), []byte(s.cfg.Token)) == 1
	}
	if h := r.Header.Get("Authorization"); len(h) > 7 && h[:7] == "Bearer " && ok(h[7:]) {
		return true
	}
	if c, err := r.Cookie(tokenCookie); err == nil && ok(c.Value) {
		return true
	}
	if ok(r.URL.Query().Get("token")) {
		http.SetCookie(w, &http.Cookie{Name: tokenCookie, Value: s.cfg.Token, Path: "/", HttpOnly: true, SameSite: http.SameSiteStrictMode})
		return true
	}
	return false
}

// Close ends the event streams and waits for them.
func (s *Server) Close() {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
}

// track counts a starting stream, unless the server is closed.
func (s *Server) track() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// Loopback reports whether addr (host:port) listens on loopback only,
// where the UI needs no token.
func Loopback(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func (s *Server) writeJSON(w http.ResponseWriter, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	if err := json.NewEncoder(w).Encode(v); err != nil {
		s.log.Debug("run UI: write reply", "err", err)
	}
}

func (s *Server) fail(w http.ResponseWriter, what string, err error) {
	s.log.Warn("run UI: "+what, "err", err)
	code := http.StatusBadGateway
	if errors.Is(err, lease.ErrInvalid) {
		code = http.StatusBadRequest
	}
	http.Error(w, fmt.Sprintf("%s: %v", what, err), code)
}

// repoInfo is one repository as /api/v1/repos lists it.
type repoInfo struct {
	Repo   string `json:"repo"`
	Active int    `json:"active"`
}

func (s *Server) repos(w http.ResponseWriter, r *http.Request) {
	ls, err := s.src.List(r.Context(), "", true)
	if err != nil {
		s.fail(w, "list leases", err)
		return
	}
	count := map[string]int{}
	for _, l := range ls {
		if _, ok := count[l.Repo]; !ok {
			count[l.Repo] = 0
		}
		if l.Active() {
			count[l.Repo]++
		}
	}
	out := make([]repoInfo, 0, len(count))
	for repo, n := range count {
		out = append(out, repoInfo{Repo: repo, Active: n})
	}
	slices.SortFunc(out, func(a, b repoInfo) int { return compareStrings(a.Repo, b.Repo) })
	s.writeJSON(w, out)
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (s *Server) leases(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	ls, err := s.src.List(r.Context(), repoid.Normalize(q.Get("repo")), q.Get("all") != "")
	if err != nil {
		s.fail(w, "list leases", err)
		return
	}
	s.writeJSON(w, ls)
}

func (s *Server) audit(w http.ResponseWriter, r *http.Request) {
	limit := s.cfg.AuditBacklog
	if v := r.URL.Query().Get("limit"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 || n > 10000 {
			http.Error(w, fmt.Sprintf("limit %q: want a number from 1 to 10000", v), http.StatusBadRequest)
			return
		}
		limit = n
	}
	evs, err := s.recentAudit(r.Context(), repoid.Normalize(r.URL.Query().Get("repo")), limit)
	if err != nil {
		s.fail(w, "read the audit stream", err)
		return
	}
	s.writeJSON(w, evs)
}

// maxAuditScan bounds how many stream messages recentAudit reads back.
const maxAuditScan = 1 << 16

// recentAudit returns up to limit of the latest audit events of repo. The
// stream's last limit messages may be other repos' or the UI's own reads
// (filtered out), so it reads further back, four times as far each time,
// until it has limit events, the stream's start, or maxAuditScan messages.
func (s *Server) recentAudit(ctx context.Context, repo string, limit int) ([]lease.AuditEvent, error) {
	var evs []lease.AuditEvent
	for n := limit; ; n *= 4 {
		from, err := s.auditStart(ctx, n)
		if err != nil {
			return nil, err
		}
		if evs, err = s.src.ReadAudit(ctx, repo, from); err != nil {
			return nil, err
		}
		evs = slices.DeleteFunc(evs, func(ev lease.AuditEvent) bool { return ownRead(&ev) })
		if len(evs) >= limit || from == 1 || n >= maxAuditScan {
			break
		}
	}
	if len(evs) > limit {
		evs = evs[len(evs)-limit:]
	}
	if evs == nil {
		evs = []lease.AuditEvent{}
	}
	return evs, nil
}

// ownRead reports a list audit event: the UI's own reads (every page load
// lists) would fill its feed; `fenceline lease audit` shows them.
func ownRead(ev *lease.AuditEvent) bool {
	return ev.Boundary == lease.BoundaryBus && ev.Type == lease.EventList
}

// auditStart is the position a backlog of about n events starts at in
// each of the audit's streams (a message may carry several events; a repo
// filter may thin it out): n before the end of the longer one.
func (s *Server) auditStart(ctx context.Context, n int) (uint64, error) {
	last, err := s.src.AuditEnd(ctx)
	if err != nil {
		return 0, err
	}
	if last <= uint64(n) {
		return 1, nil
	}
	return last - uint64(n) + 1, nil
}

func (s *Server) shards(w http.ResponseWriter, r *http.Request) {
	if s.cfg.Shards == nil {
		s.writeJSON(w, nil)
		return
	}
	v, err := s.cfg.Shards(r.Context(), repoid.Normalize(r.URL.Query().Get("repo")))
	if err != nil {
		s.fail(w, "list shards", err)
		return
	}
	s.writeJSON(w, v)
}

// writeTimeout bounds one write to an event stream's client.
const writeTimeout = 10 * time.Second

// shardsSince lists repo's shards and attempts as they are at since or
// later. Streams that learn of the same lease change at once share one
// listing instead of each reading the shard buckets again.
func (s *Server) shardsSince(ctx context.Context, repo string, since time.Time) (any, error) {
	s.fmu.Lock()
	f := s.flights[repo]
	if f == nil || f.started.Before(since) {
		now := time.Now()
		f = &shardsFlight{started: now, done: make(chan struct{})}
		if s.flights == nil {
			s.flights = map[string]*shardsFlight{}
		}
		// Streams ask with the time of a change they have just heard of: a
		// listing finished long ago serves none, so repos nobody watches
		// any more do not keep theirs.
		for r, old := range s.flights {
			if now.Sub(old.started) > flightKept && old.finished() {
				delete(s.flights, r)
			}
		}
		s.flights[repo] = f
		s.fmu.Unlock()
		// The server's context, not the caller's: other streams may wait on it.
		lctx, cancel := context.WithTimeout(s.ctx, 10*time.Second)
		f.v, f.err = s.cfg.Shards(lctx, repo)
		cancel()
		close(f.done)
		return f.v, f.err
	}
	s.fmu.Unlock()
	select {
	case <-f.done:
		return f.v, f.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// snapshot is the first event of a stream, and the one sent again to a
// client that fell behind. Audit events come separately: the recent
// backlog, then each new one, in stream order.
type snapshot struct {
	ServerTime time.Time      `json:"serverTime"`
	Repo       string         `json:"repo"`
	Leases     []*lease.Lease `json:"leases"`
	Shards     any            `json:"shards"`
}

// events streams the UI's data: a snapshot, then every lease record and
// audit event as the bus commits them.
func (s *Server) events(w http.ResponseWriter, r *http.Request) {
	if !s.track() {
		http.Error(w, "run UI shutting down", http.StatusServiceUnavailable)
		return
	}
	defer s.wg.Done()
	repo := repoid.Normalize(r.URL.Query().Get("repo"))
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	stop := context.AfterFunc(s.ctx, cancel)
	defer stop()

	// Subscribe before the snapshot, so nothing committed in between is lost.
	st := newStream(8192)
	unwatch, err := s.src.Watch(repo, func(l *lease.Lease) { st.push("lease", l) })
	if err != nil {
		s.fail(w, "watch leases", err)
		return
	}
	defer func() { _ = unwatch() }()
	snap, err := s.snapshot(ctx, repo)
	if err != nil {
		s.fail(w, "read the bus", err)
		return
	}
	stopAudit, err := s.followAudit(ctx, repo, st)
	if err != nil {
		s.fail(w, "follow the audit stream", err)
		return
	}
	defer stopAudit()

	w.Header().Set("Content-Type", "text/event-stream")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("X-Accel-Buffering", "no")
	// Every write has a deadline: a browser that stopped reading (a laptop
	// gone off the network) must not hold the stream — and Close — forever.
	rc := http.NewResponseController(w)
	write := func(format string, args ...any) bool {
		_ = rc.SetWriteDeadline(time.Now().Add(writeTimeout))
		if _, err := fmt.Fprintf(w, format, args...); err != nil {
			return false
		}
		return rc.Flush() == nil
	}
	send := func(event string, v any) bool {
		data, err := json.Marshal(v)
		if err != nil {
			s.log.Warn("run UI: encode event", "err", err)
			return true
		}
		return write("event: %s\ndata: %s\n\n", event, data)
	}
	if !send("snapshot", snap) {
		return
	}
	// The newest version of each lease the client has: a record no newer
	// (a change notice still in flight when the stream subscribed, or one
	// delivered twice or late) is not sent.
	newest := snapVersions(snap)
	keepalive := time.NewTicker(15 * time.Second)
	defer keepalive.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-keepalive.C:
			if !write(": keepalive\n\n") {
				return
			}
		case <-st.ready:
			took := time.Now()
			items, overflowed := st.take()
			if overflowed {
				// Fell behind: start over from what the bus says now.
				snap, err := s.snapshot(ctx, repo)
				if err != nil {
					return
				}
				if !send("snapshot", snap) {
					return
				}
				newest = snapVersions(snap)
				continue
			}
			leases := false
			for _, it := range items {
				if l, ok := it.v.(*lease.Lease); ok {
					if l.Version <= newest[l.LeaseID] {
						continue
					}
					newest[l.LeaseID] = l.Version
				}
				if !send(it.event, it.v) {
					return
				}
				leases = leases || it.event == "lease"
			}
			if leases && s.cfg.Shards != nil {
				// Placements, settles and cleanings go with lease changes.
				v, err := s.shardsSince(ctx, repo, took)
				if err != nil {
					s.log.Warn("run UI: list shards", "err", err)
				} else if !send("shards", v) {
					return
				}
			}
		}
	}
}

// snapVersions maps each lease in snap to the version it holds.
func snapVersions(snap *snapshot) map[string]uint64 {
	m := make(map[string]uint64, len(snap.Leases))
	for _, l := range snap.Leases {
		m[l.LeaseID] = l.Version
	}
	return m
}

func (s *Server) snapshot(ctx context.Context, repo string) (*snapshot, error) {
	ls, err := s.src.List(ctx, repo, true)
	if err != nil {
		return nil, fmt.Errorf("list leases: %w", err)
	}
	snap := &snapshot{ServerTime: time.Now().UTC(), Repo: repo, Leases: ls}
	if s.cfg.Shards != nil {
		if snap.Shards, err = s.cfg.Shards(ctx, repo); err != nil {
			return nil, fmt.Errorf("list shards: %w", err)
		}
	}
	return snap, nil
}

// followAudit pushes the audit events of repo to st in stream order (of
// each of the audit's streams): the recent backlog, then every new one.
func (s *Server) followAudit(ctx context.Context, repo string, st *stream) (stop func(), err error) {
	from, err := s.auditStart(ctx, s.cfg.AuditBacklog)
	if err != nil {
		return nil, err
	}
	return s.src.FollowAudit(ctx, repo, from, func(evs []lease.AuditEvent, err error) {
		if err != nil {
			s.log.Warn("run UI: audit message", "err", err)
			return
		}
		for i := range evs {
			if !ownRead(&evs[i]) {
				st.push("audit", &evs[i])
			}
		}
	})
}

// stream buffers a client's pending events between the bus callbacks and
// its writer, bounded: past max, it is flagged overflowed and emptied.
type stream struct {
	max   int
	ready chan struct{}

	mu         sync.Mutex
	items      []item // guarded by mu
	overflowed bool   // guarded by mu
}

type item struct {
	event string
	v     any
}

func newStream(max int) *stream { return &stream{max: max, ready: make(chan struct{}, 1)} }

func (st *stream) push(event string, v any) {
	st.mu.Lock()
	if len(st.items) >= st.max {
		st.items, st.overflowed = nil, true
	} else if !st.overflowed {
		st.items = append(st.items, item{event, v})
	}
	st.mu.Unlock()
	select {
	case st.ready <- struct{}{}:
	default:
	}
}

func (st *stream) take() ([]item, bool) {
	st.mu.Lock()
	defer st.mu.Unlock()
	items, over := st.items, st.overflowed
	st.items, st.overflowed = nil, false
	return items, over
}
