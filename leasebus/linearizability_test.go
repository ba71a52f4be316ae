package leasebus

// Linearizability of the lease service, checked with porcupine: 8+
// concurrent clients run bounded random sequences of acquire (no wait),
// renew (with the right or a wrong version), release (also repeated), get
// and list on overlapping claims of one repo, with a TTL long enough that
// nothing expires. The history must be explainable by a sequential lease
// model in which
//
//   - an acquire is granted iff no active lease clashes with it (claims
//     overlap, or an exclusive workspace is shared), and then gets fence
//     last+1 (the repo's counter rises by one per grant); a refusal names
//     exactly the active leases that clash;
//   - a renew succeeds iff the lease is active at that version, and bumps it;
//   - a release ends an active lease, and repeats answer the ended record;
//   - get and list read the current state.

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
)

type linClaim struct {
	name string
	req  AcquireRequest
}

type linInput struct {
	op      string // acquire, renew, release, get, list
	claim   int
	id      string
	version uint64
}

type linOutput struct {
	granted   bool
	id        string
	fence     uint64
	conflicts []string // sorted
	version   uint64
	status    Status
	lost      bool
	list      []string // "id@version", sorted
}

type linLease struct {
	id      string
	claim   int
	version uint64
	status  Status
}

type linState struct {
	fence  uint64
	leases []linLease // sorted by id
}

func (s linState) find(id string) (int, bool) {
	return slices.BinarySearchFunc(s.leases, id, func(l linLease, id string) int { return strings.Compare(l.id, id) })
}

func (s linState) with(l linLease) linState {
	i, found := s.find(l.id)
	n := linState{fence: s.fence, leases: slices.Clone(s.leases)}
	if found {
		n.leases[i] = l
	} else {
		n.leases = slices.Insert(n.leases, i, l)
	}
	return n
}

func linModel(claims []linClaim, base uint64) porcupine.Model {
	return porcupine.Model{
		Init: func() any { return linState{fence: base} },
		Step: func(state, input, output any) (bool, any) {
			st, in, out := state.(linState), input.(linInput), output.(linOutput)
			switch in.op {
			case "acquire":
				var blockers []string
				c := claims[in.claim].req
				for _, l := range st.leases {
					h := claims[l.claim].req
					if l.status == StatusActive && clash(c.Scope, c.WorkspaceID, c.WorkspaceMode, h.Scope, h.WorkspaceID, h.WorkspaceMode) != "" {
						blockers = append(blockers, l.id)
					}
				}
				if out.granted {
					if _, dup := st.find(out.id); dup || len(blockers) > 0 || out.fence != st.fence+1 {
						return false, st
					}
					n := st.with(linLease{id: out.id, claim: in.claim, version: 1, status: StatusActive})
					n.fence = out.fence
					return true, n
				}
				return len(blockers) > 0 && slices.Equal(blockers, out.conflicts), st
			case "renew":
				i, ok := st.find(in.id)
				if !ok {
					return false, st
				}
				l := st.leases[i]
				if l.status == StatusActive && l.version == in.version {
					if out.lost || out.version != l.version+1 {
						return false, st
					}
					l.version++
					return true, st.with(l)
				}
				return out.lost, st
			case "release":
				i, ok := st.find(in.id)
				if !ok {
					return false, st
				}
				l := st.leases[i]
				if l.status == StatusActive {
					if out.status != StatusReleased || out.version != l.version+1 {
						return false, st
					}
					l.status, l.version = StatusReleased, l.version+1
					return true, st.with(l)
				}
				return out.status == l.status && out.version == l.version, st
			case "get":
				i, ok := st.find(in.id)
				if !ok {
					return false, st
				}
				return out.status == st.leases[i].status && out.version == st.leases[i].version, st
			case "list":
				var want []string
				for _, l := range st.leases {
					if l.status == StatusActive {
						want = append(want, fmt.Sprintf("%s@%d", l.id, l.version))
					}
				}
				return slices.Equal(want, out.list), st
			}
			return false, st
		},
		Equal: func(a, b any) bool {
			x, y := a.(linState), b.(linState)
			return x.fence == y.fence && slices.Equal(x.leases, y.leases)
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(linInput), output.(linOutput)
			switch in.op {
			case "acquire":
				if out.granted {
					return fmt.Sprintf("acquire(%s) -> %s fence %d", claims[in.claim].name, out.id, out.fence)
				}
				return fmt.Sprintf("acquire(%s) -> conflict %v", claims[in.claim].name, out.conflicts)
			case "renew":
				if out.lost {
					return fmt.Sprintf("renew(%s@%d) -> lost", in.id, in.version)
				}
				return fmt.Sprintf("renew(%s@%d) -> v%d", in.id, in.version, out.version)
			case "release":
				return fmt.Sprintf("release(%s) -> %s v%d", in.id, out.status, out.version)
			case "get":
				return fmt.Sprintf("get(%s) -> %s v%d", in.id, out.status, out.version)
			default:
				return fmt.Sprintf("list -> %v", out.list)
			}
		},
		DescribeState: func(state any) string {
			st := state.(linState)
			return fmt.Sprintf("fence %d %v", st.fence, st.leases)
		},
	}
}

