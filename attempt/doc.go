// Package attempt runs one attempt of an agent's unmodified command under
// a lease: from a local checkout and a held lease to a settled result.
// The CLI's run, agent and shard commit map their flags to what this
// package takes and its result to an exit status; nothing here parses
// flags or prints for a person (Spec.Say hands progress lines to the
// caller).
//
// # An attempt
//
//	caller                        attempt                     bus / kernel
//	  | FindCheckout(path)          |                             |
//	  |---------------------------->| git rev-parse, config       |
//	  | OpenPool, Pool.Request      |   (gitsafe: no hook runs)   |
//	  | acquire and hold the lease  |                             |
//	  |-------------------------------------------------------->  |
//	  | Run(spec)                   |                             |
//	  |---------------------------->| place in a shard; snapshot  |
//	  |                             |   the git dirs and objects  |
//	  |                             | start the fences (sidecar)  |
//	  |                             | Policy, Env, HiddenPaths,   |
//	  |                             |   PrivateHome (Spec.State)  |
//	  |                             | fsguard.Start  ------------>| Landlock + seccomp
//	  |                             | watch: lost lease, ctx end  |
//	  |                             | wait: every process gone    |
//	  |                             | close the fences            |
//	  |                             | settle (record, clean shard,|
//	  |                             |   restore the git dirs,     |
//	  |                             |   check the object store,   |
//	  |                             |   report, discard the copy) |
//	  |<----------------------------| Result                      |
//	  | release the lease           |                             |
//	  |-------------------------------------------------------->  |
//
// # What settle undoes
//
// Landlock cannot keep a git dir read-only inside a writable tree, so what
// an attempt could leave that makes git run a program or lie later is
// recorded before it starts and checked at settle (snapshotGitDirs), once
// every process of it is gone, naming what was undone:
//
//   - An exclusive attempt without a pool writes the checkout's git dir:
//     its config files, hooks, info/attributes, grafts, shallow,
//     info/exclude and replace refs (and a core.hooksPath directory in
//     the work tree) are put back and a rebase or
//     cherry-pick it left in progress removed (shard.SnapshotCheckout),
//     and its object stores are checked where the attempt wrote them
//     (shard.SnapshotObjects: files compared by inode, size, mtime and
//     ctime, not read): a loose object must hash to its name, a rewritten
//     one is put back from a copy kept in fenceline's hidden state dir; a
//     written pack must pass git index-pack --verify or is moved aside (an
//     index written beside the user's unchanged pack is made anew from it);
//     commit-graphs, multi-pack-indexes, bitmaps and reverse indexes it
//     wrote are removed (the user's written anew), alternates put back,
//     Git LFS objects it wrote must hash to their names.
//     Objects that hash to their names, its commits, stay.
//   - In every mode, a repository the attempt made where it could write
//     (the whole checkout, or its claims: shard.SnapshotClaims) — a .git
//     directory, a .git file naming a git dir anywhere, a bare repository
//     — is disarmed rather than refused up front (no kernel check sees a
//     file's name, and an agent may rightly make a repository): its .git
//     is moved aside and its HEAD renamed, so the user's git in that
//     directory finds no repository and runs none of its config. One the
//     user had gets its config and hooks back and its object store
//     checked as above.
//   - A run without a pool names, at settle, each setting that runs a
//     program which the attempt added or changed in the agent CLIs'
//     project settings where it could write (.claude/, .codex/,
//     .mcp.json, CLAUDE.md, AGENTS.md: ProjectState); they are its work
//     and stay, for the user to review before starting a CLI there.
//
// A pooled exclusive attempt's shard is cleaned instead; a commit
// capacity's shard gets its git dir restored (see package shard,
// Containment) and its object store checked as above.
//
// The lease is the caller's before Run and after it: Run never releases
// it, so an attempt is settled (its record written, its shard cleaned)
// before anyone else can be granted the workspace.
//
// The caller also connects to the bus: Run sees the lease as a
// lease.Holding (Spec.Holder, a *leasebus.Holder) and the audit trail as a
// lease.Auditor, OpenPool is handed the shard store and a lease reader,
// and Pool.Request says in which Workspace to ask for the lease. The
// package imports neither NATS nor package leasebus.
//
// # The guard's policy
//
// Policy turns a lease into what the kernel lets the agent write:
//
//	shared workspace, path claim     the claimed paths; not the git dir; git shim
//	exclusive workspace, path claim  the claimed paths and the git dir
//	exclusive, whole-repo or none    the whole checkout and the git dir
//
// A claim is judged by what it resolves to on disk (ClaimPath): one that
// goes through a symlink is refused, naming the path to claim instead,
// because the lease service compared the claim as spelled. HiddenPaths
// keeps fenceline's state dir (lease credentials, the bus's, the fences'
// secrets) unreadable, but for the CA certificate the agent's git is
// pointed at. Env drops what only fenceline may know and routes the
// agent through the fences.
//
// # An agent CLI's own state
//
// A CLI's state (~/.claude, ~/.codex) names programs its next start runs
// (hooks, MCP servers, notify). Spec.State gives the agent a PrivateHome
// instead of the user's: a per-attempt copy its HOME points at, writable
// while the originals stay read-only. Settle names what the agent changed
// there (StateChanges: each setting that runs a program) and discards it,
// so nothing of it reaches the user's next unguarded run.
package attempt
