package runui

import (
	"net/http"
	"slices"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// PolicyView is what /api/v1/policy answers for a repository: the
// policies in force (the default's and the repository's, enforced and
// shadowed), every version of each, and the latest shadow refusals.
type PolicyView struct {
	Repo    string            `json:"repo"`
	InForce []policy.Document `json:"inForce"`
	// History holds every version of each policy, by "<scope> <mode>",
	// oldest first.
	History map[string][]policy.Document `json:"history"`
	// ShadowRefused are the latest shadow-refused audit events (of the
	// repository, or every repository), newest last.
	ShadowRefused []lease.AuditEvent `json:"shadowRefused"`
}

// maxShadowShown bounds the shadow refusals the view lists.
const maxShadowShown = 100

func (s *Server) policy(w http.ResponseWriter, r *http.Request) {
	repo := repoid.Normalize(r.URL.Query().Get("repo"))
	v := PolicyView{Repo: repo, InForce: []policy.Document{}, History: map[string][]policy.Document{}, ShadowRefused: []lease.AuditEvent{}}
	scopes := []string{""}
	if repo != "" {
		scopes = append(scopes, repo)
	}
	for _, sc := range scopes {
		for _, m := range []policy.Mode{policy.ModeEnforce, policy.ModeShadow} {
			h, err := s.src.PolicyHistory(r.Context(), sc, m)
			if err != nil {
				s.fail(w, "read the policies", err)
				return
			}
			if len(h) == 0 {
				continue
			}
			last := h[len(h)-1]
			v.History[last.Scope()+" "+string(m)] = h
			if last.Text != "" {
				v.InForce = append(v.InForce, last)
			}
		}
	}
	evs, err := s.recentAudit(r.Context(), repo, s.cfg.AuditBacklog)
	if err != nil {
		s.fail(w, "read the audit stream", err)
		return
	}
	for _, ev := range evs {
		if ev.Type == lease.EventShadowRefused {
			v.ShadowRefused = append(v.ShadowRefused, ev)
		}
	}
	if n := len(v.ShadowRefused); n > maxShadowShown {
		v.ShadowRefused = slices.Clone(v.ShadowRefused[n-maxShadowShown:])
	}
	s.writeJSON(w, v)
}
