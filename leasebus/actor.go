package leasebus

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// call is one request on its way through a repo actor.
type call struct {
	op    string
	by    string // the asking identity ("": the service's own call)
	msg   *nats.Msg
	at    time.Time // when the service read it off the bus, before its intake (monotonic): an acquire's wait counts from then
	req   any
	reply chan reply // for in-process calls (list across repos); else an answer to msg
	svc   *Service   // counts the answer in its metrics (nil: internal call)
	// forwarded: a standby forwarded it (primary.go); msg.Sub is then a
	// subscription to answer through, not the one it waited on.
	forwarded bool
	// alone: no other request waited behind it on its way in (intake).
	alone bool
}

// answered counts the answer to c in the service's metrics, if any.
func (c *call) answered(err *wireError) {
	if c.svc == nil || c.svc.cfg.Metrics == nil || c.msg == nil {
		return
	}
	c.svc.cfg.Metrics.answered(c.op, c.svc.cfg.Now().Sub(c.at), err)
}

// fresh reports whether the call must see every record of the log, not
// just this instance's view: reads, and the nudge that another writer
// appended.
func (c *call) fresh() bool {
	switch c.req.(type) {
	case *getRequest, *listRequest, *syncRequest, *reapRequest:
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
	c.answered(r.Error)
	data, err := json.Marshal(r)
	if err != nil {
		data, _ = json.Marshal(reply{Error: toWire(fmt.Errorf("encode reply: %w", err))})
	}
	answer(c.msg, data)
}

// fail answers c with err.
func (c *call) fail(err error) {
	c.answered(toWire(err))
	respondErr(c.msg, err)
}

func respondErr(m *nats.Msg, err error) {
	data, _ := json.Marshal(reply{Error: toWire(err)})
	answer(m, data)
}

// nonceHeader carries a client's per-request nonce. The service's answer
// echoes it, so a client takes only the answer to the request it sent:
// anyone who can make the service (or the server) publish onto a client's
// reply subject — a runner sharing its identity names it as the reply of
// a request of its own — still cannot make that answer the client's.
const nonceHeader = "Fenceline-Nonce"

// maxNonce bounds an echoed nonce (a client's is 32 hex digits).
const maxNonce = 64

// answer sends data as the reply to request m, echoing its nonce.
func answer(m *nats.Msg, data []byte) {
	r := &nats.Msg{Subject: m.Reply, Data: data}
	if n := m.Header.Get(nonceHeader); n != "" && len(n) <= maxNonce {
		r.Header = nats.Header{nonceHeader: []string{n}}
	}
	if err := m.RespondMsg(r); errors.Is(err, nats.ErrMaxPayload) {
		// Larger than the bus takes (a list of every repo of a fleet):
		// said so, rather than left for the asker to time out.
		r.Data, _ = json.Marshal(reply{Error: toWire(fmt.Errorf("%w: the answer is %d KB, more than the largest message the bus takes; ask for less (the leases of one repo rather than of every repo)", lease.ErrInvalid, len(data)>>10))})
		_ = m.RespondMsg(r)
	}
}

// actor owns one repo's state. Requests reach it as calls: queued for its
// goroutine, or run inline by the request's handler when the actor is idle.
// Either way one batch runs at a time, under busy.
type actor struct {
	svc   *Service
	key   string
	calls callQueue
	timer *time.Timer // wakes run for the next deadline; reset under busy
	// reaping: a reap is queued and not yet run (reap queues at most one).
	reaping atomic.Bool
	dead    bool  // never runs (service stopping, or damaged log); set before it is shared
	deadErr error // why, when its log is damaged

	// confirmed is when (service clock) the last read or append that saw
	// the whole of the repo's log began: the view in memory is the log's
	// as of then (see Service.cachedLease). Nil until the first.
	confirmed atomic.Pointer[time.Time]
	// term is the primary's term in which the view was confirmed (0: none
	// or no election): within it, the view is the log's (vouches).
	term atomic.Uint64
	// epoch is the primary's epoch (primacy.epoch) the view last entered
	// (enterTerm); guarded by busy.
	epoch uint64
	// refreshed is when a cached get last asked for a reload (refresh).
	refreshed atomic.Pointer[time.Time]

	// busy is held by whoever runs a batch: the actor's goroutine, or a
	// request handler running an uncontended batch inline. It guards
	// everything below.
	busy sync.Mutex

	// Guarded by busy (and owned by StartService before the actor serves).
	state   *repoState
	stale   bool      // must reload the log before the next write
	counted int       // active leases last added to the service's count (count)
	waiters []*waiter // queued acquires, oldest first

	armed   time.Time // when the actor's timer fires
	retryAt time.Time // no timer-driven batch before this (after a failure)
	// more: the last batch's record was full before it served every
	// waiter that may be due; the next batch runs at once. Guarded by busy.
	more bool

	sinceSnap, bytesSinceSnap, snapBytes int
	// kept are the sequences of the repo's log records the stream still
	// keeps as far as this actor knows, oldest first: at most logKeep (see
	// keep and roomToAppend).
	kept seqWindow
	// warm: the view was folded from another instance's announcements
	// while this one was a standby, and its audit events not yet handed
	// to this instance's audit writer (warm.go). Nil otherwise.
	warm *warmAudit
}

// seqWindow holds the last logKeep sequences noted, oldest first, in a
// ring: noting one is O(1) on every append.
type seqWindow struct {
	seqs  [logKeep]uint64
	first int // index of the oldest
	n     int
}

// note adds seq unless it is not newer than the last noted; past logKeep
// the oldest goes.
func (w *seqWindow) note(seq uint64) {
	if w.n > 0 && seq <= w.seqs[(w.first+w.n-1)%logKeep] {
		return // seen already
	}
	if w.n == logKeep {
		w.seqs[w.first] = seq
		w.first = (w.first + 1) % logKeep
		return
	}
	w.seqs[(w.first+w.n)%logKeep] = seq
	w.n++
}

// full reports the oldest sequence noted, when logKeep are noted.
func (w *seqWindow) full() (oldest uint64, ok bool) {
	if w.n < logKeep {
		return 0, false
	}
	return w.seqs[w.first], true
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

// nudge makes the actor reload its log soon (another writer appended).
func (a *actor) nudge() {
	if a.dead {
		return
	}
	// When the actor is swamped, its next lost append or refusal reloads anyway.
	a.calls.push(&call{op: "sync", req: &syncRequest{}, at: a.svc.cfg.Now()})
}

// confirm notes that the actor's view was the whole log's at began, in
// term (the primary's, see vouches; 0: none).
func (a *actor) confirm(began time.Time, term uint64) {
	a.confirmed.Store(&began)
	a.term.Store(term)
}

// refresh asks for a reload (a nudge) unless one was asked within
// refreshAfter: cached gets keep the view they answer from recent without
// waiting for it.
func (a *actor) refresh(now time.Time) {
	last := a.refreshed.Load()
	if last != nil && now.Sub(*last) < refreshAfter {
		return
	}
	if a.refreshed.CompareAndSwap(last, &now) {
		a.nudge()
	}
}

// submit runs c inline if the actor is idle, else queues it.
func (a *actor) submit(c *call) {
	if !a.inline(c) {
		a.enqueue(c)
	}
}

func (a *actor) enqueue(c *call) {
	if a.dead {
		why := error(fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable))
		if a.deadErr != nil {
			why = fmt.Errorf("%w: %v", lease.ErrUnavailable, a.deadErr)
		}
		c.respond(reply{Error: toWire(why)})
		return
	}
	if !a.calls.push(c) {
		// This identity's share of the repo's queue is full: refused,
		// and said in the audit (at most refusalRate a second: a flood
		// of them is counted, not written one by one).
		what := fmt.Sprintf("%s has %d requests waiting for %s already", a.svc.name(c.by), maxQueued, a.repoOf(c))
		a.svc.refuse(ReasonBusOverload, c.by, "refused a "+c.op+" request: "+what)
		c.respond(reply{Error: toWire(fmt.Errorf("%w: lease service overloaded: %s (at most %d an identity); retry once they are answered", lease.ErrUnavailable, what, maxQueued))})
	}
}

// repoOf names the repo c is about for a message: the repo its request
// names where that is how c reached this actor (a lease id's repo hint is
// the client's word), else the actor's log key. (Not a.state's, which
// only busy's holder may read.)
func (a *actor) repoOf(c *call) string {
	var repo string
	switch r := c.req.(type) { // the requests whose repo chose this actor
	case *AcquireRequest:
		repo = r.Repo
	case *cancelRequest:
		repo = r.Repo
	}
	if repo != "" {
		return "repo " + repo
	}
	return "the repo of lease log " + a.key
}

// reap queues a reclaim of the leases whose sessions have been silent for
// grace, unless one is queued already. It is queued however many calls
// wait: a runner can fill a repo's queue with requests (maxQueued), and a
// reap refused as the overflow is would leave a dead runner's scope held
// for as long as it kept the queue full.
func (a *actor) reap(grace time.Duration, at time.Time) {
	if a.dead || !a.reaping.CompareAndSwap(false, true) {
		return
	}
	a.calls.pushAlways(&call{op: "reap", req: &reapRequest{grace: grace}, at: at})
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
		return reply{Error: toWire(fmt.Errorf("%w: service stopping", lease.ErrUnavailable))}
	}
}

