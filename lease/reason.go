package lease

import "errors"

// Audit reason codes every write boundary shares (AuditEvent.Reason); each
// fence adds codes of its own.
const (
	ReasonLeaseLost    = "lease-lost"    // lost, revoked, expired or reclaimed, or never held
	ReasonLeaseUnknown = "lease-unknown" // the bus cannot say whether it is held: fail closed
	ReasonOutsideLease = "outside-lease" // the write is outside the lease's scope
	ReasonNotAllowed   = "not-allowed"   // the guard's policy forbids the call whatever the lease (a host, port, socket or ioctl)
	// ReasonPolicy: the security team's Cedar policy forbids it (the
	// event's message names the rule's @id and the policy's version).
	ReasonPolicy = "policy"
)

// ErrPolicyForbids: a gate closed because the security team's policy now
// forbids what it guards (a path the file guard was started granting);
// its refusals carry ReasonPolicy.
var ErrPolicyForbids = errors.New("forbidden by the policy in force")

// LeaseReason is the reason code of a write refused because the lease is
// not live, err saying why: lease-unknown when the bus could not be asked
// (ErrLeaseUnknown), policy when the policy closed the gate
// (ErrPolicyForbids), lease-lost otherwise, nil included.
func LeaseReason(err error) string {
	switch {
	case errors.Is(err, ErrLeaseUnknown):
		return ReasonLeaseUnknown
	case errors.Is(err, ErrPolicyForbids):
		return ReasonPolicy
	}
	return ReasonLeaseLost
}
