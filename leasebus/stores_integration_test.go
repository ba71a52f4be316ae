//go:build integration

package leasebus

import (
	"context"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// Any holder could once fill the bus's store and evict the lease audit:
// the shard buckets had no byte limit (a full store makes every append
// fail, so every holder in the fleet fails closed), boundary events and
// a viewer's reads shared one stream with the grants and revokes, which
// discarded its oldest, and whoever may ask JetStream anything could have
// the server store its answer (a 64 KiB bucket value, by a direct get)
// on the audit's own subjects by naming them as the reply. Here one
// holder does all of that on a small volume; afterwards the grant and the
// revoke of another lease written before the flood are still in the
// audit, and a new grant and revoke succeed and are audited.
func TestFloodEvictsNoLeaseAuditAndLeavesRoomForGrants(t *testing.T) {
	dir := testutil.Tmpfs(t, "64m")
	b := startStoreBus(t, filepath.Join(dir, "bus"))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a flood takes its time on a busy machine
	defer cancel()
	url := b.srv.ClientURL()
	const victimRepo = "github.com/acme/victim"
	victim, err := b.c.Acquire(ctx, AcquireRequest{Repo: victimRepo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	opC := NewClient(connectAs(t, url, RoleOperator))
	if _, err := opC.Revoke(ctx, victim.LeaseID, "before the flood"); err != nil {
		t.Fatal(err)
	}
	wantLeaseEvents(t, b.nc, victimRepo, victim, lease.EventGrant, lease.EventRevoked)

	holderNC := connectAs(t, url, RoleHolder)
	hjs, err := JetStream(context.Background(), holderNC)
	if err != nil {
		t.Fatal(err)
	}
	value := make([]byte, 60<<10)
	for i := range value {
		value[i] = 'a' + byte(i%26)
	}

	// 1. Bucket values: the pool bucket until it refuses, the attempts
	// bucket well past what the volume holds.
	poolsRefused := false
	for i := 0; i < 2000 && !poolsRefused; i++ {
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		_, err := hjs.Publish(pctx, fmt.Sprintf("$KV.FENCELINE_SHARDS.flood%d", i), value)
		cancel()
		poolsRefused = err != nil
	}
	if !poolsRefused {
		t.Error("the pool bucket took 2000 values of 60 KiB (117 MiB) on a 64 MiB volume")
	}
	for i := range 1200 { // 70 MiB
		pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
		_, err := hjs.Publish(pctx, fmt.Sprintf("$KV.FENCELINE_ATTEMPTS.flood%d", i), value)
		cancel()
		if err != nil {
			t.Logf("attempt value %d: %v", i, err)
			break
		}
	}

	// 2. The reply trick: the server's answers to direct gets of a
	// 60 KiB value, onto the audit's subjects.
	key := "flood0"
	req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
	injector := connectAs(t, url, RoleHolder, nats.ErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}))
	targets := []string{serviceAuditSubject(RepoKey(victimRepo)), eventsSubjectFor(victimRepo, lease.BoundaryGit, IdentityOf(holderNC))}
	for i := range 600 { // 35 MiB
		if err := injector.PublishRequest(FleetJSAPI+".DIRECT.GET.KV_FENCELINE_ATTEMPTS", targets[i%len(targets)], req); err != nil {
			break // the bus may close the connection of a client that breaks its rules
		}
	}
	_ = injector.Flush()

	// 3. Boundary events of the largest size the service takes, for the
	// victim's repo, and a viewer's reads.
	aud, err := NewAuditor(holderNC)
	if err != nil {
		t.Fatal(err)
	}
	paths := make([]string, maxEventItems)
	for i := range paths {
		paths[i] = fmt.Sprintf("%d/%s", i, strings.Repeat("p", maxEventField))
	}
	for i := range boundaryBurst + 20 {
		ev := lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryNet, Repo: victimRepo, LeaseID: fmt.Sprintf("lease_flood%d", i%3),
			Message: strings.Repeat("m", maxEventMessage), Scope: claim(t, "x")}
		ev.Scope.Paths = paths
		rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
		_ = aud.Record(rctx, ev) // refused past the rates, or slow: either way it was sent
		cancel()
	}
	viewer := NewClient(connectAs(t, url, RoleViewer))
	for range 300 {
		if _, err := viewer.List(ctx, victimRepo, false); err != nil {
			t.Fatal(err)
		}
	}

	// Nothing of the lease audit was evicted, and leases go on.
	wantLeaseEvents(t, b.nc, victimRepo, victim, lease.EventGrant, lease.EventRevoked)
	after, err := b.c.Acquire(ctx, AcquireRequest{Repo: victimRepo, Scope: claim(t, "billing"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatalf("a grant after the flood: %v", err)
	}
	if _, err := opC.Revoke(ctx, after.LeaseID, "after the flood"); err != nil {
		t.Fatalf("a revoke after the flood: %v", err)
	}
	wantLeaseEvents(t, b.nc, victimRepo, after, lease.EventGrant, lease.EventRevoked)
	wantLeaseEvents(t, b.nc, victimRepo, victim, lease.EventGrant, lease.EventRevoked)

	// No message someone had the server send was stored on the audit.
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, stream := range []string{AuditStream, EventsStream} {
		st, err := js.Stream(ctx, stream)
		if err != nil {
			t.Fatal(err)
		}
		for seq := uint64(1); ; seq++ {
			m, err := storedMsg(ctx, b.nc, "$JS.API", stream, msgGetRequest{Seq: seq, NextBySubject: ">"})
			if err != nil {
				t.Fatal(err)
			}
			if m == nil {
				break
			}
			if !serviceWrote(m.Header) {
				t.Fatalf("%s holds message %d on %s that the service did not write", stream, m.Seq, m.Subject)
			}
			seq = m.Seq
		}
		_ = st
	}
}

// Events are kept per repo, boundary and writer: a viewer's reads once
// shared one stream with everyone's events and the lease audit, which
// dropped its oldest (3,000 lists made 3,000 events). Now a writer past
// eventsPerWriter drops its own oldest, and another's stays.
func TestOneWritersFloodDropsOnlyItsOwnEvents(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	opNC := connectAs(t, url, RoleOperator)
	op := IdentityOf(opNC)
	if _, err := NewClient(opNC).List(ctx, repo, false); err != nil {
		t.Fatal(err)
	}
	viewer := NewClient(connectAs(t, url, RoleViewer))
	for range eventsPerWriter + 100 {
		if _, err := viewer.List(ctx, repo, false); err != nil {
			t.Fatal(err)
		}
	}
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		mine, theirs := 0, 0
		for _, ev := range evs {
			switch {
			case ev.Type != lease.EventList:
			case ev.RequestedBy == b.svc.name(op):
				mine++
			default:
				theirs++
			}
		}
		if mine != 1 || theirs != eventsPerWriter {
			return fmt.Errorf("the operator's list: %d events (want 1); the viewer's %d lists: %d events (want the last %d)",
				mine, eventsPerWriter+100, theirs, eventsPerWriter)
		}
		return nil
	})
}