// reload reads the log records this actor has not seen, and hands each to
// the audit chain: whoever wrote a record (this instance after an append
// whose outcome it never learned, another instance, one killed since), its
// events reach the audit stream once, through whichever instance extends
// the chain past it first.
func (a *actor) reload(ctx context.Context) error {
	n, err := a.readLog(ctx)
	if err != nil {
		return err
	}
	if n > 0 { // nothing read, nothing to index (the usual refresh)
		a.svc.indexLeases(a.key, a.entries())
		a.svc.dropEvicted(a.state)
		a.count()
	}
	return nil
}

// readLog reads the log records this actor has not seen into its state and
// hands each to the audit chain (see reload), without touching the
// service's lease index; it returns how many it read.
func (a *actor) readLog(ctx context.Context) (int, error) {
	onRecord := func(seq uint64, evs []lease.AuditEvent) {
		a.svc.audit.record(a.key, seq, evs)
		a.keep(seq)
	}
	audited := func() uint64 { // a first load starts at a snapshot and reads on back to it
		if a.state.seq > 0 {
			return 0
		}
		return a.svc.audit.auditedTo(ctx, a.key)
	}
	n, err := a.svc.store.load(ctx, a.key, a.state, audited(), a.svc.cfg.Now, onRecord)
	if errors.Is(err, errBehind) {
		// The stream dropped records of the repo this view never read
		// (logKeep newer ones followed them): read it afresh, from the
		// snapshot the stream keeps, as a start does.
		a.svc.log.Info("lease log moved past this view; reading it afresh", "repo", a.state.repo)
		old := a.state
		a.state, a.kept = a.svc.emptyState(a.state.repo), seqWindow{}
		n, err = a.svc.store.load(ctx, a.key, a.state, audited(), a.svc.cfg.Now, onRecord)
		a.state.evicted = append(a.state.evicted, old.evicted...)
		if err != nil {
			// The old view is behind the log and the new one half read:
			// neither may vouch for a lease (a cached get would answer
			// from the old view's records, an ended lease's "active"
			// among them), so none of the old view's stays indexed.
			// The next read that completes indexes its own.
			a.svc.unindex(append(a.state.evicted, old.ids()...))
			a.state.evicted = nil
		} else {
			a.state.evicted = append(a.state.evicted, a.state.dropped(old)...)
		}
	}
	if err != nil {
		return n, err
	}
	a.stale = false
	return n, nil
}

