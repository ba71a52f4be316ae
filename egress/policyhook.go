package egress

import (
	"context"
	"net/http"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// connectRequest is the policy request of a connection to t.
func (p *Proxy) connectRequest(t target) (lease.Lease, policy.Request) {
	var l lease.Lease
	if p.cfg.Lease != nil {
		l = p.cfg.Lease.Lease()
	}
	return l, policy.LeaseRequest(l, policy.ActionConnect, policy.Resource{Kind: policy.KindHost, Name: t.host, Port: t.port})
}

// policyAllows asks the policy about a host the allowlist allows: nil, or
// the refusal naming the rule and the policy's version.
func (p *Proxy) policyAllows(t target) *refusal {
	if p.cfg.Policy == nil {
		return nil
	}
	_, req := p.connectRequest(t)
	if d := p.cfg.Policy.Decide(req); d.Refused != nil {
		return &refusal{target: t, reason: policy.ReasonPolicy,
			why:  "refused by " + d.Refused.String(),
			hint: "the policy is the security team's (fenceline policy get); no flag widens it"}
	}
	return nil
}

// shadow audits a connection a shadow policy would refuse (nothing is
// refused).
func (p *Proxy) shadow(r *http.Request, t target) {
	if p.cfg.Policy == nil || p.cfg.Audit == nil {
		return
	}
	l, req := p.connectRequest(t)
	ev, ok := policy.Event(l, lease.BoundaryNet, req, p.cfg.Policy.Decide(req))
	if !ok || ev.Type != lease.EventShadowRefused {
		return
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(r.Context()), 5*time.Second)
	defer cancel()
	if err := p.cfg.Audit.Record(ctx, ev); err != nil {
		p.log.Error("fenceline egress: shadow refusal not recorded in the audit", "err", err)
	}
}
