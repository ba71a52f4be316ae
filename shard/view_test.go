package shard

import (
	"context"
	"encoding/json"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestWorkspaceShard(t *testing.T) {
	for ws, want := range map[string]string{
		"shard-2":                  "shard-2",
		CommitWorkspace("shard-2"): "shard-2",
		lease.DefaultWorkspace:     lease.DefaultWorkspace,
		"":                         "",
	} {
		if got := WorkspaceShard(ws); got != want {
			t.Errorf("WorkspaceShard(%q) = %q, want %q", ws, got, want)
		}
	}
}

// viewFixture is a pool of three shards with: two path leases in shard-1,
// the commit capacity of shard-2 held, a released lease that was in
// shard-3, a lease on the checkout and one of another repo; and five
// attempts, oldest first: one running under a live lease, three settled,
// and a crashed one in shard-2 (running, its lease revoked).
type viewFixture struct {
	st                     *Store
	b                      *bustest.Bus
	pool                   *Pool
	inShard1, commit, held []string // lease ids
	outside, otherRepo     string
	attempts               []string // attempt ids, oldest first
}

func newViewFixture(t *testing.T) *viewFixture {
	t.Helper()
	b, st, co, pool := poolFixture(t, 3, 3, 0)
	ctx := context.Background()
	f := &viewFixture{st: st, b: b, pool: pool}
	ttl := lease.Duration(time.Minute)
	acquire := func(req leasebus.AcquireRequest) string {
		req.TTL = ttl
		return b.Acquire(t, req, leasebus.HoldOptions{}).Record.LeaseID
	}
	f.inShard1 = []string{
		acquire(leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "d000"), WorkspaceID: "shard-1"}),
		acquire(leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "other"), WorkspaceID: "shard-1"}),
	}
	f.commit = []string{acquire(leasebus.AcquireRequest{Repo: co, WorkspaceID: CommitWorkspace("shard-2"), WorkspaceMode: lease.WorkspaceExclusive})}
	f.outside = acquire(leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "outside")})
	f.otherRepo = acquire(leasebus.AcquireRequest{Repo: co + "-other", WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive})

	cred := leasebus.NewCredential()
	gone, err := b.Client.Acquire(ctx, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-3", WorkspaceMode: lease.WorkspaceExclusive, TTL: ttl,
		Owner: lease.Owner{TaskID: "t", AgentID: "a", AttemptID: lease.NewAttemptID()}}, cred)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Client.Release(ctx, gone.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	crashed := acquire(leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "crash"), WorkspaceID: "shard-2"})
	if _, err := b.Operator.Revoke(ctx, crashed, "runner crashed"); err != nil {
		t.Fatal(err)
	}

	t0 := time.Now().UTC().Add(-time.Hour)
	begin := func(i int, leaseID, shardID string) string {
		a, err := st.Begin(ctx, Attempt{AttemptID: lease.NewAttemptID(), Repo: co, Leases: []string{leaseID}, Shard: shardID,
			Command: []string{"cmd", string(rune('a' + i))}, StartedAt: t0.Add(time.Duration(i) * time.Minute)})
		if err != nil {
			t.Fatal(err)
		}
		f.attempts = append(f.attempts, a.AttemptID)
		return a.AttemptID
	}
	begin(0, f.inShard1[0], "shard-1")
	for i := 1; i <= 3; i++ {
		if _, err := st.Settle(ctx, co, begin(i, gone.LeaseID, "shard-3"), StatusSucceeded, 0); err != nil {
			t.Fatal(err)
		}
	}
	begin(4, crashed, "shard-2")
	return f
}

func leaseIDs(ls []*lease.Lease) []string {
	var ids []string
	for _, l := range ls {
		ids = append(ids, l.LeaseID)
	}
	slices.Sort(ids)
	return ids
}

func attemptIDs(as []*Attempt) []string {
	var ids []string
	for _, a := range as {
		ids = append(ids, a.AttemptID)
	}
	return ids
}

