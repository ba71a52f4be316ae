package leasebus

import "github.com/fenceline/fenceline/lease"

// The lease domain lives in package lease, free of NATS, so that a fence
// can name a lease without linking the bus. Its names are re-exported
// here: each is the same type, constant or variable (errors.Is works
// across both names).

type (
	Lease         = lease.Lease
	Owner         = lease.Owner
	Status        = lease.Status
	WorkspaceMode = lease.WorkspaceMode
	Duration      = lease.Duration
	AuditEvent    = lease.AuditEvent
	Conflict      = lease.Conflict
	ConflictError = lease.ConflictError
)

const (
	StatusActive    = lease.StatusActive
	StatusReleased  = lease.StatusReleased
	StatusExpired   = lease.StatusExpired
	StatusReclaimed = lease.StatusReclaimed
	StatusRevoked   = lease.StatusRevoked

	WorkspaceExclusive = lease.WorkspaceExclusive
	WorkspaceShared    = lease.WorkspaceShared
	DefaultWorkspace   = lease.DefaultWorkspace

	EventGrant        = lease.EventGrant
	EventRelease      = lease.EventRelease
	EventRenewRefused = lease.EventRenewRefused
	EventExpired      = lease.EventExpired
	EventReclaimed    = lease.EventReclaimed
	EventRevoked      = lease.EventRevoked
	EventRefused      = lease.EventRefused
	EventDenied       = lease.EventDenied
	EventList         = lease.EventList
	EventSweep        = lease.EventSweep

	BoundaryLease    = lease.BoundaryLease
	BoundaryGit      = lease.BoundaryGit
	BoundaryPostgres = lease.BoundaryPostgres
	BoundaryFile     = lease.BoundaryFile
	BoundaryBus      = lease.BoundaryBus
	BoundaryNet      = lease.BoundaryNet

	ReasonLeaseLost    = lease.ReasonLeaseLost
	ReasonLeaseUnknown = lease.ReasonLeaseUnknown
	ReasonOutsideLease = lease.ReasonOutsideLease
	ReasonNotAllowed   = lease.ReasonNotAllowed
	ReasonPolicy       = lease.ReasonPolicy
)

var (
	ErrConflict     = lease.ErrConflict
	ErrLeaseLost    = lease.ErrLeaseLost
	ErrLeaseUnknown = lease.ErrLeaseUnknown
	ErrNotOwner     = lease.ErrNotOwner
	ErrNotFound     = lease.ErrNotFound
	ErrInvalid      = lease.ErrInvalid
	ErrUnavailable  = lease.ErrUnavailable
)

// ParseOwner reads an owner as Owner.String writes it; see lease.ParseOwner.
func ParseOwner(s string) Owner { return lease.ParseOwner(s) }

// ValidLeaseID reports whether s looks like a lease id; see lease.ValidLeaseID.
func ValidLeaseID(s string) bool { return lease.ValidLeaseID(s) }

// LeaseReason is the reason code of a write refused because the lease is
// not live; see lease.LeaseReason.
func LeaseReason(err error) string { return lease.LeaseReason(err) }

// IsFenced reports whether err means the holder must stop writing; see
// lease.IsFenced.
func IsFenced(err error) bool { return lease.IsFenced(err) }

var (
	_ lease.Source  = (*Holder)(nil)
	_ lease.Source  = Frozen{}
	_ lease.Auditor = (*Auditor)(nil)
)
