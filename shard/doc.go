// Package shard keeps a repository's bounded pool of shards (git
// repositories of their own beside the checkout) and the attempts that run
// in them, as records on the lease bus.
//
// # Model
//
// A pool belongs to one repo (the lease bus's repo identity) and one local
// checkout. It has Size shards, "shard-1".."shard-N"; shard-N is a git
// repository of its own at Dir/shard-N on the branch fenceline/shard-N,
// created lazily by the first attempt placed there: git init, the
// checkout's object directory as its only alternate
// (objects/info/alternates), a config fenceline writes, and a checkout of
// the base. Each shard is a lease-bus workspace: the lease service places
// an attempt's lease in one of the pool's shards
// (AcquireRequest.Workspaces) atomically with its overlap check, so
// invariant 1 holds per shard — one exclusive lease, or shared (path)
// leases with pairwise disjoint claims, at most MaxSharers.
//
// A shard's State is what is known of its files:
//
//	absent  no repository yet (created on first use)
//	clean   at Base, nothing else in it, nobody in it
//	dirty   anything else: an attempt works there, or worked there and
//	        left its paths for the coordinator, or crashed
//
// Cleaning (Worktree.Clean) happens only under an exclusive lease on the
// shard, when no live attempt can be in it. It first makes the shard's
// git dir fenceline's again (see Containment), then keeps commits of the
// shard's branch or detached HEAD past Base and uncommitted files as refs
// under refs/fenceline/attempts/ and fetches them into the checkout, then
// drops the shard's own refs, reflogs, objects and index, reads Base into
// a new index, hashes every file against it (git update-index --refresh:
// an index an attempt forged cannot hide a changed file), and "git reset
// --hard <base>" and "git clean -ffdx" return it to Base. A cleaning that
// fails in the shard (an attempt broke its own objects, or left files git
// cannot remove) moves the shard aside, its files kept on disk and named
// and every repository in it disarmed (its .git moved aside, HEAD
// renamed: git in it runs nothing the attempt planted), and makes it
// anew: one attempt cannot take a shard out of the pool.
// Creating and
// cleaning a shard hold a per-shard flock (Dir/.shard-N.lock): on one
// host, two sharers placed on an absent shard at once create it once. The
// fetch into the checkout also holds the pool's flock (Dir/.pool.lock),
// taken after a shard's.
//
// # Containment
//
// What an attempt can affect after it ends, and why:
//
//   - Its shard's files and git dir, until the shard is cleaned. The file
//     guard lets an exclusive attempt write its shard and the shard's own
//     git dir, nothing of the checkout's: the checkout's refs, config,
//     hooks and objects, and other shards, are not in its lease. Objects
//     it reads from the checkout come through the alternate, read-only. A
//     symlink, a .git file or a commondir file pointing at the checkout's
//     git dir changes nothing: fenceline names GIT_DIR, GIT_COMMON_DIR and
//     GIT_WORK_TREE for every git command it runs in a shard, a .git that
//     is not a directory makes cleaning move the shard aside, and cleaning
//     removes every entry of the git dir that is neither a directory nor a
//     regular file.
//   - Nothing it planted runs. Fenceline's own git goes through
//     internal/gitsafe (no hooks, no program a repository's configuration
//     names). Cleaning empties hooks/, rewrites config (fenceline's, with
//     the checkout's origin URL and a few keys that name no program) and
//     objects/info/alternates, and removes config.worktree, commondir,
//     info/attributes, info/grafts, refs/replace, everything in
//     objects/info but alternates (a forged commit-graph gives a commit
//     another tree and parents), and a repository nested
//     at .git/.git (which git upload-pack, run by the fetch into the
//     checkout, would serve instead of the shard's), naming what it undid
//     in the audit event and on run's stderr (Worktree.Undone): the next
//     attempt's git, guarded or not, finds none of it.
//   - Its work, as data: the refs cleaning keeps, fetched into the
//     checkout (a pack, each object hashed by git index-pack: an object
//     the attempt forged under another's id cannot enter the checkout).
//     Other refs it made in its shard (branches, tags, stash) are dropped.
//   - Its pushes, through the git fence (gitproxy), which judges them from
//     objects whose ids it verified and, on the server, by the pre-receive
//     hook against the claim the fence was signed with.
//
// An attempt whose cleaning never ran (its lease lost before it settled,
// its runner dead) leaves its shard dirty with whatever it planted. The
// next exclusive attempt cleans it; a commit capacity, and a path-leased
// attempt placed when nobody is in the shard, get its git dir restored
// first (a planted commondir naming the checkout's git dir would otherwise
// make git, and so fenceline's guard, take that for the shard's).
//
// The commit capacities (ModeCommitSerialized, ModeCommitExclusive) write
// the shard's git dir and are not followed by a cleaning. When one settles,
// the shard's git dir is restored as above, its object store checked
// (fenceline run snapshots it: SnapshotObjects) and the shard's branch is
// fetched into the checkout under its own name, refs/heads/fenceline/
// shard-N (Placement.CleanAfter): the one ref of the checkout fenceline
// writes, judged by name. While a serialized commit runs, what it plants
// can run in the git of the shard's path-leased attempts beside it, under
// those attempts' own guards; the file guard does not refuse git-dir
// writes by kind.
//
// Without a pool, an exclusive run works in the checkout itself with its
// git dir writable; fenceline run snapshots the checkout's executable git
// configuration first (SnapshotCheckout: config files, hooks,
// info/attributes, also of submodules and worktrees, and every .git
// entry of the worktree) and restores it at settle, saying what it undid.
// A git dir the attempt moved is found through a descriptor held since
// the snapshot and renamed back; what it put in its place (a symlink, a
// .git file) is moved aside, never written through. A nested repository
// the attempt made (a .git it added anywhere in the worktree, whose
// config the user's git status would run when it is a gitlink) has its
// .git moved aside; one the user had gets its config and hooks back.
// refs/replace/ and info/grafts are put back too: they make the user's
// git show another commit, or other parents, in place of the one the
// branch holds, so a review would read something else than what a push
// sends. The repository's other worktrees (the main one, when the run is
// in a linked worktree, and every linked one), whose files live in the
// common git dir the run may write, get their HEAD, index and
// checked-out branch back; the attempt's value of such a branch is kept
// at refs/fenceline/undone/<name>. The object stores are checked where
// the run wrote them (SnapshotObjects, ObjectSnapshot.Restore): git
// trusts an object's name and believes a commit-graph or
// multi-pack-index over the objects, so a loose object rewritten in place
// would make the user's checkout write the attempt's bytes, and a forged
// commit-graph would make git show another tree for a commit. A
// repository the attempt made is disarmed (its .git moved aside, its HEAD
// renamed, and a bare one's HEAD renamed in place); a path-leased
// attempt's claims get the same (SnapshotClaims).
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
// Two JetStream KV buckets, History 1, replicas configurable, written by
// the lease service alone: a store reads a record, changes it and asks the
// service to write it, a compare-and-swap on the revision it read (a
// conflict is ErrRevisionMismatch). The store knows them only as Records,
// the interface it consumes, with errors of its own (ErrNotFound,
// ErrRevisionMismatch, ErrNoBucket): the bus's implementation is
// leasebus.ShardRecords (reads through JetStream from either account, one
// pull consumer listing the latest record per key, writes through
// leasebus.Client.WriteShard), so this package links no NATS.
// The service checks the record as every reader does (package record)
// and whose it is: a pool's shape is an operator's (Declare), a shard's
// state the holder's of a lease placed in it, an attempt its writer's
// (record.Attempt.By); anyone may mark a shard dirty and take settled
// attempts off it, or mark an attempt whose leases all ended unknown
// (Recover). See leasebus/shards.go.
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
//	  | flock shard-k; absent: init, alternate, checkout --------------------->|
//	  |   exclusive and not ready: keep refs, reset, clean ------------------->|
//	  | attempt running; shard-k dirty ->|                    |              |
//	  | agent runs under the guard in shard-k ... every process gone           |
//	  | attempt settled ---------------->|                    |              |
//	  | exclusive: flock, restore git dir, keep refs, fetch, reset, clean -->|
//	  |   shard-k clean ---------------->|   (audit "shard")  |              |
//	  | Release ------------------------------------------->|              |
package shard
