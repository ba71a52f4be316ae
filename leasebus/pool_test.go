package leasebus

import (
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// shards are the candidate workspaces of the pool tests.
var shards = []string{"shard-1", "shard-2"}

func poolReq(t *testing.T, mode lease.WorkspaceMode, i int, paths ...string) AcquireRequest {
	t.Helper()
	r := AcquireRequest{Repo: repo, Scope: claim(t, paths...), Workspaces: shards, WorkspaceMode: mode,
		MaxSharers: 2, Owner: owner(i), TTL: lease.Duration(time.Minute)}
	if len(paths) == 0 {
		r.Scope = mustClaim(t, nil, false, nil)
	}
	return r
}

// conflictWorkspaces returns the workspaces a conflict error names.
func conflictWorkspaces(t *testing.T, err error) []string {
	t.Helper()
	var ce *lease.ConflictError
	if !errors.As(err, &ce) {
		t.Fatalf("want a conflict, got %v", err)
	}
	var ws []string
	for _, c := range ce.Conflicts {
		if !slices.Contains(ws, c.WorkspaceID) {
			ws = append(ws, c.WorkspaceID)
		}
	}
	slices.Sort(ws)
	return ws
}

// A pool request is granted in the first candidate that fits: exclusive
// leases take empty shards, shared leases pack into a shard that already
// has sharers (up to max-sharers) and spill into an empty one after that,
// and a full pool is refused naming who holds each shard.
func TestPoolPlacement(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	acquire := func(r AcquireRequest) (*lease.Lease, error) { return b.c.Acquire(ctx, r, cred) }
	must := func(r AcquireRequest, wantWS string) *lease.Lease {
		t.Helper()
		l, err := acquire(r)
		if err != nil {
			t.Fatalf("acquire %s %s: %v", r.Scope, r.WorkspaceMode, err)
		}
		if l.WorkspaceID != wantWS {
			t.Fatalf("acquire %s %s: granted in %s, want %s", r.Scope, r.WorkspaceMode, l.WorkspaceID, wantWS)
		}
		return l
	}

	ex1 := must(poolReq(t, lease.WorkspaceExclusive, 1), "shard-1")
	ex2 := must(poolReq(t, lease.WorkspaceExclusive, 2), "shard-2")
	_, err := acquire(poolReq(t, lease.WorkspaceExclusive, 3))
	if got := conflictWorkspaces(t, err); !slices.Equal(got, shards) {
		t.Fatalf("full pool: conflict names workspaces %v, want %v (%v)", got, shards, err)
	}
	if !strings.Contains(err.Error(), ex1.LeaseID) || !strings.Contains(err.Error(), ex2.LeaseID) {
		t.Fatalf("full pool: %v does not name both holders", err)
	}

	if _, err := b.c.Release(ctx, ex2.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	must(poolReq(t, lease.WorkspaceShared, 4, "a"), "shard-2")
	must(poolReq(t, lease.WorkspaceShared, 5, "b"), "shard-2") // packs with its sharer
	if _, err := acquire(poolReq(t, lease.WorkspaceShared, 6, "a/x")); !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "claims overlap") {
		t.Fatalf("overlapping claim in a pool: %v, want a claim overlap", err)
	}
	// shard-2 has max-sharers 2, shard-1 is exclusive: the pool is full.
	if _, err := acquire(poolReq(t, lease.WorkspaceShared, 7, "c")); !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "max-sharers 2") {
		t.Fatalf("third sharer: %v, want max-sharers refusal", err)
	}
	if _, err := b.c.Release(ctx, ex1.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	must(poolReq(t, lease.WorkspaceShared, 7, "c"), "shard-1") // spills into the freed shard

	// A fixed-workspace request still works beside the pool.
	must(AcquireRequest{Repo: repo, Scope: claim(t, "d"), WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceShared,
		MaxSharers: 2, Owner: owner(8), TTL: lease.Duration(time.Minute)}, "shard-1")
}

// Pool requests are placed first come, first served: an exclusive request
// queued for a full pool is not starved by later shared requests that
// would fit, and is granted the shard that empties.
func TestPoolWaiterServedFirst(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	held := map[string]*lease.Lease{}
	for i, ws := range shards {
		r := poolReq(t, lease.WorkspaceShared, i, string(rune('a'+i)))
		r.Workspaces, r.WorkspaceID = nil, ws // one sharer in each shard
		l, err := b.c.Acquire(ctx, r, cred)
		if err != nil || l.WorkspaceID != ws {
			t.Fatalf("sharer %d: %v in %v, want %s", i, err, l, ws)
		}
		held[ws] = l
	}
	got := make(chan *lease.Lease, 1)
	errc := make(chan error, 1)
	go func() {
		r := poolReq(t, lease.WorkspaceExclusive, 9)
		r.Wait = lease.Duration(20 * time.Second)
		l, err := b.c.Acquire(ctx, r, cred)
		if err != nil {
			errc <- err
			return
		}
		got <- l
	}()
	checkFor(t, 5*time.Second, time.Millisecond, func() error {
		if n := queued(b.svc, repo); n != 1 {
			return errors.New("exclusive request not queued yet")
		}
		return nil
	})
	// A shared request that would fit beside a sharer waits its turn.
	_, err := b.c.Acquire(ctx, poolReq(t, lease.WorkspaceShared, 10, "z"), cred)
	if !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "queued earlier") {
		t.Fatalf("shared request behind a queued pool request: %v, want queued earlier", err)
	}
	if _, err := b.c.Release(ctx, held["shard-2"].LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	select {
	case l := <-got:
		if l.WorkspaceID != "shard-2" || l.WorkspaceMode != lease.WorkspaceExclusive {
			t.Fatalf("queued exclusive request granted %s (%s), want shard-2 exclusive", l.WorkspaceID, l.WorkspaceMode)
		}
	case err := <-errc:
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		t.Fatal("queued exclusive request not granted 10s after its shard emptied")
	}
	// With the queue empty, the shared request fits again.
	if l, err := b.c.Acquire(ctx, poolReq(t, lease.WorkspaceShared, 10, "z"), cred); err != nil || l.WorkspaceID != "shard-1" {
		t.Fatalf("shared request after the queue drained: %v, %v", l, err)
	}
}

func TestPoolRequestValidation(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	for _, tc := range []struct {
		name string
		edit func(*AcquireRequest)
		want string
	}{
		{"both", func(r *AcquireRequest) { r.WorkspaceID = "shard-1" }, "not both"},
		{"duplicate", func(r *AcquireRequest) { r.Workspaces = []string{"shard-1", "shard-1"} }, "once"},
		{"empty name", func(r *AcquireRequest) { r.Workspaces = []string{"shard-1", " "} }, "named"},
		{"too many", func(r *AcquireRequest) {
			r.Workspaces = nil
			for i := range MaxCandidates + 1 {
				r.Workspaces = append(r.Workspaces, "s"+strings.Repeat("x", i))
			}
		}, "at most"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := poolReq(t, lease.WorkspaceShared, 1, "a")
			tc.edit(&r)
			if _, err := b.c.Acquire(ctx, r, NewCredential()); !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrInvalid mentioning %q", err, tc.want)
			}
		})
	}
}

