package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/fenceline/fenceline/internal/scope"
)

// ServiceConfig configures a lease service. The zero value works.
type ServiceConfig struct {
	// Replicas of the log and audit streams: 1 on a single server, 3 on a
	// cluster.
	Replicas int
	// MaxBatch bounds how many requests one log record commits (default 256).
	MaxBatch int
	// Logger receives operational logs (default: discard).
	Logger *slog.Logger
	// Now is the clock; its monotonic reading decides expiry (default time.Now).
	Now func() time.Time
}

// Validate reports a configuration that cannot work.
func (c *ServiceConfig) Validate() error {
	if c.Replicas < 0 || c.Replicas > 5 {
		return fmt.Errorf("replicas %d: want 1, 3 or 5", c.Replicas)
	}
	if c.MaxBatch < 0 {
		return fmt.Errorf("max batch %d: must not be negative", c.MaxBatch)
	}
	return nil
}

// Service is the lease service: it answers lease requests on the bus, keeps
// each repo's committed state in memory, batches concurrent requests of a
// repo into one compare-and-swap append to the repo's log, sweeps expired
// leases and writes the audit stream.
//
// Several instances may run against one bus (a queue group): each append is
// a compare-and-swap on the repo's log, so an instance with a stale view
// fails its write, reloads and retries; it can never grant over a lease it
// has not seen.
type Service struct {
	nc    *nats.Conn
	js    jetstream.JetStream
	store *store
	cfg   ServiceConfig
	log   *slog.Logger
	audit *auditWriter

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	subs   []*nats.Subscription

	mu       sync.Mutex
	actors   map[string]*actor // by repo key; guarded by mu
	index    map[string]string // lease id -> repo key; guarded by mu
	stopping bool              // no new goroutines once set; guarded by mu
}

// StartService creates the streams if needed, loads every repo's lease log
// and starts answering requests. Stop it with Stop.
func StartService(ctx context.Context, nc *nats.Conn, cfg ServiceConfig) (*Service, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("lease service config: %w", err)
	}
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = 256
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	if err := ensureStreams(ctx, js, cfg.Replicas); err != nil {
		return nil, err
	}
	s := &Service{nc: nc, js: js, store: &store{js: js, replicas: cfg.Replicas, writer: nuid.Next()}, cfg: cfg, log: cfg.Logger,
		actors: map[string]*actor{}, index: map[string]string{}}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	s.audit = newAuditWriter(js, s.log)
	s.wg.Go(func() { s.audit.run(s.ctx) })

	keys, err := s.store.repoKeys(ctx)
	if err != nil {
		s.Stop()
		return nil, err
	}
	for _, key := range keys {
		// Load before the actor's goroutine starts: the goroutine owns the
		// state from then on (and arms its sweep timer from the loaded
		// deadlines). Nothing else can reach the actor yet: the request
		// subscriptions start below.
		a := s.newActor(key, "")
		if err := a.reload(ctx); err != nil {
			s.Stop()
			return nil, fmt.Errorf("load lease log %s: %w", key, err)
		}
		s.mu.Lock()
		s.actors[key] = a
		s.mu.Unlock()
		s.wg.Go(func() { a.run(s.ctx) })
	}
	tail, err := nc.Subscribe(logSubject+".>", s.tail)
	if err != nil {
		s.Stop()
		return nil, fmt.Errorf("subscribe %s.>: %w", logSubject, err)
	}
	s.subs = append(s.subs, tail)
	for _, op := range []string{"acquire", "renew", "release", "revoke", "cancel", "get", "list", "sweep"} {
		sub, err := nc.QueueSubscribe(apiPrefix+"."+op, serviceQueue, s.handler(op))
		if err != nil {
			s.Stop()
			return nil, fmt.Errorf("subscribe %s.%s: %w", apiPrefix, op, err)
		}
		s.subs = append(s.subs, sub)
	}
	if err := nc.FlushTimeout(10 * time.Second); err != nil {
		s.Stop()
		return nil, fmt.Errorf("flush subscriptions: %w", err)
	}
	s.log.Info("lease service started", "repos", len(keys), "replicas", max(cfg.Replicas, 1))
	return s, nil
}

