package leasebus

import (
	"encoding/json"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// TestRecordEncodeMatchesMarshal checks the hand-assembled log record
// against encoding/json byte for byte, for deltas and snapshots with
// awkward strings, so the cached encoding can never drift from the type.
func TestRecordEncodeMatchesMarshal(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 11, 29, 10, 0, 0, 123456789, time.UTC)
	c, err := scope.New([]string{"svc/<b>&\"q\"", "z"}, false, []string{"public.*"})
	if err != nil {
		t.Fatal(err)
	}
	mk := func(id string, st lease.Status, renew string) *entry {
		e := &entry{Lease: lease.Lease{LeaseID: id, Repo: "github.com/a/<b>", Scope: c, WorkspaceID: "wt-1", WorkspaceMode: lease.WorkspaceShared,
			Owner: lease.Owner{TaskID: "t\n1", AgentID: "a\"1", AttemptID: "att", HostID: "h"}, Status: st, Version: 3, Fence: 9,
			AcquiredAt: now, RenewedAt: now, ExpiresAt: now.Add(time.Minute), TTL: lease.Duration(time.Minute)},
			SecretHash: NewCredential().hash(), RequestID: "req_<&>", RenewID: renew}
		if st != lease.StatusActive {
			e.EndedAt, e.Reason = now, "released by owner"
		}
		return e
	}
	for _, rec := range []*logRecord{
		{Kind: recordDelta, Repo: "github.com/a/<b>", Fence: 9, Prev: 4, Leases: []*entry{mk("lease_a", lease.StatusActive, "")},
			Events: []lease.AuditEvent{{Time: now, Type: lease.EventGrant, Boundary: lease.BoundaryLease, Repo: "r", LeaseID: "lease_a", Message: "granted <x>"}}},
		{Kind: recordSnapshot, Repo: "r", Fence: 12, Prev: 7, Leases: []*entry{mk("lease_a", lease.StatusReleased, "req_r"), mk("lease_b", lease.StatusActive, "req_s")}},
		{Kind: recordDelta, Repo: "r", Fence: 1},
	} {
		got, err := rec.encode()
		if err != nil {
			t.Fatal(err)
		}
		want, err := json.Marshal(rec)
		if err != nil {
			t.Fatal(err)
		}
		if string(got) != string(want) {
			t.Errorf("encode differs from json.Marshal:\n got %s\nwant %s", got, want)
		}
	}
}