// A workspace named W/x lies in W (a shard's commit capacity, shard-1/commit,
// lies in shard-1): an exclusive lease on W and a lease inside it never
// coexist; shared leases on W do not mind it.
func TestNestedWorkspaces(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	fixed := func(i int, ws string, mode lease.WorkspaceMode, paths ...string) AcquireRequest {
		r := poolReq(t, mode, i, paths...)
		r.Workspaces, r.WorkspaceID = nil, ws
		return r
	}
	ex, err := b.c.Acquire(ctx, fixed(1, "shard-1", lease.WorkspaceExclusive), cred)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Acquire(ctx, fixed(2, "shard-1/commit", lease.WorkspaceExclusive), cred); !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "held exclusively, and shard-1/commit lies in it") {
		t.Fatalf("commit capacity beside an exclusive lease on its shard: %v, want a conflict", err)
	}
	if _, err := b.c.Release(ctx, ex.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Acquire(ctx, fixed(2, "shard-1/commit", lease.WorkspaceExclusive), cred); err != nil {
		t.Fatalf("commit capacity on an empty shard: %v", err)
	}
	if _, err := b.c.Acquire(ctx, fixed(3, "shard-1", lease.WorkspaceShared, "a"), cred); err != nil {
		t.Fatalf("a path lease beside serialized commit capacity: %v", err)
	}
	if _, err := b.c.Acquire(ctx, fixed(4, "shard-1", lease.WorkspaceExclusive), cred); !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "shard-1/commit lies in it") {
		t.Fatalf("exclusive lease on a shard with commit capacity held: %v, want a conflict", err)
	}
	// A pool request's exclusive lease goes around the busy shard.
	if l, err := b.c.Acquire(ctx, poolReq(t, lease.WorkspaceExclusive, 5), cred); err != nil || l.WorkspaceID != "shard-2" {
		t.Fatalf("exclusive pool request: %v, %v; want shard-2", l, err)
	}
	for ws, parent := range map[string]string{"shard-1/commit": "shard-1", "a/b/c": "a/b"} {
		if !within(ws, parent) {
			t.Errorf("%s should lie in %s", ws, parent)
		}
	}
	for _, pair := range [][2]string{{"shard-10", "shard-1"}, {"shard-1", "shard-1"}, {"shard-1", "shard-1/commit"}} {
		if within(pair[0], pair[1]) {
			t.Errorf("%s should not lie in %s", pair[0], pair[1])
		}
	}
}
