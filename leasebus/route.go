package leasebus

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// What a request costs in log reads: a request by repo, or by a lease id
// (which names its repo, see newLeaseID), reads that repo's log at most —
// when this instance has not loaded it yet — and nothing else. Only a
// lease id of the old form, which names no repo, may cost a read of every
// log, and such scans are shared (idScans). A service reads no log before
// it serves; loadEvery loads every repo in the background.

// route hands a request about one lease (get, renew, release, revoke) to
// the actor of the lease's repo. An id that names its repo goes to that
// repo alone, whose log says whether the lease exists: a made-up id costs
// at most one read of the log it names, and starts no actor when that
// repo has no log. A hint (the repo a client says the lease is in) routes
// an old-form id; it never starts an actor for a repo without a log.
func (s *Service) route(c *call, id, hint string) {
	if key, ok := LeaseRepoKey(id); ok {
		if a, ok := s.existing(key); ok {
			a.submit(c)
			return
		}
		s.goTracked(c, func() {
			a, err := s.loadedActor(s.ctx, key)
			switch {
			case err != nil:
				c.fail(fmt.Errorf("looking for %s: %w", id, err))
			case a == nil:
				c.fail(fmt.Errorf("%s: %w (no lease was ever granted in the repo it names)", id, lease.ErrNotFound))
			default:
				a.enqueue(c)
			}
		})
		return
	}
	if a, ok := s.existing(RepoKey(hint)); ok && hint != "" {
		a.submit(c)
		return
	}
	if a, ok := s.actorForLease(id); ok && a != nil {
		a.submit(c)
		return
	}
	s.goTracked(c, func() {
		if hint != "" {
			a, err := s.loadedActor(s.ctx, RepoKey(hint))
			if err != nil {
				c.fail(fmt.Errorf("looking for %s: %w", id, err))
				return
			}
			if a != nil {
				a.enqueue(c)
				return
			}
		}
		// An id of the old form that this instance has not seen: another
		// instance may have granted it. Read every repo's log to its end
		// (shared with every other such request) before saying not found.
		err := s.scanForIDs(s.ctx)
		if a, ok := s.actorForLease(id); ok && a != nil {
			a.enqueue(c)
			return
		}
		if err != nil { // not knowing is not "not found"
			c.fail(fmt.Errorf("%w: looking for %s in the lease logs: %w", lease.ErrUnavailable, id, err))
			return
		}
		c.fail(fmt.Errorf("%s: %w", id, lease.ErrNotFound))
	})
}

// repoLoad is a load of one repo's log under way (loadedActor).
type repoLoad struct {
	done chan struct{}
	a    *actor
	err  error
}

// loadedActor returns the actor of repo key, first reading the repo's log
// when this instance has none, or nil when the repo has no lease log (or
// only answers someone had the server send onto it, see serviceWrote):
// asking about a repo nobody ever leased in starts nothing. Concurrent
// callers for one repo share one read.
func (s *Service) loadedActor(ctx context.Context, key string) (*actor, error) {
	s.mu.Lock()
	if a, ok := s.actors[key]; ok {
		s.mu.Unlock()
		return a, nil
	}
	if s.stopping {
		s.mu.Unlock()
		return nil, fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable)
	}
	if l, ok := s.loading[key]; ok {
		s.mu.Unlock()
		select {
		case <-l.done:
			return l.a, l.err
		case <-ctx.Done():
			return nil, fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable)
		}
	}
	l := &repoLoad{done: make(chan struct{})}
	s.loading[key] = l
	s.mu.Unlock()
	l.a, l.err = s.load(ctx, key)
	close(l.done)
	return l.a, l.err
}

// load reads the log of repo key into a new actor and, if the log holds a
// repo's leases, installs and starts it (see loadedActor).
func (s *Service) load(ctx context.Context, key string) (*actor, error) {
	a := s.newActor(key, "")
	began, term := s.cfg.Now(), s.termNow()
	_, err := a.readLog(ctx)
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.loading, key)
	if b, ok := s.actors[key]; ok {
		// Started meanwhile (an acquire, another instance's append): it
		// reads the log itself; ours is dropped.
		a.timer.Stop()
		return b, nil
	}
	switch {
	case err != nil && (ctx.Err() != nil || !errors.Is(err, errDamaged)):
		a.timer.Stop()
		return nil, fmt.Errorf("%w: reading lease log %s: %w", lease.ErrUnavailable, key, err)
	case err != nil:
		// One damaged log must not take every other repo down: this repo
		// answers with the damage until an operator repairs it.
		s.log.Error("lease log damaged; its repo is not served", "repo_key", key, "err", err)
		a.timer.Stop()
		a.dead, a.deadErr = true, err
		s.actors[key] = a
		return a, nil
	case a.state.repo == "":
		// Nothing the service wrote: answers someone had the server send
		// onto the log (see serviceWrote). No repo, no actor.
		a.timer.Stop()
		s.audit.forget(key)
		return nil, nil
	}
	// Installed and indexed under one hold of mu: nothing can reach the
	// actor before its leases are indexed, so no later batch's index
	// entry is overwritten by this older view.
	a.confirm(began, term)
	s.actors[key] = a
	for _, e := range a.entries() {
		s.setIndexLocked(key, e)
	}
	a.count()
	if s.stopping {
		a.dead = true // never runs: enqueue answers "stopping"
		return a, nil
	}
	// The goroutine owns the state from here on, and arms its sweep timer
	// from the loaded deadlines.
	s.wg.Go(func() { a.run(s.ctx) })
	return a, nil
}

// loadAhead bounds how many repos' logs the background pass (and a scan
// for old-form ids) reads at once.
const loadAhead = 32

