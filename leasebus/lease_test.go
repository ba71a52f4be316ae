package leasebus

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

const repo = "github.com/acme/payments"

func TestAcquireConflictNamesHolder(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	a, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if a.Status != lease.StatusActive || a.Version != 1 || a.Fence == 0 || a.WorkspaceMode != lease.WorkspaceShared || a.WorkspaceID != lease.DefaultWorkspace {
		t.Fatalf("unexpected grant %+v", a)
	}
	_, err = b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing/api"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	var ce *lease.ConflictError
	if !errors.As(err, &ce) || !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("want a conflict, got %v", err)
	}
	if len(ce.Conflicts) != 1 || ce.Conflicts[0].LeaseID != a.LeaseID || ce.Conflicts[0].Owner != owner(1) || !ce.Conflicts[0].ExpiresAt.Equal(a.ExpiresAt) {
		t.Fatalf("conflict does not name the holder: %+v", ce.Conflicts)
	}
	if !strings.Contains(err.Error(), a.LeaseID) || !strings.Contains(err.Error(), "agent-1") {
		t.Fatalf("conflict message %q does not name lease and owner", err)
	}
	// A disjoint scope (a prefix that is not an ancestor) is granted, with a higher fence.
	c, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/bill"), Owner: owner(3), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatalf("disjoint scope refused: %v", err)
	}
	if c.Fence <= a.Fence {
		t.Fatalf("fence did not increase: %d then %d", a.Fence, c.Fence)
	}
}

func TestOwnerBinding(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "libs"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	forged := NewCredential()
	if _, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: forged, Version: l.Version}); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("forged renew: want ErrNotOwner, got %v", err)
	}
	if _, err := b.c.Release(ctx, l.LeaseID, forged); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("forged release: want ErrNotOwner, got %v", err)
	}
	if _, err := b.c.Release(ctx, l.LeaseID, ""); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("release by id alone: want ErrNotOwner, got %v", err)
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || !got.Active() || got.Version != l.Version {
		t.Fatalf("lease changed by forged calls: %+v %v", got, err)
	}
	// The owner renews (compare-and-swap on version) and releases, twice.
	r, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version})
	if err != nil || r.Version != l.Version+1 {
		t.Fatalf("owner renew: %+v %v", r, err)
	}
	if _, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("renew with a stale version: want ErrLeaseLost, got %v", err)
	}
	for i := range 2 {
		rel, err := b.c.Release(ctx, l.LeaseID, cred)
		if err != nil || rel.Status != lease.StatusReleased {
			t.Fatalf("release #%d: %+v %v", i+1, rel, err)
		}
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		refused := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == "not-owner" && ev.LeaseID == l.LeaseID && ev.Owner == owner(1) && ev.Fence == l.Fence {
				refused++
			}
		}
		if refused != 3 {
			return errors.New("want 3 audited forged operations")
		}
		return nil
	})
}

func TestRenewAfterExpiryRefusedAndSwept(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Second)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// The sweeper reclaims it by itself once the TTL lapses.
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		got, err := b.c.Get(ctx, l.LeaseID)
		if err != nil {
			return err
		}
		if got.Status != lease.StatusReclaimed {
			return errors.New("still " + string(got.Status))
		}
		return nil
	})
	if _, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("renew after expiry: want ErrLeaseLost, got %v", err)
	}
	// The scope is free again, with a higher fence.
	n, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil || n.Fence <= l.Fence {
		t.Fatalf("reacquire: %+v %v", n, err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		var reclaimed, renewRefused bool
		for _, ev := range evs {
			if ev.Type == lease.EventReclaimed && ev.LeaseID == l.LeaseID && strings.HasPrefix(ev.Message, "reclaimed: "+l.LeaseID+" owner=") && strings.Contains(ev.Message, "expired=") {
				reclaimed = true
			}
			if ev.Type == lease.EventRenewRefused && ev.LeaseID == l.LeaseID && ev.Owner == owner(1) && ev.Fence == l.Fence {
				renewRefused = true
			}
		}
		if !reclaimed || !renewRefused {
			return fmt.Errorf("want reclaimed and renew-refused audit events for %s in %+v", l.LeaseID, evs)
		}
		return nil
	})
}

func TestWaitAcquireHandsOver(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	first, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "x"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan *lease.Lease, 1)
	errs := make(chan error, 1)
	go func() {
		l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "x/y"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(10 * time.Second)}, NewCredential())
		if err != nil {
			errs <- err
			return
		}
		got <- l
	}()
	// The waiter is queued, not granted.
	select {
	case l := <-got:
		t.Fatalf("granted while the conflicting lease is active: %+v", l)
	case err := <-errs:
		t.Fatal(err)
	case <-time.After(200 * time.Millisecond):
	}
	if _, err := b.c.Release(ctx, first.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	select {
	case l := <-got:
		if l.Fence <= first.Fence {
			t.Fatalf("fence %d not above %d", l.Fence, first.Fence)
		}
	case err := <-errs:
		t.Fatal(err)
	case <-time.After(5 * time.Second):
		t.Fatal("waiter not granted after release")
	}
}

func TestWaitTimesOutWithConflict(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}}, Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	_, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "docs"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(300 * time.Millisecond)}, NewCredential())
	var ce *lease.ConflictError
	if !errors.As(err, &ce) || !ce.Waited || len(ce.Conflicts) != 1 {
		t.Fatalf("want a waited conflict, got %v", err)
	}
	if el := time.Since(start); el < 300*time.Millisecond {
		t.Fatalf("gave up after %s, before the wait", el)
	}
}

