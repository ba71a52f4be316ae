package faults

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// Grant is one acknowledged grant.
type Grant struct {
	LeaseID string
	Repo    string
	Claim   scope.Claim
	Fence   uint64
	// GrantedAt is the service's acquiredAt.
	GrantedAt time.Time
	// RevokedAt is when the revoker's call returned (zero: not revoked by
	// the harness). Writes under the lease must stop within the bound.
	RevokedAt time.Time
	// EndedAt is the service's endedAt once known (zero: active, or not
	// known).
	EndedAt time.Time
	// End is the audit event type of the end the service acknowledged to
	// whoever ended the lease (leasebus.EventRelease, EventRevoked; ""
	// while none was acknowledged).
	End string
	// Abandoned: the holder left the lease to the sweeper (never renewed
	// nor released); the audit must show exactly one end of it.
	Abandoned bool
}

// Write is one write that landed at a boundary.
type Write struct {
	// Boundary is where it landed: "file", "postgres", "git", or such a
	// name qualified by who wrote (e.g. "pod/file").
	Boundary string
	LeaseID  string
	// Fence is the fence the write carried, 0 when the boundary does not
	// record one.
	Fence uint64
	// At is when the write landed (taken just before, for the file
	// boundary: the writer stamps the line it appends).
	At     time.Time
	Detail string
}

// History records grants and writes; it is safe for concurrent use.
type History struct {
	mu     sync.Mutex
	grants map[string]*Grant // guarded by mu
	order  []string          // guarded by mu: lease ids in the order granted
	writes []Write           // guarded by mu
	// Faults counts injected faults by kind (e.g. "kill-9"), Revokes the
	// revokes issued; both only for the report.
	faults map[string]int // guarded by mu
	// incidents counts what went wrong without breaking an invariant
	// (an agent that could not start during a fault), by kind.
	incidents map[string]int // guarded by mu
	// refused holds the attempt ids whose acquire the service refused
	// (a conflict), as the client was told.
	refused map[string]bool // guarded by mu
	// audit is the audit stream as read after the run (auditRead: it was).
	audit     []lease.AuditEvent // guarded by mu
	auditRead bool               // guarded by mu
}

// NewHistory returns an empty History.
func NewHistory() *History {
	return &History{grants: map[string]*Grant{}, faults: map[string]int{}, incidents: map[string]int{}, refused: map[string]bool{}}
}

// Grant records an acknowledged grant (again: updates it).
func (h *History) Grant(g Grant) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if _, ok := h.grants[g.LeaseID]; !ok {
		h.order = append(h.order, g.LeaseID)
	}
	h.grants[g.LeaseID] = &g
}

// Revoked records that the revoke of leaseID returned at at (the service
// said: revoked), and the service's endedAt when known.
func (h *History) Revoked(leaseID string, at, endedAt time.Time) {
	h.EndedBy(leaseID, lease.EventRevoked, at, endedAt)
}

// EndedBy records that the service ended leaseID with an end of type typ
// (its audit event), ended at endedAt, and that writes under it must stop
// within the bound of at: a revoke's return, or the service's own end
// (a reclaim the revoke found done).
func (h *History) EndedBy(leaseID, typ string, at, endedAt time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if g, ok := h.grants[leaseID]; ok {
		g.RevokedAt = at
		g.End = typ
		if !endedAt.IsZero() {
			g.EndedAt = endedAt
		}
	}
}

// Released records that the service acknowledged the release of leaseID
// (status released), ended at endedAt.
func (h *History) Released(leaseID string, endedAt time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if g, ok := h.grants[leaseID]; ok {
		g.End = lease.EventRelease
		if !endedAt.IsZero() {
			g.EndedAt = endedAt
		}
	}
}

// Abandoned records that leaseID's holder left it to the sweeper.
func (h *History) Abandoned(leaseID string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if g, ok := h.grants[leaseID]; ok {
		g.Abandoned = true
	}
}

// Refused records that the acquire of attempt was refused (a conflict).
func (h *History) Refused(attempt string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.refused[attempt] = true
}

// Audit records the audit events read from the audit stream after the run
// (again: replaces them).
func (h *History) Audit(evs []lease.AuditEvent) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.audit, h.auditRead = slices.Clone(evs), true
}

// Ended records the service's endedAt of a lease (released at the end, say).
func (h *History) Ended(leaseID string, endedAt time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if g, ok := h.grants[leaseID]; ok && g.EndedAt.IsZero() {
		g.EndedAt = endedAt
	}
}

// Write records a write that landed.
func (h *History) Write(w Write) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.writes = append(h.writes, w)
}

// Fault counts one injected fault of kind.
func (h *History) Fault(kind string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.faults[kind]++
}

// Incident counts one incident of kind.
func (h *History) Incident(kind string) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.incidents[kind]++
}

// Grants returns the grants in the order recorded.
func (h *History) Grants() []Grant {
	h.mu.Lock()
	defer h.mu.Unlock()
	out := make([]Grant, 0, len(h.order))
	for _, id := range h.order {
		out = append(out, *h.grants[id])
	}
	return out
}