// Stop stops answering, finishes in-flight batches and waits for every
// goroutine the service started.
func (s *Service) Stop() {
	for _, sub := range s.subs {
		_ = sub.Unsubscribe()
	}
	s.mu.Lock()
	s.stopping = true // a handler still running starts nothing new
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
}

// actor returns the actor of a repo, starting it if needed. A new actor
// loads the repo's log before its first write.
func (s *Service) actor(key, repo string) *actor {
	s.mu.Lock()
	defer s.mu.Unlock()
	if a, ok := s.actors[key]; ok {
		return a
	}
	a := s.newActor(key, repo)
	s.actors[key] = a
	if s.stopping {
		a.dead = true // never runs: enqueue answers "stopping"
		return a
	}
	s.wg.Go(func() { a.run(s.ctx) })
	return a
}

// goTracked runs f on a goroutine the service waits for in Stop; once the
// service is stopping it answers c with ErrUnavailable instead.
func (s *Service) goTracked(c *call, f func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		c.respond(reply{Error: toWire(fmt.Errorf("%w: lease service stopping", ErrUnavailable))})
		return
	}
	s.wg.Go(f)
}

func (s *Service) newActor(key, repo string) *actor {
	return &actor{svc: s, key: key, state: newRepoState(repo), stale: true,
		calls: make(chan *call, 4096), rearm: make(chan struct{}, 1)}
}

func (s *Service) actorForLease(id string) (*actor, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	key, ok := s.index[id]
	if !ok {
		return nil, false
	}
	return s.actors[key], true
}

func (s *Service) indexLeases(key string, es []*entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range es {
		s.index[e.LeaseID] = key
	}
}

func (s *Service) unindex(ids []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		delete(s.index, id)
	}
}

func (s *Service) allActors() []*actor {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make([]*actor, 0, len(s.actors))
	for _, a := range s.actors {
		out = append(out, a)
	}
	slices.SortFunc(out, func(a, b *actor) int { return strings.Compare(a.key, b.key) })
	return out
}

// call is one request on its way through a repo actor.
type call struct {
	op    string
	msg   *nats.Msg
	at    time.Time // when the service received it (monotonic)
	req   any
	reply chan reply // for in-process calls (list across repos); else msg.Respond
}

// fresh reports whether the call must see every record of the log, not
// just this instance's view: reads, and the nudge that another writer
// appended.
func (c *call) fresh() bool {
	switch c.req.(type) {
	case *getRequest, *listRequest, *syncRequest:
		return true
	}
	return false
}

func (c *call) respond(r reply) {
	if c.reply != nil {
		c.reply <- r
		return
	}
	if c.msg == nil {
		return // an internal nudge: nobody waits
	}
	data, err := json.Marshal(r)
	if err != nil {
		data, _ = json.Marshal(reply{Error: toWire(fmt.Errorf("encode reply: %w", err))})
	}
	_ = c.msg.Respond(data)
}

func respondErr(m *nats.Msg, err error) {
	data, _ := json.Marshal(reply{Error: toWire(err)})
	_ = m.Respond(data)
}

