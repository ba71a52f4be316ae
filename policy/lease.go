package policy

import (
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// LeaseRequest is the request of l's holder to do a on res: the agent and
// task of its owner, its repo, and its lease id, workspace mode, TTL and
// whole-repo claim as context.
func LeaseRequest(l lease.Lease, a Action, res Resource) Request {
	return Request{Agent: l.Owner.AgentID, Task: l.Owner.TaskID, Repo: l.Repo, Action: a, Resource: res,
		Context: Context{LeaseID: l.LeaseID, WorkspaceMode: string(l.WorkspaceMode),
			TTLSeconds: int64(time.Duration(l.TTL) / time.Second), WholeRepo: l.Scope.Kind == scope.KindWholeRepo}}
}

// Event is the audit event of a fence's decision d on r under l at
// boundary: a refusal (EventDenied, reason policy) or a shadow refusal
// (EventShadowRefused); ok is false when d needs none.
func Event(l lease.Lease, boundary string, r Request, d Decision) (ev lease.AuditEvent, ok bool) {
	ev = lease.AuditEvent{Time: time.Now().UTC(), Boundary: boundary, Repo: l.Repo, LeaseID: l.LeaseID,
		Owner: l.Owner, Scope: l.Scope, Fence: l.Fence, Reason: lease.ReasonPolicy}
	switch {
	case d.Refused != nil:
		ev.Type = lease.EventDenied
		ev.Message = (&Refusal{Request: r, Verdict: *d.Refused}).Error() + " for lease " + l.LeaseID + " (" + l.Owner.String() + ")"
	case d.Shadow != nil:
		ev.Type = lease.EventShadowRefused
		ev.Message = "shadow policy: " + r.Action.String() + " " + r.Resource.String() + " would be refused by " + d.Shadow.String() + " for lease " + l.LeaseID + "; nothing was refused"
	default:
		return ev, false
	}
	return ev, true
}

func (a Action) String() string { return string(a) }
