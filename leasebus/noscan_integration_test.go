//go:build integration

package leasebus

import (
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestDiscoverByIDReadsOneLog: on a bus of 500 repos, a fresh instance
// (the one that granted the leases gone) answers a get, a renew and a
// release by lease id reading only that lease's repo's log, starting one
// actor; a made-up id naming a repo with no log is not found and starts
// nothing; one naming a repo with a log but no such lease is not found.
func TestDiscoverByIDReadsOneLog(t *testing.T) {
	b := startBus(t)
	const n = 500
	leases := manyRepos(t, b, n, time.Minute)
	b.svc.Stop()
	svc, m, release := startHeld(t, b)
	ctx := ctxT(t)
	if got := logReads(t, m); got != 0 {
		t.Fatalf("starting read the lease log %d times, want 0", got)
	}

	target := leases[n/2]
	key, ok := LeaseRepoKey(target.l.LeaseID)
	if !ok || key != RepoKey(target.l.Repo) {
		t.Fatalf("lease id %s names repo key %q (%v), want %s", target.l.LeaseID, key, ok, RepoKey(target.l.Repo))
	}
	got, err := b.c.Get(ctx, target.l.LeaseID)
	if err != nil || !got.Active() || got.Fence != target.l.Fence {
		t.Fatalf("get by id on a fresh instance: %+v %v", got, err)
	}
	renewed, err := b.c.Renew(ctx, RenewRequest{LeaseID: target.l.LeaseID, Credential: target.cred, Version: got.Version})
	if err != nil || renewed.Version != got.Version+1 {
		t.Fatalf("renew by id on a fresh instance: %+v %v", renewed, err)
	}
	rel, err := b.c.Release(ctx, target.l.LeaseID, target.cred)
	if err != nil || rel.Status != lease.StatusReleased {
		t.Fatalf("release by id on a fresh instance: %+v %v", rel, err)
	}
	// One repo's log (a record and the end of it, read again by each
	// request), never the 500.
	reads := logReads(t, m)
	t.Logf("get, renew and release by id on a fresh instance: %d log reads (%d repos)", reads, n)
	if reads > 20 {
		t.Fatalf("get, renew and release of one lease read the lease log %d times (%d repos)", reads, n)
	}
	if a := actorCount(svc); a != 1 {
		t.Fatalf("%d actors after requests about one repo's lease, want 1", a)
	}

	before := logReads(t, m)
	forged := newLeaseID(RepoKey("github.com/nobody/forged"), time.Now())
	if _, err := b.c.Get(ctx, forged); !errors.Is(err, lease.ErrNotFound) {
		t.Fatalf("get of a made-up id naming a repo with no log: %v, want not found", err)
	}
	if _, err := b.c.Revoke(ctx, forged, "made up"); !errors.Is(err, lease.ErrNotFound) {
		t.Fatalf("revoke of a made-up id naming a repo with no log: %v, want not found", err)
	}
	if reads := logReads(t, m) - before; reads > 2 {
		t.Fatalf("two requests for a made-up id read the lease log %d times, want at most one read each", reads)
	}
	if a := actorCount(svc); a != 1 {
		t.Fatalf("a made-up id started an actor: %d actors, want 1", a)
	}
	inLogged := newLeaseID(RepoKey(manyRepo(7)), time.Now())
	if _, err := b.c.Get(ctx, inLogged); !errors.Is(err, lease.ErrNotFound) {
		t.Fatalf("get of a made-up id naming a repo with a log: %v, want not found", err)
	}

	// Released, the background load serves every repo.
	release()
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if a := actorCount(svc); a != n {
			return fmt.Errorf("%d of %d repos loaded", a, n)
		}
		return nil
	})
	if got := svc.activeLeases.Load(); got != n-1 {
		t.Fatalf("active leases %d, want %d", got, n-1)
	}
}

// TestMetricsScrapeReadsNoLog: with 500 repos served, a scrape reports
// their active leases without reading any repo's log.
func TestMetricsScrapeReadsNoLog(t *testing.T) {
	b := startBus(t)
	const n = 500
	manyRepos(t, b, n, time.Minute)
	b.svc.Stop()
	svc, m, release := startHeld(t, b)
	release()
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if a := actorCount(svc); a != n {
			return fmt.Errorf("%d of %d repos loaded", a, n)
		}
		return nil
	})
	// A background read (the audit's catch-up) may fall between two
	// counts: the scrape must come clean in one of a few.
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		before := logReads(t, m)
		rec := httptest.NewRecorder()
		m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		body := rec.Body.String()
		if !strings.Contains(body, fmt.Sprintf("fenceline_bus_active_leases %d\n", n)) || !strings.Contains(body, fmt.Sprintf("fenceline_bus_repos %d\n", n)) {
			return fmt.Errorf("scrape lacks %d active leases in %d repos:\n%s", n, n, body)
		}
		if reads := logReads(t, m) - before; reads != 0 {
			return fmt.Errorf("a scrape read the lease log %d times", reads)
		}
		return nil
	})
}

