// The lease checks a push passes: what the holder knows (leaseGate), the
// bus's record and the repository's other leases (busCheck), and a fresh
// confirmation last (confirm). All fail closed.

package gitproxy

import (
	"context"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// freshAnswer bounds the round trip of the confirmation a push is
// forwarded on: an answer that took longer may describe the lease as it
// was well before it arrived (a paused node, a slow link), so it is asked
// again rather than believed.
const freshAnswer = 250 * time.Millisecond

// confirm asks the bus, right before a push is forwarded, whether its lease
// is still active with the same fence, trusting only an answer that came
// back within freshAnswer of the question (asked again until
// BusTimeout). Fail closed.
func (p *Proxy) confirm(ctx context.Context, ps *push) *refusal {
	if ref := p.leaseGate(ps); ref != nil {
		return ref
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.BusTimeout)
	defer cancel()
	var slow time.Duration
	for {
		asked := time.Now()
		cur, err := p.cfg.Bus.Get(ctx, ps.lease.LeaseID)
		took := time.Since(asked)
		switch {
		case err != nil && slow > 0:
			return refuse(ReasonLeaseUnknown, "cannot confirm lease %s (fence %d) with the bus: its answers took %s, more than the %s a push is forwarded on (then: %v)", ps.lease.LeaseID, ps.fence, slow.Round(time.Millisecond), freshAnswer, err)
		case err != nil:
			return refuse(ReasonLeaseUnknown, "cannot confirm lease %s (fence %d) with the bus: %v", ps.lease.LeaseID, ps.fence, err)
		}
		if ref := p.stillHeld(ps, cur); ref != nil {
			return ref
		}
		if took <= freshAnswer {
			return p.leaseGate(ps) // and the holder has not heard otherwise meanwhile
		}
		slow = took
	}
}

// currentLease is the proxy's lease record, or a zero one without a lease.
func (p *Proxy) currentLease() lease.Lease {
	if p.cfg.Lease == nil {
		return lease.Lease{}
	}
	return p.cfg.Lease.Lease()
}

// leaseGate checks what the proxy itself knows: it holds a lease, the
// holder still considers it held, and its workspace may push.
func (p *Proxy) leaseGate(ps *push) *refusal {
	if p.cfg.Lease == nil {
		return refuse(ReasonNoLease, "this sidecar holds no lease; pushes are refused (take one with fenceline run or fenceline sidecar)")
	}
	ps.lease = p.cfg.Lease.Lease()
	fence, err := p.cfg.Lease.Fence()
	if err != nil {
		return refuse(lease.LeaseReason(err), "lease %s %s (fence %d) is not held: %v", ps.lease.LeaseID, ps.lease.Scope, ps.lease.Fence, err)
	}
	ps.fence = fence
	if ps.lease.WorkspaceMode != lease.WorkspaceExclusive {
		return refuse(ReasonSharedWorkspace, "lease %s %s works in a shared workspace and may not push: pushing is a repository-wide mutation (ask the coordinator, or take an exclusive workspace)", ps.lease.LeaseID, ps.lease.Scope)
	}
	return nil
}

// busCheck asks the bus whether the lease is still active with the same
// fence (a lost lease is the first thing to say) and returns the repo's
// other active leases; confirm asks again, last. Fail closed: no answer
// means no push.
func (p *Proxy) busCheck(ctx context.Context, ps *push) ([]*lease.Lease, *refusal) {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.BusTimeout)
	defer cancel()
	cur, err := p.cfg.Bus.Get(ctx, ps.lease.LeaseID)
	if err != nil {
		return nil, refuse(ReasonLeaseUnknown, "cannot confirm lease %s (fence %d) with the bus: %v", ps.lease.LeaseID, ps.fence, err)
	}
	if ref := p.stillHeld(ps, cur); ref != nil {
		return nil, ref
	}
	others, err := p.cfg.Bus.List(ctx, ps.lease.Repo, false)
	if err != nil {
		return nil, refuse(ReasonLeaseUnknown, "cannot list the leases of %s: %v", ps.lease.Repo, err)
	}
	return others, nil
}

// stillHeld refuses unless cur, the bus's record of the push's lease, is
// active with the push's fence.
func (p *Proxy) stillHeld(ps *push, cur *lease.Lease) *refusal {
	if !cur.Active() {
		return refuse(ReasonLeaseLost, "lease %s (fence %d) is %s: %s", cur.LeaseID, ps.fence, cur.Status, cur.Reason)
	}
	if cur.Fence != ps.fence {
		return refuse(ReasonStaleFence, "lease %s carries fence %d but the bus says %d", cur.LeaseID, ps.fence, cur.Fence)
	}
	return nil
}
