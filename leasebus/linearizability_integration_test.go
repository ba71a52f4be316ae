//go:build integration

package leasebus

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/fenceline/fenceline/lease"
)

func TestLinearizableLeases(t *testing.T) {
	b := startBus(t)
	seed := testSeed(t)
	claims := linClaims(t)
	const clients, opsPerClient, rounds = 8, 40, 4
	conns := make([]*Client, clients)
	for i := range conns {
		conns[i] = NewClient(connect(t, b.srv.ClientURL()))
	}
	for round := range rounds {
		repo := fmt.Sprintf("github.com/acme/lin-%d", round)
		// Claims are normalized the way the service does it, once.
		rc := slices.Clone(claims)
		for i := range rc {
			rc[i].req.Repo = repo
			rc[i].req.CredentialHash = strings.Repeat("0", 64)
			if err := rc[i].req.normalize(); err != nil {
				t.Fatal(err)
			}
		}
		start := time.Now()
		var mu sync.Mutex
		var history []porcupine.Operation
		var wg sync.WaitGroup
		for ci := range clients {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(seed, uint64(round*100+ci)))
				c := conns[ci]
				ctx := ctxT(t)
				type hl struct {
					id      string
					cred    Credential
					version uint64
				}
				var held []*hl
				var ended []*hl
				var known []string
				record := func(in linInput, call time.Duration, out linOutput) {
					mu.Lock()
					history = append(history, porcupine.Operation{ClientId: ci, Input: in, Output: out,
						Call: call.Nanoseconds(), Return: time.Since(start).Nanoseconds()})
					mu.Unlock()
				}
				fail := func(what string, err error) {
					if errors.Is(err, lease.ErrUnavailable) {
						t.Errorf("%s: the bus was unavailable (unknown outcome) in a test without faults: %v", what, err)
					} else {
						t.Errorf("%s: %v", what, err)
					}
				}
				for range opsPerClient {
					k := rng.IntN(20)
					switch {
					case k < 8 && len(held) < 2:
						cl := rng.IntN(len(rc))
						req := rc[cl].req
						req.TTL = lease.Duration(5 * time.Minute)
						req.Owner = owner(ci)
						cred := NewCredential()
						in := linInput{op: "acquire", claim: cl}
						call := time.Since(start)
						l, err := c.Acquire(ctx, req, cred)
						var out linOutput
						if err == nil {
							out = linOutput{granted: true, id: l.LeaseID, fence: l.Fence}
							held = append(held, &hl{id: l.LeaseID, cred: cred, version: l.Version})
							known = append(known, l.LeaseID)
						} else if ids, ok := conflictIDs(err); ok {
							out = linOutput{conflicts: ids}
						} else {
							fail("acquire", err)
							return
						}
						record(in, call, out)
					case k < 11 && len(held) > 0:
						h := held[rng.IntN(len(held))]
						v := h.version
						if rng.IntN(5) == 0 {
							v = h.version + 1 // a version the lease never had
							if rng.IntN(2) == 0 && h.version > 1 {
								v = h.version - 1 // a stale one
							}
						}
						in := linInput{op: "renew", id: h.id, version: v}
						call := time.Since(start)
						l, err := c.Renew(ctx, RenewRequest{LeaseID: h.id, Credential: h.cred, Version: v, RenewID: NewRequestID()})
						var out linOutput
						switch {
						case err == nil:
							out = linOutput{version: l.Version}
							h.version = l.Version
						case errors.Is(err, lease.ErrLeaseLost):
							out = linOutput{lost: true}
						default:
							fail("renew", err)
							return
						}
						record(in, call, out)
					case k < 16 && len(held)+len(ended) > 0:
						var h *hl
						if i := rng.IntN(len(held) + len(ended)); i < len(held) {
							h = held[i]
							held = slices.Delete(held, i, i+1)
							ended = append(ended, h)
						} else {
							h = ended[i-len(held)]
						}
						in := linInput{op: "release", id: h.id}
						call := time.Since(start)
						l, err := c.Release(ctx, h.id, h.cred)
						if err != nil {
							fail("release", err)
							return
						}
						record(in, call, linOutput{status: l.Status, version: l.Version})
					case k < 18 && len(known) > 0:
						id := known[rng.IntN(len(known))]
						call := time.Since(start)
						l, err := c.Get(ctx, id)
						if err != nil {
							fail("get", err)
							return
						}
						record(linInput{op: "get", id: id}, call, linOutput{status: l.Status, version: l.Version})
					default:
						call := time.Since(start)
						ls, err := c.List(ctx, repo, false)
						if err != nil {
							fail("list", err)
							return
						}
						var out linOutput
						for _, l := range ls {
							out.list = append(out.list, fmt.Sprintf("%s@%d", l.LeaseID, l.Version))
						}
						slices.Sort(out.list)
						record(linInput{op: "list"}, call, out)
					}
					if rng.IntN(3) == 0 {
						time.Sleep(time.Duration(rng.IntN(3)) * time.Millisecond)
					}
				}
				for _, h := range held {
					call := time.Since(start)
					l, err := c.Release(ctx, h.id, h.cred)
					if err != nil {
						fail("final release", err)
						return
					}
					record(linInput{op: "release", id: h.id}, call, linOutput{status: l.Status, version: l.Version})
				}
			})
		}
		wg.Wait()
		if t.Failed() {
			t.FailNow()
		}
		// Each repo has its own fence counter, from 0.
		model := linModel(rc, 0)
		res, info := porcupine.CheckOperationsVerbose(model, history, 60*time.Second)
		grants, conflicts := 0, 0
		for _, op := range history {
			if op.Input.(linInput).op == "acquire" {
				if op.Output.(linOutput).granted {
					grants++
				} else {
					conflicts++
				}
			}
		}
		t.Logf("round %d: %d operations (%d grants, %d conflicts): %s", round, len(history), grants, conflicts, res)
		if grants == 0 || conflicts == 0 {
			t.Errorf("round %d exercised no grant or no conflict", round)
		}
		if res != porcupine.Ok {
			f, err := os.CreateTemp("", "fenceline-linearizability-*.html")
			if err == nil {
				_ = porcupine.Visualize(model, info, f)
				_ = f.Close()
				t.Logf("visualization: %s", f.Name())
			}
			if name, err := dumpLinearization(model, history, info); err == nil {
				t.Logf("history and longest partial linearization: %s", name)
			}
			t.Fatalf("round %d: history is not linearizable (result %s)", round, res)
		}
	}
}
