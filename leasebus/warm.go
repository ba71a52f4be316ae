package leasebus

import (
	"context"
	"encoding/json"
	"strconv"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// Warm standbys. A standby serves no lease request and reads no repo's
// log, but it keeps a view of every repo all the same: the primary's
// announcement of each append (Service.announceAppend) carries the record
// itself, and the standby folds it into the repo's actor as a load would
// have. A takeover then costs one read per repo — the log's last record,
// to confirm the view is the log's — where a load of every repo read each
// one back to its snapshot: at 10,000 leases over 1,000 repos, 16–22 s
// through the log stream's leader, longer than the holders' TTL allowed,
// and thousands of leases lost at each primary's crash.
//
// What a warm view may not know, it does not guess:
//   - A repo the standby has no view of (it started after the repo's first
//     record: a restarted node) becomes warm at its next snapshot, or
//     once the standby, having heard it appended to, loads it in the
//     background (warmCold), one repo at a time; a takeover before either
//     loads it as before.
//   - A record missed (announcements are core NATS, at most once) leaves
//     the view behind its log: the view stops folding (broken) until the
//     next snapshot, which carries the whole state, or a background load;
//     a takeover before either reads the repo afresh.
//   - The audit. The log is where a grant's events are durable; the
//     primary copies them to the audit stream, and a standby must not (it
//     would race the primary's chain for nothing). So a warm view keeps
//     the events of its last warmKeep records that carry any, and a new
//     primary hands those the audit chain does not cover yet to its audit
//     writer before it serves the repo (handOver). Where the view dropped
//     events the chain does not cover — more than warmKeep behind, or
//     records the view never saw — the repo is loaded afresh, which reads
//     them from the log as any start does.
//
// Correctness never depends on a warm view: every append is still a
// compare-and-swap on the repo's last record, and a view the log moved
// past is read again, as any view is.

// logSeqHeader carries the log sequence of the record an append
// announcement carries.
const logSeqHeader = "Fenceline-Log-Seq"

// warmKeep bounds how many records' audit events a warm view keeps: the
// primary writes a record's events within auditDelay of its append, so a
// takeover finds at most a few records' events not yet written.
const warmKeep = 32

// warmAudit is what a warm view knows of its records' audit events.
type warmAudit struct {
	// recs are the records folded while warm that carry events, oldest
	// first, at most warmKeep.
	recs []auditRec
	// lost: the events of records up to this sequence may be unknown here
	// (before the view began, dropped past warmKeep, or missed).
	lost uint64
	// broken: a record was missed; the view folds nothing until a
	// snapshot.
	broken bool
}

// note keeps a folded record's events.
func (w *warmAudit) note(seq uint64, evs []lease.AuditEvent) {
	if len(evs) == 0 {
		return
	}
	if len(w.recs) == warmKeep {
		w.lost = max(w.lost, w.recs[0].seq)
		w.recs = append(w.recs[:0], w.recs[1:]...)
	}
	w.recs = append(w.recs, auditRec{seq: seq, events: evs})
}

// follow folds a record another instance appended, announced on the
// repo's appended subject, into this standby's view of the repo.
func (s *Service) follow(key string, m *nats.Msg) {
	seq, err := strconv.ParseUint(m.Header.Get(logSeqHeader), 10, 64)
	if err != nil || seq == 0 || len(m.Data) == 0 {
		return // no record: only a nudge
	}
	rec := new(logRecord)
	if json.Unmarshal(m.Data, rec) != nil || rec.Prev >= seq || rec.Repo == "" || RepoKey(rec.Repo) != key {
		return
	}
	if rec.Kind != recordSnapshot && rec.Kind != recordDelta {
		return
	}
	a, ok := s.existing(key)
	if !ok {
		if rec.Kind == recordSnapshot || rec.Prev == 0 {
			s.warmUp(key, seq, rec)
		} else {
			s.cold.add(key, seq) // loaded in the background (warmCold)
		}
		return
	}
	a.busy.Lock()
	defer a.busy.Unlock()
	if a.dead || s.Primary() {
		return // a primary's actors read the log themselves
	}
	if !a.foldWarm(seq, rec) {
		if a.warm != nil && a.warm.broken {
			s.cold.add(key, seq)
		}
		return
	}
	// What the view holds of them: it keeps its own entry of a lease the
	// record has at the version it read (observe), set past it.
	held := make([]*entry, 0, len(rec.Leases))
	for _, e := range rec.Leases {
		if v := a.state.held(e.LeaseID); v != nil {
			held = append(held, v)
		}
	}
	s.indexLeases(key, held)
	s.dropEvicted(a.state)
}

// warmUp starts a warm view of a repo this standby has none of, from its
// snapshot (or first record) at seq.
func (s *Service) warmUp(key string, seq uint64, rec *logRecord) {
	a := s.newActor(key, rec.Repo)
	a.stale = false
	a.warm = &warmAudit{lost: rec.Prev}
	a.foldWarm(seq, rec)
	s.installWarm(a)
}

// installWarm installs a, a new warm view, unless the repo has an actor
// (or a load under way) by now, and reports whether it did.
func (s *Service) installWarm(a *actor) bool {
	a.state.evicted = nil // nothing of it is indexed yet
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.actors[a.key]; ok || s.stopping || s.loading[a.key] != nil {
		a.timer.Stop()
		return false
	}
	s.actors[a.key] = a
	for _, e := range a.entries() {
		s.setIndexLocked(a.key, e)
	}
	s.wg.Go(func() { a.run(s.ctx) })
	return true
}

// foldWarm folds the record at seq into the view, if it follows it (a
// snapshot always does), and reports whether it did. Called under busy,
// or before the actor is shared.
func (a *actor) foldWarm(seq uint64, rec *logRecord) bool {
	if a.warm == nil {
		// A view this instance served as primary: every record up to
		// here went to its audit writer.
		a.warm = &warmAudit{}
	}
	w := a.warm
	switch {
	case seq <= a.state.seq:
		return false // known already
	case rec.Kind == recordDelta && (w.broken || rec.Prev != a.state.seq):
		// A record missed: fold nothing until a snapshot.
		w.broken = true
		return false
	}
	if rec.Kind == recordSnapshot && rec.Prev != a.state.seq {
		w.lost = max(w.lost, rec.Prev) // the records between went unseen
	}
	w.broken = false
	apply(a.state, rec, seq, a.svc.cfg.Now, func(seq uint64, evs []lease.AuditEvent) {
		w.note(seq, evs)
		a.keep(seq)
	})
	a.stale = false
	return true
}

// handOver makes a warm view this instance's, now that it is the primary:
// it hands the audit writer the events the audit chain does not cover yet
// (read from the audit stream: one request) and counts its leases' TTLs
// from now, as a load would have; or, where the view may have missed some
// events, drops the view so that the reload that follows reads the repo
// afresh, as a start does. Called under busy, before that reload.
func (a *actor) handOver(ctx context.Context) {
	w := a.warm
	a.warm = nil
	if !w.broken {
		mark := a.svc.audit.auditedTo(ctx, a.key) // 0 when unreadable
		if mark >= w.lost {
			for _, r := range w.recs {
				if r.seq > mark {
					a.svc.audit.record(a.key, r.seq, r.events)
				}
			}
			a.svc.audit.record(a.key, a.state.seq, nil)
			a.state.restart(a.svc.cfg.Now())
			a.count()
			return
		}
	}
	why := "its audit events may not all be known here"
	if w.broken {
		why = "it missed a record"
	}
	a.svc.log.Info("reading a lease log afresh at the takeover: the warm view of it is not complete", "repo", a.state.repo, "why", why)
	// Nothing of the view may vouch for a lease any more (a cached get,
	// a keepalive's answer): it may hold as active a lease the log has
	// since ended, and forgotten, so the read that follows would not
	// correct it. The read indexes what it finds.
	old := a.state
	a.state, a.kept = a.svc.emptyState(a.state.repo), seqWindow{}
	a.svc.unindex(append(old.evicted, old.ids()...))
}

// coldRepos are the repos a standby heard appended to but has no view of
// it can fold into: none (it started after the repo's last snapshot), or
// one that missed a record — each with the last record heard of it.
// warmCold loads them.
type coldRepos struct {
	mu   sync.Mutex
	keys map[string]uint64 // repo key -> the last record heard of it; guarded by mu
	wake chan struct{}     // made by StartService on a bus with an election
}

// add notes that repo key was heard appended to, at seq, with no view to
// fold the record into.
func (c *coldRepos) add(key string, seq uint64) {
	c.mu.Lock()
	if c.keys == nil {
		c.keys = map[string]uint64{}
	}
	last, had := c.keys[key]
	c.keys[key] = max(last, seq)
	c.mu.Unlock()
	if !had {
		select {
		case c.wake <- struct{}{}:
		default:
		}
	}
}

// take removes and returns one cold repo and the last record heard of it
// ("" when none).
func (c *coldRepos) take() (string, uint64) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for key, seq := range c.keys {
		delete(c.keys, key)
		return key, seq
	}
	return "", 0
}

