package gitproxy

import (
	"fmt"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// Policy is what a security team decides about pushes that rewrite or
// remove history. The zero value is the safe default: path leases may do
// neither. Exclusive leases without a path claim (or with whole-repo) may;
// a rewrite's net diff must still stay out of other leases' claims.
type Policy struct {
	// AllowForcePush lets path leases push non-fast-forward updates.
	AllowForcePush bool
	// AllowRefDelete lets path leases delete refs.
	AllowRefDelete bool
}

// Audit reason codes of refused pushes and requests.
const (
	ReasonNoLease         = "no-lease"               // the proxy holds no lease
	ReasonLeaseLost       = lease.ReasonLeaseLost    // lost, revoked, expired, or the bus says it is not active
	ReasonLeaseUnknown    = lease.ReasonLeaseUnknown // the bus cannot be reached: fail closed
	ReasonStaleFence      = "stale-fence"            // the bus has a newer fence for this lease than the proxy
	ReasonSharedWorkspace = "shared-workspace"       // pushing is a repository-wide mutation
	ReasonOutsideLease    = lease.ReasonOutsideLease // a touched path is outside the pusher's claim
	ReasonOtherLease      = "other-lease"            // a touched path is inside another active lease's claim
	ReasonForcePush       = "force-push"             // non-fast-forward update by a path lease
	ReasonRefDelete       = "ref-delete"             // ref deletion by a path lease
	ReasonNotCommit       = "not-commit"             // a ref would point at a tree or blob
	ReasonBadPush         = "bad-push"               // malformed request or pack
	ReasonWholePush       = "whole-push"             // another ref of the same push was refused
	ReasonNotGitEndpoint  = "not-git-endpoint"       // a request that is none of git's smart-HTTP endpoints of the repository
	ReasonSignedPush      = "signed-push"            // a push certificate: not advertised, not accepted
	ReasonStaleDelete     = "stale-delete"           // a delete naming no value, of a ref the upstream has
	ReasonUpstream        = "upstream-unreachable"   // the upstream did not answer the forwarded push
	ReasonFenceError      = "fence-error"            // the fence itself failed; nothing was forwarded
)

// refusal is why a push or one of its ref updates is refused.
type refusal struct {
	code string
	msg  string // starts with "fenceline: "; shown by git push
}

func refuse(code, format string, args ...any) *refusal {
	return &refusal{code: code, msg: "fenceline: " + fmt.Sprintf(format, args...)}
}

// judge applies the push rule of docs/design.md to one ref update of a push by
// own (an active, exclusive-workspace lease): every touched path inside
// own's claim when it claims paths, and inside no other active lease's
// claim — declared claims win.
func judge(own lease.Lease, others []*lease.Lease, rc refChange, pol Policy) *refusal {
	pathLease := own.Scope.Kind == scope.KindPaths
	switch {
	case rc.kind == kindDelete && rc.absent:
		return nil // deletes a ref the upstream does not have: nothing
	case rc.notCommit != "" && own.Scope.Kind != scope.KindWholeRepo:
		return refuse(ReasonNotCommit, "%s would point at a %s, not a commit; only a whole-repo lease may push that", rc.cmd.Ref, rc.notCommit)
	case rc.kind == kindDelete && pathLease && !pol.AllowRefDelete:
		return refuse(ReasonRefDelete, "deleting %s is not allowed for path lease %s %s (policy)", rc.cmd.Ref, own.LeaseID, own.Scope)
	case rc.kind == kindRewrite && pathLease && !pol.AllowForcePush:
		return refuse(ReasonForcePush, "non-fast-forward update of %s is not allowed for path lease %s %s (policy)", rc.cmd.Ref, own.LeaseID, own.Scope)
	}
	if pathLease {
		var outside []string
		for _, p := range rc.paths {
			if !own.Scope.ContainsPath(p) {
				outside = append(outside, p)
			}
		}
		if len(outside) > 0 {
			return refuse(ReasonOutsideLease, "%s is outside lease %s %s", andMore(outside), own.LeaseID, own.Scope)
		}
	}
	for _, o := range others {
		if o.LeaseID == own.LeaseID || !o.Active() || o.Scope.Kind == scope.KindNone {
			continue
		}
		var inside []string
		for _, p := range rc.paths {
			if o.Scope.ContainsPath(p) {
				inside = append(inside, p)
			}
		}
		if len(inside) > 0 {
			return refuse(ReasonOtherLease, "%s is inside lease %s of %s %s (fence %d, expires %s)",
				andMore(inside), o.LeaseID, o.Owner, o.Scope, o.Fence, o.ExpiresAt.UTC().Format(time.RFC3339))
		}
	}
	return nil
}

// andMore names the first path and counts the rest.
func andMore(paths []string) string {
	if len(paths) == 1 {
		return paths[0]
	}
	return fmt.Sprintf("%s (and %d more)", paths[0], len(paths)-1)
}