func TestWorkspaceOccupancy(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	none := scope.Claim{Kind: scope.KindNone, Paths: []string{}, Tables: []string{}}
	acq := func(i int, c scope.Claim, ws string, mode lease.WorkspaceMode, maxSharers int) error {
		_, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: c, WorkspaceID: ws, WorkspaceMode: mode, MaxSharers: maxSharers, Owner: owner(i), TTL: lease.Duration(time.Minute)}, NewCredential())
		return err
	}
	// Unclaimed exclusive attempts run in parallel, one per shard.
	if err := acq(1, none, "wt-1", lease.WorkspaceExclusive, 0); err != nil {
		t.Fatal(err)
	}
	if err := acq(2, none, "wt-2", lease.WorkspaceExclusive, 0); err != nil {
		t.Fatal(err)
	}
	if err := acq(3, claim(t, "p"), "wt-1", lease.WorkspaceShared, 0); !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("shared lease joined an exclusive shard: %v", err)
	}
	// Disjoint path leases share a shard up to max-sharers.
	if err := acq(4, claim(t, "a"), "wt-3", lease.WorkspaceShared, 2); err != nil {
		t.Fatal(err)
	}
	if err := acq(5, claim(t, "b"), "wt-3", lease.WorkspaceShared, 2); err != nil {
		t.Fatal(err)
	}
	if err := acq(6, claim(t, "c"), "wt-3", lease.WorkspaceShared, 2); !errors.Is(err, lease.ErrConflict) || !strings.Contains(err.Error(), "max-sharers 2") {
		t.Fatalf("max-sharers not honored: %v", err)
	}
	if err := acq(7, none, "wt-3", lease.WorkspaceExclusive, 0); !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("exclusive lease joined an occupied shard: %v", err)
	}
}

func TestBadInputNamed(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cases := []struct {
		name string
		req  AcquireRequest
		want string
	}{
		{"no repo", AcquireRequest{Scope: claim(t, "a")}, "repo is empty"},
		{"ttl", AcquireRequest{Repo: repo, Scope: claim(t, "a"), TTL: lease.Duration(time.Millisecond)}, "ttl 1ms out of range"},
		{"shared none", AcquireRequest{Repo: repo, WorkspaceMode: lease.WorkspaceShared}, "must claim paths"},
		{"unnormalized scope", AcquireRequest{Repo: repo, Scope: scope.Claim{Kind: scope.KindPaths, Paths: []string{"../x"}, Tables: []string{}}}, "../x"},
		{"mode", AcquireRequest{Repo: repo, Scope: claim(t, "a"), WorkspaceMode: "both"}, `"both"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := b.c.Acquire(ctx, tc.req, NewCredential())
			if !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrInvalid mentioning %q", err, tc.want)
			}
		})
	}
	if _, err := b.c.Get(ctx, "nope"); !errors.Is(err, lease.ErrInvalid) {
		t.Fatalf("bad lease id: %v", err)
	}
	if _, err := b.c.Get(ctx, "lease_0000000000000000"); !errors.Is(err, lease.ErrNotFound) {
		t.Fatalf("unknown lease id: %v", err)
	}
}

// With two service instances, a queued acquire is granted promptly when
// the conflicting lease is released through the other instance: the
// instances meet on start and follow each other's appends.
func TestWaiterWokenAcrossInstances(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	second, err := StartService(ctx, connect(t, b.srv.ClientURL()), ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	defer second.Stop()
	clients := []*Client{NewClient(connect(t, b.srv.ClientURL())), NewClient(connect(t, b.srv.ClientURL()))}
	for i := range 8 {
		cred := NewCredential()
		held, err := clients[0].Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "hot"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
		if err != nil {
			t.Fatal(err)
		}
		got := make(chan error, 1)
		go func() {
			l, err := clients[1].Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "hot"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(20 * time.Second)}, cred)
			if err == nil {
				_, err = clients[1].Release(ctx, l.LeaseID, cred)
			}
			got <- err
		}()
		// Let the waiter queue (on whichever instance took it), then release.
		checkFor(t, 5*time.Second, time.Millisecond, func() error {
			if n := queued(b.svc, repo) + queued(second, repo); n != 1 {
				return fmt.Errorf("%d queued acquires, want 1", n)
			}
			return nil
		})
		start := time.Now()
		if _, err := clients[0].Release(ctx, held.LeaseID, cred); err != nil {
			t.Fatal(err)
		}
		select {
		case err := <-got:
			if err != nil {
				t.Fatalf("round %d: %v", i, err)
			}
			if el := time.Since(start); el > 2*time.Second {
				t.Fatalf("round %d: waiter granted %s after the release", i, el)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("round %d: waiter not granted 5s after the release", i)
		}
	}
}

func TestParseOwnerRoundTrip(t *testing.T) {
	t.Parallel()
	for _, o := range []lease.Owner{
		{TaskID: "job_4821", AgentID: "codex-worker-4", AttemptID: "att_1"},
		{TaskID: "t", AgentID: "a", AttemptID: "x", HostID: "host-7"},
		{},
	} {
		if got := lease.ParseOwner(o.String()); got != o {
			t.Errorf("ParseOwner(%q) = %+v, want %+v", o.String(), got, o)
		}
	}
}