// warmCold loads, one at a time, the views a standby heard it lacks, so
// that a standby started after the primary (a restarted node) is warm
// within a pass over the active repos, not only at each one's next
// snapshot. A load here hands nothing to the audit writer: it keeps the
// events of the records past the audit mark it read first, as a warm view
// does (warmLoad). A primary loads what it lacks by itself: the set is
// dropped.
//
// A load that fails (a read timed out on a busy bus) is tried again
// warmRetry later, backing off while it fails: an idle repo may hear no
// record for long, and its view would stay cold until then.
func (s *Service) warmCold(ctx context.Context) {
	retry := time.NewTimer(warmRetry)
	retry.Stop()
	defer retry.Stop()
	failed := map[string]coldFailure{} // repo key -> its failed loads
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.cold.wake:
		case <-retry.C:
			now := time.Now()
			for key, f := range failed {
				if !f.next.After(now) {
					s.cold.add(key, f.seq)
				}
			}
		}
		for key, seq := s.cold.take(); key != ""; key, seq = s.cold.take() {
			if ctx.Err() != nil {
				return
			}
			if s.Primary() {
				delete(failed, key) // a primary loads what it lacks itself
				continue
			}
			err := s.warmLoad(ctx, key, seq)
			switch {
			case err == nil:
				delete(failed, key)
			case ctx.Err() == nil:
				f := failed[key]
				f.seq, f.tries = max(f.seq, seq), f.tries+1
				wait := warmRetry << min(f.tries-1, warmBackoffs)
				f.next = time.Now().Add(wait)
				failed[key] = f
				s.log.Debug("warm a standby's view of a lease log; will try again", "repo_key", key, "in", wait, "err", err)
			}
		}
		// One timer, for the soonest retry due (reset, not only armed: the
		// failures since may be due sooner than it was set for).
		var soonest time.Time
		for _, f := range failed {
			if soonest.IsZero() || f.next.Before(soonest) {
				soonest = f.next
			}
		}
		if !soonest.IsZero() {
			retry.Reset(max(time.Until(soonest), time.Millisecond))
		}
	}
}

