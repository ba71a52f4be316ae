//go:build integration

package leasebus

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"
)

func TestRestartSweepsLeasesOfDeadHolders(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	ctx := ctxT(t)
	const ttl = 2 * time.Second
	var dead []*Lease
	for i := range 3 {
		l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("dead%d", i)), Owner: owner(i), TTL: Duration(ttl)}, NewCredential())
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
	status := map[string]Status{}
	stop, err := NewClient(connect(t, srv.ClientURL())).Watch(repo, func(l *Lease) {
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
		if status[l.LeaseID] != StatusReclaimed {
			t.Errorf("%s ended %s, want reclaimed", l.LeaseID, status[l.LeaseID])
		}
		if at.Before(loadStart.Add(ttl)) {
			t.Errorf("%s reclaimed %s after the restarted service started loading, before its ttl %s counted from there", l.LeaseID, at.Sub(loadStart), ttl)
		}
	}
	mu.Unlock()
	for _, l := range dead {
		n, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: l.Scope, Owner: owner(9), TTL: Duration(time.Minute)}, NewCredential())
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
			if ev.Type == EventReclaimed {
				reclaimed++
			}
		}
		if reclaimed != len(dead) {
			return fmt.Errorf("%d reclaimed audit events, want %d", reclaimed, len(dead))
		}
		return nil
	})
}