// entries are the repo's leases, active and recently ended.
func (a *actor) entries() []*entry {
	all := make([]*entry, 0, len(a.state.leases)+len(a.state.ended))
	for _, e := range a.state.leases {
		all = append(all, e)
	}
	for _, e := range a.state.ended {
		all = append(all, e)
	}
	return all
}

// count brings the service's count of active leases up to date with this
// repo's committed state (the metrics read it, never the log). Called
// under busy, or before the actor is shared.
func (a *actor) count() {
	n := len(a.state.leases)
	a.svc.activeLeases.Add(int64(n - a.counted))
	a.counted = n
}

func (a *actor) run(ctx context.Context) {
	timer := a.timer
	defer timer.Stop()
	var batch []*call
	for {
		a.busy.Lock()
		a.resetTimer()
		a.busy.Unlock()
		batch = batch[:0]
		fired := false
		select {
		case <-ctx.Done():
			a.busy.Lock()
			a.shutdown()
			a.busy.Unlock()
			return
		case <-a.calls.ready:
		case <-timer.C:
			fired = true
		}
		a.busy.Lock()
		batch = a.drain(batch)
		if len(batch) > 0 || fired {
			a.process(ctx, batch)
		}
		a.busy.Unlock()
	}
}

// drain appends the queued calls to batch, up to MaxBatch. A reap taken
// off the queue lets the next be queued (run or failed with its batch).
func (a *actor) drain(batch []*call) []*call {
	n := len(batch)
	batch = a.calls.take(batch, a.svc.cfg.MaxBatch)
	for _, c := range batch[n:] {
		if c.op == "reap" {
			a.reaping.Store(false)
		}
	}
	return batch
}

// inline runs c's batch on the caller's goroutine when nothing else is
// going on: the actor is idle and no more requests wait on the caller's
// subscription. It saves the hand-off to the actor's goroutine for an
// uncontended request; under load requests queue and batch as usual.
func (a *actor) inline(c *call) bool {
	if a.dead || c.msg == nil || c.msg.Sub == nil || c.forwarded || !c.alone {
		return false
	}
	// Nor past calls of its identity still queued: a batch takes at most
	// MaxBatch of the queue, and c must follow them (a cancel its acquire).
	if a.calls.lenOf(c.by) > 0 {
		return false
	}
	if !a.busy.TryLock() {
		return false
	}
	// Calls queued before c go first (a cancel must follow its acquire).
	a.process(a.svc.ctx, append(a.drain(nil), c))
	// Re-arm the actor's timer only if it must run earlier than it is set
	// for (a new lease's or waiter's deadline). The timer is
	// reset here rather than by waking the actor's goroutine for it: one
	// goroutine hand-off less on an uncontended acquire.
	if a.wakeAt(a.svc.cfg.Now()).Before(a.armed) {
		a.resetTimer()
	}
	a.busy.Unlock()
	return true
}

// resetTimer arms the timer for the next lease deadline or waiter
// deadline. Called under busy; a timer that fires early runs a batch that
// finds nothing due.
func (a *actor) resetTimer() {
	now := a.svc.cfg.Now()
	wake := a.wakeAt(now)
	a.armed = wake
	a.timer.Reset(max(wake.Sub(now), time.Millisecond))
}

// dropEvicted takes the ended leases st forgot since it was last asked out
// of the service's lease index. Called by st's owner (under its actor's
// busy).
func (s *Service) dropEvicted(st *repoState) {
	if len(st.evicted) > 0 {
		s.unindex(st.evicted)
		st.evicted = nil
	}
}

// forgetEnded drops the repo's ended leases past endedKeep, from its state
// and from the service's lease index, whether or not anything is written.
// Called under busy.
func (a *actor) forgetEnded(now time.Time) {
	a.state.forget(now)
	a.svc.dropEvicted(a.state)
}

// endedSlack is how long after an ended lease is due to be forgotten the
// actor of a repo that has nothing else to do wakes for it: one wake-up
// forgets all that ended within endedSlack of each other.
const endedSlack = endedKeep / 5

// wakeAt is when the actor must next run without a request: the next lease
// or waiter deadline, or the time to forget ended leases (within
// endedSlack).
func (a *actor) wakeAt(now time.Time) time.Time {
	next := a.state.nextDeadline()
	for _, w := range a.waiters {
		if next.IsZero() || w.deadline.Before(next) {
			next = w.deadline
		}
	}
	if len(a.state.endedFIFO) > 0 {
		if f := a.state.endedFIFO[0].at.Add(endedKeep + endedSlack); next.IsZero() || f.Before(next) {
			next = f
		}
	}
	if a.more {
		next = now // the last batch's record was full before it served every waiter
	}
	wake := now.Add(time.Hour)
	if !next.IsZero() {
		wake = next.Add(time.Millisecond)
	}
	if wake.Before(a.retryAt) {
		wake = a.retryAt // backing off after a failed batch
	}
	if p := a.svc.prim; p != nil && !a.svc.Primary() {
		// Not in a term: a sweep could not append. beginTerm nudges every
		// actor; a renewal that comes late ends no term, so check again
		// now and then.
		wake = maxTime(wake, now.Add(p.term/4))
	}
	return wake
}

