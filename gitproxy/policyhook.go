package gitproxy

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// ReasonPolicy: the security team's policy forbids the ref update (push)
// or a path it touches (write); the message names the rule and version.
const ReasonPolicy = lease.ReasonPolicy

// judgePolicy asks the policy about one ref update of a push by l: push
// on the ref (context force, delete, create), then write on every path it
// touches. The first refusal is returned; what a shadow policy would
// refuse is audited (nothing refused) through audit, which may be nil.
func judgePolicy(ctx context.Context, st *policy.Store, l lease.Lease, rc refChange, audit lease.Auditor, log *slog.Logger) *refusal {
	if st == nil || st.Empty() {
		return nil
	}
	push := policy.LeaseRequest(l, policy.ActionPush, policy.Resource{Kind: policy.KindRef, Name: rc.cmd.Ref})
	push.Context.Force = rc.kind == kindRewrite
	push.Context.Delete = rc.kind == kindDelete
	push.Context.Create = rc.kind == kindCreate
	reqs := []policy.Request{push}
	for _, p := range rc.paths {
		reqs = append(reqs, policy.LeaseRequest(l, policy.ActionWrite, policy.Resource{Kind: policy.KindPath, Name: p}))
	}
	for _, r := range reqs {
		d := st.Decide(r)
		if d.Refused != nil {
			return refuse(ReasonPolicy, "%s %s by lease %s (%s): refused by %s", r.Action, r.Resource, l.LeaseID, l.Owner, d.Refused)
		}
		if d.Shadow != nil && audit != nil {
			if ev, ok := policy.Event(l, lease.BoundaryGit, r, d); ok {
				actx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
				if err := audit.Record(actx, ev); err != nil && log != nil {
					log.Error("audit of a shadow refusal not recorded", "lease", l.LeaseID, "err", err)
				}
				cancel()
			}
		}
	}
	return nil
}

// HookPolicy is the reason of a pre-receive refusal by the policy.
const HookPolicy = ReasonPolicy

// hookPolicy asks the policy about a push the hook verified: push on
// every ref it updates (force when the old tip is not an ancestor of the
// new one, by the server's own objects), write on every path it touches.
// The principal is the owner the signed fence names.
func hookPolicy(ctx context.Context, g gitRunner, st *policy.Store, repo, leaseID, owner string, claim scope.Claim, cmds []command, touched []string) *HookError {
	if st == nil || st.Empty() {
		return nil
	}
	o := lease.ParseOwner(owner)
	l := lease.Lease{LeaseID: leaseID, Repo: repo, Owner: o, Scope: claim}
	for _, c := range cmds {
		r := policy.LeaseRequest(l, policy.ActionPush, policy.Resource{Kind: policy.KindRef, Name: c.Ref})
		r.Context.Create, r.Context.Delete = c.isCreate() && !c.isDelete(), c.isDelete()
		if !c.isCreate() && !c.isDelete() {
			_, err := g.runHere(ctx, "merge-base", "--is-ancestor", c.Old, c.New)
			r.Context.Force = err != nil
		}
		if d := st.Decide(r); d.Refused != nil {
			return &HookError{Reason: HookPolicy, Msg: fmt.Sprintf("push of %s refused by %s", c.Ref, d.Refused)}
		}
	}
	for _, p := range touched {
		r := policy.LeaseRequest(l, policy.ActionWrite, policy.Resource{Kind: policy.KindPath, Name: p})
		if d := st.Decide(r); d.Refused != nil {
			return &HookError{Reason: HookPolicy, Msg: fmt.Sprintf("it writes %s, refused by %s", p, d.Refused)}
		}
	}
	return nil
}
