package leasebus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/nats-io/nuid"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// ServiceConfig configures a lease service. The zero value works.
type ServiceConfig struct {
	// Replicas of the log and audit streams: 1 on a single server, 3 on a
	// cluster.
	Replicas int
	// MaxBatch bounds how many requests one log record commits (default 256).
	MaxBatch int
	// MaxRecordBytes bounds the estimated size of one log record: a batch
	// that reaches it takes no more requests, and the next batch runs the
	// rest (default half the largest message the bus's servers and the
	// log stream take: 512 KB on a NATS server's default 1 MB, 4 MB on
	// the embedded bus).
	MaxRecordBytes int
	// MaxHeldBytes bounds what one identity's leases take across every
	// repo, as counted against a repo's room (entrySize: 1 KB a lease plus
	// its claim and texts), those it released or lost included until
	// their repos forget them (within EndedKept); a grant past it is
	// refused, naming the identity (default DefaultMaxHeldBytes). Repo
	// names are the asker's to choose, so without it one runner could grow
	// every instance's memory by a repo's room at a time.
	MaxHeldBytes int
	// Logger receives operational logs (default: discard).
	Logger *slog.Logger
	// Now is the clock; its monotonic reading decides expiry (default time.Now).
	Now func() time.Time
	// StoreProbe, when set, is asked every 100 ms and when a write fails
	// or goes unanswered what is wrong with the bus's store, so writes are
	// refused at once, naming the fault (a full or read-only store), rather
	// than after a timeout. `bus serve` sets it to embedded.StoreProbe of its
	// embedded server.
	StoreProbe StoreProbe
	// Names maps bus identities (public nkeys) to the names the audit
	// calls them by (RequestedBy); an identity not in it is named by its
	// key.
	Names map[string]string
	// Metrics, when set, counts requests, appends and queues (one Service
	// per ServiceMetrics).
	Metrics *ServiceMetrics
	// holdLoads, when set, holds the background load of every repo's log
	// until it is closed (tests: what a request costs before it).
	holdLoads <-chan struct{}
	// FenceSecretDir holds the repositories' storage secrets
	// (WriteFenceSecret), from which the service derives each lease's
	// grant keys for its acquirer (grants.go); empty: it grants no keys,
	// and storages that check fences refuse every fenced write.
	FenceSecretDir string
	// SessionGrace is how long a client's session may send no keepalive
	// before its leases are reclaimed (default DefaultSessionGrace; see
	// liveness.go).
	SessionGrace time.Duration
	// Primary has the instances on the bus elect one that alone serves
	// the lease requests (primary.go); `bus serve` sets it on a cluster.
	// Without it every instance serves every repo, kept apart by
	// compare-and-swap alone.
	Primary bool
	// PrimaryTerm is how long a primary's claim counts from when it was
	// sent (default DefaultPrimaryTerm).
	PrimaryTerm time.Duration
}

// DefaultMaxHeldBytes is ServiceConfig.MaxHeldBytes's default: about
// 25,000 leases of short claims an identity, held or released within the
// last five minutes (a fleet's runners have one each; a host whose
// processes share one holds them all).
const DefaultMaxHeldBytes = 32 << 20