func maxTime(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

func (a *actor) shutdown() {
	err := toWire(fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable))
	for _, w := range a.waiters {
		w.c.respond(reply{Error: err})
	}
	a.setWaiters(nil)
	for _, c := range a.calls.takeAll(nil) {
		c.respond(reply{Error: err})
	}
}

// outcome is what one call's turn in a batch decided.
type outcome struct {
	c      *call
	lease  *entry
	leases []*lease.Lease
	err    error
	park   *waiter // queue it
	// withdrawn is the waiter a cancel withdrew (answered when the batch
	// ends: answerWithdrawn).
	withdrawn *waiter
	// overload says why the call was refused as an overload: audited
	// once the batch is committed (not at each of its retries).
	overload string
}

// process runs one batch: sweep, apply each call, serve the queue, then
// commit everything with one compare-and-swap append. On a lost race it
// reloads and runs the batch again; requests are idempotent, so a retry
// after an unknown outcome is safe too.
func (a *actor) process(ctx context.Context, batch []*call) {
	const attempts = 8
	// A primary's view within its term is the log's (primary.go): reads
	// need not reload, but a nudge (another writer's append seen) does.
	//
	// The batch runs in one term, read once: it confirms the view in that
	// term and appends only while it lasts. The view's first batch in an
	// epoch of this primary's reads the log and sets its leases past their
	// records (enterTerm), whatever the batch.
	term, epoch := a.svc.termAndEpoch()
	vouched := term != 0 && a.term.Load() == term
	entering := term != 0 && a.epoch != epoch
	if entering {
		a.stale = true
	}
	sameTerm := func() error {
		if a.svc.prim != nil && a.svc.termNow() != term {
			return fmt.Errorf("%w: the lease service's primary term changed while the batch ran; retry", lease.ErrUnavailable)
		}
		return nil
	}
	a.forgetEnded(a.svc.cfg.Now()) // a quiet repo's too: wakeAt wakes it for them
	for _, c := range batch {
		if _, nudge := c.req.(*syncRequest); c.fresh() && (!vouched || nudge) {
			a.stale = true
		}
	}
	busyOnce := false // an append refused as busy was tried again
	// The attempt under way: what it reserved across repos (reserveHeld,
	// reserveWait) goes back when it ends, committed (finish, once its
	// leases and waiters are counted) or not. The waiters its cancels
	// withdrew stay withdrawn: a withdrawal writes nothing, so it stands
	// whatever becomes of the batch's record, and each withdrawn acquire
	// is answered once, when the batch ends (answerWithdrawn).
	var attempt *txn
	var withdrawn []*waiter
	endAttempt := func() {
		if attempt != nil {
			a.unreserve(attempt)
			withdrawn = append(withdrawn, attempt.withdrawn...)
			attempt = nil
		}
	}
	defer func() {
		endAttempt()
		a.answerWithdrawn(withdrawn)
	}()
	for try := 0; ; try++ {
		endAttempt()
		reloaded := a.stale
		if a.warm != nil {
			if !a.svc.Primary() {
				// A standby's warm view follows the primary's
				// announcements; it reads no log and writes none
				// (warm.go).
				a.failAll(batch, fmt.Errorf("%w: this lease service instance is not the primary", lease.ErrUnavailable))
				return
			}
			// The view becomes this primary's: its audit first, before
			// any record of this instance's, then a read of the log's
			// last record to confirm it.
			a.handOver(ctx)
			a.stale, reloaded = true, true
		}
		if a.stale {
			began := a.svc.cfg.Now()
			if err := a.reload(ctx); err != nil {
				a.svc.warns.warn(a.svc.log, a.svc.cfg.Now(), "reload lease log", "repo", a.state.repo, "err", err)
				a.failAll(batch, fmt.Errorf("%w: reading the lease log: %v", lease.ErrUnavailable, err))
				return
			}
			if entering {
				a.svc.indexLeases(a.key, a.state.enterTerm(a.svc.cfg.Now()))
				a.epoch, entering = epoch, false
			}
			a.confirm(began, term)
		}
		t := a.state.begin(a.svc.cfg.Now())
		attempt = t
		t.budget = a.svc.recordBudget
		t.sweep()
		outs := make([]outcome, len(batch))
		queue := slices.Clone(a.waiters)
		for i, c := range batch {
			if i > 0 && t.callsFull() {
				// The calls' half of the record is full (the other half
				// is the waiters', so that no runner's calls keep them
				// from being served): the rest of the batch goes back to
				// the head of its askers' turns, for the next batch.
				a.calls.putBack(batch[i:])
				batch, outs = batch[:i], outs[:i]
				break
			}
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
		// Renewals need no record where this primary vouches for the
		// view: within its term no other instance writes the repo's log,
		// and a successor counts every TTL afresh (renewSlack).
		if t.dirty() || len(t.renewed) > 0 && !a.svc.vouches(a) {
			if err := cmp.Or(a.svc.storeFault(), a.svc.mayAppend(), sameTerm(), a.awaitRoom(ctx)); err != nil {
				// Known not written: refuse at once rather than wait for
				// an append the bus cannot take (or that is not this
				// instance's to make: said once, when the term ended).
				if a.svc.mayAppend() == nil {
					a.svc.warns.warn(a.svc.log, a.svc.cfg.Now(), "append lease log refused", "repo", a.state.repo, "err", err)
				}
				a.failAll(batch, err)
				return
			}
			var err error
			var data []byte
			began := a.svc.cfg.Now()
			actx, cancel := a.svc.withinTerm(ctx)
			seq, data, err = a.svc.store.append(actx, a.key, a.state.seq, t.record())
			cancel()
			size = len(data)
			if err != nil {
				a.stale = true
				if errors.Is(err, errCAS) && try < attempts {
					continue
				}
				if errors.Is(err, errLogBusy) && !busyOnce {
					// Read the log and try once more (the write in
					// flight may be this instance's own, timed out,
					// about to land); a second refusal fails the batch:
					// a leader cut off from its followers refuses so at
					// once for as long as the cut lasts.
					busyOnce = true
					continue
				}
				err = a.svc.diagnoseSoon(ctx, err)
				a.svc.warns.warn(a.svc.log, a.svc.cfg.Now(), "append lease log", "repo", a.state.repo, "err", err)
				a.failAll(batch, fmt.Errorf("%w: writing the lease log: %w", lease.ErrUnavailable, err))
				return
			}
			a.svc.announceAppend(a.key, seq, data)
			// The compare-and-swap on the repo's last record took: nothing
			// was appended to it that this view lacks.
			a.confirm(began, term)
		}
		t.commit(seq)
		a.count()
		a.finish(t, outs, served, remaining, seq, size)
		return
	}
}

// refusesOnState reports whether any outcome refuses because of what the
// state says (conflict, lost, not owner, not found).
func refusesOnState(lists ...[]outcome) bool {
	for _, outs := range lists {
		for _, o := range outs {
			if o.err != nil && (errors.Is(o.err, lease.ErrConflict) || lease.IsFenced(o.err)) {
				return true
			}
		}
	}
	return false
}

// failAll answers a batch that could not be committed, answers queued
// acquires whose wait is over, and backs the actor off so a failing bus is
// not retried in a tight loop.
func (a *actor) failAll(batch []*call, err error) {
	for _, c := range batch {
		c.respond(reply{Error: toWire(err)})
	}
	now := a.svc.cfg.Now()
	a.retryAt = now.Add(250 * time.Millisecond)
	var kept []*waiter
	for _, w := range a.waiters {
		if !now.Before(w.deadline) && !w.cancelled {
			w.c.respond(reply{Error: toWire(fmt.Errorf("%w: wait ended while the lease log could not be written: %v", lease.ErrUnavailable, err))})
			continue
		}
		kept = append(kept, w)
	}
	a.setWaiters(kept)
}

// finish publishes what a committed batch changed and answers its calls.
func (a *actor) finish(t *txn, outs []outcome, served []outcome, remaining []*waiter, seq uint64, size int) {
	changed := make([]*entry, 0, len(t.order))
	for _, id := range t.order {
		changed = append(changed, t.changed[id])
	}
	a.svc.indexLeases(a.key, changed)
	a.svc.dropEvicted(a.state)
	a.setWaiters(remaining)
	a.unreserve(t) // counted now: its leases are indexed, its waiters the actor's
	// Answer first: watchers and the audit stream are not on the path of
	// the request (the record is durable; the events are in it).
	for _, o := range append(outs, served...) {
		if o.park != nil {
			continue
		}
		if o.overload != "" {
			a.svc.refuse(ReasonBusOverload, o.c.by, o.overload)
		}
		var grants *GrantKeys
		if o.err == nil && o.lease != nil && answersWithGrants(o.c.op) {
			grants = a.svc.grantKeys(&o.lease.Lease)
		}
		if grants == nil && o.err == nil && o.leases == nil && o.lease != nil && o.c.msg != nil && o.c.reply == nil {
			// The common answer, from the record's cached JSON.
			pub := o.lease.publicJSON()
			data := make([]byte, 0, len(pub)+10)
			data = append(append(append(data, `{"lease":`...), pub...), '}')
			o.c.answered(nil)
			answer(o.c.msg, data)
			continue
		}
		r := reply{Error: toWire(o.err), Leases: o.leases, Grants: grants}
		if o.lease != nil {
			l := o.lease.Lease
			r.Lease = &l
		}
		o.c.respond(r)
	}
	for _, id := range t.order {
		a.notify(t.changed[id])
	}
	if size > 0 {
		a.svc.audit.record(a.key, seq, t.events)
		a.keep(seq)
		a.maybeSnapshot(size)
	}
}

// notify publishes a lease's committed record for watchers (best effort:
// holders also learn of loss at their next renewal).
func (a *actor) notify(e *entry) {
	a.svc.announce(changedPrefix+"."+a.key+"."+e.LeaseID, e.publicJSON())
	if e.Session != "" && !e.Active() {
		// And to the session's holders, who hear it on one subscription
		// for all their leases (sessionNotices) — only that it ended: a
		// holder acts on nothing else (Holder.observe), and a renewal's
		// notice, one for each lease every interval, is most of what a
		// fleet's service would send them.
		a.svc.announce(sessionNotices(noticeInbox(e.Holder), e.Session), e.publicJSON())
	}
}

// maybeSnapshot writes the whole state once the deltas since the last
// snapshot outweigh it, so loading stays proportional to the state, not to
// its history — and at least every logKeep/2 records, so the records the
// stream keeps of the repo always hold a snapshot (the stream drops the
// oldest past logKeep: see keep).
func (a *actor) maybeSnapshot(deltaBytes int) {
	a.sinceSnap++
	a.bytesSinceSnap += deltaBytes
	due := a.sinceSnap >= 64 && a.bytesSinceSnap >= a.snapBytes || a.sinceSnap >= logKeep/2
	if !due || a.svc.mayAppend() != nil || a.roomToAppend() != nil {
		return
	}
	prev := a.state.seq
	ctx, cancel := a.svc.withinTerm(a.svc.ctx)
	defer cancel()
	seq, data, err := a.svc.store.append(ctx, a.key, prev, a.state.snapshot())
	if err != nil {
		if errors.Is(err, errCAS) || errors.Is(err, errLogBusy) {
			a.stale = true
		}
		a.svc.warns.warn(a.svc.log, a.svc.cfg.Now(), "snapshot lease log", "repo", a.state.repo, "err", err)
		return
	}
	a.state.seq = seq
	a.svc.audit.record(a.key, seq, nil)
	a.keep(seq)
	a.svc.announceAppend(a.key, seq, data)
	a.sinceSnap, a.bytesSinceSnap, a.snapBytes = 0, 0, len(data)
}

// keep notes a record of the repo's log at seq (appended or read), which
// the stream keeps until logKeep newer ones of the repo follow it.
func (a *actor) keep(seq uint64) { a.kept.note(seq) }

// roomWait bounds how long a repo's batch waits for the audit to cover the
// record its append would have the log drop (awaitRoom).
const roomWait = 2 * time.Second

// awaitRoom waits, up to roomWait, until an append would drop no record
// whose audit events are not yet in the audit stream (roomToAppend): the
// repo's writes slow down to what the audit takes, and stop, refused
// with the reason, while it is out of reach.
func (a *actor) awaitRoom(ctx context.Context) error {
	timeout := time.NewTimer(roomWait)
	defer timeout.Stop()
	for {
		progressed := a.svc.audit.progressed() // before the check: no advance missed
		err := a.roomToAppend()
		if err == nil {
			return nil
		}
		a.svc.audit.poke()
		select {
		case <-progressed:
		case <-timeout.C:
			return err
		case <-ctx.Done():
			return err
		}
	}
}

// roomToAppend refuses an append that would have the stream drop a record
// of the repo whose audit events are not yet in the audit stream: the log
// is their only copy (exactly-once audit). It never does while the audit
// keeps up; it does while the audit stream is out of reach and the repo
// writes logKeep records meanwhile.
func (a *actor) roomToAppend() error {
	oldest, full := a.kept.full()
	if !full {
		return nil
	}
	if covered := a.svc.audit.covered(a.key); oldest > covered {
		return fmt.Errorf("%w: the audit stream is behind on %s: its lease log record %d is not yet audited (up to %d), and another append would have the log drop it", lease.ErrUnavailable, a.state.repo, oldest, covered)
	}
	return nil
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
		o.withdrawn, o.err = a.cancel(t, r, queue)
	case *getRequest:
		if o.lease = t.lookup(r.LeaseID); o.lease == nil {
			o.err = fmt.Errorf("%s: %w", r.LeaseID, lease.ErrNotFound)
		}
	case *listRequest:
		o.leases = []*lease.Lease{}
		add := func(e *entry) {
			if r.holder != "" && e.Holder != r.holder {
				return
			}
			l := e.Lease
			o.leases = append(o.leases, &l)
		}
		t.active(func(e *entry) bool { add(e); return true })
		if r.All {
			for _, x := range t.base.endedFIFO {
				if _, changed := t.changed[x.id]; !changed {
					add(t.base.ended[x.id])
				}
			}
			for _, id := range t.order {
				if e := t.changed[id]; !e.Active() {
					add(e)
				}
			}
		}
		slices.SortFunc(o.leases, func(x, y *lease.Lease) int { return strings.Compare(x.LeaseID, y.LeaseID) })
	case *syncRequest:
		// nothing: the reload before the batch was the point
	case *reapRequest:
		t.reap(func(e *entry, now time.Time) (time.Duration, bool) { return a.svc.silentSession(e, now, r.grace) })
	case *sweepRequest:
		o.leases = []*lease.Lease{}
		for _, id := range t.order {
			if e := t.changed[id]; e.Status == lease.StatusReclaimed {
				l := e.Lease
				o.leases = append(o.leases, &l)
			}
		}
	default:
		o.err = fmt.Errorf("%w: unknown request %T", lease.ErrInvalid, c.req)
	}
	return o
}

