// Package policy is a security team's policy, written in Cedar, as every
// fence of fenceline asks it: the schema fenceline ships (Schema), parsing
// and validation against it with the line and column of every problem
// (Parse), and decisions (Set.Decide) that name the deciding rule's @id
// and the policy's version.
//
// Semantics, in one paragraph: a policy only narrows. With no policy,
// every fence behaves exactly as before; a policy is a list of `forbid`
// rules (a `permit` is refused when the policy is parsed: there is
// nothing for it to widen), and a request is refused when any forbid rule
// of the repository's policy or of the default policy matches it — or
// fails to evaluate (a rule that errors refuses: fail closed). The
// runner's and sidecar's flags narrow further; a flag that would allow
// what the policy forbids is refused before any lease is taken
// (CheckFlags). A shadow policy is evaluated beside the enforced one and
// its refusals are only reported (Decision.Shadow).
//
// The package has no dependency on NATS: the lease bus stores the
// documents and feeds a Store, which every fence holds and asks.
//
//	leasebus (bucket FENCELINE_POLICY, watched)
//	    │ Store.Put(Document)
//	    ▼
//	Store ──Decide(Request)──▶ fences: lease service (claim), gitproxy and
//	                           the pre-receive hook (push, write), pgproxy
//	                           (sql_write, sql_opaque), fsguard (write),
//	                           egress (connect)
package policy