// handler decodes a request and hands it to the actor of its repo.
func (s *Service) handler(op string) nats.MsgHandler {
	return func(m *nats.Msg) {
		c := &call{op: op, msg: m, at: s.cfg.Now()}
		var repo, leaseID, hint string
		var err error
		switch op {
		case "acquire":
			var r AcquireRequest
			err = decode(m.Data, &r)
			if err == nil {
				err = r.normalize()
			}
			c.req, repo = &r, r.Repo
		case "renew":
			var r RenewRequest
			err = decode(m.Data, &r)
			if err == nil && r.Version == 0 {
				err = fmt.Errorf("%w: renew needs the version the holder last saw (a renewal is a compare-and-swap on it)", ErrInvalid)
			}
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "release":
			var r ReleaseRequest
			err = decode(m.Data, &r)
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "revoke":
			var r RevokeRequest
			err = decode(m.Data, &r)
			if err == nil && strings.TrimSpace(r.Reason) == "" {
				err = fmt.Errorf("%w: revoke needs a reason (--reason)", ErrInvalid)
			}
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "cancel":
			var r cancelRequest
			err = decode(m.Data, &r)
			c.req, repo = &r, r.Repo
		case "get":
			var r getRequest
			err = decode(m.Data, &r)
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "list":
			var r listRequest
			if err = decode(m.Data, &r); err == nil {
				s.goTracked(c, func() { s.list(c, &r) }) // fans out to actors; must not block the subscription
				return
			}
		case "sweep":
			var r sweepRequest
			if err = decode(m.Data, &r); err == nil {
				s.goTracked(c, func() { s.sweepAll(c, &r) })
				return
			}
		}
		if err != nil {
			respondErr(m, err)
			return
		}
		if repo != "" {
			s.actor(RepoKey(repo), repo).submit(c)
			return
		}
		if !ValidLeaseID(leaseID) {
			respondErr(m, fmt.Errorf("%w: %q is not a lease id (want lease_…)", ErrInvalid, leaseID))
			return
		}
		if hint != "" {
			s.actor(RepoKey(hint), hint).submit(c)
			return
		}
		if a, ok := s.actorForLease(leaseID); ok {
			a.submit(c)
			return
		}
		// Not a lease this instance has seen: another instance may have
		// granted it. Read every repo's log before saying not found.
		s.goTracked(c, func() {
			s.discover(s.ctx)
			if a, ok := s.actorForLease(leaseID); ok {
				a.enqueue(c)
				return
			}
			respondErr(m, fmt.Errorf("%s: %w", leaseID, ErrNotFound))
		})
	}
}

// discover starts an actor for every repo with a lease log and has each
// read its log to the end, so the lease index covers what other instances
// granted.
func (s *Service) discover(ctx context.Context) {
	keys, err := s.store.repoKeys(ctx)
	if err != nil {
		s.log.Warn("list lease logs", "err", err)
		return
	}
	for _, key := range keys {
		s.actor(key, "").ask(ctx, &call{op: "sync", req: &syncRequest{}})
	}
}

// tail nudges the actor of every repo that another writer appends to, so
// this instance's view (and its queued waiters) follow within a round trip.
// Appends carry their writer's id; an instance ignores its own.
func (s *Service) tail(m *nats.Msg) {
	if m.Header.Get(writerHeader) == s.store.writer {
		return
	}
	key := strings.TrimPrefix(m.Subject, logSubject+".")
	a := s.actor(key, "")
	select {
	case a.calls <- &call{op: "sync", req: &syncRequest{}, at: s.cfg.Now()}:
	default: // a full queue will be processed (and reloaded) anyway
	}
}

func decode(data []byte, v any) error {
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("%w: decode request: %v", ErrInvalid, err)
	}
	return nil
}