func (a *actor) acquire(t *txn, c *call, r *AcquireRequest, queue []*waiter) outcome {
	o := outcome{c: c}
	if e := t.granted(r); e != nil {
		o.lease = e
		return o
	}
	claim := claimRequest{scope: r.Scope, workspaceID: r.WorkspaceID, pool: r.Workspaces, mode: r.WorkspaceMode, maxSharers: r.MaxSharers}
	// Queued requests that overlap go first, waiting or not: a stream of
	// small claims must not starve a queued larger one.
	placed, conflicts := t.place(claim, queue)
	if len(conflicts) == 0 {
		if err := t.roomFor(r, placed, a.reserveHeld); err != nil {
			o.overload = fmt.Sprintf("refused the acquire of %s by %s: %v", r.Scope, r.Owner, err)
			o.err = err
			return o
		}
		o.lease = t.grant(r, placed)
		return o
	}
	if r.Wait > 0 {
		if n := waitingOf(c.by, queue); n >= maxWaiting {
			// Every batch looks at every waiter: a runner that kept
			// thousands waiting would slow every batch of the repo, each
			// other runner's requests included. Its own acquires wait,
			// up to maxWaiting; the rest are turned away, to retry.
			what := fmt.Sprintf("%s has %d acquires waiting in repo %s already (at most %d an identity)", a.svc.name(c.by), n, t.base.repo, maxWaiting)
			o.overload = fmt.Sprintf("refused to queue the acquire of %s by %s: %s", r.Scope, r.Owner, what)
			o.err = fmt.Errorf("%w: lease service overloaded: %s; retry once one is answered", lease.ErrUnavailable, what)
			return o
		}
		if n, ok := a.reserveWait(t, c.by); !ok {
			// A waiting acquire holds its request here, and repo names
			// are the asker's: bounded across repos too.
			what := fmt.Sprintf("%s has %d acquires waiting across repos already (at most %d an identity)", a.svc.name(c.by), n, maxWaitingAcross)
			o.overload = fmt.Sprintf("refused to queue the acquire of %s by %s: %s", r.Scope, r.Owner, what)
			o.err = fmt.Errorf("%w: lease service overloaded: %s; retry once one is answered", lease.ErrUnavailable, what)
			return o
		}
		o.park = &waiter{c: c, req: r, claim: claim, deadline: c.at.Add(time.Duration(r.Wait))}
		return o
	}
	ce := conflictError(t.base.repo, conflicts, false)
	t.refusal(r.byName, r.Owner, r.Scope, "conflict", fmt.Sprintf("refused acquire of %s by %s: %s", r.Scope, r.Owner, ce.Error()))
	o.err = ce
	return o
}

