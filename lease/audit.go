package lease

import (
	"context"
	"time"

	"github.com/fenceline/fenceline/lease/scope"
)

// Audit event types.
const (
	EventGrant        = "grant"
	EventRelease      = "release"
	EventRenewRefused = "renew-refused"
	EventExpired      = "expired"
	EventReclaimed    = "reclaimed"
	EventRevoked      = "revoked"
	EventRefused      = "refused" // an operation refused at the lease bus (forged credential, conflict)
	EventDenied       = "denied"  // a write denied at a boundary (git, postgres, file)
	EventList         = "list"    // leases read (lease list, the run UI), naming who asked
	EventSweep        = "sweep"   // a sweep asked for, naming who asked and what it reclaimed
	// EventPolicySet is a policy change: the operator, the version, the
	// digest (boundary policy).
	EventPolicySet = "policy-set"
	// EventShadowRefused is what a shadow policy would have refused (at
	// the boundary that judged it); nothing was refused.
	EventShadowRefused = "shadow-refused"
)

// Boundaries that produce audit events.
const (
	BoundaryLease    = "lease"
	BoundaryGit      = "git"
	BoundaryPostgres = "postgres"
	BoundaryFile     = "file"
	// BoundaryBus marks reads and sweeps asked of the lease service (on
	// the events stream, boundary bus; RepoKey("") for every repo).
	BoundaryBus = "bus"
	// BoundaryNet marks a guarded agent's network reach refused: a connect,
	// socket or proxy request outside what its policy allows.
	BoundaryNet = "net"
	// BoundaryPolicy marks a policy change (who set which version).
	BoundaryPolicy = "policy"
)

// AuditEvent is one entry of the audit stream. Every grant, release,
// expiry, reclaim, revoke and every refused operation or denied write
// produces one, naming the lease, its owner, scope and fence.
type AuditEvent struct {
	Time     time.Time   `json:"time"`
	Type     string      `json:"type"`
	Boundary string      `json:"boundary"`
	Repo     string      `json:"repo"`
	LeaseID  string      `json:"leaseId,omitempty"`
	Owner    Owner       `json:"owner,omitzero"`
	Scope    scope.Claim `json:"scope"`
	Fence    uint64      `json:"fence,omitempty"`
	Reason   string      `json:"reason,omitempty"`
	// RequestedBy is the bus identity that asked for a revoke, a sweep or
	// a read, or that sent a boundary's event (the service's name for it,
	// else its public nkey): the token of the request subject, which the
	// bus lets only that identity use.
	RequestedBy string `json:"requestedBy,omitempty"`
	Message     string `json:"message"`
}

// Gate says whether the lease allows writes right now: a nil error means
// writes are allowed, with the lease's current fence token;
// ErrLeaseLost or ErrLeaseUnknown means every write must be refused.
// *leasebus.Holder is one; a fence asks it inside each write, never once
// up front.
type Gate interface {
	Fence() (uint64, error)
}

// Source is a Gate that also tells the lease record it guards (for the
// names in refusals and audit events). *leasebus.Holder and
// leasebus.Frozen are Sources.
type Source interface {
	Gate
	Lease() Lease
}

// View reads the lease bus when a decision needs it: a lease by id, the
// leases of a repo (all: ended ones too). *leasebus.Client is one.
type View interface {
	Get(ctx context.Context, leaseID string) (*Lease, error)
	List(ctx context.Context, repo string, all bool) ([]*Lease, error)
}

// Auditor durably records audit events; *leasebus.Auditor sends them to
// the lease service, which writes them to the audit stream.
type Auditor interface {
	Record(ctx context.Context, ev AuditEvent) error
}