// Validate reports a configuration that cannot work.
func (c *ServiceConfig) Validate() error {
	if c.Replicas < 0 || c.Replicas > 5 {
		return fmt.Errorf("replicas %d: want 1, 3 or 5", c.Replicas)
	}
	if c.MaxRecordBytes < 0 {
		return fmt.Errorf("max record bytes %d: must not be negative", c.MaxRecordBytes)
	}
	if c.MaxHeldBytes < 0 {
		return fmt.Errorf("max held bytes %d: must not be negative", c.MaxHeldBytes)
	}
	if c.MaxBatch < 0 {
		return fmt.Errorf("max batch %d: must not be negative", c.MaxBatch)
	}
	if c.SessionGrace != 0 && c.SessionGrace < 2*DefaultSilence {
		return fmt.Errorf("session grace %s: at least %s (a holder must have stopped writing long before its lease is reclaimed)", c.SessionGrace, 2*DefaultSilence)
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
	nc    *nats.Conn // in the service account: the streams, the other instances
	fleet *nats.Conn // in the fleet account: requests, answers, change notices
	// ownFleet: fleet was connected by StartService (closed by Stop).
	ownFleet bool
	// open: the bus asks no credentials (its INFO says no auth is
	// required), so every connection is Anonymous and may ask as such.
	// On a bus with identities nobody is Anonymous: a message on an
	// Anonymous request subject is an answer someone had the bus send
	// there (the reply trick), refused as any other such.
	open bool
	// recordBudget bounds the estimated bytes of one log record (txn.full):
	// half the largest message the log stream and the bus's servers take
	// (1 MB by default on a NATS server, 8 MB on the embedded bus).
	recordBudget int
	// repoRoom bounds what one repo's leases take (repoState.room): what
	// one message of the bus carries.
	repoRoom int
	// fleetUnprobedAt: when the bus last refused the fleet connection
	// hearsFleet's request (a configuration from before it), unix ns; 0:
	// it has not, or has let it through since.
	fleetUnprobedAt atomic.Int64
	// reach is the claim connection's answer to hearsFleet (answerReach),
	// nil while the bus refuses it; guarded by reachMu.
	reachMu sync.Mutex
	reach   *nats.Subscription
	// asked: an identity of the service account (a tool or test acting
	// as a client) has made a request, so changes are announced there too.
	asked atomic.Bool
	js    jetstream.JetStream
	store *store
	cfg   ServiceConfig
	log   *slog.Logger
	warns *warnings // the repos' warnings, repeats held back
	audit *auditWriter

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	actors map[string]*actor   // by repo key; guarded by mu
	index  map[string]*indexed // lease id -> its repo key and record (never changed once made: replaced); guarded by mu
	// heldBy is what the leases in index take, by holder (entrySize),
	// across every repo, the ended ones its repos still remember included:
	// an identity holds at most ServiceConfig.MaxHeldBytes (reserveHeld).
	// Kept with index; guarded by mu.
	heldBy map[string]int
	// reserved is what batches in progress have granted by holder and not
	// yet indexed (reserveHeld), and waitingBy the acquires each identity
	// has waiting at every repo's actor (waitersChanged) with parking those
	// batches in progress have queued (reserveWait). Guarded by mu.
	reserved, waitingBy, parking map[string]int
	stopping                     bool                  // no new goroutines once set; guarded by mu
	inFlight                     map[string]int        // goTracked's goroutines by identity; guarded by mu
	subs                         []*nats.Subscription  // guarded by mu
	tailing                      atomic.Bool           // following other instances' appends (and announcing ours)
	storeErr                     atomic.Pointer[error] // the store fault the probe last found (watchStore)
	statusCache                  statusCache           // the streams' leaders a status answer reports (status.go)
	// refusals queues refusals by the bus for refusalWriter; what does not
	// fit is counted in refusalsDropped.
	refusals        chan busRefusal
	refusalsDropped atomic.Int64
	// overloadsQueued counts the overload refusals (ReasonBusOverload)
	// queued this second, and overloadsDropped those counted instead:
	// past refusalRate a second, or when the queue was full.
	overloadsQueued  atomic.Int64
	overloadsDropped atomic.Int64
	// boundary bounds each identity's rate of boundary events.
	boundary boundaryLimits
	// secrets caches the storages' secrets of FenceSecretDir (grants.go).
	secrets secretCache

	// activeLeases counts the active leases of every actor's committed
	// state (actor.count), for the metrics.
	activeLeases atomic.Int64
	// loading holds the loads of repos' logs under way (loadedActor), so
	// concurrent requests for one repo share one; guarded by mu.
	loading map[string]*repoLoad
	// scans coalesces the scans for old-form lease ids (route.go).
	scans idScans
	// cold holds the repos a standby has no warm view of that it heard
	// appended to (warm.go).
	cold coldRepos
	// live is what this instance knows of sessions' keepalives.
	live *liveness
	// beats are the changes its next beat names (beat.go).
	beats *beater
	// keptReads holds a token for each keepalive reading logs now (at most
	// maxKeptReaders: see Service.keepalive).
	keptReads chan struct{}
	// keptReaders counts the places in keptReads by identity; guarded by
	// keptMu.
	keptMu      sync.Mutex
	keptReaders map[string]int
	// lastReap (on the monotonic clock), behind and massSilence belong to
	// the session reaper's goroutine (reapSilent).
	lastReap    time.Time
	behind      bool
	massSilence bool
	// keepaliveSubs take keepalives (asked here, or forwarded by a
	// standby): the reaper waits while they are behind. Guarded by mu.
	keepaliveSubs []*nats.Subscription
	// intakes hold the requests read and not yet served, by identity
	// (intake.go); an identity's sessions are not reclaimed while its
	// keepalives wait there (silentSession). Guarded by mu; only
	// appended to.
	intakes []*intake
	// shards writes the shard store's records (shards.go).
	shards shardStore
	// prim is this instance's part in the election of the primary
	// (primary.go); nil when there is none (ServiceConfig.Primary off).
	prim *primacy
	// gone tells askers at once when the primary a standby forwarded
	// their request to takes none (primary.go).
	gone goneWatch
	// answerVia holds a subscription of each connection the service
	// answers on, through which a forwarded request is answered; guarded
	// by mu.
	answerVia map[*nats.Conn]*nats.Subscription
	// policies are the policies in force, followed from the bus
	// (policy.go); acquires are judged by them (policyclaims.go).
	policies policy.Store
	// names are the names of identities enrolled since the service
	// started (IdentityChanged), by public nkey; cfg.Names has the rest.
	names sync.Map
}

// StartService creates the streams if needed and starts answering
// requests; it reads no repo's lease log before it serves. A repo's log is
// read when a request first needs it, and a background pass loads every
// other repo's, a few at a time (loadEvery). Stop it with Stop.
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
	if cfg.SessionGrace == 0 {
		cfg.SessionGrace = DefaultSessionGrace
	}
	if cfg.MaxHeldBytes == 0 {
		cfg.MaxHeldBytes = DefaultMaxHeldBytes
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	if err := ensureStreamsPatiently(ctx, js, cfg.Replicas, cfg.Logger); err != nil {
		if cfg.StoreProbe != nil {
			if perr := cfg.StoreProbe(ctx); perr != nil {
				return nil, fmt.Errorf("%w (%w)", perr, err)
			}
		}
		return nil, err
	}
	// Requests, answers and change notices go through a connection in the
	// fleet account (ConnectFleet), or through nc on a bus without one.
	fleet, why, err := fleetConn(nc)
	if err != nil {
		return nil, err
	}
	ownFleet := fleet != nc
	if why != "" {
		cfg.Logger.Warn("the lease service answers on its one connection: the bus has no fleet account, so a holder can have JetStream's answers stored in the lease streams (docs/trust.md)", "why", why)
	}
	s := &Service{nc: nc, fleet: fleet, ownFleet: ownFleet, open: !fleet.AuthRequired(), recordBudget: cmp.Or(cfg.MaxRecordBytes, recordBudget(nc)), repoRoom: repoRoomOf(nc), js: js, store: &store{js: js, replicas: cfg.Replicas, writer: nuid.Next(), boxes: newMailboxes(nc, 64), metrics: cfg.Metrics}, cfg: cfg, log: cfg.Logger, warns: newWarnings(warnEvery),
		actors: map[string]*actor{}, index: map[string]*indexed{}, heldBy: map[string]int{}, loading: map[string]*repoLoad{}, answerVia: map[*nats.Conn]*nats.Subscription{},
		keptReads: make(chan struct{}, maxKeptReaders), keptReaders: map[string]int{}}
	if cfg.Metrics != nil {
		if err := cfg.Metrics.attach(s); err != nil {
			if ownFleet {
				fleet.Close()
			}
			return nil, fmt.Errorf("lease service metrics: %w (one service per ServiceMetrics)", err)
		}
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	if cfg.Primary {
		s.prim = &primacy{term: cmp.Or(cfg.PrimaryTerm, DefaultPrimaryTerm)}
	}
	s.live = newLiveness(cfg.SessionGrace, cfg.Now())
	s.beats = newBeater(cfg.Now(), cfg.SessionGrace)
	s.audit = newAuditWriter(js, s.log, s.store.writer)
	s.wg.Go(func() { s.audit.run(s.ctx) })
	s.refusals = make(chan busRefusal, 256)
	s.wg.Go(func() { s.refusalWriter(s.ctx) })
	if cfg.StoreProbe != nil {
		s.wg.Go(func() { s.watchStore(s.ctx) })
	}

	if err := s.meetPeers(); err != nil {
		s.Stop()
		return nil, err
	}
	if err := s.shareLiveness(); err != nil {
		s.Stop()
		return nil, err
	}
	// The policies in force are read before the first request is served:
	// no claim is judged without them.
	// On a new cluster the policy stream may still be electing its leader
	// when the others are ready (the streams' elections run one by one).
	// The watch lives as long as the service; the caller's ctx bounds only
	// the wait.
	policy.Prefault() // it judges claims for as long as it runs
	detach := context.AfterFunc(ctx, s.cancel)
	pw, err := watchPoliciesPatiently(s.ctx, js, &s.policies, serviceStartPatience, func(try int, err error) {
		s.log.Info("waiting for JetStream: the policy stream has no leader yet", "try", try, "err", err)
	})
	if !detach() && err == nil {
		pw.Stop()
		err = ctx.Err()
	}
	if err != nil {
		s.Stop()
		return nil, fmt.Errorf("lease service: %w", err)
	}
	s.wg.Go(func() { s.followPolicies(s.ctx, pw) })
	if s.prim != nil {
		if err := s.takeForwarded(); err != nil {
			s.Stop()
			return nil, err
		}
		if s.fleet != s.nc {
			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			err := s.answerReach(actx)
			cancel()
			switch {
			case refusesReach(err):
				s.reachRefused(err)
			case err != nil: // made again when the check finds nobody answering
				s.log.Warn("lease service: its claim connection does not answer its fleet connection yet", "err", err)
			}
		}
	}
	subs, err := s.subscribe(slices.Concat(leaseOps, otherOps, []string{opStatus}))
	if err != nil {
		s.Stop()
		return nil, err
	}
	for _, sub := range subs {
		s.track(sub)
	}
	if s.prim != nil {
		// Learns, before the first election, whether the bus lets the
		// fleet connection reach the claim connection (hearsFleet).
		_ = s.probeFleet(ctx, time.Second)
		s.cold.wake = make(chan struct{}, 1)
		s.wg.Go(func() { s.elect(s.ctx) })
		s.wg.Go(func() { s.warmCold(s.ctx) })
		s.log.Info("lease service started; electing the primary", "replicas", max(cfg.Replicas, 1), "term", s.prim.term)
		return s, nil
	}
	// Serving already: each repo's log is read when a request first needs
	// it, and by this background pass, which loads the rest a few at a
	// time, so leases nobody asks about still expire. The audit catch-up
	// follows it: it accounts for the records the pass saw.
	s.goBackground(func() {
		s.loadEvery(s.ctx)
		s.catchUp(s.ctx)
	})
	s.log.Info("lease service started", "replicas", max(cfg.Replicas, 1))
	return s, nil
}

// ensureStreamsPatiently creates the streams, trying again until ctx ends
// while JetStream cannot answer yet. On a fresh cluster it first elects a
// meta leader (a request sent before that is dropped unanswered), then each
// replicated stream elects its own (a raft election takes 4-9 s), so each
// try gets its own deadline, doubling from 2 s. Servers started together
// may not all have met yet: "no suitable peers" is tried again for a while
// (clusterFormWait), then named as the likely misconfiguration.
func ensureStreamsPatiently(ctx context.Context, js jetstream.JetStream, replicas int, log *slog.Logger) error {
	per := 2 * time.Second
	start := time.Now()
	for try := 1; ; try++ {
		tctx, cancel := context.WithTimeout(ctx, per)
		err := ensureStreams(tctx, js, replicas)
		cancel()
		var apiErr *jetstream.APIError
		if errors.As(err, &apiErr) && apiErr.ErrorCode == 10005 && time.Since(start) > clusterFormWait {
			return fmt.Errorf("%w (after %s: does the cluster have %d servers with JetStream, and do their routes reach each other?)", err, clusterFormWait, replicas)
		}
		if err == nil || ctx.Err() != nil || !transient(err) {
			return err
		}
		if errors.As(err, &apiErr) && apiErr.ErrorCode == 10005 {
			log.Info("waiting for the cluster to form: JetStream knows too few servers to place the lease streams yet; start the others (or check their routes)",
				"replicas", replicas, "waited", time.Since(start).Round(time.Second), "gives_up_after", clusterFormWait)
		} else {
			log.Info("waiting for JetStream: a new cluster elects its leaders first, which needs a majority of its servers up", "try", try, "err", err)
		}
		per = min(2*per, 30*time.Second)
		select {
		case <-ctx.Done():
			return err
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// serviceStartPatience bounds how long a starting service waits for the
// policy stream to answer once every stream exists.
const serviceStartPatience = 60 * time.Second

// clusterFormWait bounds how long stream creation waits for a cluster's
// servers to meet (JetStream: no suitable peers for placement).
const clusterFormWait = 30 * time.Second

// transient reports whether a failed JetStream request may succeed when
// tried again: no answer, JetStream not available yet, or a cluster still
// forming (its meta leader does not know enough peers yet to place R3).
func transient(err error) bool {
	var apiErr *jetstream.APIError
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout), errors.Is(err, nats.ErrNoResponders):
		return true
	case errors.As(err, &apiErr):
		// 10008: JetStream system temporarily unavailable; 10005: no suitable peers for placement.
		return apiErr.Code == 503 || apiErr.ErrorCode == 10008 || apiErr.ErrorCode == 10005
	}
	return false
}

// Stop stops answering, finishes in-flight batches and waits for every
// goroutine the service started.
func (s *Service) Stop() {
	s.mu.Lock()
	s.stopping = true // a handler still running starts nothing new
	subs := s.subs
	s.mu.Unlock()
	for _, sub := range subs {
		_ = sub.Unsubscribe()
	}
	var release func()
	if s.prim != nil {
		release = s.leaveTerm() // nothing is appended from here on
	}
	s.cancel()
	s.wg.Wait()
	s.reachMu.Lock()
	if s.reach != nil {
		_ = s.reach.Unsubscribe()
		s.reach = nil
	}
	s.reachMu.Unlock()
	if release != nil {
		release() // a standby takes over at once
	}
	s.store.boxes.close()
	if s.ownFleet {
		s.fleet.Close()
	}
}

// FleetConn is the service's connection in the fleet account (its one
// connection on a bus without accounts): where identity requests are
// taken too (embedded.ServeIdentities).
func (s *Service) FleetConn() *nats.Conn { return s.fleet }

// conns are the connections the service takes requests on: the fleet
// account's, and the service account's when that is another.
func (s *Service) conns() []*nats.Conn {
	if s.fleet == s.nc {
		return []*nats.Conn{s.nc}
	}
	return []*nats.Conn{s.fleet, s.nc}
}

// announce publishes a change notice in the fleet account, and in the
// service account once anything there has asked the service (only tools
// and tests act as clients there: every notice twice would cost the fleet
// a publish per change for no one).
func (s *Service) announce(subj string, data []byte) {
	_ = s.fleet.Publish(subj, data)
	if s.fleet != s.nc && s.asked.Load() {
		_ = s.nc.Publish(subj, data)
	}
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
// service is stopping it answers c with ErrUnavailable instead, and
// reports false.
//
// A request's goroutines are counted by its identity: one with
// maxInFlight of them running has the request refused as an overload
// (audited), so a runner that floods the requests served this way (list,
// sweep, status, a lease's first lookup) holds at most that many
// goroutines, and the fan-outs among them queue at each repo as its own
// calls, in turn with everyone else's (callQueue).
func (s *Service) goTracked(c *call, f func()) bool {
	s.mu.Lock()
	if s.stopping {
		s.mu.Unlock()
		c.respond(reply{Error: toWire(fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable))})
		return false
	}
	by := ""
	if c.msg != nil {
		by = c.by
	}
	if by != "" {
		if n := s.inFlight[by]; n >= maxInFlight {
			s.mu.Unlock()
			what := fmt.Sprintf("%s has %d requests in flight already (at most %d an identity)", s.name(by), n, maxInFlight)
			s.refuse(ReasonBusOverload, by, "refused a "+c.op+" request: "+what)
			c.fail(fmt.Errorf("%w: lease service overloaded: %s; retry once they are answered", lease.ErrUnavailable, what))
			return false
		}
		if s.inFlight == nil {
			s.inFlight = map[string]int{}
		}
		s.inFlight[by]++
	}
	s.wg.Go(func() {
		if by != "" {
			defer s.doneInFlight(by)
		}
		f()
	})
	s.mu.Unlock()
	return true
}

// maxInFlight bounds the goroutines one identity's requests hold in the
// service at once (goTracked).
const maxInFlight = 2048

// doneInFlight counts one of by's requests in flight as done.
func (s *Service) doneInFlight(by string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.inFlight[by]--; s.inFlight[by] <= 0 {
		delete(s.inFlight, by)
	}
}

// goBackground runs f on a goroutine the service waits for in Stop, and
// reports whether it did (not once the service is stopping).
func (s *Service) goBackground(f func()) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		return false
	}
	s.wg.Go(f)
	return true
}

// emptyState is a view of repo with nothing read yet. A primary's views
// set the active leases they read past their record (renewSlack): it
// answers renewals from memory.
func (s *Service) emptyState(repo string) *repoState {
	st := newRepoState(repo)
	st.room = s.repoRoom
	if s.prim != nil {
		st.slack = renewSlack
	}
	return st
}

func (s *Service) newActor(key, repo string) *actor {
	return &actor{svc: s, key: key, state: s.emptyState(repo), stale: true,
		calls: callQueue{ready: make(chan struct{}, 1)}, timer: time.NewTimer(time.Hour)}
}

// existing returns the actor of a repo key if there is one.
func (s *Service) existing(key string) (*actor, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a, ok := s.actors[key]
	return a, ok
}

// indexed is what the service keeps of a lease outside its repo's actor:
// which actor has it, and its entry as of the last batch that changed it
// or reload that read it (for cached gets, and the session reaper in
// liveness.go). Shared, not copied: an entry's record, holder and session
// never change once it is made (a change is a new entry, see
// entry.clone); only its deadline and encodings, which the index's
// readers do not read, are set afterwards under the actor's busy. A copy
// of the record was 0.7 KB a lease (BenchmarkMemoryPerLease).
type indexed struct {
	key string
	e   *entry
}

// indexOf is what the index keeps of e, a lease of repo key.
func indexOf(key string, e *entry) *indexed {
	return &indexed{key: key, e: e}
}

// setIndexLocked indexes e, a lease of repo key, and tallies what its
// holder holds (heldBy). Called with mu held.
func (s *Service) setIndexLocked(key string, e *entry) {
	if old, ok := s.index[e.LeaseID]; ok {
		s.tallyLocked(old.e, -1)
	}
	s.index[e.LeaseID] = indexOf(key, e)
	s.tallyLocked(e, 1)
}

// tallyLocked adds e's bytes to its holder's tally (sign 1) or takes them
// away (-1). An ended lease counts until its repo forgets it (endedKeep):
// it takes the same memory, and a runner acquiring and releasing in one
// made-up repo after another held nothing active while each repo kept
// what it had released, up to its room. Called with mu held.
func (s *Service) tallyLocked(e *entry, sign int) {
	addCount(&s.heldBy, e.Holder, sign*entrySize(e))
}

// reserveHeld reserves n bytes for a lease a batch grants identity,
// unless its leases across every repo this instance knows (heldBy), with
// what other batches reserved, would then take more than most; it
// returns what they take. Batches of many repos run at once:
// checked against the index alone, each saw the same total.
func (s *Service) reserveHeld(identity string, n, most int) (held int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	held = s.heldBy[identity] + s.reserved[identity]
	if held+n > most {
		return held, false
	}
	addCount(&s.reserved, identity, n)
	return held, true
}

// maxWaitingAcross bounds the acquires one identity has waiting across
// every repo (maxWaiting bounds them at one): a waiting acquire holds its
// request in the service's memory, and repo names are the asker's to
// choose.
const maxWaitingAcross = 512

// reserveWait reserves a place for an acquire a batch queues for
// identity, unless it has maxWaitingAcross waiting (or queued by batches
// in progress) already; it returns how many.
func (s *Service) reserveWait(identity string) (waiting int, ok bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	waiting = s.waitingBy[identity] + s.parking[identity]
	if waiting >= maxWaitingAcross {
		return waiting, false
	}
	addCount(&s.parking, identity, 1)
	return waiting, true
}

// unreserve returns what a batch reserved (reserveHeld, reserveWait),
// once it is committed (and indexed) or abandoned.
func (s *Service) unreserve(held, parked map[string]int) {
	if len(held) == 0 && len(parked) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, n := range held {
		addCount(&s.reserved, id, -n)
	}
	for id, n := range parked {
		addCount(&s.parking, id, -n)
	}
}

// waitersChanged counts the acquires an actor has waiting: before were
// its waiters, after are they now. What changed is worked out before
// taking mu, which every cached get takes too.
func (s *Service) waitersChanged(before, after []*waiter) {
	if slices.Equal(before, after) {
		return
	}
	was := make(map[*waiter]bool, len(before))
	for _, w := range before {
		was[w] = true
	}
	delta := map[string]int{}
	for _, w := range after {
		if was[w] {
			delete(was, w)
			continue
		}
		delta[w.c.by]++
	}
	for w := range was {
		delta[w.c.by]--
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for by, n := range delta {
		addCount(&s.waitingBy, by, n)
	}
}

// addCount adds n to (*m)[key], dropping the key at zero.
func addCount(m *map[string]int, key string, n int) {
	if *m == nil {
		*m = map[string]int{}
	}
	if v := (*m)[key] + n; v > 0 {
		(*m)[key] = v
	} else {
		delete(*m, key)
	}
}

func (s *Service) actorForLease(id string) (*actor, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	ix, ok := s.index[id]
	if !ok {
		return nil, false
	}
	return s.actors[ix.key], true
}

// indexLeases records es, the leases of repo key a batch changed or a
// reload read. Only the repo's actor calls it, so its entries are not
// changing meanwhile.
//
// A lease whose record changed is marked for the next beat once it is in
// the index the keepalives answer from, and before the batch that changed
// it answers anyone (beat.go).
func (s *Service) indexLeases(key string, es []*entry) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, e := range es {
		if old, ok := s.index[e.LeaseID]; !ok || old.e.Version != e.Version || old.e.Status != e.Status || old.e.Fence != e.Fence {
			s.beats.mark(e.LeaseID)
		}
		s.setIndexLocked(key, e)
	}
}

// maxCachedAge bounds how old a view a cached get may answer from: older,
// the get reads the log (through the stream's leader) like any other. A
// cached get finding the view older than refreshAfter asks the actor to
// reload meanwhile, so a repo whose holders beat stays within it. With a
// holder's defaults (heartbeat 200 ms, silence 800 ms) such a view leaves
// 400 ms for the answer to arrive.
const (
	maxCachedAge = 200 * time.Millisecond
	refreshAfter = 100 * time.Millisecond
)

// cachedLease is the record of lease id as this instance last committed
// or read it, and how long ago (service clock) that view was confirmed to
// be the whole log's: what a holder's heartbeat asks (getRequest.Cached).
// It answers without the actor's queue or a read of the log, so most
// heartbeats cost a map lookup; the holder counts the answer as heard age
// before it asked. An instance alone on the bus writes every record
// itself, so its view is the log's (age 0) — cut off from the log's
// leader it can change nothing either. Once it follows another instance,
// whose appends reach it only by a reload, it has none (ok false) when
// its view is older than maxCachedAge: it must not vouch for a lease from
// a view the other may have changed since.
func (s *Service) cachedLease(id string) (l lease.Lease, age time.Duration, ok bool) {
	s.mu.Lock()
	ix, a := s.viewOfLocked(id)
	s.mu.Unlock()
	if a == nil {
		return lease.Lease{}, 0, false
	}
	age, ok = s.viewAge(a, s.viewing())
	if !ok {
		return lease.Lease{}, 0, false
	}
	return ix.e.Lease, age, true
}

// viewOfLocked is this instance's record of lease id and the actor of its
// repo (nil when it has none). Called with mu held; the record is never
// changed once indexed, so it may be read after mu is released.
func (s *Service) viewOfLocked(id string) (*indexed, *actor) {
	ix, found := s.index[id]
	if !found {
		return nil, nil
	}
	a := s.actors[ix.key]
	if a == nil {
		return nil, nil
	}
	return ix, a
}

// vantage is what decides, now, whether this instance vouches for its
// views (viewing): once per request, however many leases it asks after.
type vantage struct {
	now    time.Time
	sole   bool   // alone on the bus: every record is its own
	term   uint64 // the primary's term it is in
	inTerm bool
}

func (s *Service) viewing() vantage {
	v := vantage{now: s.cfg.Now(), sole: s.prim == nil && !s.tailing.Load()}
	if s.prim != nil {
		v.term, v.inTerm = s.prim.current(v.now)
	}
	return v
}

// viewAge is how old the view of a's repo is (0: vouched for, as the
// log's own), and whether this instance may answer from it at all (see
// cachedLease); it asks a to refresh a view getting old.
func (s *Service) viewAge(a *actor, v vantage) (time.Duration, bool) {
	if v.sole || s.prim != nil && v.inTerm && a.term.Load() == v.term {
		return 0, true
	}
	conf := a.confirmed.Load()
	if conf == nil {
		return 0, false
	}
	age := max(v.now.Sub(*conf), 0)
	if age > refreshAfter {
		a.refresh(v.now)
	}
	return age, age <= maxCachedAge
}

// unindex drops ids from the lease index; one that was there is marked
// for the next beat (a keepalive about it no longer finds a view).
func (s *Service) unindex(ids []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, id := range ids {
		if ix, ok := s.index[id]; ok {
			s.beats.mark(id)
			s.tallyLocked(ix.e, -1)
			delete(s.index, id)
		}
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

// subscribe takes the requests of ops, on every connection the service
// answers on, and waits until the server has them.
func (s *Service) subscribe(ops []string) ([]*nats.Subscription, error) {
	var subs []*nats.Subscription
	fail := func(err error) ([]*nats.Subscription, error) {
		for _, sub := range subs {
			_ = sub.Unsubscribe()
		}
		return nil, err
	}
	for _, op := range ops {
		// <op>.<identity>: the bus lets each identity publish only under
		// its own, so the last token says who asked (see Grant).
		// Asked in the fleet account, and in the service account by
		// the service's own identities (tools and tests that act as
		// one).
		for _, conn := range s.conns() {
			h := s.handler(op, conn != s.fleet)
			if s.prim != nil && slices.Contains(leaseOps, op) {
				h = s.primaryOnly(h, op, conn != s.fleet)
			}
			in, ok := s.newIntake(op, true, h)
			if !ok {
				return fail(fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable))
			}
			take := func(m *nats.Msg) { in.deliver(m, m.Sub, m) }
			var sub *nats.Subscription
			var err error
			if op == opStatus {
				sub, err = conn.Subscribe(requestSubject(op, "*"), take) // every instance answers
			} else {
				sub, err = conn.QueueSubscribe(requestSubject(op, "*"), serviceQueue, take)
			}
			if err != nil {
				return fail(fmt.Errorf("subscribe %s: %w", requestSubject(op, "*"), err))
			}
			subs = append(subs, sub)
			s.mu.Lock()
			if op == "keepalive" {
				s.keepaliveSubs = append(s.keepaliveSubs, sub)
			}
			if s.answerVia[conn] == nil {
				s.answerVia[conn] = sub
			}
			s.mu.Unlock()
		}
	}
	for _, conn := range s.conns() {
		if err := conn.FlushTimeout(10 * time.Second); err != nil {
			return fail(fmt.Errorf("flush subscriptions: %w", err))
		}
	}
	return subs, nil
}

// primaryOnly serves a lease request with h on the primary, and forwards
// it from a standby (primary.go).
func (s *Service) primaryOnly(h serveFunc, op string, inServiceAccount bool) serveFunc {
	return func(m *nats.Msg, at time.Time, alone bool) {
		if s.Primary() {
			h(m, at, alone)
			return
		}
		s.forward(m, op, inServiceAccount)
	}
}

// handler decodes a request and hands it to the actor of its repo.
func (s *Service) handler(op string, serviceAccount bool) serveFunc {
	return s.handlerOf(op, serviceAccount, false)
}

// handlerOf is handler; forwarded says that its requests come from a
// standby (primary.go), on one subscription for every op, which must not
// wait for any one request's append: they run on their repo's actor.
func (s *Service) handlerOf(op string, serviceAccount, forwarded bool) serveFunc {
	return func(m *nats.Msg, at time.Time, alone bool) {
		if serviceAccount && !s.asked.Load() {
			s.asked.Store(true) // announce changes there too from now on
		}
		c := &call{op: op, msg: m, at: at, svc: s, forwarded: forwarded, alone: alone}
		var repo, leaseID, hint string
		var err error
		if jetStreamDelivery(m) {
			// A JetStream delivery, not a request its identity published:
			// the server delivers a push consumer's messages to any subject
			// its creator names, without checking its permissions.
			s.refuse(ReasonBusForged, "", fmt.Sprintf("ignored a JetStream delivery on the request subject %s (a consumer someone made delivers there)", m.Subject))
			return
		}
		id := m.Subject[strings.LastIndexByte(m.Subject, '.')+1:]
		if !validIdentity(id) {
			s.cfg.Metrics.took(op)
			c.fail(fmt.Errorf("%w: request subject %q names no identity (want %s)", lease.ErrInvalid, m.Subject, requestSubject(op, "<identity>")))
			return
		}
		if _, sent := s.sender(m); !sent {
			// Not a request its identity sent (it would await the answer in
			// its own inbox): an answer someone had the server, or this
			// service, send here by naming this subject as its reply. (Not
			// in the name of id, who did not send it.)
			why := fmt.Sprintf("whose reply %q is not that identity's inbox", m.Reply)
			if id == Anonymous {
				why = "on a bus with identities, where no one asks as " + Anonymous
			}
			s.refuse(ReasonBusForged, "", fmt.Sprintf("ignored a message on %s, the request subject of %s, %s: an answer someone had the bus send there", m.Subject, s.name(id), why))
			return
		}
		c.by = id
		s.cfg.Metrics.took(op) // each path from here answers (call.answered)
		if most := maxRequestOf(op); most > 0 && len(m.Data) > most {
			// A call waiting at an actor keeps its request: what a
			// request of its kind may hold, and no more, past its
			// intake.
			c.fail(fmt.Errorf("%w: %s request of %d KB: at most %d KB", lease.ErrInvalid, op, len(m.Data)>>10, most>>10))
			return
		}
		switch op {
		case "acquire":
			var r AcquireRequest
			err = decode(m.Data, &r)
			if err == nil {
				err = r.normalize()
			}
			if err == nil {
				err = s.checkAcquirePolicy(id, &r)
			}
			if err == nil && r.Session != "" {
				if ok, _ := s.live.admits(sessionKey(id, r.Session)); !ok {
					s.refuseSession(c, id, "acquire") // its keepalives would be refused
					return
				}
			}
			r.by, r.byName = id, s.name(id)
			c.req, repo = &r, r.Repo
		case "renew":
			var r RenewRequest
			err = decode(m.Data, &r)
			if err == nil && r.Version == 0 {
				err = fmt.Errorf("%w: renew needs the version the holder last saw (a renewal is a compare-and-swap on it)", lease.ErrInvalid)
			}
			if err == nil && !validRenewID(r.RenewID) {
				// It is in the lease's record from then on (a renewal
				// retried answers from it), so it is bounded as the
				// grant counted it (roomFor): letters, digits, - and _,
				// which the record carries as they are.
				err = fmt.Errorf("%w: renewal id %q: want at most %d letters, digits, - or _ (a client's NewRequestID)", lease.ErrInvalid, clip(r.RenewID, 80), maxRenewID)
			}
			r.by = id
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "release":
			var r ReleaseRequest
			err = decode(m.Data, &r)
			r.by = id
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "revoke":
			var r RevokeRequest
			err = decode(m.Data, &r)
			if err == nil && strings.TrimSpace(r.Reason) == "" {
				err = fmt.Errorf("%w: revoke needs a reason (Reason)", lease.ErrInvalid)
			}
			if err == nil && len(r.Reason) > maxRevokeReason {
				err = fmt.Errorf("%w: revoke reason of %d bytes: at most %d (it is in the lease's record)", lease.ErrInvalid, len(r.Reason), maxRevokeReason)
			}
			r.by = s.name(id)
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "cancel":
			var r cancelRequest
			err = decode(m.Data, &r)
			r.by = id
			c.req, repo = &r, r.Repo
		case "keepalive":
			var r keepaliveRequest
			if err = decode(m.Data, &r); err == nil {
				err = checkKeepalive(&r)
			}
			if err == nil {
				s.keepalive(c, id, &r)
				return
			}
		case "get":
			var r getRequest
			err = decode(m.Data, &r)
			if err == nil && r.Cached {
				if l, age, ok := s.cachedLease(r.LeaseID); ok {
					c.respond(reply{Lease: &l, Age: lease.Duration(age)})
					return
				}
			}
			c.req, leaseID, hint = &r, r.LeaseID, r.Repo
		case "list":
			var r listRequest
			if err = decode(m.Data, &r); err == nil {
				s.goTracked(c, func() { // fans out to actors; must not block the subscription
					c.respond(s.fanOut(c, r.Repo, &r))
					s.auditAccess(lease.EventList, r.Repo, id, nil) // after the answer: reads fail open, and wait for no fsync
				})
				return
			}
		case opStatus:
			s.goTracked(c, func() {
				st := s.status(s.ctx)
				c.respond(reply{Status: &st})
			})
			return
		case "audit":
			if len(m.Data) > maxEventRequest {
				c.fail(fmt.Errorf("%w: an audit event of %d bytes: at most %d (clip what the agent sent to an excerpt)", lease.ErrInvalid, len(m.Data), maxEventRequest))
				return
			}
			var ev lease.AuditEvent
			if err = decode(m.Data, &ev); err == nil {
				err = checkBoundaryEvent(&ev)
			}
			if err == nil {
				s.goTracked(c, func() { c.respond(s.recordBoundary(s.ctx, id, ev)) })
				return
			}
		case opShard, opShardAdmin:
			if len(m.Data) > maxShardRequest {
				c.fail(fmt.Errorf("%w: a shard write of %d bytes: at most %d", lease.ErrInvalid, len(m.Data), maxShardRequest))
				return
			}
			var w ShardWrite
			if err = decode(m.Data, &w); err == nil {
				s.goTracked(c, func() { c.respond(s.writeShard(s.ctx, id, op == opShardAdmin, w)) })
				return
			}
		case opPolicy:
			if len(m.Data) > maxPolicyRequest {
				c.fail(fmt.Errorf("%w: a policy write of %d bytes: at most %d", lease.ErrInvalid, len(m.Data), maxPolicyRequest))
				return
			}
			var w PolicyWrite
			if err = decode(m.Data, &w); err == nil {
				s.goTracked(c, func() { c.respond(s.writePolicy(s.ctx, id, w)) })
				return
			}
		case "sweep":
			var r sweepRequest
			if err = decode(m.Data, &r); err == nil {
				s.goTracked(c, func() {
					rep := s.fanOut(c, r.Repo, &r)
					c.respond(rep)
					if rep.Error == nil {
						s.auditAccess(lease.EventSweep, r.Repo, id, rep.Leases)
					}
				})
				return
			}
		}
		if err != nil {
			c.fail(err)
			return
		}
		if r, ok := c.req.(*cancelRequest); ok {
			// A cancel of a repo nobody leased in has nothing to withdraw:
			// it starts no actor (see actorIfLogged).
			s.goTracked(c, func() {
				a, err := s.actorIfLogged(s.ctx, r.Repo)
				switch {
				case err != nil:
					c.fail(err)
				case a == nil:
					c.respond(reply{})
				default:
					a.submit(c)
				}
			})
			return
		}
		if repo != "" {
			s.actor(RepoKey(repo), repo).submit(c)
			return
		}
		if !lease.ValidLeaseID(leaseID) {
			c.fail(fmt.Errorf("%w: %q is not a lease id (want lease_…)", lease.ErrInvalid, leaseID))
			return
		}
		s.route(c, leaseID, hint) // reads at most the log of the repo the id names (route.go)
	}
}

// track records a subscription for Stop; one made while stopping is
// dropped at once.
func (s *Service) track(sub *nats.Subscription) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stopping {
		_ = sub.Unsubscribe()
		return
	}
	s.subs = append(s.subs, sub)
}

// meetPeers finds the other lease service instances on the bus. Alone, an
// instance does not follow the log subjects: every append would come back
// to it for nothing. Once it meets another instance (each announces itself
// on start and answers announcements), both follow each other's appends.
// Correctness never depends on this — compare-and-swap appends, fresh reads
// and confirmed refusals do — only how soon a queued acquire sees a release
// made through another instance.
func (s *Service) meetPeers() error {
	// Announcements and answers carry the writer header: a server's answer
	// that a client sent here (see serviceWrote) is not an instance.
	hello, err := s.nc.Subscribe(peersSubject, func(m *nats.Msg) {
		if !fromInstance(m) || string(m.Data) == s.store.writer {
			return
		}
		s.followOthers()
		if m.Reply != "" {
			_ = m.RespondMsg(s.peerMsg(m.Reply))
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", peersSubject, err)
	}
	s.track(hello)
	inbox := s.nc.NewRespInbox()
	answers, err := s.nc.Subscribe(inbox, func(m *nats.Msg) {
		if fromInstance(m) && string(m.Data) != s.store.writer {
			s.followOthers()
		}
	})
	if err != nil {
		return fmt.Errorf("subscribe %s: %w", inbox, err)
	}
	s.track(answers)
	hi := s.peerMsg(peersSubject)
	hi.Reply = inbox
	if err := s.nc.PublishMsg(hi); err != nil {
		return fmt.Errorf("announce on %s: %w", peersSubject, err)
	}
	// Again now and then while alone: an instance that started across a
	// partition, or whose announcement was lost, is met once it heals
	// (until then this one answers heartbeats as the log's only writer).
	s.goBackground(func() {
		t := time.NewTicker(reannounce)
		defer t.Stop()
		for !s.tailing.Load() {
			select {
			case <-s.ctx.Done():
				return
			case <-t.C:
				_ = s.nc.PublishMsg(hi)
			}
		}
	})
	return nil
}

// reannounce is how often an instance that has met no other announces
// itself again.
const reannounce = 2 * time.Second

// peerMsg is this instance's announcement (or answer to one) on subj.
func (s *Service) peerMsg(subj string) *nats.Msg {
	m := nats.NewMsg(subj)
	m.Header.Set(writerHeader, s.store.writer)
	m.Data = []byte(s.store.writer)
	return m
}

// followOthers starts following the log subjects (once) and has every
// actor reload, since appends may have been missed until now.
func (s *Service) followOthers() {
	s.mu.Lock()
	stopping := s.stopping
	s.mu.Unlock()
	if stopping || !s.tailing.CompareAndSwap(false, true) {
		return
	}
	sub, err := s.nc.Subscribe(appendedPrefix+".>", s.tail)
	if err != nil {
		s.log.Warn("follow other lease service instances", "err", err)
		return
	}
	s.track(sub)
	s.log.Info("another lease service instance is on the bus; following its appends")
	for _, a := range s.allActors() {
		a.nudge()
	}
}

// tail follows what another instance appends. A primary (or an instance
// of a bus without an election) nudges the repo's actor, so its view and
// its queued waiters follow within a round trip; a standby folds the
// record the announcement carries into its warm view (warm.go), so a
// takeover needs no load. Announcements carry their writer's id; an
// instance ignores its own.
func (s *Service) tail(m *nats.Msg) {
	if !fromInstance(m) || m.Header.Get(writerHeader) == s.store.writer {
		return // not another instance's (see fromInstance), or our own
	}
	key := strings.TrimPrefix(m.Subject, appendedPrefix+".")
	if !s.Primary() {
		s.follow(key, m)
		return
	}
	s.actor(key, "").nudge()
}

// fromInstance reports whether m, on a subject between lease service
// instances, can be another instance's: it carries a writer stamp
// (serviceWrote) and is no JetStream delivery. A push consumer's
// creator names its delivery subject unchecked, and a record the service
// stored (a shard record) carries the service's stamp: delivered here, it
// would pass for an instance's word.
func fromInstance(m *nats.Msg) bool { return serviceWrote(m.Header) && !jetStreamDelivery(m) }

// announceAppend tells the other instances, once there are any, that the
// repo's log has the record data at seq: standbys fold it into their warm
// views (warm.go), another serving instance reloads. It is sent only
// after the stream acknowledged the append, so what it carries is
// durable, and a nudged instance that reloads finds it. Best effort: a
// lost announcement delays a waiter or leaves a standby's view to be read
// at its takeover, never changes a decision.
func (s *Service) announceAppend(key string, seq uint64, data []byte) {
	if !s.tailing.Load() {
		return
	}
	m := nats.NewMsg(appendedPrefix + "." + key)
	m.Header.Set(writerHeader, s.store.writer)
	m.Header.Set(logSeqHeader, strconv.FormatUint(seq, 10))
	m.Data = data
	_ = s.nc.PublishMsg(m)
}

func decode(data []byte, v any) error {
	if err := unmarshalRequest(data, v); err != nil {
		return fmt.Errorf("%w: decode request: %v", lease.ErrInvalid, err)
	}
	return nil
}

// normalize validates an acquire request and fills in its defaults.
func (r *AcquireRequest) normalize() error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s", lease.ErrInvalid, fmt.Sprintf(format, args...))
	}
	if strings.TrimSpace(r.Repo) == "" {
		return bad("repo is empty: name the repository (Repo)")
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
	// Every field of the request is in the lease's record and its audit events:
	// bounded, so that no request makes its repo's next log record too
	// large to append (which failed every request of its batch, of every
	// runner; TestOversizedAcquireFailsNoOtherRequest).
	if items, size := claimSize(r.Scope); items > MaxClaimItems || size > MaxClaimBytes {
		return bad("scope of %d paths and tables (%d bytes as recorded): at most %d, of %d bytes in all; claim their parent directory (or schema.*) instead", items, size, MaxClaimItems, MaxClaimBytes)
	}
	if err := r.Scope.Validate(); err != nil {
		return bad("scope: %v", err)
	}
	for _, f := range []struct {
		name, v string
		max     int
	}{
		{"repo", r.Repo, maxRepoName},
		{"workspace", r.WorkspaceID, maxIDField},
		{"owner task", r.Owner.TaskID, maxIDField},
		{"owner agent", r.Owner.AgentID, maxIDField},
		{"owner attempt", r.Owner.AttemptID, maxIDField},
		{"owner host", r.Owner.HostID, maxIDField},
		{"request id", r.RequestID, maxIDField},
	} {
		if len(f.v) > f.max {
			return bad("%s of %d bytes (%q…): at most %d", f.name, len(f.v), clip(f.v, 40), f.max)
		}
	}
	for _, w := range r.Workspaces {
		if len(w) > maxIDField {
			return bad("candidate workspace of %d bytes (%q…): at most %d", len(w), clip(w, 40), maxIDField)
		}
	}
	if len(r.Workspaces) > 0 {
		if r.WorkspaceID != "" {
			return bad("workspace %q and candidate workspaces %v: name one workspace or the candidates, not both", r.WorkspaceID, r.Workspaces)
		}
		if len(r.Workspaces) > MaxCandidates {
			return bad("%d candidate workspaces: at most %d", len(r.Workspaces), MaxCandidates)
		}
		seen := make(map[string]bool, len(r.Workspaces))
		for _, w := range r.Workspaces {
			if strings.TrimSpace(w) == "" || seen[w] {
				return bad("candidate workspaces %q: each must be named, and once", r.Workspaces)
			}
			seen[w] = true
		}
	} else if r.WorkspaceID == "" {
		r.WorkspaceID = lease.DefaultWorkspace
	}
	switch r.WorkspaceMode {
	case "":
		r.WorkspaceMode = lease.WorkspaceShared
		if r.Scope.Kind != scope.KindPaths {
			r.WorkspaceMode = lease.WorkspaceExclusive
		}
	case lease.WorkspaceShared, lease.WorkspaceExclusive:
	default:
		return bad("workspace mode %q: want shared or exclusive", r.WorkspaceMode)
	}
	if r.WorkspaceMode == lease.WorkspaceShared && r.Scope.Kind != scope.KindPaths {
		return bad("a shared-workspace lease must claim paths (Scope); claim none only with an exclusive WorkspaceMode")
	}
	if r.Scope.Kind == scope.KindWholeRepo && r.WorkspaceMode != lease.WorkspaceExclusive {
		return bad("a whole-repo lease needs an exclusive workspace")
	}
	if r.TTL == 0 {
		r.TTL = lease.Duration(DefaultTTL)
	}
	if d := time.Duration(r.TTL); d < MinTTL || d > MaxTTL {
		return bad("ttl %s out of range: want %s to %s", d, MinTTL, MaxTTL)
	}
	if r.Wait < 0 || time.Duration(r.Wait) > MaxTTL {
		return bad("wait %s out of range: want 0 to %s", time.Duration(r.Wait), MaxTTL)
	}
	if r.MaxSharers < 0 {
		return bad("max-sharers %d is negative", r.MaxSharers)
	}
	if len(r.CredentialHash) != 64 || strings.Trim(r.CredentialHash, "0123456789abcdef") != "" {
		return bad("credential hash missing or malformed: the client must send the SHA-256 of its credential, in 64 lowercase hex digits")
	}
	if r.Session != "" && !validSession(r.Session) {
		return bad("session %q: want %s followed by 32 hex digits (a client's session id)", clip(r.Session, 80), sessionPrefix)
	}
	return nil
}

// MaxCandidates bounds AcquireRequest.Workspaces (a shard pool's size).
const MaxCandidates = 256

const (
	// MaxClaimItems and MaxClaimBytes bound a lease's claim: its paths
	// and tables, and their bytes together. A claim larger than that is
	// better made of the directories (or schemas) above its items.
	MaxClaimItems = 1024
	MaxClaimBytes = 32 << 10
	// maxRepoName bounds a repo's name, maxIDField an owner's, a
	// workspace's and a request's id.
	maxRepoName = 1 << 10
	maxIDField  = 256
	// maxRevokeReason bounds an operator's reason for a revoke.
	maxRevokeReason = 1 << 10
)

// maxAcquireRequest bounds an acquire request as sent: a claim (32 KB as
// recorded), up to MaxCandidates workspaces of up to maxIDField bytes,
// and the owner's ids fit with room to spare. maxLeaseRequest bounds a
// renewal, release, revoke, cancel, get, list or sweep, which name a
// lease or a repo and little else.
const (
	maxAcquireRequest = 128 << 10
	maxLeaseRequest   = 16 << 10
)

// maxRequestOf is the most bytes a request of op may be as sent (0: its
// own bound, or none): a call queued at an actor (4,096 an identity at
// each repo) or an acquire waiting there keeps its request, which could
// otherwise be padded with fields nobody reads up to the bus's largest
// message.
func maxRequestOf(op string) int {
	switch op {
	case "acquire":
		return maxAcquireRequest
	case "renew", "release", "revoke", "cancel", "get", "list", "sweep":
		return maxLeaseRequest
	}
	return 0
}

// maxRenewID bounds a renewal's id (validRenewID).
const maxRenewID = 64

// validRenewID reports whether id may be a renewal's id: empty (none
// given), or up to maxRenewID letters, digits, - and _.
func validRenewID(id string) bool {
	if len(id) > maxRenewID {
		return false
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return false
		}
	}
	return true
}

// recordBudget is the budget of one log record (txn.full) on a bus whose
// servers take messages of at most nc's maximum payload.
func recordBudget(nc *nats.Conn) int { return largestMessage(nc) / 2 }

// repoRoomOf is the room of one repo's leases (repoRoom) on a bus whose
// servers take messages of at most nc's maximum payload.
func repoRoomOf(nc *nats.Conn) int { return repoRoom(largestMessage(nc)) }

// largestMessage is the largest message the log stream and nc's server
// take.
func largestMessage(nc *nats.Conn) int {
	most := int64(streamBudgets[LogStream].maxMsgSize)
	if p := nc.MaxPayload(); p > 0 {
		most = min(most, p)
	}
	return int(most)
}

// claimSize is how many paths and tables c lists, and their bytes as a
// record encodes them (jsonLen).
func claimSize(c scope.Claim) (items, size int) {
	for _, list := range [][]string{c.Paths, c.Tables} {
		for _, it := range list {
			size += jsonLen(it)
		}
		items += len(list)
	}
	return items, size
}

// DefaultTTL is the TTL of a lease that asks for none.
const DefaultTTL = 300 * time.Second

// name is what the audit calls identity id.
func (s *Service) name(id string) string {
	if n := s.cfg.Names[id]; n != "" {
		return n
	}
	if n, ok := s.names.Load(id); ok {
		return n.(string)
	}
	return id
}

// accessAuditTimeout bounds writing a read's or a sweep's audit event.
const accessAuditTimeout = 2 * time.Second

// auditAccess writes who asked for a list or a sweep of repo (every repo
// when empty) to the events stream (boundary bus, writer id), after
// the answer went out: a failed write is logged (reads fail open; what a
// sweep reclaims is audited with the lease log's events anyway).
func (s *Service) auditAccess(typ, repo, id string, swept []*lease.Lease) {
	who := s.name(id)
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: typ, Boundary: lease.BoundaryBus, Repo: repo, RequestedBy: who}
	what := repo
	if what == "" {
		what = "every repo"
	}
	switch typ {
	case lease.EventList:
		ev.Message = fmt.Sprintf("list: %s read the leases of %s", who, what)
	case lease.EventSweep:
		ids := make([]string, len(swept))
		for i, l := range swept {
			ids[i] = l.LeaseID
		}
		ev.Message = fmt.Sprintf("sweep: %s swept %s; reclaimed %d %v", who, what, len(ids), ids)
	}
	if err := s.writeBusEvent(s.ctx, id, ev); err != nil {
		s.log.Warn("audit event of a "+typ+" not written", "repo", repo, "requested_by", who, "err", err)
	}
}

