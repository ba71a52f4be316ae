package lease

import (
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"
)

func TestReasonsAndPredicates(t *testing.T) {
	conflict := &ConflictError{Repo: "r", Conflicts: []Conflict{{LeaseID: "lease_1", Why: "overlap"}}}
	for _, c := range []struct {
		err    error
		reason string
		fenced bool
	}{
		{nil, ReasonLeaseLost, false},
		{fmt.Errorf("renew: %w", ErrLeaseLost), ReasonLeaseLost, true},
		{fmt.Errorf("renew: %w", ErrLeaseUnknown), ReasonLeaseUnknown, false},
		{ErrNotOwner, ReasonLeaseLost, true},
		{ErrNotFound, ReasonLeaseLost, true},
		{ErrUnavailable, ReasonLeaseLost, false},
		{conflict, ReasonLeaseLost, false},
	} {
		if got := LeaseReason(c.err); got != c.reason {
			t.Errorf("LeaseReason(%v) = %q, want %q", c.err, got, c.reason)
		}
		if got := IsFenced(c.err); got != c.fenced {
			t.Errorf("IsFenced(%v) = %v, want %v", c.err, got, c.fenced)
		}
	}
	if !errors.Is(fmt.Errorf("acquire: %w", conflict), ErrConflict) {
		t.Error("a wrapped *ConflictError is not ErrConflict")
	}
}

func TestLeaseJSON(t *testing.T) {
	l := Lease{LeaseID: "lease_0abc", Owner: Owner{TaskID: "t", AgentID: "a", AttemptID: "att", HostID: "h"}, Status: StatusActive, TTL: Duration(90 * time.Second)}
	b, err := json.Marshal(&l)
	if err != nil {
		t.Fatal(err)
	}
	var got Lease
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	if got.TTL != l.TTL || got.Owner != l.Owner || !got.Active() {
		t.Fatalf("round trip of %s gave %+v", b, got)
	}
	if o := ParseOwner(l.Owner.String()); o != l.Owner {
		t.Fatalf("ParseOwner(%q) = %+v", l.Owner.String(), o)
	}
	if !ValidLeaseID(l.LeaseID) || ValidLeaseID("lease_") || ValidLeaseID("lease_A") {
		t.Fatal("ValidLeaseID")
	}
}