// normalize validates an acquire request and fills in its defaults.
func (r *AcquireRequest) normalize() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", ErrInvalid, fmt.Sprintf(format, args...))
	}
	if strings.TrimSpace(r.Repo) == "" {
		return bad("repo is empty: name the repository (--repo)")
	}
	if r.Scope.Kind == "" {
		r.Scope.Kind = scope.KindNone
	}
	if r.Scope.Paths == nil {
		r.Scope.Paths = []string{}
	}
	if r.Scope.Tables == nil {
		r.Scope.Tables = []string{}
	}
	if err := r.Scope.Validate(); err != nil {
		return bad("scope: %v", err)
	}
	if r.WorkspaceID == "" {
		r.WorkspaceID = DefaultWorkspace
	}
	switch r.WorkspaceMode {
	case "":
		r.WorkspaceMode = WorkspaceShared
		if r.Scope.Kind != scope.KindPaths {
			r.WorkspaceMode = WorkspaceExclusive
		}
	case WorkspaceShared, WorkspaceExclusive:
	default:
		return bad("workspace mode %q: want shared or exclusive", r.WorkspaceMode)
	}
	if r.WorkspaceMode == WorkspaceShared && r.Scope.Kind != scope.KindPaths {
		return bad("a shared-workspace lease must claim paths (--scope); claim none only with --workspace exclusive")
	}
	if r.Scope.Kind == scope.KindWholeRepo && r.WorkspaceMode != WorkspaceExclusive {
		return bad("a whole-repo lease needs an exclusive workspace")
	}
	if r.TTL == 0 {
		r.TTL = Duration(DefaultTTL)
	}
	if d := time.Duration(r.TTL); d < MinTTL || d > MaxTTL {
		return bad("ttl %s out of range: want %s to %s", d, MinTTL, MaxTTL)
	}
	if r.Wait < 0 {
		return bad("wait %s is negative", time.Duration(r.Wait))
	}
	if r.MaxSharers < 0 {
		return bad("max-sharers %d is negative", r.MaxSharers)
	}
	if len(r.CredentialHash) != 64 {
		return bad("credential hash missing: the client must send the SHA-256 of its credential")
	}
	return nil
}

// DefaultTTL is the TTL of a lease that asks for none.
const DefaultTTL = 300 * time.Second

// list answers a list request, across every repo or one.
func (s *Service) list(c *call, r *listRequest) {
	var actors []*actor
	if r.Repo != "" {
		actors = []*actor{s.actor(RepoKey(r.Repo), r.Repo)}
	} else {
		if keys, err := s.store.repoKeys(s.ctx); err == nil {
			for _, key := range keys {
				s.actor(key, "") // repos other instances started
			}
		}
		actors = s.allActors()
	}
	out := reply{Leases: []*Lease{}}
	for _, a := range actors {
		rep := a.ask(s.ctx, &call{op: "list", req: r})
		if rep.Error != nil {
			c.respond(rep)
			return
		}
		out.Leases = append(out.Leases, rep.Leases...)
	}
	c.respond(out)
}

func (s *Service) sweepAll(c *call, r *sweepRequest) {
	var actors []*actor
	if r.Repo != "" {
		actors = []*actor{s.actor(RepoKey(r.Repo), r.Repo)}
	} else {
		actors = s.allActors()
	}
	out := reply{Leases: []*Lease{}}
	for _, a := range actors {
		rep := a.ask(s.ctx, &call{op: "sweep", req: r})
		if rep.Error != nil {
			c.respond(rep)
			return
		}
		out.Leases = append(out.Leases, rep.Leases...)
	}
	c.respond(out)
}

// actor owns one repo's state. Its goroutine is the only one that touches
// state and waiters; requests reach it through calls.
type actor struct {
	svc   *Service
	key   string
	calls chan *call
	rearm chan struct{} // a batch ran inline: re-arm the timer
	dead  bool          // created while the service stopped; set before it is shared

	// busy is held by whoever runs a batch: the actor's goroutine, or a
	// request handler running an uncontended batch inline. It guards
	// everything below.
	busy sync.Mutex

	// Guarded by busy (and owned by StartService before the actor serves).
	state   *repoState
	stale   bool      // must reload the log before the next write
	waiters []*waiter // queued acquires, oldest first

	uncertain bool // an append's outcome is unknown: recheck audit on reload

	sinceSnap, bytesSinceSnap, snapBytes int
	// purgeAt is the sequence of a snapshot whose predecessors are still in
	// the log, waiting for their audit events (up to purgeCovers) to be
	// written; 0 when none.
	purgeAt, purgeCovers uint64
}

// waiter is an acquire queued behind conflicting leases.
type waiter struct {
	c        *call
	req      *AcquireRequest
	claim    claimRequest
	deadline time.Time
	// cancelled is set when its client withdrew it; it is dropped from the
	// queue without an answer (the cancel answered it).
	cancelled bool
}

// submit runs c inline if the actor is idle, else queues it.
func (a *actor) submit(c *call) {
	if !a.inline(c) {
		a.enqueue(c)
	}
}

