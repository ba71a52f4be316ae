//go:build integration

package leasebus

import (
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Two lease service instances on one bus (the queue group splits requests
// between them): each appends with compare-and-swap on the repo's log, so
// an instance with a stale view fails its write, reloads and retries. The
// log must still never grant over an active lease, and no fence may be
// issued twice. (Renew and release of a lease the answering instance has
// not loaded yet must still work: "not found" would make its holder stop.)
func TestPropertyTwoServiceInstances(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	seed := testSeed(t)
	svc2, err := StartService(ctxT(t), connect(t, b.srv.ClientURL()), ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc2.Stop)
	const multiRepo = "github.com/acme/two-instances"
	claims := propClaims(t)
	logChk := newCommitChecker(3)
	follower := followLog(t, connect(t, b.srv.ClientURL()), logChk)

	var mu sync.Mutex
	fences := map[uint64]string{}
	stats := map[string]int{}
	until := time.Now().Add(4 * time.Second)
	var wg sync.WaitGroup
	for w := range 6 {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			c := NewClient(connect(t, b.srv.ClientURL()))
			ctx := ctxT(t)
			for op := 0; op < 150 && time.Now().Before(until); op++ {
				req := claims[rng.IntN(len(claims))]
				req.Repo, req.Owner, req.TTL = multiRepo, owner(w), lease.Duration(time.Second)
				cred := NewCredential()
				l, err := c.Acquire(ctx, req, cred)
				var ce *lease.ConflictError
				switch {
				case errors.As(err, &ce):
					mu.Lock()
					stats["conflict"]++
					mu.Unlock()
				case err != nil:
					t.Errorf("acquire: %v", err)
					return
				default:
					mu.Lock()
					stats["grant"]++
					if id, ok := fences[l.Fence]; ok {
						t.Errorf("fence %d issued to %s and %s", l.Fence, id, l.LeaseID)
					}
					fences[l.Fence] = l.LeaseID
					mu.Unlock()
					if _, err := c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
						t.Errorf("renew of a lease just granted (by either instance): %v", err)
					}
					if rng.IntN(2) == 0 {
						if _, err := c.Release(ctx, l.LeaseID, cred); err != nil {
							t.Errorf("release of a lease granted by either instance: %v", err)
						}
						mu.Lock()
						stats["release"]++
						mu.Unlock()
					}
				}
				ls, err := c.List(ctx, multiRepo, false)
				if err != nil {
					t.Errorf("list: %v", err)
				} else if err := checkActiveSet(ls, 3); err != nil {
					t.Errorf("list: %v", err)
				}
				time.Sleep(time.Duration(rng.IntN(10)) * time.Millisecond) // spacing operations
			}
		})
	}
	wg.Wait()
	follower.waitCaughtUp(t, multiRepo, 10*time.Second)
	t.Logf("outcomes %v; log follower: %s", stats, follower.stats())
	if err := logChk.err(); err != nil {
		t.Fatalf("lease log violates the invariants:\n%v", err)
	}
	for f, id := range fences {
		if g, ok := logChk.granted(id); !ok || g.Fence != f {
			t.Errorf("acknowledged grant %s (fence %d) not in the log as such", id, f)
		}
	}
	if stats["grant"] < 20 || stats["conflict"] == 0 {
		t.Errorf("too little contention: %v", stats)
	}
}