// loadEvery loads every repo's log that this instance has not loaded yet,
// loadAhead at a time, while the service already serves: leases nobody
// asks about are then swept like every other (each lease's TTL counted
// from when its repo was loaded, as at any start). Every record up to the
// log stream's last sequence when it began has then been handed to the
// audit chain, which the catch-up that follows relies on.
func (s *Service) loadEvery(ctx context.Context) {
	if h := s.cfg.holdLoads; h != nil {
		select {
		case <-h:
		case <-ctx.Done():
			return
		}
	}
	began := time.Now()
	var last uint64
	var keys []string
	for wait := 250 * time.Millisecond; ; wait = min(2*wait, 30*time.Second) {
		var err error
		if last, keys, err = s.logExtent(ctx); err == nil {
			break
		}
		s.log.Warn("list the lease logs to load; trying again", "err", err, "in", wait)
		select {
		case <-ctx.Done():
			return
		case <-time.After(wait):
		}
	}
	// An actor a request started meanwhile reads its log too (to be sure
	// that every record up to last was seen before accountedTo says so).
	failed := s.loadKeys(ctx, keys, s.syncActor)
	if ctx.Err() != nil {
		return
	}
	if failed == 0 {
		s.audit.accountedTo(last)
	}
	s.log.Info("lease service loaded every repo's lease log", "repos", len(keys), "failed", failed, "took", time.Since(began).Round(time.Millisecond))
}

// logExtent reads the log stream's last sequence, then lists the repos
// with a log: every repo with a record up to that sequence is listed.
func (s *Service) logExtent(ctx context.Context) (uint64, []string, error) {
	stream, err := s.store.logStream(ctx)
	if err != nil {
		return 0, nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, publishTimeout)
	defer cancel()
	info, err := stream.Info(ctx)
	if err != nil {
		return 0, nil, fmt.Errorf("read lease log stream: %w", err)
	}
	keys, err := s.store.repoKeys(ctx)
	return info.State.LastSeq, keys, err
}

// loadKeys loads the repos of keys, loadAhead at a time, calls then with
// each that this instance served before (its actor read the log earlier,
// or is about to), and returns how many could not be loaded (or then
// failed for).
func (s *Service) loadKeys(ctx context.Context, keys []string, then func(context.Context, *actor) error) int {
	var mu sync.Mutex
	next, failed := 0, 0
	var wg sync.WaitGroup
	for range min(loadAhead, len(keys)) {
		wg.Go(func() {
			for {
				mu.Lock()
				if next == len(keys) || ctx.Err() != nil {
					mu.Unlock()
					return
				}
				key := keys[next]
				next++
				mu.Unlock()
				_, had := s.existing(key)
				a, err := s.loadedActor(ctx, key)
				if err == nil && a != nil && had && then != nil {
					err = then(ctx, a)
				}
				if err != nil {
					if ctx.Err() == nil {
						s.log.Warn("load lease log", "repo_key", key, "err", err)
					}
					mu.Lock()
					failed++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	return failed
}

// idScanSpacing is the least time between two scans of every repo's log
// for old-form lease ids.
const idScanSpacing = time.Second

// idScans coalesces the scans of every repo's log for lease ids of the old
// form (which name no repo): one runs at a time, each starts at least
// idScanSpacing after the one before, and a caller waits for the first
// that starts after it asked (so it sees every grant made before). However
// many such requests arrive, they cost at most one read of every log per
// idScanSpacing — never one scan each.
type idScans struct {
	mu      sync.Mutex
	next    *idScan // the scan callers now wait for; guarded by mu
	running bool    // runScans is running; guarded by mu
}

type idScan struct {
	done chan struct{}
	err  error
}

// scanForIDs waits for a scan of every repo's log that started after it
// was called, so the lease index covers what other instances granted.
func (s *Service) scanForIDs(ctx context.Context) error {
	s.scans.mu.Lock()
	sc := s.scans.next
	if sc == nil {
		sc = &idScan{done: make(chan struct{})}
		s.scans.next = sc
		if !s.scans.running {
			s.scans.running = s.goBackground(func() { s.runScans(s.ctx) })
		}
	}
	s.scans.mu.Unlock()
	select {
	case <-sc.done:
		return sc.err
	case <-ctx.Done():
		return fmt.Errorf("%w: lease service stopping", lease.ErrUnavailable)
	}
}

// runScans runs the scans callers wait for, until none does.
func (s *Service) runScans(ctx context.Context) {
	for {
		s.scans.mu.Lock()
		sc := s.scans.next
		s.scans.next = nil
		if sc == nil || ctx.Err() != nil {
			s.scans.running = false
			s.scans.mu.Unlock()
			return
		}
		s.scans.mu.Unlock()
		sc.err = s.scanOnce(ctx)
		close(sc.done)
		select {
		case <-ctx.Done():
		case <-time.After(idScanSpacing):
		}
	}
}

// scanOnce reads every repo's log to its end: it loads those this
// instance has not, and has the actors of the others reload.
func (s *Service) scanOnce(ctx context.Context) error {
	s.cfg.Metrics.scanned()
	keys, err := s.store.repoKeys(ctx)
	if err != nil {
		return err
	}
	if failed := s.loadKeys(ctx, keys, s.syncActor); failed > 0 {
		return fmt.Errorf("%d of %d lease logs could not be read", failed, len(keys))
	}
	return nil
}

// syncActor has a reload its repo's log to the end (a damaged log, which
// answers for itself, excepted).
func (s *Service) syncActor(ctx context.Context, a *actor) error {
	if a.dead {
		return nil
	}
	if r := a.ask(ctx, &call{op: "sync", req: &syncRequest{}}); r.Error != nil {
		return r.Error.err()
	}
	return nil
}