// writeBusEvent writes one event of the bus itself (a read, a sweep, a
// refusal by NATS) that identity writer (none: the bus's own) caused, on
// the events stream, stamped as the service's (see serviceWrote).
func (s *Service) writeBusEvent(ctx context.Context, writer string, ev lease.AuditEvent) error {
	return s.writeEvent(ctx, eventsSubjectFor(ev.Repo, lease.BoundaryBus, writer), ev)
}

// writeEvent writes one event to subject, stamped as the service's.
func (s *Service) writeEvent(ctx context.Context, subject string, ev lease.AuditEvent) error {
	data, err := (&auditBatch{Events: []lease.AuditEvent{ev}}).encode()
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, accessAuditTimeout)
	defer cancel()
	msg := nats.NewMsg(subject)
	msg.Header.Set(writerHeader, s.store.writer)
	msg.Data = data
	_, err = s.js.PublishMsg(ctx, msg)
	return err
}

// actorIfLogged returns the actor of repo, starting one only when the repo
// has a lease log (nil when it has none): asking about a repo nobody ever
// leased in starts nothing. Without this, a viewer listing made-up repos
// left a permanent actor, goroutine and state behind for each.
func (s *Service) actorIfLogged(ctx context.Context, repo string) (*actor, error) {
	a, err := s.loadedActor(ctx, RepoKey(repo))
	if err != nil {
		return nil, fmt.Errorf("looking for the lease log of %s: %w", repo, err)
	}
	return a, nil
}

// fanOut runs req through the actor of repo, or of every repo with a lease
// log when repo is empty, and returns all their leases.
func (s *Service) fanOut(c *call, repo string, req any) reply {
	var actors []*actor
	if repo != "" {
		a, err := s.actorIfLogged(s.ctx, repo)
		if err != nil {
			return reply{Error: toWire(err)}
		}
		if a == nil {
			return reply{Leases: []*lease.Lease{}} // nobody ever leased in it
		}
		actors = []*actor{a}
	} else {
		if keys, err := s.store.repoKeys(s.ctx); err == nil {
			for _, key := range keys {
				s.actor(key, "") // repos other instances started
			}
		}
		actors = s.allActors()
	}
	out := reply{Leases: []*lease.Lease{}}
	for _, a := range actors {
		rep := a.ask(s.ctx, &call{op: c.op, by: c.by, req: req})
		if rep.Error != nil {
			return rep
		}
		out.Leases = append(out.Leases, rep.Leases...)
	}
	return out
}
