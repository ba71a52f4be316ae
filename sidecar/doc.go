// Package sidecar is the per-agent sidecar: it keeps the agent's lease alive
// and serves the write-boundary fences (git and Postgres, as configured)
// that the agent is routed through, tells the agent's environment how to
// reach them, and runs the admin server (probes, Prometheus metrics and the
// lease API) that a pod's agent container and its platform read.
// fenceline run and fenceline sidecar are built on it; Pod is the whole of
// what fenceline sidecar runs (admin server, lease, fences, shutdown).
//
// The sidecar knows only the lease domain (package lease) and links no
// NATS: it is handed the held lease (a lease.Holding; the pod's Holder
// also ends it, Close or Orphan), the audit trail (a lease.Auditor), a
// lease reader for the git fence (lease.View) and the run UI
// (RunUI). Its caller, fenceline's CLI, connects to the lease bus and
// passes in package leasebus's implementations.
//
// # Admin server
//
//	GET  /healthz               200 while the process serves
//	GET  /readyz                200 only while the lease is held and the
//	                            sidecar is not shutting down; 503 otherwise,
//	                            the body says why (unknown, lost, draining)
//	GET  /metrics               Prometheus exposition (see Metrics)
//	GET  /api/v1/lease          LeaseView: state, record, fence, fences
//	GET  /api/v1/lease/events   server-sent events: the LeaseView now, then
//	                            on every change, and again every KeepAlive
//	POST /api/v1/settled        the agent wrapper: every process of the
//	                            attempt is gone (SettledReport)
//	POST /api/v1/audit          the agent wrapper: one file denial, recorded
//	                            under this sidecar's lease
//
// Bound to a loopback address the server needs no token unless one is
// configured; bound anywhere else it refuses to start without one. With a
// token every path but /healthz and /readyz (kubelet probes carry no
// credentials) needs "Authorization: Bearer <token>".
//
// # Pods: the sidecar and the agent wrapper
//
// In a pod the agent runs in its own container under "fenceline agent",
// which applies the file-write guard (package fsguard) to the agent and
// takes the lease state from the sidecar's events stream. Writes are allowed
// only while the last event said held and arrived within the wrapper's
// grace: unknown, lost, a broken stream or one never connected deny every
// write (fail closed); reads go on. The wrapper's side of the admin API is
// here too: Client follows the events stream into a Gate (the guard's
// fsguard.Gate), forwards denials (Client.Auditor) and reports the attempt
// settled.
//
//	agent wrapper                       sidecar                       bus
//	     |                                 | acquire, hold -------------->|
//	     | GET /api/v1/lease/events        |                              |
//	     |-------------------------------->|                              |
//	     |<-- event: lease {state: held} --|                              |
//	     | start CMD under the guard       | renew (CAS) every ttl/3 ---->|
//	     |<-- event: lease (keep-alive) ---|                              |
//	     |                                 |<----- revoked (watch) -------|
//	     |<-- event: lease {state: lost} --| /readyz 503                  |
//	     | every write-class call: EACCES  |                              |
//	     | POST /api/v1/audit (denial) --->| record --------------------->|
//	     | CMD and its processes gone      |                              |
//	     | POST /api/v1/settled ---------->| (SIGTERM: drain fences,      |
//	     |                                 |  release only after settled) |
//	     |                                 | release -------------------->|
//
// On SIGTERM the sidecar stops being ready, drains its fences (no new
// connections; in-flight requests finish) and releases the lease only once
// the wrapper has reported the attempt settled. A wrapper that was connected
// but reports nothing within the settle timeout leaves the lease to expire
// by its ttl (the sweeper reclaims it): it is never released under a
// process that may still write. With no wrapper ever connected, nothing
// but the drained fences wrote under the lease, and it is released at once.
package sidecar