// reserveHeld reserves n bytes of identity's leases across repos for t
// (Service.reserveHeld), returning what they take and the most they may;
// ok for an actor of no service (the state machine's tests), the
// service's own asks, or an anonymous asker (a bus without identities,
// where every client is one).
func (a *actor) reserveHeld(t *txn, identity string, n int) (held, most int, ok bool) {
	if a.svc == nil || identity == Anonymous || identity == "" {
		return 0, 0, true
	}
	most = a.svc.cfg.MaxHeldBytes
	if held, ok = a.svc.reserveHeld(identity, n, most); ok {
		addCount(&t.reservedBy, identity, n)
	}
	return held, most, ok
}

// reserveWait reserves a waiting place of identity's for t
// (Service.reserveWait); see reserveHeld.
func (a *actor) reserveWait(t *txn, identity string) (waiting int, ok bool) {
	if a.svc == nil || identity == Anonymous || identity == "" {
		return 0, true
	}
	if waiting, ok = a.svc.reserveWait(identity); ok {
		addCount(&t.parkingBy, identity, 1)
	}
	return waiting, ok
}

// unreserve returns what t reserved (its batch committed, or abandoned).
func (a *actor) unreserve(t *txn) {
	if a.svc != nil && t != nil {
		a.svc.unreserve(t.reservedBy, t.parkingBy)
		t.reservedBy, t.parkingBy = nil, nil
	}
}