// Writes returns the writes recorded.
func (h *History) Writes() []Write {
	h.mu.Lock()
	defer h.mu.Unlock()
	return slices.Clone(h.writes)
}

// Violation is one broken invariant.
type Violation struct {
	Check  string
	Detail string
}

func (v Violation) String() string { return v.Check + ": " + v.Detail }

// Check is one invariant checked over a History (StandardChecks,
// AuditCheck); add your own by passing more to Verify.
type Check struct {
	Name string
	Run  func(*History) []Violation
}

// Report is what Verify found.
type Report struct {
	Grants  int
	Revokes int
	Faults  map[string]int
	// Incidents counts incidents by kind (see History.Incident).
	Incidents map[string]int
	// Writes counts the writes per boundary.
	Writes map[string]int
	// LastAfterRevoke is, per boundary, the latest a write landed after
	// its lease's revoke returned (negative: every write landed before).
	LastAfterRevoke map[string]time.Duration
	// Audit counts the audit events read per type (nil: none were read).
	Audit      map[string]int
	Violations []Violation
}

// String is the counts on one line, then the violations.
func (r Report) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "grants=%d revokes=%d", r.Grants, r.Revokes)
	for _, k := range sortedKeys(r.Faults) {
		fmt.Fprintf(&b, " faults[%s]=%d", k, r.Faults[k])
	}
	for _, k := range sortedKeys(r.Incidents) {
		fmt.Fprintf(&b, " incidents[%s]=%d", k, r.Incidents[k])
	}
	for _, k := range sortedKeys(r.Writes) {
		fmt.Fprintf(&b, " writes[%s]=%d", k, r.Writes[k])
	}
	for _, k := range sortedKeys(r.LastAfterRevoke) {
		fmt.Fprintf(&b, " lastAfterRevoke[%s]=%s", k, r.LastAfterRevoke[k].Round(time.Millisecond))
	}
	for _, k := range sortedKeys(r.Audit) {
		fmt.Fprintf(&b, " audit[%s]=%d", k, r.Audit[k])
	}
	fmt.Fprintf(&b, " violations=%d", len(r.Violations))
	for _, v := range r.Violations {
		fmt.Fprintf(&b, "\n  %s", v)
	}
	return b.String()
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// Verify runs checks over h and reports the counts and what broke.
func Verify(h *History, checks ...Check) Report {
	r := Report{Faults: map[string]int{}, Writes: map[string]int{}, LastAfterRevoke: map[string]time.Duration{}}
	grants := h.Grants()
	byID := map[string]Grant{}
	for _, g := range grants {
		byID[g.LeaseID] = g
		if !g.RevokedAt.IsZero() {
			r.Revokes++
		}
	}
	r.Grants = len(grants)
	h.mu.Lock()
	for k, n := range h.faults {
		r.Faults[k] = n
	}
	r.Incidents = maps.Clone(h.incidents)
	if h.auditRead {
		r.Audit = map[string]int{}
		for _, ev := range h.audit {
			r.Audit[ev.Type]++
		}
	}
	h.mu.Unlock()
	for _, w := range h.Writes() {
		r.Writes[w.Boundary]++
		if g, ok := byID[w.LeaseID]; ok && !g.RevokedAt.IsZero() {
			d := w.At.Sub(g.RevokedAt)
			if cur, seen := r.LastAfterRevoke[w.Boundary]; !seen || d > cur {
				r.LastAfterRevoke[w.Boundary] = d
			}
		}
	}
	for _, c := range checks {
		r.Violations = append(r.Violations, c.Run(h)...)
	}
	return r
}

// StandardChecks are the lease invariants every fault suite checks: no
// overlapping grants, no write past bound after its lease ended, fences
// unique and rising.
func StandardChecks(bound time.Duration) []Check {
	return []Check{
		{Name: "no-overlap", Run: checkNoOverlap},
		{Name: "no-late-write", Run: func(h *History) []Violation { return checkNoLateWrite(h, bound) }},
		{Name: "fences", Run: checkFences},
	}
}

// overlapping reports whether two grants claim overlapping things in one repo.
func overlapping(a, b Grant) bool { return a.Repo == b.Repo && a.Claim.Overlaps(b.Claim) }

// checkNoOverlap: by the service's clock, no two overlapping grants are
// valid at once: the later one is granted no earlier than the first ended.
func checkNoOverlap(h *History) []Violation {
	gs := h.Grants()
	var out []Violation
	for i, a := range gs {
		for _, b := range gs[i+1:] {
			if !overlapping(a, b) {
				continue
			}
			first, second := a, b
			if second.GrantedAt.Before(first.GrantedAt) {
				first, second = second, first
			}
			if first.EndedAt.IsZero() || second.GrantedAt.Before(first.EndedAt) {
				out = append(out, Violation{"no-overlap", fmt.Sprintf("%s (fence %d, granted %s, ended %s) and %s (fence %d, granted %s) claim %v at once",
					first.LeaseID, first.Fence, stamp(first.GrantedAt), stamp(first.EndedAt), second.LeaseID, second.Fence, stamp(second.GrantedAt), first.Claim.Overlap(second.Claim))})
			}
		}
	}
	return out
}

