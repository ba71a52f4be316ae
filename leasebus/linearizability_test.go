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
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"testing"

	"github.com/anishathalye/porcupine"
	"github.com/fenceline/fenceline/lease"
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
	status    lease.Status
	lost      bool
	list      []string // "id@version", sorted
}

type linLease struct {
	id      string
	claim   int
	version uint64
	status  lease.Status
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
					if l.status == lease.StatusActive && clash(c.Scope, c.WorkspaceID, c.WorkspaceMode, h.Scope, h.WorkspaceID, h.WorkspaceMode) != "" {
						blockers = append(blockers, l.id)
					}
				}
				if out.granted {
					if _, dup := st.find(out.id); dup || len(blockers) > 0 || out.fence != st.fence+1 {
						return false, st
					}
					n := st.with(linLease{id: out.id, claim: in.claim, version: 1, status: lease.StatusActive})
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
				if l.status == lease.StatusActive && l.version == in.version {
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
				if l.status == lease.StatusActive {
					if out.status != lease.StatusReleased || out.version != l.version+1 {
						return false, st
					}
					l.status, l.version = lease.StatusReleased, l.version+1
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
					if l.status == lease.StatusActive {
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
		{"none+public.*@wt-1", AcquireRequest{Scope: mustClaim(t, nil, false, []string{"public.*"}), WorkspaceID: "wt-1", WorkspaceMode: lease.WorkspaceExclusive}},
		{"d@wt-1 shared", AcquireRequest{Scope: claim(t, "d"), WorkspaceID: "wt-1", WorkspaceMode: lease.WorkspaceShared}},
		{"whole-repo@wt-2", AcquireRequest{Scope: mustClaim(t, nil, true, nil), WorkspaceID: "wt-2", WorkspaceMode: lease.WorkspaceExclusive}},
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
