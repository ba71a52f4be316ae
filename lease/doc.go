// Package lease is the lease domain every fence shares, with no dependency
// on NATS: the lease record (Lease, Owner, Status, WorkspaceMode,
// Duration), ids (NewID, NewAttemptID), audit events (AuditEvent, the
// Event* types and Boundary* names), the reason codes of refusals, the
// sentinel errors and ConflictError, what a holder knows of its lease
// (HolderState: Held, Unknown, Lost), and the interfaces a fence needs of a
// lease (Gate, Source), a process acting under a held lease (Holding) and
// an audit trail (Auditor).
//
// The lease bus (package leasebus) implements them over NATS JetStream:
// its Holder is a Holding (so a Source), its Auditor an Auditor. A fence,
// the sidecar that runs the fences, or an attempt that only names leases
// and writes audit events imports this package alone and links neither
// the NATS client nor the server; its caller connects to the bus.
//
//	fence (fsguard, gitproxy, pgproxy, egress)
//	   │ Gate.Fence() before each write      Auditor.Record(AuditEvent)
//	   ▼                                     ▼
//	leasebus.Holder (renews over NATS)      leasebus.Auditor (via the service)
package lease