func (a *actor) enqueue(c *call) {
	if a.dead {
		c.respond(reply{Error: toWire(fmt.Errorf("%w: lease service stopping", ErrUnavailable))})
		return
	}
	select {
	case a.calls <- c:
	default:
		c.respond(reply{Error: toWire(fmt.Errorf("%w: lease service overloaded for this repo; retry", ErrUnavailable))})
	}
}

// ask runs an in-process call through the actor and waits for its reply.
func (a *actor) ask(ctx context.Context, c *call) reply {
	c.reply = make(chan reply, 1)
	c.at = a.svc.cfg.Now()
	a.enqueue(c)
	select {
	case r := <-c.reply:
		return r
	case <-ctx.Done():
		return reply{Error: toWire(fmt.Errorf("%w: service stopping", ErrUnavailable))}
	}
}

// reload reads the log records this actor has not seen. Audit events of
// records that are not yet in the audit stream (their writer crashed before
// flushing) are queued again.
func (a *actor) reload(ctx context.Context) error {
	// Only records this instance may have written without queuing their
	// events need the audit check: at start, and after an append whose
	// outcome is unknown. Other instances' records are theirs to audit.
	written := uint64(math.MaxUint64)
	if a.state.seq == 0 || a.uncertain {
		var err error
		if written, err = lastWritten(ctx, a.svc.js, a.key); err != nil {
			return err
		}
	}
	err := a.svc.store.load(ctx, a.key, a.state, a.svc.cfg.Now, func(seq uint64, evs []AuditEvent) {
		if seq > written {
			a.svc.audit.add(a.key, seq, evs)
		}
	})
	if err != nil {
		return err
	}
	a.stale, a.uncertain = false, false
	all := make([]*entry, 0, len(a.state.leases)+len(a.state.ended))
	for _, e := range a.state.leases {
		all = append(all, e)
	}
	for _, e := range a.state.ended {
		all = append(all, e)
	}
	a.svc.indexLeases(a.key, all)
	return nil
}

func (a *actor) run(ctx context.Context) {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	batch := make([]*call, 0, a.svc.cfg.MaxBatch)
	for {
		a.busy.Lock()
		a.resetTimer(timer)
		a.busy.Unlock()
		batch = batch[:0]
		fired := false
		select {
		case <-ctx.Done():
			a.busy.Lock()
			a.shutdown()
			a.busy.Unlock()
			return
		case c := <-a.calls:
			batch = append(batch, c)
		case <-timer.C:
			fired = true
		case <-a.rearm:
			continue // a batch ran inline: deadlines may have moved
		}
		a.busy.Lock()
		batch = a.drain(batch)
		if len(batch) > 0 || fired {
			a.process(ctx, batch)
		}
		a.busy.Unlock()
	}
}

// drain appends the queued calls to batch, up to MaxBatch.
func (a *actor) drain(batch []*call) []*call {
	for len(batch) < a.svc.cfg.MaxBatch {
		select {
		case c := <-a.calls:
			batch = append(batch, c)
		default:
			return batch
		}
	}
	return batch
}

// inline runs c's batch on the caller's goroutine when nothing else is
// going on: the actor is idle and no more requests wait on the caller's
// subscription. It saves the hand-off to the actor's goroutine for an
// uncontended request; under load requests queue and batch as usual.
func (a *actor) inline(c *call) bool {
	if a.dead || c.msg == nil || c.msg.Sub == nil {
		return false
	}
	// nats.go counts the message being handled as pending until the
	// handler returns: more than one means others are waiting.
	if n, _, err := c.msg.Sub.Pending(); err != nil || n > 1 {
		return false
	}
	if !a.busy.TryLock() {
		return false
	}
	a.process(a.svc.ctx, a.drain([]*call{c}))
	a.busy.Unlock()
	select {
	case a.rearm <- struct{}{}:
	default:
	}
	return true
}

