// Package faults is fenceline's fault harness: it runs the real fenceline
// binary (built by the test with go build) as separate processes — the bus
// (`fenceline bus serve`), guarded agents (`fenceline run`), the operator's
// CLI (`fenceline lease revoke`) — injects faults into them (kill -9 and
// restart of the bus, more in cluster_*.go), records what happened, and
// checks the lease invariants on the record.
//
// # What is recorded
//
// A History holds every acknowledged grant (lease, fence, repo, claim, the
// service's acquiredAt, and when the revoker's call returned) and every
// write that reached a boundary and landed there (the boundary, the lease
// and fence it was made under, and when it landed). Writes are read back
// from the storage itself after the run: lines a guarded child appended to a
// file (stamped by the child just before the append), rows a child inserted
// through the Postgres fence (each row carries the lease id, the token the
// fence set, and the server's clock_timestamp), and pushes that updated a
// ref on the git server (its post-receive hook logs the pushed commit's
// subject, which names the lease, and the server's time).
//
// # What is checked
//
// Verify runs Checks over a History and returns a Report with the counts
// and every Violation. StandardChecks are:
//
//   - no-overlap: no two grants with overlapping claims in one repo were
//     valid at once (by the service's own acquiredAt/endedAt);
//   - no-late-write: no write landed under a lease more than the bound (1 s)
//     after the lease was revoked (as seen by the revoker) or after an
//     overlapping lease was granted;
//   - fences: fence tokens are unique, rise with every grant of a repo, and
//     a write that carries a fence carries its lease's.
//
// A Check is just a name and a function of the History, so other suites add
// their own (audit completeness reads the audit stream and compares it with
// the grants).
//
// # Running
//
// The short form is a Go test (go test -run TestSingleBus ./test/faults),
// a few faults in well under a minute; scripts/faults.sh runs the long form
// (FENCELINE_FAULTS_ROUNDS rounds) and prints the counts. Every process the
// harness starts listens on 127.0.0.1 only, uses the test's own
// XDG_STATE_HOME (where the bus keeps its credentials and the CLI finds
// them) and FENCELINE_NATS, and is killed when the test ends.
package faults