// TestView: each shard lists the active leases in it (its commit
// capacity's too), other active leases of the repo are outside the
// shards, ended leases and other repos' are not shown; a crashed attempt
// is recovered first and its shard shows dirty; recent keeps the newest
// attempts and every older running one.
func TestView(t *testing.T) {
	t.Parallel()
	f := newViewFixture(t)
	ctx := context.Background()
	v, err := f.st.View(ctx, f.pool, f.b.Client, 2)
	if err != nil {
		t.Fatal(err)
	}
	if v.Repo != f.pool.Repo || v.Size != 3 || len(v.Shards) != 3 {
		t.Fatalf("view of %s: %+v", f.pool.Repo, v)
	}
	want := map[string][]string{"shard-1": f.inShard1, "shard-2": f.commit, "shard-3": nil}
	for _, sh := range v.Shards {
		w := slices.Sorted(slices.Values(want[sh.ID]))
		if got := leaseIDs(sh.Occupants); !slices.Equal(got, w) {
			t.Errorf("%s occupants %v, want %v", sh.ID, got, w)
		}
		if sh.Occupants == nil {
			t.Errorf("%s occupants nil, want empty", sh.ID)
		}
	}
	if got := leaseIDs(v.Other); !slices.Equal(got, []string{f.outside}) {
		t.Errorf("outside the shards %v, want [%s] (not %s of another repo)", got, f.outside, f.otherRepo)
	}
	if sh := v.Shards[1]; sh.State != StateDirty {
		t.Errorf("shard-2 after its attempt crashed: %s, want dirty", sh.State)
	}
	a := f.attempts
	if got, want := attemptIDs(v.Attempts), []string{a[0], a[3], a[4]}; !slices.Equal(got, want) {
		t.Errorf("recent 2: attempts %v, want %v (the old running one, then the two newest)", got, want)
	}
	if st := v.Attempts[0].Status; st != StatusRunning {
		t.Errorf("attempt under a live lease: %s, want running", st)
	}
	if st := v.Attempts[2].Status; st != StatusUnknown {
		t.Errorf("crashed attempt: %s, want unknown", st)
	}

	all, err := f.st.View(ctx, f.pool, f.b.Client, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := attemptIDs(all.Attempts); !slices.Equal(got, a) {
		t.Errorf("recent 0: attempts %v, want all %v", got, a)
	}
	if many, err := f.st.View(ctx, f.pool, f.b.Client, 10); err != nil || !slices.Equal(attemptIDs(many.Attempts), a) {
		t.Errorf("recent 10 of 5: %v, %v; want all %v", attemptIDs(many.Attempts), err, a)
	}
}

// TestViewJSON: the JSON of a View is the shard list --json contract: the
// pool's fields at the top with shards, attempts and otherLeases (left
// out when empty); each shard's fields with occupants ([] when empty).
func TestViewJSON(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 1, 2, 3)
	ctx := context.Background()
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "d000"), WorkspaceID: "shard-2", TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	v, err := st.View(ctx, pool, b.Client, 20)
	if err != nil {
		t.Fatal(err)
	}
	raw, err := json.Marshal([]*View{v})
	if err != nil {
		t.Fatal(err)
	}
	var got []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &got); err != nil || len(got) != 1 {
		t.Fatalf("decode %s: %v", raw, err)
	}
	if keys := slices.Sorted(maps.Keys(got[0])); !slices.Equal(keys, []string{"attempts", "checkout", "dir", "maxSharers", "repo", "shards", "size"}) {
		t.Errorf("pool keys %v\n%s", keys, raw)
	}
	if s := string(got[0]["attempts"]); s != "null" {
		t.Errorf("attempts of a pool nobody ran in: %s, want null", s)
	}
	var shards []map[string]json.RawMessage
	if err := json.Unmarshal(got[0]["shards"], &shards); err != nil || len(shards) != 2 {
		t.Fatalf("decode shards %s: %v", got[0]["shards"], err)
	}
	if keys := slices.Sorted(maps.Keys(shards[0])); !slices.Equal(keys, []string{"branch", "id", "occupants", "path", "state"}) {
		t.Errorf("shard keys %v\n%s", keys, raw)
	}
	if s := string(shards[0]["occupants"]); s != "[]" {
		t.Errorf("occupants of an empty shard: %s, want []", s)
	}
	var occ []lease.Lease
	if err := json.Unmarshal(shards[1]["occupants"], &occ); err != nil || len(occ) != 1 || occ[0].LeaseID != l.Record.LeaseID {
		t.Errorf("occupants of shard-2: %s, %v; want %s", shards[1]["occupants"], err, l.Record.LeaseID)
	}
	// Other is shown only when there is one.
	b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "outside"), TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	if v, err = st.View(ctx, pool, b.Client, 20); err != nil {
		t.Fatal(err)
	}
	if raw, err = json.Marshal(v); err != nil {
		t.Fatal(err)
	}
	var top map[string]json.RawMessage
	if err := json.Unmarshal(raw, &top); err != nil || top["otherLeases"] == nil {
		t.Errorf("with a lease on the checkout: %s, %v; want otherLeases", raw, err)
	}
}