// resetTimer arms the timer for the next lease deadline or waiter deadline.
func (a *actor) resetTimer(t *time.Timer) {
	next := a.state.nextDeadline()
	for _, w := range a.waiters {
		if next.IsZero() || w.deadline.Before(next) {
			next = w.deadline
		}
	}
	d := time.Hour
	if !next.IsZero() {
		d = max(next.Sub(a.svc.cfg.Now())+time.Millisecond, time.Millisecond)
	}
	if a.purgeAt != 0 {
		d = min(d, 4*auditDelay)
	}
	t.Reset(d)
}

func (a *actor) shutdown() {
	err := toWire(fmt.Errorf("%w: lease service stopping", ErrUnavailable))
	for _, w := range a.waiters {
		w.c.respond(reply{Error: err})
	}
	a.waiters = nil
	for {
		select {
		case c := <-a.calls:
			c.respond(reply{Error: err})
		default:
			return
		}
	}
}

// outcome is what one call's turn in a batch decided.
type outcome struct {
	c      *call
	lease  *entry
	leases []*Lease
	err    error
	park   *waiter // queue it
}

// process runs one batch: sweep, apply each call, serve the queue, then
// commit everything with one compare-and-swap append. On a lost race it
// reloads and runs the batch again; requests are idempotent, so a retry
// after an unknown outcome is safe too.
func (a *actor) process(ctx context.Context, batch []*call) {
	const attempts = 8
	for _, c := range batch {
		if c.fresh() {
			a.stale = true
		}
	}
	for try := 0; ; try++ {
		reloaded := a.stale
		if a.stale {
			if err := a.reload(ctx); err != nil {
				a.svc.log.Warn("reload lease log", "repo", a.state.repo, "err", err)
				a.failAll(batch, fmt.Errorf("%w: reading the lease log: %v", ErrUnavailable, err))
				return
			}
		}
		t := a.state.begin(a.svc.cfg.Now())
		t.sweep()
		outs := make([]outcome, len(batch))
		queue := slices.Clone(a.waiters)
		for i, c := range batch {
			outs[i] = a.apply(t, c, queue)
			if w := outs[i].park; w != nil {
				queue = append(queue, w)
			}
		}
		served, remaining := a.serve(t, queue)
		if !reloaded && try < attempts && refusesOnState(outs, served) {
			// A refusal is not a write, so no compare-and-swap vouches for
			// the state it was decided on: confirm it on a fresh view.
			a.stale = true
			continue
		}

		seq, size := a.state.seq, 0
		if t.dirty() {
			var err error
			seq, size, err = a.svc.store.append(ctx, a.key, a.state.seq, t.record())
			if err != nil {
				a.stale = true
				if errors.Is(err, errCAS) && try < attempts {
					continue
				}
				a.uncertain = !errors.Is(err, errCAS) // it may have landed
				a.svc.log.Warn("append lease log", "repo", a.state.repo, "err", err)
				a.failAll(batch, fmt.Errorf("%w: writing the lease log: %v", ErrUnavailable, err))
				return
			}
		}
		t.commit(seq)
		a.finish(t, outs, served, remaining, seq, size)
		return
	}
}

// refusesOnState reports whether any outcome refuses because of what the
// state says (conflict, lost, not owner, not found).
func refusesOnState(lists ...[]outcome) bool {
	for _, outs := range lists {
		for _, o := range outs {
			if o.err != nil && (errors.Is(o.err, ErrConflict) || IsFenced(o.err)) {
				return true
			}
		}
	}
	return false
}

func (a *actor) failAll(batch []*call, err error) {
	for _, c := range batch {
		c.respond(reply{Error: toWire(err)})
	}
}

