package leasebus

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// The lease service judges claims by the policy in force (policy.go): an
// acquire whose claim a rule forbids — a protected path, a whole-repo
// claim by a task the policy does not name, a TTL above its maximum — is
// refused before it reaches the repo's actor, naming the rule and the
// version, and audited (type refused, reason policy). When a policy
// changes, every active lease whose claim the new version forbids is
// revoked (within the bus's delivery time: revocation then reaches every
// boundary of its holder within 1 s, invariant 9).

// policyRevoker names the policy in the audit as who revoked a lease.
const policyRevoker = "policy"

// claimRequests are the policy requests of an acquire's (or a lease's)
// claim, asked by the bus identity the audit calls identity (the
// principal's agent and task are the owner's word; the identity is the
// bus's, so a policy can bind a claim to the runners allowed it).
func claimRequests(repo, identity string, o lease.Owner, c scope.Claim, mode lease.WorkspaceMode, ttl time.Duration, leaseID string) []policy.Request {
	base := policy.Request{Agent: o.AgentID, Task: o.TaskID, Repo: repo, Context: policy.Context{
		Identity: identity, LeaseID: leaseID, WorkspaceMode: string(mode), TTLSeconds: int64(ttl / time.Second)}}
	return policy.ClaimRequests(base, c.Paths, c.Tables, c.Kind == scope.KindWholeRepo)
}

// judgeClaim returns the policy's refusal of a claim (nil: allowed), and
// the shadow verdicts of the requests it allows.
func (s *Service) judgeClaim(reqs []policy.Request) (*policy.Refusal, []policy.Refusal) {
	var shadow []policy.Refusal
	for _, r := range reqs {
		d := s.policies.Decide(r)
		if d.Refused != nil {
			return &policy.Refusal{Request: r, Verdict: *d.Refused}, nil
		}
		if d.Shadow != nil {
			shadow = append(shadow, policy.Refusal{Request: r, Verdict: *d.Shadow})
		}
	}
	return nil, shadow
}

// checkAcquirePolicy judges an acquire's claim; a refusal is audited
// (after the answer) and returned, shadow refusals only audited.
func (s *Service) checkAcquirePolicy(id string, r *AcquireRequest) error {
	if s.policies.Empty() {
		return nil
	}
	refused, shadow := s.judgeClaim(claimRequests(r.Repo, s.name(id), r.Owner, r.Scope, r.WorkspaceMode, time.Duration(r.TTL), ""))
	for _, sr := range shadow {
		s.auditPolicyClaim(id, r.Repo, r.Owner, r.Scope, EventShadowRefused, fmt.Sprintf("shadow-refused (nothing refused): acquire of %s by %s: %s would be refused by %s", r.Scope, r.Owner, sr.Request.Resource, sr.Verdict))
	}
	if refused == nil {
		return nil
	}
	err := fmt.Errorf("acquire of %s by %s: %w (the policy is the security team's: `fenceline policy get`)", r.Scope, r.Owner, refused)
	s.auditPolicyClaim(id, r.Repo, r.Owner, r.Scope, lease.EventRefused, "refused "+err.Error())
	return err
}

// auditPolicyClaim writes a claim the policy refused (or would refuse) to
// the events stream, boundary lease, in the asker's name.
func (s *Service) auditPolicyClaim(id, repo string, o lease.Owner, c scope.Claim, typ, msg string) {
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: typ, Boundary: lease.BoundaryLease, Repo: repo, Owner: o, Scope: c,
		Reason: lease.ReasonPolicy, RequestedBy: s.name(id), Message: clip(msg, maxEventMessage)}
	boundEvent(&ev)
	s.goBackground(func() {
		if err := s.writeEvent(s.ctx, eventsSubjectFor(repo, lease.BoundaryLease, id), ev); err != nil {
			s.log.Warn("audit event of a claim the policy refused not written", "repo", repo, "type", typ, "err", err)
		}
	})
}

// followPolicies keeps s.policies in step with the bus and, at every
// change, revokes the active leases the new policy forbids. The first
// read happened in StartService.
func (s *Service) followPolicies(ctx context.Context, w *PolicyWatch) {
	for {
		changed := s.policies.Changed()
		select {
		case <-ctx.Done():
			w.Stop()
			return
		case <-changed:
			s.revokeForbidden(ctx)
		case <-w.Done():
			if err := w.Err(); err != nil {
				s.log.Warn("following policies stopped; starting again", "err", err)
			}
			for wait := 100 * time.Millisecond; ; wait = min(2*wait, 5*time.Second) {
				var err error
				if w, err = WatchPolicies(ctx, s.js, &s.policies); err == nil {
					break
				}
				s.log.Warn("follow policies", "err", err, "again_in", wait)
				select {
				case <-ctx.Done():
					return
				case <-time.After(wait):
				}
			}
		}
	}
}

// revokeForbidden revokes every active lease whose claim the policy in
// force forbids.
func (s *Service) revokeForbidden(ctx context.Context) {
	for _, a := range s.allActors() {
		r := a.ask(ctx, &call{op: "list", req: &listRequest{}})
		if r.Error != nil {
			continue
		}
		for _, l := range r.Leases {
			refused, _ := s.judgeClaim(claimRequests(l.Repo, s.name(s.holderOf(l.LeaseID)), l.Owner, l.Scope, l.WorkspaceMode, time.Duration(l.TTL), l.LeaseID))
			if refused == nil {
				continue
			}
			reason := fmt.Sprintf("the policy now forbids its claim: %s", refused)
			rr := a.ask(ctx, &call{op: "revoke", req: &RevokeRequest{LeaseID: l.LeaseID, Repo: l.Repo, Reason: reason, by: policyRevoker}})
			if err := rr.Error.err(); err != nil && !errors.Is(err, lease.ErrNotFound) {
				s.log.Warn("revoke a lease the policy forbids", "lease", l.LeaseID, "err", err)
				continue
			}
			s.log.Info("revoked a lease the policy forbids", "lease", l.LeaseID, "rule", refused.Verdict.Rule, "version", refused.Verdict.Version)
		}
	}
}

// holderOf is the bus identity that acquired active lease id ("" when
// unknown).
func (s *Service) holderOf(id string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	if ix := s.index[id]; ix != nil && ix.e != nil {
		return ix.e.Holder
	}
	return ""
}