// On a 3-node cluster (R3 streams): every stream the service makes is
// bounded, answers aimed at the audit's subjects are refused, and a
// flood of a viewer's reads and a holder's boundary events leaves the
// grant and the revoke of another lease in the audit.
func TestClusterStoresBoundedAndLeaseAuditKept(t *testing.T) {
	t.Parallel() // waits on elections: runs beside the others (own servers)
	cl := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	svcNC := cl.connect(t)
	sctx, scancel := context.WithTimeout(ctx, 60*time.Second)
	svc, err := StartService(sctx, svcNC, ServiceConfig{Replicas: 3})
	scancel()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	js, err := JetStream(context.Background(), svcNC)
	if err != nil {
		t.Fatal(err)
	}
	for name, budget := range streamBudgets {
		st, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st.CachedInfo().Config
		if cfg.Replicas != 3 || cfg.MaxBytes < budget.min || cfg.MaxBytes > budget.max || cfg.MaxMsgSize != budget.maxMsgSize {
			t.Errorf("%s: replicas %d, MaxBytes %d (want %d to %d), MaxMsgSize %d", name, cfg.Replicas, cfg.MaxBytes, budget.min, budget.max, cfg.MaxMsgSize)
		}
	}
	url := strings.Join(cl.urls, ",")
	c := NewClient(svcNC)
	victim, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewClient(connectAs(t, url, RoleOperator)).Revoke(ctx, victim.LeaseID, "before the flood"); err != nil {
		t.Fatal(err)
	}

	_, key := storeAt(t, url, make([]byte, 60<<10))
	refused := make(chan struct{}, 1)
	injector := connectAs(t, url, RoleHolder, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if strings.Contains(err.Error(), "Permissions Violation for Publish with Reply") {
			select {
			case refused <- struct{}{}:
			default:
			}
		}
	}))
	req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
	for range 100 {
		if err := injector.PublishRequest(FleetJSAPI+".DIRECT.GET.KV_FENCELINE_ATTEMPTS", serviceAuditSubject(RepoKey(repo)), req); err != nil {
			break
		}
	}
	_ = injector.Flush()
	select {
	case <-refused:
	case <-ctx.Done():
		t.Fatal("the cluster did not refuse a request whose reply is the lease audit's subject")
	}
	aud, err := NewAuditor(connectAs(t, url, RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 100 {
		rctx, rcancel := context.WithTimeout(ctx, 2*time.Second)
		_ = aud.Record(rctx, lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryNet, Repo: repo, Message: fmt.Sprintf("flood %d %s", i, strings.Repeat("m", maxEventMessage))})
		rcancel()
	}
	viewer := NewClient(connectAs(t, url, RoleViewer))
	for range 200 {
		if _, err := viewer.List(ctx, repo, false); err != nil {
			t.Fatal(err)
		}
	}
	wantLeaseEvents(t, svcNC, repo, victim, lease.EventGrant, lease.EventRevoked)
	if _, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatalf("a grant after the flood: %v", err)
	}
}