func linClaims(t testing.TB) []linClaim {
	t.Helper()
	p := func(paths ...string) AcquireRequest {
		return AcquireRequest{Scope: claim(t, paths...)}
	}
	return []linClaim{
		{"a", p("a")},
		{"a/b", p("a/b")},
		{"a/b/c", p("a/b/c")},
		{"b", p("b")},
		{"b/c", p("b/c")},
		{"a/b/c+b/c", p("a/b/c", "b/c")},
		{"c+public.x", AcquireRequest{Scope: mustClaim(t, []string{"c"}, false, []string{"public.x"})}},
		{"none+public.*@wt-1", AcquireRequest{Scope: mustClaim(t, nil, false, []string{"public.*"}), WorkspaceID: "wt-1", WorkspaceMode: WorkspaceExclusive}},
		{"d@wt-1 shared", AcquireRequest{Scope: claim(t, "d"), WorkspaceID: "wt-1", WorkspaceMode: WorkspaceShared}},
		{"whole-repo@wt-2", AcquireRequest{Scope: mustClaim(t, nil, true, nil), WorkspaceID: "wt-2", WorkspaceMode: WorkspaceExclusive}},
	}
}

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
					if errors.Is(err, ErrUnavailable) {
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
						req.TTL = Duration(5 * time.Minute)
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
						case errors.Is(err, ErrLeaseLost):
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

// dumpLinearization writes the history, in call order, and the longest
// partial linearization porcupine found to a file, for a failing run.
func dumpLinearization(model porcupine.Model, history []porcupine.Operation, info porcupine.LinearizationInfo) (string, error) {
	f, err := os.CreateTemp("", "fenceline-linearizability-*.txt")
	if err != nil {
		return "", err
	}
	defer f.Close()
	h := slices.Clone(history)
	sort.Slice(h, func(i, j int) bool { return h[i].Call < h[j].Call })
	for _, op := range h {
		fmt.Fprintf(f, "[%9dus %9dus] client %d: %s\n", op.Call/1000, op.Return/1000, op.ClientId, model.DescribeOperation(op.Input, op.Output))
	}
	for _, p := range info.PartialLinearizationsOperations() {
		var longest []porcupine.Operation
		for _, l := range p {
			if len(l) > len(longest) {
				longest = l
			}
		}
		fmt.Fprintf(f, "\nlongest partial linearization (%d operations):\n", len(longest))
		st := model.Init()
		for _, op := range longest {
			_, st = model.Step(st, op.Input, op.Output)
			fmt.Fprintf(f, "  client %d: %s => %s\n", op.ClientId, model.DescribeOperation(op.Input, op.Output), model.DescribeState(st))
		}
	}
	return f.Name(), nil
}
