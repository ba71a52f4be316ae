package leasebus

// A randomized concurrent property test against one real bus: several
// clients acquire (with and without wait), renew, release and crash
// (stop renewing) over overlapping claims in two repos, with TTLs of 1–2 s
// so leases expire and are swept while others wait for them. Three
// independent observers check invariants 1, 2 and 4 over the whole run:
//
//   - after every operation, a List of the repo is pairwise disjoint;
//   - the Watch stream of committed records, folded in commit order,
//     never grants over an active lease, and fences rise strictly and are
//     never reissued;
//   - the lease log itself, read with an ordered consumer, says the same;
//   - no lease is reclaimed before its holder's own validity (the moment
//     it sent its last successful acquire/renew, plus TTL minus margin)
//     has run out, and crashed holders' leases are reclaimed by the
//     service's own timer within TTL plus a little.
//
// The seed is logged; set FENCELINE_TEST_SEED to replay a schedule.

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

func testSeed(t testing.TB) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("FENCELINE_TEST_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("FENCELINE_TEST_SEED: %v", err)
		}
		seed = v
	}
	t.Logf("seed %d (replay with FENCELINE_TEST_SEED=%d)", seed, seed)
	return seed
}

// propClaims is the claim universe: a small path tree, whole-repo, none
// (in its own workspace), and tables.
func propClaims(t testing.TB) []AcquireRequest {
	t.Helper()
	mk := func(paths []string, whole bool, tables []string, ws string, mode lease.WorkspaceMode) AcquireRequest {
		return AcquireRequest{Scope: mustClaim(t, paths, whole, tables), WorkspaceID: ws, WorkspaceMode: mode, MaxSharers: 3}
	}
	return []AcquireRequest{
		mk([]string{"a"}, false, nil, "", ""),
		mk([]string{"a/b"}, false, nil, "", ""),
		mk([]string{"a/b/c"}, false, nil, "", ""),
		mk([]string{"b"}, false, nil, "", ""),
		mk([]string{"b/c"}, false, nil, "", ""),
		mk([]string{"a/b/c", "b/c"}, false, nil, "", ""),
		mk([]string{"c"}, false, []string{"public.x"}, "", ""),
		mk([]string{"d"}, false, []string{"public.*"}, "", ""),
		mk([]string{"e"}, false, nil, "wt-1", lease.WorkspaceExclusive),
		mk([]string{"f"}, false, nil, "wt-1", lease.WorkspaceShared),
		mk(nil, true, nil, "wt-2", lease.WorkspaceExclusive),
		mk(nil, false, nil, "wt-3", lease.WorkspaceExclusive),
		mk(nil, false, []string{"public.y"}, "wt-4", lease.WorkspaceExclusive),
		mk(nil, false, []string{"public.x"}, "wt-5", lease.WorkspaceExclusive),
		// Pool requests: placed in the first candidate that fits; their
		// candidates meet the fixed workspaces above.
		pool(mk([]string{"g"}, false, nil, "", lease.WorkspaceShared), "wt-1", "wt-6"),
		pool(mk([]string{"h"}, false, nil, "", lease.WorkspaceShared), "wt-6", "wt-7"),
		pool(mk([]string{"a/x"}, false, nil, "", lease.WorkspaceShared), "wt-6", "wt-7"),
		pool(mk(nil, false, nil, "", lease.WorkspaceExclusive), "wt-3", "wt-6", "wt-7"),
		pool(mk([]string{"i"}, false, nil, "", lease.WorkspaceExclusive), "wt-6", "wt-7"),
		// Commit capacity inside a pooled shard: nests in wt-6.
		mk(nil, false, nil, "wt-6/commit", lease.WorkspaceExclusive),
	}
}

func pool(r AcquireRequest, candidates ...string) AcquireRequest {
	r.Workspaces = candidates
	return r
}

type heldLease struct {
	l          *lease.Lease
	cred       Credential
	sent       time.Time // when the last successful acquire/renew was sent
	validUntil time.Time // holder-side: sent + TTL - margin
}

const holderMargin = 100 * time.Millisecond

