// Package leasebus grants scoped leases with fence tokens over NATS
// JetStream: the lease store, the lease service that batches requests, the
// client and heartbeat holder that agents' sidecars use, and the audit
// stream. The lease domain (Lease, AuditEvent, the reasons and sentinel
// errors) lives in package lease, free of NATS, and is re-exported here
// under the same names; the embedded single-machine server lives in
// leasebus/embedded, so this package links only the NATS client.
//
// # Storage
//
// Each repo has one lease log, the subject fenceline.log.<repoKey> of the
// stream FENCELINE_LOG (file storage, SyncAlways on the embedded server, R3
// on a cluster). A record is either a delta (the full records of the leases
// one batch changed, plus that batch's audit events) or a snapshot (the
// whole state). Every record is appended with
// Nats-Expected-Last-Subject-Sequence set to the sequence the writer's
// state reflects: a compare-and-swap on the whole repo. An append that
// loses the race fails, the writer reloads the records it missed, and runs
// its batch again — so no writer can grant over a lease it has not seen,
// whatever its view was, and any number of service instances may run.
// Instances announce themselves on fenceline.lease.v1.instances; once one
// meets another, each announces its acknowledged appends to the others
// (fenceline.lease.v1.appended.<repoKey>, the record itself), so queued
// acquires see releases made elsewhere, and a standby keeps a warm view of
// every repo (warm.go). Reads reload before answering, and a refusal is
// confirmed on a fresh view (a refusal is not a write: no compare-and-swap
// vouches for it).
//
// On a cluster the instances elect a primary (ServiceConfig.Primary,
// primary.go), which alone serves the lease requests; the others forward
// what they take to it. One writer then owns every repo's log: no
// compare-and-swap is lost to another instance, nothing is re-read because
// another wrote it, and the primary vouches for its views from memory
// within its term, where instances that all serve must confirm each view
// with a read of the log. It answers renewals from memory too, appending
// one in renewSlack of each lease's: a successor counts every TTL afresh,
// and sets each lease past its record so that versions never go back.
//
// Why a log rather than one KV key per lease: an overlap decision needs a
// consistent view of a repo's active leases, so grants of a repo serialize
// on one compare-and-swap whatever the layout. A per-lease key plus a
// sequencer key needs two writes per grant and cannot make them atomic; a
// single per-repo record rewrites every lease on every grant (a 1,000-lease
// repo would write ~600 KB per acquire). The log writes only what changed,
// one fsync per batch, and snapshots keep loading proportional to the state.
//
// Fence tokens are a per-repo counter carried in every record: each grant
// takes the next value, so tokens strictly increase for every grant of the
// repo (overlapping or not), are never reissued, and survive restarts with
// the log.
//
// # Routing
//
// A lease id names its repo: lease_<16 characters of time and
// randomness><RepoKey> (LeaseRepoKey). A get, renew, release or revoke by
// id goes to the actor of that repo on whichever instance receives it,
// which reads that repo's log alone if it has not loaded it; the log says
// whether the lease exists, so a made-up id costs one read and, naming a
// repo with no log, starts no actor. Ids of the old form (no repo key,
// granted before) are found through the lease index, a repo hint, or a
// scan of every log that concurrent requests share (at most one a second).
// An instance reads no log before it serves: each repo's is read when a
// request first needs it, and a background pass loads the rest a few at a
// time, so leases nobody asks about are still swept (their TTL counted
// from that load, as at any start). The metrics read counts the actors
// keep, never a log.
//
// # Protocol
//
//	holder/client              lease service (actor per repo)              JetStream
//	     |  fenceline.lease.v1.acquire  |                                        |
//	     |----------------------------->| queue; drain up to MaxBatch requests   |
//	     |  (other clients' requests)   | sweep, apply each to a txn, serve queue|
//	     |----------------------------->|  append(delta, expect=lastSeq) ------->|
//	     |                              |<------------------------- ack(seq) ----|
//	     |<----------------- replies ---| commit; publish changed.<repo>.<lease> |
//	     |                              | audit: the repo's chain, gathered 20 ms|
//
// # Audit
//
// Every grant, release, expiry, reclaim, revoke and refusal the service
// decides is an audit event inside the very log record that commits it: an
// acknowledged operation's event is as durable as the operation. From
// there, each repo's events go to the lease audit stream (AuditStream,
// which holds nothing else) as a chain of messages on
// $JS.EVENT.FENCELINE.audit.<repoKey>.lease. A message carries the events of the
// log records (From, LogSeq] and is appended with
// Nats-Expected-Last-Subject-Sequence set to the stream sequence of the
// chain's previous message (whose LogSeq is From): it lands only directly
// on top of the message it was built after. The chain's last LogSeq is the
// written-up-to mark. It moves only with such an append, so only forward,
// and only together with the events it vouches for.
//
//   - Exactly once. Each event is in one log record. Two messages covering
//     one record would have to land on the same predecessor, and the
//     compare-and-swap lets only one. A retry after a lost acknowledgement
//     (a stream leader paused after storing the message) fails if the first
//     try landed; a writer that fails the compare-and-swap reads the
//     chain's last message from the stream leader (never a lagging
//     follower) and sends only the records it does not cover.
//   - No dedupe window to outlast. Nothing relies on Nats-Msg-Id and the
//     stream's Duplicates window (2 minutes by default): a republish may
//     come any time later (a paused instance resuming after minutes, a
//     service restarted after an hour) and is still refused, because it no
//     longer sits on top of the chain's last message.
//   - Complete. Each instance hands every record it appends or loads, in
//     log order, to its audit writer, which sends what lies past the mark;
//     any instance may extend any repo's chain. Records of an instance
//     killed before it wrote their events are loaded, and so written, by the
//     next instance that appends to the repo (its compare-and-swap fails
//     until it has loaded them), by every instance when it starts, and by
//     every running instance within two audit catch-up periods (2 s each:
//     each sequence of the log stream is one record, so an instance that
//     counts the records it has seen up to the stream's last sequence
//     knows when one escaped it, and then reloads every repo).
//   - Nothing dropped too early. The log stream keeps logKeep records of
//     each repo and drops the oldest as a new one comes; an instance
//     appends nothing that would drop a record its chain does not cover
//     (actor.roomToAppend): a record never leaves the log before its
//     events are in the audit stream.
//   - Ordered. The chain follows the log, so a repo's lease events read in
//     stream order replay its history.
//
// The cost is what it was: one audit message per repo per 20 ms window, and
// a read of the chain only after a lost race or an unknown outcome. One
// limit: should the audit stream's retention (MaxAge, MaxBytes: only the
// service's own lease events count against it, see streamBudgets) drop a
// repo's newest chain message, the chain restarts from the records still
// in the lease log, whose events are written again.
//
// # Time
//
// Expiry never depends on synchronized wall clocks. The service gives each
// lease a deadline on its own monotonic clock when it commits (or first
// loads) the lease's current version: observation + TTL. The holder
// measures from the moment it sent the renewal, before the service saw it,
// and stops a margin earlier still (see Holder). The RFC 3339 times in the
// records are informational.
//
// # Ownership
//
// The acquirer chooses a random credential and sends only its SHA-256; a
// renewal proves it with an HMAC over the lease, version and renewal id
// (good for that renewal only), and a release presents the credential
// itself. The lease id alone is
// never enough; refusals are audited. Revoke is the operator's path and is
// audited with its reason and who asked.
//
// # Identities
//
// The bus admits only nkey users, each with a role (service, holder,
// operator, viewer) whose publish and subscribe permissions NATS enforces;
// one table (auth.go) makes the embedded server's admission table and the
// configuration for any other server (AuthConfig, docs/trust.md). The
// streams and the service's store connection are in one NATS account,
// every other identity in another with no JetStream (accounts.go). The
// embedded server makes one credentials file per role on first start
// (EnsureCreds) and reuses them.
//
// The rule for who asked: every lease request is published on
// fenceline.lease.v1.<op>.<identity>, where identity is the asker's public
// nkey (IdentityOf), and each user may publish only under its own. The
// service takes the identity from the subject, never from the body, and
// records it (AuditEvent.RequestedBy) for revoke, sweep and list. Replies go
// to _INBOX.<identity>.…, which only that identity may subscribe to. Only
// the service may subscribe to requests or publish change notices, the
// log, peer announcements and the lease boundary's audit events; a
// JetStream delivery onto those subjects (a push consumer's creator picks
// its deliver subject unchecked) is ignored by clients and the service.
//
// Every request carries a random nonce the service's answer echoes, and a
// client takes no other message on its reply subject (whose name ends in
// 128 random bits) as the answer; a holder also checks that a renewal's
// answer is the one the service makes for it (notOurs). Boundaries' audit
// events reach the audit stream only through the service (Auditor), which
// clips them, names their sender and bounds each identity's rate.
//
// Permissions do not cover reply subjects: whoever may make a request (a
// JetStream API call, a publish to a bucket it writes, a lease request)
// names any reply subject, and the server or the service publishes its
// answer there — onto a request, change or announcement subject, or into
// the log or audit stream, which store whatever is published on their
// subjects. So the service takes a request only with a reply to the
// asker's own inbox; a watch takes only a record of the lease its subject
// names; and the log, the lease and bus audit subjects and the instances'
// announcements count only messages stamped with the writer header and
// free of the server's Nats-Stream/Nats-Sequence headers (serviceWrote:
// a direct get's answer carries its stored message's headers behind
// those). Such answers are no longer stored at all: the streams are in an
// account of their own, and the fleet reaches their API only by import, so
// an answer it has aimed anywhere lands in its own account (accounts.go).
package leasebus