// finish publishes what a committed batch changed and answers its calls.
func (a *actor) finish(t *txn, outs []outcome, served []outcome, remaining []*waiter, seq uint64, size int) {
	var granted []*entry
	for _, id := range t.order {
		if e := t.changed[id]; e.Version == 1 {
			granted = append(granted, e)
		}
	}
	a.svc.indexLeases(a.key, granted)
	if len(a.state.evicted) > 0 {
		a.svc.unindex(a.state.evicted)
		a.state.evicted = nil
	}
	a.waiters = remaining
	// Answer first: watchers and the audit stream are not on the path of
	// the request (the record is durable; the events are in it).
	for _, o := range append(outs, served...) {
		if o.park != nil {
			continue
		}
		r := reply{Error: toWire(o.err), Leases: o.leases}
		if o.lease != nil {
			l := o.lease.Lease
			r.Lease = &l
		}
		o.c.respond(r)
	}
	for _, id := range t.order {
		a.notify(t.changed[id])
	}
	a.svc.audit.add(a.key, seq, t.events)
	if size > 0 {
		a.maybeSnapshot(size)
	}
	a.maybePurge()
}

// notify publishes a lease's committed record for watchers (best effort:
// holders also learn of loss at their next renewal).
func (a *actor) notify(e *entry) {
	data, err := json.Marshal(&e.Lease)
	if err != nil {
		return
	}
	_ = a.svc.nc.Publish(changedPrefix+"."+a.key+"."+e.LeaseID, data)
}

// maybeSnapshot writes the whole state once the deltas since the last
// snapshot outweigh it, so loading stays proportional to the state, not to
// its history. The records before it are purged later (maybePurge).
func (a *actor) maybeSnapshot(deltaBytes int) {
	a.sinceSnap++
	a.bytesSinceSnap += deltaBytes
	if a.sinceSnap < 64 || a.bytesSinceSnap < a.snapBytes || a.purgeAt != 0 {
		return
	}
	prev := a.state.seq
	seq, size, err := a.svc.store.append(a.svc.ctx, a.key, prev, a.state.snapshot())
	if err != nil {
		if errors.Is(err, errCAS) {
			a.stale = true
		}
		a.svc.log.Warn("snapshot lease log", "repo", a.state.repo, "err", err)
		return
	}
	a.state.seq = seq
	a.sinceSnap, a.bytesSinceSnap, a.snapBytes = 0, 0, size
	a.purgeAt, a.purgeCovers = seq, prev
}

// maybePurge drops the records before the last snapshot once every audit
// event they carry is in the audit stream.
func (a *actor) maybePurge() {
	if a.purgeAt == 0 || a.svc.audit.written(a.key) < a.purgeCovers {
		return
	}
	if err := a.svc.store.purgeBefore(a.svc.ctx, a.key, a.purgeAt); err != nil {
		a.svc.log.Warn("purge lease log", "repo", a.state.repo, "err", err)
		return
	}
	a.purgeAt, a.purgeCovers = 0, 0
}

// apply runs one call against the batch's transaction.
func (a *actor) apply(t *txn, c *call, queue []*waiter) outcome {
	o := outcome{c: c}
	switch r := c.req.(type) {
	case *AcquireRequest:
		return a.acquire(t, c, r, queue)
	case *RenewRequest:
		o.lease, o.err = t.renew(r)
	case *ReleaseRequest:
		o.lease, o.err = t.release(r)
	case *RevokeRequest:
		o.lease, o.err = t.revoke(r)
	case *cancelRequest:
		o.err = a.cancel(t, r)
	case *getRequest:
		if o.lease = t.lookup(r.LeaseID); o.lease == nil {
			o.err = fmt.Errorf("%s: %w", r.LeaseID, ErrNotFound)
		}
	case *listRequest:
		o.leases = []*Lease{}
		add := func(e *entry) {
			l := e.Lease
			o.leases = append(o.leases, &l)
		}
		t.active(func(e *entry) bool { add(e); return true })
		if r.All {
			for _, id := range t.base.endedFIFO {
				if _, changed := t.changed[id]; !changed {
					add(t.base.ended[id])
				}
			}
			for _, id := range t.order {
				if e := t.changed[id]; !e.Active() {
					add(e)
				}
			}
		}
		slices.SortFunc(o.leases, func(x, y *Lease) int { return strings.Compare(x.LeaseID, y.LeaseID) })
	case *syncRequest:
		// nothing: the reload before the batch was the point
	case *sweepRequest:
		o.leases = []*Lease{}
		for _, id := range t.order {
			if e := t.changed[id]; e.Status == StatusReclaimed {
				l := e.Lease
				o.leases = append(o.leases, &l)
			}
		}
	default:
		o.err = fmt.Errorf("%w: unknown request %T", ErrInvalid, c.req)
	}
	return o
}

