// Package lease is the lease domain every fence shares, with no dependency
// on NATS: the lease record (Lease, Owner, Status, WorkspaceMode,
// Duration), audit events (AuditEvent, the Event* types and Boundary*
// names), the reason codes of refusals, the sentinel errors and
// ConflictError, and the interfaces a fence needs of a lease (Gate,
// Source) and of an audit trail (Auditor).
//
// The lease bus (package leasebus) implements them over NATS JetStream:
// its Holder is a Source, its Auditor an Auditor, and it re-exports every
// name here under its old one, so leasebus.Lease and lease.Lease are the
// same type and leasebus.ErrLeaseLost is lease.ErrLeaseLost. A fence that
// only names leases and writes audit events imports this package alone and
// links neither the NATS client nor the server.
//
//	fence (fsguard, gitproxy, pgproxy, egress)
//	   │ Gate.Fence() before each write      Auditor.Record(AuditEvent)
//	   ▼                                     ▼
//	leasebus.Holder (renews over NATS)      leasebus.Auditor (via the service)
package lease
