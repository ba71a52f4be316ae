//go:build integration

package leasebus

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

func TestRestartSweepsLeasesOfDeadHolders(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	ctx := ctxT(t)
	const ttl = 2 * time.Second
	var dead []*lease.Lease
	for i := range 3 {
		l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("dead%d", i)), Owner: owner(i), TTL: lease.Duration(ttl)}, NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		dead = append(dead, l)
	}
	// Most of the TTL passes before the restart: by the old service's
	// clock the leases are nearly gone, but the new service must judge
	// from its own observation (invariant 4: no shared wall clock; a
	// holder that renewed just before the restart must not lose its lease
	// early).
	time.Sleep(1500 * time.Millisecond) // spacing the restart into the TTL, not waiting for state
	b.stop()
	srv, err := EmbeddedStartServer(serverConfig(t, ServerConfig{Listen: "127.0.0.1:0", StoreDir: b.dir}))
	if err != nil {
		t.Fatal(err)
	}
	b.srv = srv
	b.nc = connect(t, srv.ClientURL())
	var mu sync.Mutex
	ended := map[string]time.Time{}
	status := map[string]lease.Status{}
	stop, err := NewClient(connectAs(t, srv.ClientURL(), RoleViewer)).Watch(repo, func(l *lease.Lease) { // a viewer, as the run UI
		mu.Lock()
		defer mu.Unlock()
		if !l.Active() {
			ended[l.LeaseID] = time.Now()
			status[l.LeaseID] = l.Status
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	loadStart := time.Now()
	b.svc, err = StartService(context.Background(), b.nc, ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	loaded := time.Now()
	b.c = NewClient(b.nc)

	// No requests for the repo: the service's own timer must sweep.
	checkFor(t, ttl+3*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, l := range dead {
			if _, ok := ended[l.LeaseID]; !ok {
				return fmt.Errorf("%s not reclaimed %s after the service loaded it (ttl %s)", l.LeaseID, time.Since(loaded).Round(time.Millisecond), ttl)
			}
		}
		return nil
	})
	mu.Lock()
	for _, l := range dead {
		at := ended[l.LeaseID]
		if status[l.LeaseID] != lease.StatusReclaimed {
			t.Errorf("%s ended %s, want reclaimed", l.LeaseID, status[l.LeaseID])
		}
		if at.Before(loadStart.Add(ttl)) {
			t.Errorf("%s reclaimed %s after the restarted service started loading, before its ttl %s counted from there", l.LeaseID, at.Sub(loadStart), ttl)
		}
	}
	mu.Unlock()
	for _, l := range dead {
		n, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: l.Scope, Owner: owner(9), TTL: lease.Duration(time.Minute)}, NewCredential())
		if err != nil || n.Fence <= dead[len(dead)-1].Fence {
			t.Fatalf("reacquire of a reclaimed claim: %+v %v", n, err)
		}
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		reclaimed := 0
		for _, ev := range evs {
			if ev.Type == lease.EventReclaimed {
				reclaimed++
			}
		}
		if reclaimed != len(dead) {
			return fmt.Errorf("%d reclaimed audit events, want %d", reclaimed, len(dead))
		}
		return nil
	})
}

func TestRestartKeepsAcknowledgedState(t *testing.T) {
	for _, how := range []string{restartClean, restartCrash, restartCopy} {
		t.Run(how, func(t *testing.T) {
			b := startBus(t)
			ctx := ctxT(t)
			repos := []string{"github.com/acme/restart-1", "github.com/acme/restart-2"}
			var active, released []ackedLease
			maxFence := map[string]uint64{}
			for i := range 12 {
				repo := repos[i%2]
				cred := NewCredential()
				l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("p%d", i)), Owner: owner(i), TTL: lease.Duration(time.Minute)}, cred)
				if err != nil {
					t.Fatal(err)
				}
				maxFence[repo] = max(maxFence[repo], l.Fence)
				switch i % 3 {
				case 0: // renewed twice
					for range 2 {
						if l, err = b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
							t.Fatal(err)
						}
					}
					active = append(active, ackedLease{l, cred})
				case 1:
					if l, err = b.c.Release(ctx, l.LeaseID, cred); err != nil {
						t.Fatal(err)
					}
					released = append(released, ackedLease{l, cred})
				default:
					active = append(active, ackedLease{l, cred})
				}
			}

			b.restart(how)

			for _, a := range active {
				got, err := b.c.Get(ctx, a.l.LeaseID)
				if err != nil {
					t.Fatalf("acknowledged lease %s lost in the restart: %v", a.l.LeaseID, err)
				}
				if !got.Active() || got.Fence != a.l.Fence || got.Version != a.l.Version || got.Scope.String() != a.l.Scope.String() || got.Owner != a.l.Owner {
					t.Fatalf("after restart %s is %+v, acknowledged %+v", a.l.LeaseID, got, a.l)
				}
			}
			for _, r := range released {
				got, err := b.c.Get(ctx, r.l.LeaseID)
				if err != nil || got.Status != lease.StatusReleased || got.Version != r.l.Version {
					t.Fatalf("released lease %s after restart: %+v %v", r.l.LeaseID, got, err)
				}
				// Releasing again stays idempotent for the owner, and
				// forged calls stay refused.
				if got, err := b.c.Release(ctx, r.l.LeaseID, r.cred); err != nil || got.Status != lease.StatusReleased {
					t.Fatalf("repeated release after restart: %+v %v", got, err)
				}
				if _, err := b.c.Release(ctx, r.l.LeaseID, NewCredential()); !errors.Is(err, lease.ErrNotOwner) {
					t.Fatalf("forged release after restart: %v", err)
				}
			}
			// Owners keep renewing with compare-and-swap on the version
			// they had; the claims are still held.
			for _, a := range active {
				if _, err := b.c.Renew(ctx, RenewRequest{LeaseID: a.l.LeaseID, Credential: a.cred, Version: a.l.Version + 1}); !errors.Is(err, lease.ErrLeaseLost) {
					t.Fatalf("stale renew after restart: %v", err)
				}
				got, err := b.c.Renew(ctx, RenewRequest{LeaseID: a.l.LeaseID, Credential: a.cred, Version: a.l.Version})
				if err != nil || got.Version != a.l.Version+1 {
					t.Fatalf("owner renew after restart: %+v %v", got, err)
				}
				_, err = b.c.Acquire(ctx, AcquireRequest{Repo: a.l.Repo, Scope: a.l.Scope, Owner: owner(99), TTL: lease.Duration(time.Minute)}, NewCredential())
				if !errors.Is(err, lease.ErrConflict) {
					t.Fatalf("claim of %s granted again after restart: %v", a.l.LeaseID, err)
				}
			}
			// Fences continue above every fence issued before.
			for _, repo := range repos {
				l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "after-restart"), Owner: owner(100), TTL: lease.Duration(time.Minute)}, NewCredential())
				if err != nil {
					t.Fatal(err)
				}
				if l.Fence != maxFence[repo]+1 {
					t.Fatalf("first fence after restart in %s is %d, want %d", repo, l.Fence, maxFence[repo]+1)
				}
			}
		})
	}
}
