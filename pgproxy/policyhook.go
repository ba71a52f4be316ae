package pgproxy

import (
	"context"
	"fmt"

	"github.com/fenceline/fenceline/policy"
)

// policyRefusal asks the security team's policy (Config.Policy) about a
// write: sql_write on a table the statement writes, or sql_opaque (table
// "") on one whose tables cannot be named. A refusal names the rule and
// the policy's version; what a shadow policy would refuse is audited and
// refused nothing.
func (s *session) policyRefusal(a policy.Action, table string) *refusal {
	st := s.p.cfg.Policy
	if st == nil || st.Empty() || s.p.cfg.Lease == nil {
		return nil
	}
	l := s.p.cfg.Lease.Lease()
	r := policy.LeaseRequest(l, a, policy.Resource{Kind: policy.KindTable, Name: table})
	d := st.Decide(r)
	if d.Refused != nil {
		what := fmt.Sprintf("%s on table %s", a, table)
		if table == "" {
			what = fmt.Sprintf("%s (a write whose tables cannot be named)", a)
		}
		return &refusal{code: policy.ReasonPolicy, reason: what + " refused by " + d.Refused.String(),
			hint: "the policy is the security team's (fenceline policy get); no lease or flag widens it"}
	}
	if ev, ok := policy.Event(l, "postgres", r, d); ok && s.p.cfg.Audit != nil {
		s.blocking(func() {
			ctx, cancel := context.WithTimeout(s.p.ctx, s.p.cfg.AuditTimeout)
			defer cancel()
			if err := s.p.cfg.Audit.Record(ctx, ev); err != nil {
				s.p.log.Error("audit event of a shadow refusal not recorded", "lease", l.LeaseID, "err", err)
			}
		})
	}
	return nil
}
