package lease

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease/scope"
)

// Sentinel errors callers branch on. Errors of the lease bus wrap one of
// these (or are a *ConflictError) so errors.Is works across the bus.
var (
	// ErrConflict: the claim overlaps an active lease (see *ConflictError).
	ErrConflict = errors.New("conflicting lease")
	// ErrLeaseLost: the lease is no longer active, or its version moved on;
	// the holder must stop writing.
	ErrLeaseLost = errors.New("lease lost")
	// ErrLeaseUnknown means the holder cannot vouch for its lease right
	// now: the bus is unreachable, the connection to it was lost and the
	// lease is not yet re-checked, or the lease was announced ended and
	// the service has not yet confirmed it. Writes must stop (fail
	// closed); reads may go on.
	ErrLeaseUnknown = errors.New("lease state unknown")
	// ErrNotOwner: the credential does not match the lease.
	ErrNotOwner = errors.New("not the lease owner")
	// ErrNotFound: no lease with that id is known.
	ErrNotFound = errors.New("lease not found")
	// ErrInvalid: the request itself is malformed.
	ErrInvalid = errors.New("invalid request")
	// ErrUnavailable: the bus or the lease service did not answer; the
	// outcome of a write may be unknown.
	ErrUnavailable = errors.New("lease bus unavailable")
)

// Conflict names one active lease that blocks a request, or (RequestID
// set, LeaseID empty) an earlier queued request for an overlapping claim.
type Conflict struct {
	LeaseID     string      `json:"leaseId,omitempty"`
	RequestID   string      `json:"requestId,omitempty"`
	Owner       Owner       `json:"owner"`
	Scope       scope.Claim `json:"scope"`
	WorkspaceID string      `json:"workspaceId"`
	ExpiresAt   time.Time   `json:"expiresAt"`
	Fence       uint64      `json:"fence"`
	// Why says what overlaps ("services/billing ⟷ services/billing/api",
	// "workspace checkout is exclusive", "waiting behind req_…").
	Why string `json:"why"`
}

// ConflictError is returned when a claim cannot be granted now.
type ConflictError struct {
	Repo      string     `json:"repo"`
	Conflicts []Conflict `json:"conflicts"`
	// Waited is true when the request waited for its deadline.
	Waited bool `json:"waited,omitempty"`
	// More counts the conflicts past those listed: an answer lists a
	// bounded number, each with its claim clipped, so that no runner's
	// leases make another's answer too large for the bus.
	More int `json:"more,omitempty"`
}

func (e *ConflictError) Error() string {
	var b strings.Builder
	b.WriteString("conflict in ")
	b.WriteString(e.Repo)
	if e.Waited {
		b.WriteString(" (still held at the end of --wait)")
	}
	for i, c := range e.Conflicts {
		if i == 0 {
			b.WriteString(": ")
		} else {
			b.WriteString("; ")
		}
		if c.LeaseID == "" {
			fmt.Fprintf(&b, "request %s of %s is queued first: %s", c.RequestID, c.Owner, c.Why)
			continue
		}
		fmt.Fprintf(&b, "%s held by %s (fence %d, expires %s): %s",
			c.LeaseID, c.Owner, c.Fence, c.ExpiresAt.UTC().Format(time.RFC3339), c.Why)
	}
	if e.More > 0 {
		fmt.Fprintf(&b, "; and %d more", e.More)
	}
	return b.String()
}

// Is makes errors.Is(err, ErrConflict) true for a *ConflictError.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// IsFenced reports whether err means the holder must stop writing: the
// lease is lost or its ownership is not proven.
func IsFenced(err error) bool {
	return errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotOwner) || errors.Is(err, ErrNotFound)
}
