// Package runui serves fenceline's run UI and the JSON admin API behind
// it: the repositories on the bus, their leases (scope, owner, attempt,
// fence, status and a live expiry countdown), shards (occupants,
// commit-capacity holder) and attempts, and a live audit feed — grants,
// releases, reclaims and every write refused at a boundary.
//
// The page is embedded in the binary (no CDN) and is fed by server-sent
// events built from the bus itself, read through a Source
// (leasebus.UIReader: the lease service's watch subject for lease
// records, and an ordered consumer on each of the audit's streams; this
// package links no NATS). Nothing is polled, and the UI never writes to
// the bus.
//
//	browser                    runui.Server                      bus
//	   | GET /api/v1/events?repo=R |                               |
//	   |-------------------------->| List(R), shards(R)            |
//	   |                           |------------------------------>|
//	   |<-- event: snapshot -------|                               |
//	   |                           | Watch(R): lease records       |
//	   |                           | audit consumer (last N, then  |
//	   |                           |   every new event)            |
//	   |<-- event: lease ----------|<------------------------------|
//	   |<-- event: audit ----------|<------------------------------|
//
// The watch starts before the snapshot is read, so nothing committed in
// between is lost; a lease record no newer than the client already has
// (from the snapshot or the stream) is not sent. A client that falls behind is sent a fresh snapshot instead of
// the records it missed. Off loopback the server requires a token (a bearer
// header, or ?token= once, which sets a cookie); on loopback none.
//
// API (all GET, JSON):
//
//	/api/v1/repos                repositories with leases (active or recently ended) or shards
//	/api/v1/leases?repo=R&all=1  leases of R (every repo without it); all: recently ended too
//	/api/v1/audit?repo=R&limit=N the last N audit events (default 100)
//	/api/v1/shards?repo=R        shards and attempts, when a shard source is configured
//	/api/v1/events?repo=R        the live stream the page uses (text/event-stream)
package runui