// TestRestartServesBeforeLoadingEveryRepo: a restarted bus of 500 repos
// answers its first requests (an acquire, a get by id) reading only the
// logs they name; a lease whose holder died, that nobody asks about, is
// still reclaimed (its TTL counted from the restarted service's load)
// and audited once.
func TestRestartServesBeforeLoadingEveryRepo(t *testing.T) {
	t.Parallel() // waits on a TTL: runs beside the others (own server)
	b := startBus(t)
	const n = 500
	leases := manyRepos(t, b, n, time.Minute)
	const deadRepo = "github.com/acme/dead-holder"
	dead, err := b.c.Acquire(ctxT(t), AcquireRequest{Repo: deadRepo, Scope: claim(t, "x"), Owner: owner(1), TTL: lease.Duration(MinTTL)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	m := NewServiceMetrics()
	hold := make(chan struct{})
	var once sync.Once
	release := func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release)
	b.cfg = ServiceConfig{Metrics: m, holdLoads: hold}
	b.restart(restartClean)
	ctx := ctxT(t)
	if got := logReads(t, m); got != 0 {
		t.Fatalf("starting read the lease log %d times, want 0", got)
	}
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/new", Scope: claim(t, "a"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	if got, err := b.c.Get(ctx, leases[3].l.LeaseID); err != nil || !got.Active() {
		t.Fatalf("get by id after restart: %+v %v", got, err)
	}
	reads := logReads(t, m)
	t.Logf("first acquire and get after a restart: %d log reads (%d repos)", reads, n)
	if reads > 10 {
		t.Fatalf("the first two requests after a restart read the lease log %d times (%d repos)", reads, n)
	}

	release()
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		l, err := b.c.Get(ctx, dead.LeaseID)
		if err != nil {
			return err
		}
		if l.Status != lease.StatusReclaimed {
			return fmt.Errorf("lease of the dead holder is %s", l.Status)
		}
		return nil
	})
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, deadRepo, 0)
		if err != nil {
			return err
		}
		reclaimed := 0
		for _, ev := range evs {
			if ev.Type == lease.EventReclaimed && ev.LeaseID == dead.LeaseID {
				reclaimed++
			}
		}
		if reclaimed != 1 {
			return fmt.Errorf("%d reclaimed events of %s, want 1", reclaimed, dead.LeaseID)
		}
		return nil
	})
}

// TestDiscoverOldFormID: a lease whose id names no repo (written before
// ids did) is still found and released by id on an instance that has not
// loaded it; made-up ids of that form, asked for at once, share a few
// scans rather than one each.
func TestDiscoverOldFormID(t *testing.T) {
	b := startBus(t)
	manyRepos(t, b, 50, time.Minute)
	cred := NewCredential()
	old := writeOldLease(t, ctxT(t), b.nc, "github.com/acme/old", cred)
	b.svc.Stop()
	_, m, _ := startHeld(t, b)
	ctx := ctxT(t)

	got, err := b.c.Get(ctx, old.LeaseID)
	if err != nil || !got.Active() || got.Fence != old.Fence {
		t.Fatalf("get of an old-form id: %+v %v", got, err)
	}
	rel, err := b.c.Release(ctx, old.LeaseID, cred)
	if err != nil || rel.Status != lease.StatusReleased {
		t.Fatalf("release of an old-form id: %+v %v", rel, err)
	}
	scans := metric(t, m, "fenceline_bus_id_scans_total")
	var wg sync.WaitGroup
	const asks = 20
	for range asks {
		wg.Go(func() {
			if _, err := b.c.Get(ctx, newID("lease_", time.Now())); !errors.Is(err, lease.ErrNotFound) {
				t.Errorf("get of a made-up old-form id: %v, want not found", err)
			}
		})
	}
	wg.Wait()
	more := metric(t, m, "fenceline_bus_id_scans_total") - scans
	t.Logf("%d gets of made-up old-form ids at once: %v scans", asks, more)
	if more > 3 {
		t.Fatalf("%d gets of made-up old-form ids at once made %v scans of every log, want them to share a few", asks, more)
	}
}
