// Package faults is fenceline's fault harness: it runs the real fenceline
// binary (built by the test with go build) as separate processes — bus
// servers and lease services (`fenceline bus serve`), guarded agents
// (`fenceline run`, `fenceline sidecar` with `fenceline agent`), the
// operator's CLI (`fenceline lease revoke`, `fenceline lease audit`) —
// against a real Postgres and a real git server, injects faults into them,
// revokes the agents' leases right after each fault, records what happened,
// and checks the lease invariants on the record. It has two halves.
//
// # The single-bus half (TestSingleBusKillRestartRevoke)
//
// One `fenceline bus serve` process, its credentials made on first start in
// the test's own XDG_STATE_HOME, where the CLI finds them. Three lineages
// of guarded agents write in a loop, each on its own claim:
//
//   - run: `fenceline run` whose child appends "<lease> <nanos>" lines to a
//     file through the file guard and inserts rows through the run's
//     Postgres fence (pgproxy), about every 10 ms each;
//   - pod: the same writes in pod mode, `fenceline agent` beside
//     `fenceline sidecar`;
//   - git: `fenceline run` in an exclusive workspace pushing a commit about
//     every 20 ms through the git fence to a `git http-backend` server.
//
// Each round the bus is killed with -9 and restarted on the same port and
// store; every lineage's lease is revoked the moment the bus answers (every
// second round once the agents write again, so the revoke reaches the
// holders as a change notice), and each claim is granted to a new agent at
// once, while the revoked agents go on trying to write for 3 s. At the end
// the current agents stop and release their leases, and the audit is read
// with `fenceline lease audit --json`.
//
// # The cluster half (TestClusterAuditThroughFaults)
//
// Three node processes (`bus serve` with cluster flags: a JetStream server
// and a lease service each, replicas 3) and a lease-service-only process,
// all sharing one set of bus credentials (FENCELINE_CREDS). Load: 4
// clients acquire, renew, release and abandon (TTL 2 s, left to the
// sweeper) leases on 15 overlapping claims, and an operator revokes live
// ones. Two lineages of guarded agents on the cluster (`fenceline run
// --nats` with every node's URL): run (file and Postgres writes, as above)
// and git (pushes, as above). Each round:
//
//  1. SIGSTOP of the lease log stream's leader for 3 s, SIGCONT;
//  2. SIGSTOP of the audit stream's leader for 3 s, SIGCONT;
//  3. SIGKILL of the service process and of the log stream's leader;
//  4. restart of both;
//  5. unless FENCELINE_FAULTS_PAUSE_HOLDER=0: SIGSTOP of the node the run
//     agent's holder is connected to (found from its sockets in /proc),
//     the revokes sent during the pause,
//     SIGCONT 3 s after the SIGSTOP at the earliest, then the claims
//     granted again;
//  6. unless FENCELINE_FAULTS_PAUSE_HOLDER=0: the node the run agent's
//     holder is connected to cut off from the other two (every route
//     through a bridge that drops its bytes: no connection closes, and its
//     server goes on answering the holder's pings), the revokes sent on
//     the other side during the partition, healed 3 s after the cut, then
//     the claims granted again.
//
// Right after each of 1-4 (every second round once the agents write again)
// and during 5 and 6, every agent's lease is revoked and its claim granted to a
// new agent at once (after 5: once the node is back), the revoked agent
// left trying for 3 s. A revoke by the load's operator that the service
// answers "lease not found" is judged against the audit: an error if the
// audit shows the lease granted before and not ended by then. At the end the
// audit is read from the audit stream's leader (a follower just restarted
// may answer a direct get with a prefix of the stream).
//
// In both halves a revoke is `fenceline lease revoke`, retried until it
// answers; a try that gives no answer within 8 s is killed and tried again
// (an incident, see below), and the lease's deadline for writes is when a
// try returned, as the operator saw it. An agent whose run exits before
// its lease is granted (it could not reach the bus during a fault), or has
// no lease after 30 s (then it is killed), is started again, also an
// incident. Killing an agent kills its guarded
// command's process group too (it is not the run's own).
//
// # What is recorded
//
// A History holds every acknowledged grant (lease, fence, repo, claim, the
// service's acquiredAt), every acknowledged end (when a revoke returned, a
// release the service answered, the service's endedAt; for a lease ended
// by a sweeper, the time on the audit event that ends it), the leases
// abandoned to the sweeper, the acquires refused for a conflict, the
// faults injected, incidents (what went wrong without breaking an
// invariant: a revoke try that hung, an agent that could not start), the
// audit stream as read after the run, and every write
// that reached a boundary and landed there (the boundary, the lease and
// fence it was made under, and when it landed). Writes are read back from
// the storage itself after the run: lines a guarded child appended to a
// file (stamped by the child just before the append), rows a child
// inserted through the Postgres fence (each row carries the lease id, the
// token the fence set, and the server's clock_timestamp), and pushes that
// updated a ref on the git server (its post-receive hook logs the pushed
// commit's subject, which names the lease, and the server's time when its
// pre-receive hook began to take the push: after the git fence's last
// check, so a forwarded push is in flight, as a COMMIT sent is).
//
// # What is checked
//
// Verify runs Checks over a History and returns a Report with the counts
// (grants, revokes, faults by kind, incidents by kind, writes per boundary,
// the latest write after its lease's revoke per boundary, audit events by
// type) and every Violation. Each revoke right after a fault is logged
// with how long after the fault it returned and how long after it the
// claim was granted again. Both halves run StandardChecks and AuditCheck:
//
//   - no-overlap: no two grants with overlapping claims in one repo were
//     valid at once (by the service's own acquiredAt/endedAt);
//   - no-late-write: no write landed under a lease more than the bound (1 s)
//     after the lease was revoked (as seen by the revoker) or after an
//     overlapping lease was granted, and none under a lease never granted;
//   - fences: fence tokens are unique, rise with every grant of a repo, and
//     a write that carries a fence carries its lease's;
//   - audit: every acknowledged grant is in the audit exactly once with
//     the fence its holder got, every acknowledged release and revoke
//     exactly once as that end, every abandoned lease ends there exactly
//     once (reclaimed, expired or revoked), every refused acquire is there,
//     and no lease is granted or ended twice in the audit.
//
// The cluster half also replays each repo's audit in its order (fences
// rising, never two overlapping leases active) and checks that the
// service's audit messages of each repo form one chain over the lease log.
// TestChecksCatchViolations shows each check catching what it is for.
//
// # Running
//
// The short form is the package's tests (go test -tags integration
// ./test/faults, the integration tier): 2 bus restarts and 1 cluster
// round, about 75 s on 2 cores. The long forms run
// more rounds and print the counts: scripts/faults.sh
// (FENCELINE_FAULTS_ROUNDS, default 20) and scripts/faults-cluster.sh
// (FENCELINE_FAULTS_CLUSTER_ROUNDS, default 5). Every process the harness
// starts listens on 127.0.0.1 only and is killed when the test ends.
package faults
