// Package shard keeps a repository's bounded pool of git worktree shards
// and the attempts that run in them, as records on the lease bus.
//
// # Model
//
// A pool belongs to one repo (the lease bus's repo identity) and one local
// checkout. It has Size shards, "shard-1".."shard-N"; shard-N is the git
// worktree Dir/shard-N on the branch fenceline/shard-N, created lazily with
// the real "git worktree add" by the first attempt placed there. Each shard
// is a lease-bus workspace: the lease service places an attempt's lease in
// one of the pool's shards (AcquireRequest.Workspaces) atomically with its
// overlap check, so invariant 1 holds per shard — one exclusive lease, or
// shared (path) leases with pairwise disjoint claims, at most MaxSharers.
//
// A shard's State is what is known of its files:
//
//	absent  no worktree yet (created on first use)
//	clean   at Base, nothing else in it, nobody in it
//	dirty   anything else: an attempt works there, or worked there and
//	        left its paths for the coordinator, or crashed
//
// Cleaning (Worktree.Clean) happens only under an exclusive lease on the
// shard, when no live attempt can be in it: commits of the shard's branch
// past Base and uncommitted files are first kept as refs under
// refs/fenceline/attempts/, then "git checkout -f -B", "git reset --hard
// <base>" and "git clean -ffdx" return it to Base. Creating and cleaning a
// shard hold a per-shard flock (Dir/.shard-N.lock): on one host, two sharers
// placed on an absent shard at once create it once. What touches the
// administrative files of every worktree in the common git dir (git worktree
// add and prune, checkout -B) also holds the pool's flock (Dir/.pool.lock),
// taken after a shard's: concurrent worktree adds fail reading each other's
// half-written files.
//
// An Attempt is one run of one command: written "running" (with its lease
// and shard) before the command starts, settled (succeeded, failed,
// cancelled; exit code, settledAt) after every process of it is gone and
// before its lease is released (DESIGN invariant 6). Recover turns a
// "running" attempt whose leases are no longer active (its runner crashed,
// the lease expired and was reclaimed) into "unknown" and marks its shard
// dirty, with an audit event; runners and "fenceline shard list" call it,
// there is no daemon.
//
// # Storage
//
// Two JetStream KV buckets, every change a compare-and-swap on the key's
// last revision (conflicts detected with jetstream.ErrKeyRevisionMismatch,
// which R1 and R3 buckets both report), History 1, replicas configurable:
//
//	FENCELINE_SHARDS    key <repoKey>               the Pool record
//	FENCELINE_ATTEMPTS  key <repoKey>.<attemptId>   one Attempt record
//
// Attempt keys carry the repo key so one repo's attempts are listed with
// a subject filter (<repoKey>.*) instead of reading every attempt.
//
// # Sequence
//
//	runner                    shard records (KV)        lease service      git
//	  | Pool(repo) ----------------->|                        |              |
//	  | Recover: running attempts    |  Get(lease) ---------->|              |
//	  |   with ended leases -> unknown, shard dirty, audit    |              |
//	  | Acquire(Workspaces=shard-1..N, MaxSharers) ---------->|              |
//	  |<------------------------------------ lease in shard-k |              |
//	  | flock shard-k; absent: worktree add ---------------------------------->|
//	  |   exclusive and not ready: keep refs, reset, clean ------------------->|
//	  | attempt running; shard-k dirty ->|                    |              |
//	  | agent runs under the guard in shard-k ... every process gone           |
//	  | attempt settled ---------------->|                    |              |
//	  | exclusive: flock, keep refs, reset, clean -------------------------->|
//	  |   shard-k clean ---------------->|   (audit "shard")  |              |
//	  | Release ------------------------------------------->|              |
package shard