// checkNoLateWrite: every write under a lease landed no later than bound
// after the lease's revoke returned, or after an overlapping lease was
// granted, whichever came first; and only under leases that were granted.
func checkNoLateWrite(h *History, bound time.Duration) []Violation {
	gs := h.Grants()
	byID := map[string]Grant{}
	for _, g := range gs {
		byID[g.LeaseID] = g
	}
	// deadline per lease: the first of its revoke and the next overlapping grant.
	deadline := map[string]time.Time{}
	why := map[string]string{}
	for _, g := range gs {
		if !g.RevokedAt.IsZero() {
			deadline[g.LeaseID], why[g.LeaseID] = g.RevokedAt, "its revoke returned"
		}
		for _, o := range gs {
			if o.LeaseID == g.LeaseID || !overlapping(g, o) || !o.GrantedAt.After(g.GrantedAt) {
				continue
			}
			if d, ok := deadline[g.LeaseID]; !ok || o.GrantedAt.Before(d) {
				deadline[g.LeaseID], why[g.LeaseID] = o.GrantedAt, o.LeaseID+" was granted"
			}
		}
	}
	var out []Violation
	late := map[string]int{} // per lease and boundary, reported once with a count
	first := map[string]Write{}
	for _, w := range h.Writes() {
		if _, ok := byID[w.LeaseID]; !ok {
			out = append(out, Violation{"no-late-write", fmt.Sprintf("%s write at %s under lease %q, which was never granted (%s)", w.Boundary, stamp(w.At), w.LeaseID, w.Detail)})
			continue
		}
		d, ok := deadline[w.LeaseID]
		if !ok || !w.At.After(d.Add(bound)) {
			continue
		}
		k := w.LeaseID + "/" + w.Boundary
		if late[k] == 0 || w.At.Before(first[k].At) {
			first[k] = w
		}
		late[k]++
	}
	for _, k := range sortedKeys(late) {
		w := first[k]
		d := deadline[w.LeaseID]
		out = append(out, Violation{"no-late-write", fmt.Sprintf("%d %s writes under %s (fence %d) landed more than %s after %s at %s; the first %s after (%s)",
			late[k], w.Boundary, w.LeaseID, byID[w.LeaseID].Fence, bound, why[w.LeaseID], stamp(d), w.At.Sub(d).Round(time.Millisecond), w.Detail)})
	}
	return out
}

// checkFences: fences are unique, rise with the grant order of each repo,
// and a write that carries a fence carries its lease's.
func checkFences(h *History) []Violation {
	gs := h.Grants()
	var out []Violation
	seen := map[string]string{} // repo/fence -> lease
	byRepo := map[string][]Grant{}
	for _, g := range gs {
		k := fmt.Sprintf("%s/%d", g.Repo, g.Fence)
		if other, dup := seen[k]; dup {
			out = append(out, Violation{"fences", fmt.Sprintf("fence %d of %s given to both %s and %s", g.Fence, g.Repo, other, g.LeaseID)})
		}
		seen[k] = g.LeaseID
		byRepo[g.Repo] = append(byRepo[g.Repo], g)
	}
	for _, repo := range sortedKeys(byRepo) {
		rgs := byRepo[repo]
		sort.SliceStable(rgs, func(i, j int) bool { return rgs[i].GrantedAt.Before(rgs[j].GrantedAt) })
		for i := 1; i < len(rgs); i++ {
			if rgs[i].Fence <= rgs[i-1].Fence && rgs[i].GrantedAt.After(rgs[i-1].GrantedAt) {
				out = append(out, Violation{"fences", fmt.Sprintf("%s granted %s at %s with fence %d, not above %s's %d granted at %s",
					repo, rgs[i].LeaseID, stamp(rgs[i].GrantedAt), rgs[i].Fence, rgs[i-1].LeaseID, rgs[i-1].Fence, stamp(rgs[i-1].GrantedAt))})
			}
		}
	}
	byID := map[string]Grant{}
	for _, g := range gs {
		byID[g.LeaseID] = g
	}
	bad := map[string]int{}
	for _, w := range h.Writes() {
		if g, ok := byID[w.LeaseID]; ok && w.Fence != 0 && w.Fence != g.Fence {
			bad[fmt.Sprintf("%s write under %s carried fence %d, the lease's is %d", w.Boundary, w.LeaseID, w.Fence, g.Fence)]++
		}
	}
	for _, k := range sortedKeys(bad) {
		out = append(out, Violation{"fences", fmt.Sprintf("%s (%d writes)", k, bad[k])})
	}
	return out
}

func stamp(t time.Time) string {
	if t.IsZero() {
		return "never"
	}
	return t.Format("15:04:05.000000")
}