// answerWithdrawn answers the acquires the cancels of a batch withdrew,
// each once, and drops them from the queue (a failed batch kept them
// there, failAll). Answered when the cancel ran, a batch that lost its
// compare-and-swap and ran again withdrew an acquire queued in it anew
// and answered it twice.
func (a *actor) answerWithdrawn(ws []*waiter) {
	if len(ws) == 0 {
		return
	}
	answered := map[*call]bool{}
	for _, w := range ws {
		if !answered[w.c] {
			answered[w.c] = true
			w.c.respond(reply{Error: toWire(fmt.Errorf("%w: acquire cancelled by its client", lease.ErrInvalid))})
		}
	}
	if slices.ContainsFunc(a.waiters, func(w *waiter) bool { return w.cancelled }) {
		a.setWaiters(slices.DeleteFunc(slices.Clone(a.waiters), func(w *waiter) bool { return w.cancelled }))
	}
}

// setWaiters makes next the repo's waiting acquires, counted across
// repos (Service.waitersChanged).
func (a *actor) setWaiters(next []*waiter) {
	if a.svc != nil {
		a.svc.waitersChanged(a.waiters, next)
	}
	a.waiters = next
}

// maxWaiting bounds the acquires one identity has waiting (AcquireRequest.Wait)
// at one repo: each batch looks at every waiter, once for each waiter it
// places.
const maxWaiting = 256

// waitingOf counts the acquires of identity by waiting in queue.
func waitingOf(by string, queue []*waiter) int {
	n := 0
	for _, w := range queue {
		if w.c.by == by && !w.cancelled {
			n++
		}
	}
	return n
}

// serve grants queued acquires that fit now, oldest first, and times out
// those past their deadline. A waiter is granted only if no earlier waiter
// that is still queued overlaps it.
func (a *actor) serve(t *txn, queue []*waiter) (served []outcome, remaining []*waiter) {
	a.more = false
	progressed := false // a waiter was granted or refused: each batch serves one at least
	for _, w := range queue {
		if w.cancelled {
			continue
		}
		if t.full() && progressed {
			// The record is full: the next batch, at once, serves the
			// rest (wakeAt).
			a.more = true
			remaining = append(remaining, w)
			continue
		}
		if e := t.granted(w.req); e != nil {
			served = append(served, outcome{c: w.c, lease: e})
			continue
		}
		placed, conflicts := t.place(w.claim, remaining)
		switch {
		case len(conflicts) == 0:
			progressed = true
			if err := t.roomFor(w.req, placed, a.reserveHeld); err != nil {
				served = append(served, outcome{c: w.c, err: err, overload: fmt.Sprintf("refused the acquire of %s by %s after waiting: %v", w.claim.scope, w.req.Owner, err)})
				continue
			}
			served = append(served, outcome{c: w.c, lease: t.grant(w.req, placed)})
		case !t.now.Before(w.deadline):
			progressed = true
			ce := conflictError(t.base.repo, conflicts, true)
			t.refusal(w.req.byName, w.req.Owner, w.claim.scope, "wait-expired", fmt.Sprintf("refused acquire of %s by %s after waiting %s: %s", w.claim.scope, w.req.Owner, time.Duration(w.req.Wait), ce.Error()))
			served = append(served, outcome{c: w.c, err: ce})
		default:
			remaining = append(remaining, w)
		}
	}
	return served, remaining
}

