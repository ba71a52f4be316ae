// Package embedded runs the lease bus's NATS server in-process: the
// server `fenceline bus serve` and the tests start (StartServer), with
// the nkey identities and role permissions of package leasebus, a store
// probe and keeper that restart JetStream after a store fault (StoreProbe,
// KeepStore), and a tap on the server's log that audits what the server
// itself refuses (AuditRefusals).
//
// It is the only package of the lease bus that links nats-server: package
// leasebus (client, holder, service) needs only nats.go, and a fence
// needs only package lease.
//
//	bus serve ─▶ StartServer(leasebus.ServerConfig) ─▶ *server.Server
//	         ─▶ leasebus.StartService(nc, {StoreProbe: StoreProbe(srv, dir)})
//	         ─▶ AuditRefusals(svc, srv) ; go KeepStore(ctx, srv, dir)
package embedded