// warmRetry is how long after a failed load warmCold tries it again; each
// failure of the same repo in a row doubles it, warmBackoffs times at most
// (32 s: a log that cannot be loaded, damaged, is not read every second).
const (
	warmRetry    = time.Second
	warmBackoffs = 5
)

// coldFailure is what warmCold keeps of a repo whose loads failed: the
// last record heard of it, the failures in a row, and when to try next.
type coldFailure struct {
	seq   uint64
	tries int
	next  time.Time
}

// warmLoad reads the log of repo key into a warm view, if this standby
// has none that holds the record heard (seq) and can fold the next. The
// audit mark is read first: the events of the records up to it are in the
// audit stream, those after it the load reads and the view keeps.
//
// A view can lack a record without having missed one it could fold: the
// record was announced while this load was reading, before the view it
// makes was installed (nothing to fold it into then). Hence the record
// heard, not only a broken view, says whether to load.
func (s *Service) warmLoad(ctx context.Context, key string, heard uint64) error {
	if a, ok := s.existing(key); ok {
		a.busy.Lock()
		current := !a.coldView() && a.state.seq >= heard
		a.busy.Unlock()
		if current {
			return nil
		}
	}
	mark := s.audit.auditedTo(ctx, key)
	st := s.emptyState("")
	w := &warmAudit{lost: mark}
	var kept seqWindow
	if _, err := s.store.load(ctx, key, st, mark, s.cfg.Now, func(seq uint64, evs []lease.AuditEvent) {
		w.note(seq, evs)
		kept.note(seq)
	}); err != nil {
		return err
	}
	if st.repo == "" {
		return nil // nothing the service wrote
	}
	fresh := s.newActor(key, st.repo)
	fresh.state, fresh.kept, fresh.warm, fresh.stale = st, kept, w, false
	if s.installWarm(fresh) {
		return nil
	}
	a, ok := s.existing(key)
	if !ok {
		return nil // stopping, or loaded meanwhile
	}
	a.busy.Lock()
	defer a.busy.Unlock()
	if a.dead || a.state.seq >= st.seq || s.Primary() {
		return nil // mended meanwhile (a snapshot, a record folded), or no longer ours to mend
	}
	st.evicted = append(st.evicted, a.state.evicted...)
	st.evicted = append(st.evicted, st.dropped(a.state)...)
	a.state, a.kept, a.warm, a.stale = st, kept, w, false
	s.indexLeases(key, a.entries())
	s.dropEvicted(a.state)
	return nil
}

// coldView reports whether a standby's view of the repo cannot fold the
// next record: it missed one. Called under busy.
func (a *actor) coldView() bool {
	return a.warm != nil && a.warm.broken
}