func TestPropertyConcurrentLeases(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	seed := testSeed(t)
	repos := []string{"github.com/acme/prop-1", "github.com/acme/prop-2"}
	claims := propClaims(t)

	watchChk := newCommitChecker(3)
	var evMu sync.Mutex
	endedAt := map[string]time.Time{} // lease id -> when the watch saw it reclaimed/expired
	endStatus := map[string]lease.Status{}
	watchChecker(t, NewClient(connectAs(t, b.srv.ClientURL(), RoleViewer)), "", watchChk, func(l *lease.Lease, at time.Time) {
		if !l.Active() {
			evMu.Lock()
			endedAt[l.LeaseID] = at
			endStatus[l.LeaseID] = l.Status
			evMu.Unlock()
		}
	})
	logChk := newCommitChecker(3)
	follower := followLog(t, connect(t, b.srv.ClientURL()), logChk)

	var (
		mu         sync.Mutex
		validUntil = map[string]time.Time{}    // holder-side validity per lease
		results    = map[string]*lease.Lease{} // every grant a client received
		crashed    = map[string]time.Time{}    // leases whose holder stopped renewing, and since when
		stats      = map[string]int{}
	)
	count := func(k string) { mu.Lock(); stats[k]++; mu.Unlock() }

	const workers, opsPerWorker = 5, 70
	runUntil := time.Now().Add(12 * time.Second)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			c := NewClient(connect(t, b.srv.ClientURL()))
			ctx := ctxT(t)
			var held []*heldLease
			note := func(h *heldLease) {
				mu.Lock()
				defer mu.Unlock()
				validUntil[h.l.LeaseID] = h.validUntil
			}
			drop := func(i int) { held = append(held[:i], held[i+1:]...) }
			renew := func(i int) {
				h := held[i]
				sent := time.Now()
				l, err := c.Renew(ctx, RenewRequest{LeaseID: h.l.LeaseID, Credential: h.cred, Version: h.l.Version, RenewID: NewRequestID()})
				switch {
				case err == nil:
					if l.Version != h.l.Version+1 || l.Fence != h.l.Fence {
						t.Errorf("renew of %s v%d returned v%d fence %d (was %d)", h.l.LeaseID, h.l.Version, l.Version, l.Fence, h.l.Fence)
					}
					h.l, h.sent, h.validUntil = l, sent, sent.Add(time.Duration(l.TTL)-holderMargin)
					note(h)
					count("renew")
				case errors.Is(err, lease.ErrLeaseLost):
					// Only acceptable once the holder's own validity ran out.
					if time.Now().Before(h.validUntil) && sent.Before(h.validUntil) {
						t.Errorf("renew of %s sent %s before its validity ended was refused: %v", h.l.LeaseID, h.validUntil.Sub(sent), err)
					}
					drop(i)
					count("renew-lost")
				default:
					t.Errorf("renew %s: %v", h.l.LeaseID, err)
					drop(i)
				}
			}
			for op := 0; op < opsPerWorker && time.Now().Before(runUntil); op++ {
				// A live holder renews at a third of its TTL.
				for i := len(held) - 1; i >= 0; i-- {
					if time.Since(held[i].sent) > time.Duration(held[i].l.TTL)/3 {
						renew(i)
					}
				}
				repo := repos[rng.IntN(len(repos))]
				switch k := rng.IntN(20); {
				case k < 9 && len(held) < 3:
					req := claims[rng.IntN(len(claims))]
					req.Repo = repo
					req.Owner = owner(w)
					req.TTL = lease.Duration(time.Second + time.Duration(rng.IntN(1000))*time.Millisecond)
					if rng.IntN(4) == 0 {
						req.Wait = lease.Duration(time.Duration(100+rng.IntN(600)) * time.Millisecond)
					}
					cred := NewCredential()
					sent := time.Now()
					l, err := c.Acquire(ctx, req, cred)
					var ce *lease.ConflictError
					switch {
					case err == nil:
						if len(req.Workspaces) > 0 && !slices.Contains(req.Workspaces, l.WorkspaceID) {
							t.Errorf("pool acquire over %v granted in workspace %s", req.Workspaces, l.WorkspaceID)
						}
						h := &heldLease{l: l, cred: cred, sent: sent, validUntil: sent.Add(time.Duration(l.TTL) - holderMargin)}
						held = append(held, h)
						note(h)
						mu.Lock()
						results[l.LeaseID] = l
						mu.Unlock()
						count("grant")
					case errors.As(err, &ce):
						if len(ce.Conflicts) == 0 {
							t.Errorf("conflict names no lease: %v", err)
						}
						count("conflict")
						if ce.Waited {
							count("wait-expired")
						}
					default:
						t.Errorf("acquire %s: %v", req.Scope, err)
					}
				case k < 13 && len(held) > 0:
					renew(rng.IntN(len(held)))
				case k < 16 && len(held) > 0:
					i := rng.IntN(len(held))
					h := held[i]
					l, err := c.Release(ctx, h.l.LeaseID, h.cred)
					switch {
					case err != nil:
						t.Errorf("release %s: %v", h.l.LeaseID, err)
					case l.Status == lease.StatusReleased:
						count("release")
					case l.Status == lease.StatusReclaimed && time.Now().After(h.validUntil):
						count("release-after-reclaim")
					default:
						t.Errorf("release of %s answered %s (holder valid for %s more)", h.l.LeaseID, l.Status, time.Until(h.validUntil))
					}
					drop(i)
				case k < 17 && len(held) > 0:
					// The holder crashes: it stops renewing and never releases.
					i := rng.IntN(len(held))
					mu.Lock()
					crashed[held[i].l.LeaseID] = time.Now()
					mu.Unlock()
					drop(i)
					count("crash")
				default:
					time.Sleep(time.Duration(rng.IntN(40)) * time.Millisecond)
				}
				ls, err := c.List(ctx, repo, false)
				if err != nil {
					t.Errorf("list: %v", err)
				} else if err := checkActiveSet(ls, 3); err != nil {
					t.Errorf("list after an operation: %v", err)
				}
				time.Sleep(time.Duration(rng.IntN(15)) * time.Millisecond)
			}
			for _, h := range held {
				if _, err := c.Release(ctx, h.l.LeaseID, h.cred); err != nil {
					t.Errorf("final release %s: %v", h.l.LeaseID, err)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("outcomes: %v", stats)

	// Crashed holders' leases are reclaimed by the service's own timer
	// (nothing else touches those repos now), within TTL plus slack.
	ctx := ctxT(t)
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		// Read the state from the watch, not from the service, so the
		// reclaim comes from the service's timer, not from a request.
		watchChk.mu.Lock()
		defer watchChk.mu.Unlock()
		for _, repo := range repos {
			for id := range watchChk.repo(repo).active {
				return fmt.Errorf("lease %s of %s still active", id, repo)
			}
		}
		return nil
	})
	for _, repo := range repos {
		ls, err := b.c.List(ctx, repo, false)
		if err != nil || len(ls) != 0 {
			t.Fatalf("leases left in %s after every holder released or crashed: %v %v", repo, ls, err)
		}
		follower.waitCaughtUp(t, repo, 10*time.Second)
	}

	if err := watchChk.err(); err != nil {
		t.Fatalf("watch stream violates the invariants:\n%v", err)
	}
	if err := logChk.err(); err != nil {
		t.Fatalf("lease log violates the invariants:\n%v", err)
	}
	t.Logf("watch saw %d grants; log follower: %s", watchChk.grantCount(), follower.stats())

	mu.Lock()
	defer mu.Unlock()
	evMu.Lock()
	defer evMu.Unlock()
	for id, l := range results {
		for _, chk := range []*commitChecker{watchChk, logChk} {
			g, ok := chk.granted(id)
			if !ok {
				t.Errorf("grant %s (fence %d) answered to a client but never committed/observed", id, l.Fence)
			} else if g.Fence != l.Fence {
				t.Errorf("grant %s: client got fence %d, committed fence %d", id, l.Fence, g.Fence)
			}
		}
	}
	if watchChk.grantCount() != len(results) || logChk.grantCount() != len(results) {
		t.Errorf("clients got %d grants, the watch saw %d, the log %d", len(results), watchChk.grantCount(), logChk.grantCount())
	}
	// Invariant 4: nobody considers a lease expired before its holder stops.
	for id, at := range endedAt {
		st := endStatus[id]
		if st != lease.StatusReclaimed && st != lease.StatusExpired {
			continue
		}
		if vu, ok := validUntil[id]; ok && at.Before(vu) {
			t.Errorf("lease %s %s at %s, before its holder's validity ended (%s later)", id, st, at.Format(time.StampMicro), vu.Sub(at))
		}
	}
	for id, since := range crashed {
		at, ok := endedAt[id]
		if !ok {
			t.Errorf("crashed holder's lease %s never reclaimed", id)
			continue
		}
		if st := endStatus[id]; st != lease.StatusReclaimed {
			t.Errorf("crashed holder's lease %s ended %s, want reclaimed", id, st)
		}
		if ttl := time.Duration(results[id].TTL); at.Sub(since) > ttl+2*time.Second {
			t.Errorf("crashed holder's lease %s reclaimed %s after the crash, ttl %s", id, at.Sub(since), ttl)
		}
	}
	for _, k := range []string{"grant", "conflict", "renew", "release", "crash"} {
		if stats[k] == 0 {
			t.Errorf("the run never exercised %q: %v", k, stats)
		}
	}
}
