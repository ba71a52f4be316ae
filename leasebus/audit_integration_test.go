//go:build integration

package leasebus

import (
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// An instance appends a record and is killed before it writes the
// record's audit events or announces the record to the other instances;
// nobody touches the repo again, while the running instance writes to
// other repos. Its audit catch-up finds the record and writes its events
// within a few seconds.
func TestAuditCatchUpFindsUnannouncedRecord(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	ctx := ctxT(t)
	const auditRepo = "github.com/acme/audit-catch-up"
	key := RepoKey(auditRepo)
	x := acquireVia(t, ctx, b.svc, auditRepo, claim(t, "x"), owner(1))
	wantOnce(t, ctx, b.nc, auditRepo, x)

	// The other instance's append: a grant on top of the log as it is.
	a := b.svc.actor(key, auditRepo)
	a.busy.Lock()
	seq, fence := a.state.seq, a.state.fence
	a.busy.Unlock()
	now := time.Now().UTC().Round(time.Millisecond)
	e := &entry{Lease: lease.Lease{LeaseID: newID("lease_", now), Repo: auditRepo, Scope: claim(t, "y"),
		WorkspaceID: lease.DefaultWorkspace, WorkspaceMode: lease.WorkspaceShared, Owner: owner(2), Status: lease.StatusActive,
		Version: 1, Fence: fence + 1, AcquiredAt: now, RenewedAt: now, ExpiresAt: now.Add(time.Minute), TTL: lease.Duration(time.Minute)},
		SecretHash: NewCredential().hash(), RequestID: NewRequestID()}
	rec := &logRecord{Kind: recordDelta, Repo: auditRepo, Fence: e.Fence, Leases: []*entry{e},
		Events: []lease.AuditEvent{{Time: now, Type: lease.EventGrant, Boundary: lease.BoundaryLease, Repo: auditRepo, LeaseID: e.LeaseID,
			Owner: e.Owner, Scope: e.Scope, Fence: e.Fence, Message: "granted by an instance killed since"}}}
	if _, _, err := b.svc.store.append(ctx, key, seq, rec); err != nil {
		t.Fatal(err)
	}
	appended := time.Now()
	// This instance goes on writing another repo's log: it sees records
	// newer than the one that escaped it.
	other := acquireVia(t, ctx, b.svc, "github.com/acme/audit-other", claim(t, "o"), owner(3))
	wantOnce(t, ctx, b.nc, auditRepo, x, &e.Lease)
	wantOnce(t, ctx, b.nc, "github.com/acme/audit-other", other)
	t.Logf("the killed instance's grant was written %s after its append", time.Since(appended).Round(time.Millisecond))
	if took := time.Since(appended); took > 3*auditCatchUpEvery+time.Second {
		t.Errorf("the catch-up took %s, want at most %s", took, 3*auditCatchUpEvery+time.Second)
	}
	checkChain(t, ctx, b.nc, auditRepo)
}
