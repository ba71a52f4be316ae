// Package gitproxy is the git push fence: a smart-HTTP proxy in front of a
// git server that lets a push land only when the pusher's lease is live,
// its fence current, and every path the push touches inside the lease —
// for an unmodified git client. Fetches and clones pass through untouched,
// lease or not: reads fail open, writes fail closed.
//
// # What the fence serves
//
// Git's smart-HTTP endpoints of one repository, the path of the upstream
// URL (Config.Upstream), spelled with or without its ".git" as git
// clients do, and nothing else:
//
//	GET  <repo>/info/refs?service=git-upload-pack    fetch, clone, ls-remote (v2's ls-refs too)
//	POST <repo>/git-upload-pack
//	GET  <repo>/info/refs?service=git-receive-pack   push, judged (below)
//	POST <repo>/git-receive-pack
//
// Only these carry the upstream credential (Config.UpstreamHeader), and
// the upstream URL of each is built from the configured repository path,
// never from the client's bytes, with only the request headers git sends.
// Any other request — another path, method or query, another repository
// on the host, a forge's REST API, dumb-HTTP files (HEAD, objects/…,
// info/refs without a service), a path with escapes (%2F, %2e%2e), "..",
// "//", ";" parameters or another case — gets 403 with one line naming
// the path ("… the git fence serves only git's smart-HTTP endpoints of
// <repo> …; API hosts go through the egress proxy") and an audit event
// (reason not-git-endpoint, with lease, owner and fence). Git needs no
// dumb HTTP: it falls back to it only when the server does not speak
// smart HTTP, over which alone a push can be judged. The fence follows no
// redirect of the upstream (git gets it, and follows it through the fence
// or without the credential; the mirror fetch runs with
// http.followRedirects=false), and drops the upstream's Set-Cookie. The
// egress proxy hands the git host's requests to this same handler, so the
// rule is the same in forward mode (TestAttackUpstreamCredentialBeyondGit).
// An upstream URL without a path serves every repository's endpoints and
// may carry no credential.
//
// # Protocol
//
// A push over smart HTTP (protocol v0) is two requests. The proxy relays
// the first (remembering whether the upstream takes push options) and
// judges the second before anything of it reaches the upstream:
//
//	git push                     gitproxy                               upstream
//	  | GET info/refs?service=git-receive-pack                              |
//	  |----------------------------->|------------------------------------->|
//	  |<---------- ref advertisement (caps: report-status, push-options…) --|
//	  | POST git-receive-pack        |                                      |
//	  |  "<old> <new> <ref>\0<caps>" | parse commands, push options         |
//	  |  flush, [options, flush]     | (own parser: go-git v5 mis-reads     |
//	  |  PACK…                       |  push options)                       |
//	  |----------------------------->| spool to disk + go-git pack scanner: |
//	  |                              |  keep commits/trees/tags, step over  |
//	  |                              |  blobs; thin bases from the agent's  |
//	  |                              |  repo or a mirror of the upstream    |
//	  |                              | touched paths: old tip vs new tip    |
//	  |                              |  (new ref: vs default branch HEAD),  |
//	  |                              |  every new commit vs each parent     |
//	  |                              | bus: lease active? same fence?       |
//	  |                              |  other leases' claims?               |
//	  |   refused: report-status     |                                      |
//	  |<-- "ng <ref> fenceline: …" --|                                      |
//	  |                              | accepted: same commands + options    |
//	  |                              |  fenceline-lease/-fence/-owner/-repo,|
//	  |                              |  -claim and -mac (signed, see below),|
//	  |                              |  headers Fenceline-Lease/-Fence,     |
//	  |                              |  the pack as received -------------->|
//	  |                              |              pre-receive hook: MAC,  |
//	  |                              |              then fence not stale    |
//	  |<------------------------------------------- report-status ----------|
//
// A refusal goes back in git's own report-status (inside side-band when
// negotiated), so git push prints
//
//	! [remote rejected] main -> main (fenceline: libs/tax/rates.go is outside lease lease_… [services/billing])
//
// and every refusal is an audit event naming lease, owner, fence and reason.
// So is every error of the fence's own once the request names its refs
// (a malformed command, a pack it cannot spool, an upstream that does not
// answer the forwarded push): git prints the reason against each ref,
// never a bare HTTP status. Only a request whose first line cannot be read
// at all gets HTTP 400.
//
// Signed pushes are not relayed: the proxy drops push-cert from the
// upstream's advertisement (it cannot vouch for a certificate whose
// updates it does not forward as signed), so git push --signed=if-asked
// pushes unsigned and --signed=yes stops in git ("the receiving end does
// not support --signed push"); a certificate sent anyway is refused per
// ref.
// A push is forwarded whole or not at all: when one ref is refused, the
// others are refused with a pointer to it.
//
// # The push rule (docs/design.md)
//
// Only a lease with an exclusive workspace may push; a shared-workspace
// path lease may not (pushing is a repository-wide mutation). Every touched
// path must lie inside the pusher's own claim when it claims paths, and
// inside no other active lease's claim — declared claims win, so an
// exclusive attempt that claims nothing cannot push over another agent's
// leased paths. A ref update is judged by what it moves, whatever the pack
// holds (an update onto commits the upstream already has comes with an
// empty pack). Its touched paths are:
//
//   - an update of an existing ref (fast-forward or not): the paths that
//     differ between the old tip and the new tip;
//   - a new ref: the paths that differ between the new tip and the
//     upstream's default branch where they meet (each merge base of the
//     two), the history the ref adds to the one branch every lease may
//     build on; every path of the new tip when they share no history or
//     the upstream has no default branch. The default branch is the
//     upstream's HEAD as its upload-pack advertisement names it, read
//     when the push is judged. A new ref on another branch's commits is
//     thus judged by that branch's changes: being on the upstream is not
//     being allowed to publish them under a new name;
//   - in both cases, for history the upstream did not have (the commits
//     in the pack), what every new commit changes against each of its
//     parents (a commit that touches a path and a later one that reverts
//     it still count).
//
// Old tips and default-branch tips are read from the agent's repository
// or the upstream's mirror only as objects whose content hashes to their
// id; an old tip neither has is refused, not guessed. Ref deletions and
// non-fast-forward updates by path leases are refused unless the Policy
// allows them. The upstream enforces each command's old value (a push
// whose old tip is not the ref's current value fails there), so judging
// against the old tip the client names is judging against the ref.
// The pre-receive hook applies the same rule with git on the server's own
// objects (diff-tree of old and new tips, merge-base --all with HEAD for a
// new ref, log of the new commits) and refuses a push whose paths leave
// the claim its fence was signed with.
//
// A delete of a ref the upstream does not have ("<zero> <zero> <ref>",
// git push URL :nope) deletes nothing: it passes whatever the Policy, and
// the upstream answers it as it would a direct push (a warning, ok). When
// the ref does exist, such a command would delete it whatever its value,
// so the proxy refuses it (fetch, then delete), and the hook refuses one
// that reaches the server for a ref that exists by then.
//
// A push whose own options name fenceline-* is refused: those options are
// the fence's to set.
//
// # Storage-side fence
//
// The decision is taken against the bus right before forwarding, but a
// sidecar frozen between its check and its forward could still deliver a
// zombie push. PreReceive (fenceline hook pre-receive) closes that gap in
// the git server itself: it keeps the highest fence accepted for every path
// pushes claimed or touched (<git-dir>/fenceline/fences.json), and refuses
// a push whose fence is lower than one already accepted for an overlapping
// path.
//
// # Signed fences
//
// The hook believes a fence only when the lease service granted it. A
// per-repository secret, which InstallHook (fenceline hook install) creates
// in <git-dir>/fenceline/hook.key (mode 0600, owned by the git server's
// user), is held by the hook and the lease service alone (fenceline bus
// fence-secret set); no sidecar, runner or agent holds it. For each grant
// the service derives the lease's git grant key,
//
//	grant key = lease.MAC(secret, lease.GitGrantMessage(repo, lease, owner, fence, claim))
//
// and gives it to the lease's acquirer alone; the sidecar signs with it
// (FenceOptions), and the hook derives the same key from its secret and
// the options. A runner's key signs only its own lease's fence, owner and
// claim in its repository. The option is
//
//	fenceline-mac=v2:<64 lowercase hex digits>
//
// and the MAC, HMAC-SHA256 under the grant key, is over these bytes, every
// line ending in "\n", values exactly as the other options carry them:
//
//	fenceline-git-fence v1
//	repo <fenceline-repo>
//	lease <fenceline-lease>
//	owner <fenceline-owner, "task=… agent=… attempt=…">
//	fence <fenceline-fence, decimal>
//	claim <fenceline-claim, JSON of the lease's scope; empty when not sent>
//	update <old-oid> <new-oid> <ref>      one line per ref update of the
//	                                      push, sorted bytewise
//
// No value may hold a newline or NUL, so the encoding is unambiguous. The
// update lines are the ones git gives the hook on stdin, so the options of
// one push do not carry another (a replay of the same updates is the same
// push). The hook compares in constant time, then checks that the signed
// repo is its own (hook pre-receive --repo), then the fence. It refuses,
// naming lease, fence and reason, and records nothing, when the options
// are unsigned, the MAC does not verify (another key, other ref updates,
// another claim, repo, lease, owner or fence), its version is unknown, an option
// repeats or is not one it knows, or it has no secret to verify with; every
// refusal is appended to <git-dir>/fenceline/refusals.jsonl. With
// AllowUnfenced, a push that carries no fenceline option at all passes and
// records nothing; any fenceline option makes the push checked in full. A
// later format gets a new version tag; a hook names a tag it does not know.
//
// # Forward mode
//
// For https:// remotes, the sidecar's egress proxy (package egress; git's
// http.proxy or HTTPS_PROXY) answers CONNECT for the git host itself,
// terminates TLS with a certificate minted by a local CA (LoadOrCreateCA)
// that git trusts for that host only (http.<url>.sslCAInfo), and serves
// the same fence; it tunnels no other host unless its allowlist names it. The sidecar may hold
// the upstream credential and add it, so the agent never sees it; it goes
// only to the repository's smart-HTTP endpoints, as in reverse mode.
//
// # Resources
//
// Memory stays bounded by the push's history, not its size: the pack is
// spooled to disk, blobs are never kept, and the base stores' caches are
// small. A 200 MB push keeps the sidecar under 20 MB resident.
package gitproxy