// queuedConflict names the first request in queue that claim must wait
// behind, or returns nil. Overlapping claims wait their turn. Between pool
// requests over common candidates, first come is first placed; a request
// for one workspace never waits for a pool request's placement (it would
// only guess which candidate the pool request will get).
func queuedConflict(claim claimRequest, queue []*waiter) []lease.Conflict {
	for _, w := range queue {
		if w.cancelled {
			continue
		}
		var why string
		switch {
		case len(w.claim.pool) == 0:
			why = blocks(claim, w.claim.scope, w.claim.workspaceID, w.claim.mode)
		case claim.scope.Overlaps(w.claim.scope):
			why = "claims overlap: " + strings.Join(claim.scope.Overlap(w.claim.scope), ", ")
		case len(claim.pool) > 0 && slices.ContainsFunc(claim.pool, func(ws string) bool { return slices.Contains(w.claim.pool, ws) }):
			why = "it waits for the same workspaces " + strings.Join(w.claim.pool, ", ")
		}
		if why != "" {
			return []lease.Conflict{{RequestID: w.req.RequestID, Owner: w.req.Owner, Scope: w.claim.scope,
				WorkspaceID: w.claim.workspaceID, Why: "queued earlier: " + why}}
		}
	}
	return nil
}

// cancel withdraws a queued acquire; if it was already granted, the lease
// is released (the caller gave up on it).
func (a *actor) cancel(t *txn, r *cancelRequest, queue []*waiter) (*waiter, error) {
	for _, w := range queue { // queued before, or earlier in this batch
		if w.req.RequestID == r.RequestID && r.Credential.matches(w.req.CredentialHash) && w.req.by == r.by && !w.cancelled {
			// Withdrawn: serve drops it, and the batch answers it when
			// it ends (answerWithdrawn).
			w.cancelled = true
			t.withdrawn = append(t.withdrawn, w)
			return w, nil
		}
	}
	// Granted before, or earlier in this batch: release it (release checks
	// the credential and audits a forged one).
	e := t.byRequest(r.by, r.RequestID)
	if e == nil {
		return nil, nil
	}
	_, err := t.release(&ReleaseRequest{LeaseID: e.LeaseID, Credential: r.Credential, by: r.by})
	return nil, err
}

// maxQueued bounds the calls one identity keeps waiting at one repo's
// actor; more are refused as an overload, to be retried. The bound is
// each identity's, not the repo's: a runner that floods a repo fills its
// own share and is refused, and another runner's requests still queue.
// (Identities are enrolled by an operator: an agent cannot make more.)
const maxQueued = 4096

// callQueue holds the calls waiting for an actor's goroutine: one queue
// per asking identity (the service's own calls are identity ""), each
// oldest first, taken in turns, one call of each identity with calls
// waiting per turn. So a runner that keeps a repo busy cannot make
// another runner wait behind its backlog: each request waits for at most
// one call of every other identity with calls queued, and a flood only
// lengthens its sender's own queue. Calls of one identity keep their
// order (a cancel follows its acquire); calls of different identities
// were concurrent, and any order is theirs.
//
// The queues are slices that grow with what waits, not buffered
// channels, which every repo would carry at full size whether anything
// waits or not (a 4,096-call channel was 32 KB a repo: 3.2 GB at 100,000
// repos; BenchmarkMemoryPerRepo). An idle repo's queue holds nothing.
type callQueue struct {
	mu    sync.Mutex
	q     turns[*call]  // guarded by mu
	ready chan struct{} // one slot: calls came since the goroutine last looked
}

// push queues c and wakes the actor's goroutine; false when c's identity
// has maxQueued calls waiting already.
func (q *callQueue) push(c *call) bool {
	return q.add(c, maxQueued)
}

// pushAlways queues c and wakes the actor's goroutine however many calls
// wait: for the service's own calls, of which it queues at most one each.
func (q *callQueue) pushAlways(c *call) {
	q.add(c, -1)
}

// add queues c unless its identity has limit calls waiting (-1: no limit).
func (q *callQueue) add(c *call, limit int) bool {
	q.mu.Lock()
	if limit >= 0 && q.q.lenOf(c.by) >= limit {
		q.mu.Unlock()
		return false
	}
	q.q.push(c.by, c, 0)
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default: // a wake-up is pending already
	}
	return true
}

// putBack queues calls, taken off the queue for a batch that had no room
// for them, again ahead of their identities' other calls (their order
// kept: a cancel still follows its acquire), and wakes the actor's
// goroutine.
func (q *callQueue) putBack(calls []*call) {
	var order []string // the identities, in the order their first call was taken
	each := map[string][]*call{}
	for _, c := range calls {
		if _, ok := each[c.by]; !ok {
			order = append(order, c.by)
		}
		each[c.by] = append(each[c.by], c)
	}
	q.mu.Lock()
	for i := len(order) - 1; i >= 0; i-- {
		q.q.pushFront(order[i], 0, each[order[i]]...)
	}
	q.mu.Unlock()
	select {
	case q.ready <- struct{}{}:
	default:
	}
}

// take moves up to max waiting calls onto batch, one of each identity in
// turn, each identity's oldest first. Calls left waiting keep the
// goroutine's wake-up pending, so they are run next.
func (q *callQueue) take(batch []*call, max int) []*call {
	q.mu.Lock()
	for taken := 0; taken < max && q.q.len() > 0; taken++ {
		c, _ := q.q.pop()
		batch = append(batch, c)
	}
	left := q.q.len()
	q.mu.Unlock()
	if left > 0 {
		select {
		case q.ready <- struct{}{}:
		default:
		}
	}
	return batch
}

// takeAll moves every waiting call onto batch.
func (q *callQueue) takeAll(batch []*call) []*call {
	q.mu.Lock()
	n := q.q.len()
	q.mu.Unlock()
	return q.take(batch, n)
}

// len is how many calls wait.
func (q *callQueue) len() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.q.len()
}

// lenOf is how many calls identity by has waiting.
func (q *callQueue) lenOf(by string) int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.q.lenOf(by)
}