func (a *actor) acquire(t *txn, c *call, r *AcquireRequest, queue []*waiter) outcome {
	o := outcome{c: c}
	if e := t.granted(r); e != nil {
		o.lease = e
		return o
	}
	claim := claimRequest{scope: r.Scope, workspaceID: r.WorkspaceID, mode: r.WorkspaceMode, maxSharers: r.MaxSharers}
	conflicts := t.conflicts(claim)
	if len(conflicts) == 0 {
		// Queued requests that overlap go first, waiting or not: a stream
		// of small claims must not starve a queued larger one.
		conflicts = queuedConflict(claim, queue)
	}
	if len(conflicts) == 0 {
		o.lease = t.grant(r, claim)
		return o
	}
	if r.Wait > 0 {
		o.park = &waiter{c: c, req: r, claim: claim, deadline: c.at.Add(time.Duration(r.Wait))}
		return o
	}
	ce := &ConflictError{Repo: t.base.repo, Conflicts: conflicts}
	t.refusal(r.Owner, r.Scope, "conflict", fmt.Sprintf("refused acquire of %s by %s: %s", r.Scope, r.Owner, ce.Error()))
	o.err = ce
	return o
}

// serve grants queued acquires that fit now, oldest first, and times out
// those past their deadline. A waiter is granted only if no earlier waiter
// that is still queued overlaps it.
func (a *actor) serve(t *txn, queue []*waiter) (served []outcome, remaining []*waiter) {
	for _, w := range queue {
		if w.cancelled {
			continue
		}
		if e := t.granted(w.req); e != nil {
			served = append(served, outcome{c: w.c, lease: e})
			continue
		}
		conflicts := t.conflicts(w.claim)
		if len(conflicts) == 0 {
			conflicts = queuedConflict(w.claim, remaining)
		}
		switch {
		case len(conflicts) == 0:
			served = append(served, outcome{c: w.c, lease: t.grant(w.req, w.claim)})
		case !t.now.Before(w.deadline):
			ce := &ConflictError{Repo: t.base.repo, Conflicts: conflicts, Waited: true}
			t.refusal(w.req.Owner, w.claim.scope, "wait-expired", fmt.Sprintf("refused acquire of %s by %s after waiting %s: %s", w.claim.scope, w.req.Owner, time.Duration(w.req.Wait), ce.Error()))
			served = append(served, outcome{c: w.c, err: ce})
		default:
			remaining = append(remaining, w)
		}
	}
	return served, remaining
}

// queuedConflict names the first request in queue that claim must wait
// behind, or returns nil.
func queuedConflict(claim claimRequest, queue []*waiter) []Conflict {
	for _, w := range queue {
		if why := blocks(claim, w.claim.scope, w.claim.workspaceID, w.claim.mode); why != "" && !w.cancelled {
			return []Conflict{{RequestID: w.req.RequestID, Owner: w.req.Owner, Scope: w.claim.scope,
				WorkspaceID: w.claim.workspaceID, Why: "queued earlier: " + why}}
		}
	}
	return nil
}

// cancel withdraws a queued acquire; if it was already granted, the lease
// is released (the caller gave up on it).
func (a *actor) cancel(t *txn, r *cancelRequest) error {
	for _, w := range a.waiters {
		if w.req.RequestID == r.RequestID && r.Credential.matches(w.req.CredentialHash) && !w.cancelled {
			w.cancelled = true // serve drops it
			w.c.respond(reply{Error: toWire(fmt.Errorf("%w: acquire cancelled by its client", ErrInvalid))})
			return nil
		}
	}
	id, ok := t.base.byRequest[r.RequestID]
	if !ok {
		return nil
	}
	_, err := t.release(&ReleaseRequest{LeaseID: id, Credential: r.Credential})
	return err
}
