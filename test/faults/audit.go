package faults

// Audit completeness: what the clients were told against what the audit
// stream says, for both halves of the harness.

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// AuditCheck is the audit-completeness invariant over a History whose
// audit stream was read (History.Audit): every acknowledged grant is in
// the audit exactly once, with the fence its holder got; every
// acknowledged end (a release or revoke the service answered as done) is
// there exactly once, as that end; every abandoned lease ends there
// exactly once (reclaimed, expired or revoked); every refused acquire's
// attempt is there; and no lease, acknowledged or not, is granted twice or
// ends twice in the audit.
func AuditCheck() Check { return Check{Name: "audit", Run: checkAuditComplete} }

// endEvents are the audit event types that end a lease.
var endEvents = []string{lease.EventRelease, lease.EventRevoked, lease.EventReclaimed, lease.EventExpired}

func checkAuditComplete(h *History) []Violation {
	h.mu.Lock()
	evs, read := h.audit, h.auditRead
	refusedAtt := make([]string, 0, len(h.refused))
	for att := range h.refused {
		refusedAtt = append(refusedAtt, att)
	}
	h.mu.Unlock()
	if !read {
		return []Violation{{"audit", "the audit stream was not read (History.Audit)"}}
	}
	slices.Sort(refusedAtt)
	grants := map[string][]uint64{} // lease -> fences of its grant events
	ends := map[string][]string{}   // lease -> its end events' types
	refused := map[string]int{}     // attempt id -> refusal events
	for _, ev := range evs {
		if ev.Boundary != lease.BoundaryLease {
			continue
		}
		switch {
		case ev.Type == lease.EventGrant && ev.LeaseID != "":
			grants[ev.LeaseID] = append(grants[ev.LeaseID], ev.Fence)
		case slices.Contains(endEvents, ev.Type) && ev.LeaseID != "":
			ends[ev.LeaseID] = append(ends[ev.LeaseID], ev.Type)
		case ev.Type == lease.EventRefused && ev.LeaseID == "":
			refused[ev.Owner.AttemptID]++
		}
	}
	var out []Violation
	add := func(format string, args ...any) {
		out = append(out, Violation{"audit", fmt.Sprintf(format, args...)})
	}
	for _, g := range h.Grants() {
		switch fs := grants[g.LeaseID]; {
		case len(fs) == 0:
			add("grant of %s (fence %d, granted %s) is not in the audit", g.LeaseID, g.Fence, stamp(g.GrantedAt))
		case len(fs) > 1:
			// Reported below for every lease.
		case fs[0] != g.Fence:
			add("grant of %s: its holder got fence %d, the audit says %d", g.LeaseID, g.Fence, fs[0])
		}
		es := ends[g.LeaseID]
		switch {
		case g.End != "" && !slices.Contains(es, g.End):
			add("%s of %s (acknowledged, ended %s) is not in the audit (its ends there: %v)", g.End, g.LeaseID, stamp(g.EndedAt), es)
		case g.Abandoned && g.End == "" && len(es) == 0:
			add("abandoned %s (fence %d) never ends in the audit: no reclaim, expiry or revoke", g.LeaseID, g.Fence)
		}
	}
	for _, id := range sortedKeys(grants) {
		if n := len(grants[id]); n > 1 {
			add("%s is granted %d times in the audit (fences %v)", id, n, grants[id])
		}
	}
	for _, id := range sortedKeys(ends) {
		if es := ends[id]; len(es) > 1 {
			add("%s ends %d times in the audit: %s", id, len(es), strings.Join(es, ", "))
		}
	}
	for _, att := range refusedAtt {
		if refused[att] == 0 {
			add("the refusal of attempt %s (acknowledged to its client) is not in the audit", att)
		}
	}
	return out
}

// EndsFromAudit sets the EndedAt of every grant without one to the time of
// the audit event that ends it (the service's clock, as its endedAt), if
// the audit has exactly one.
func (h *History) EndsFromAudit() {
	h.mu.Lock()
	defer h.mu.Unlock()
	ends := map[string][]time.Time{}
	for _, ev := range h.audit {
		if ev.Boundary == lease.BoundaryLease && ev.LeaseID != "" && slices.Contains(endEvents, ev.Type) {
			ends[ev.LeaseID] = append(ends[ev.LeaseID], ev.Time)
		}
	}
	for id, g := range h.grants {
		if e := ends[id]; g.EndedAt.IsZero() && len(e) == 1 {
			g.EndedAt = e[0]
		}
	}
}

// AwaitAudit reads the audit with read and records it in h until
// AuditCheck finds nothing missing or within has passed (the audit writer
// gathers events for a moment, a reclaim waits for its deadline), and
// returns the last read's error, if the last read failed.
func AwaitAudit(ctx context.Context, h *History, within time.Duration, read func(context.Context) ([]lease.AuditEvent, error)) error {
	deadline := time.Now().Add(within)
	for {
		rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		evs, err := read(rctx)
		cancel()
		if err == nil {
			h.Audit(evs)
			if len(checkAuditComplete(h)) == 0 {
				return nil
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return err
		}
		select { // polling the audit stream
		case <-ctx.Done():
		case <-time.After(250 * time.Millisecond):
		}
	}
}

// readAuditFromLeader reads a repo's audit events as leasebus.ReadAudit
// does, but from the audit stream's leader: a direct get may be answered by
// a follower still catching up (a node just restarted), which would show
// only a prefix of the stream.
func readAuditFromLeader(ctx context.Context, nc *nats.Conn, repo string) ([]lease.AuditEvent, error) {
	filter := leasebus.AuditSubject + "." + leasebus.RepoKey(repo) + ".*"
	var out []lease.AuditEvent
	for seq := uint64(1); ; {
		req, err := json.Marshal(map[string]any{"seq": seq, "next_by_subj": filter})
		if err != nil {
			return nil, err
		}
		resp, err := nc.RequestWithContext(ctx, "$JS.API.STREAM.MSG.GET."+leasebus.AuditStream, req)
		if err != nil {
			return out, fmt.Errorf("read audit stream at %d: %w", seq, err)
		}
		var r struct {
			Error *struct {
				Code    int    `json:"code"`
				ErrCode int    `json:"err_code"`
				Desc    string `json:"description"`
			} `json:"error"`
			Message *struct {
				Seq  uint64 `json:"seq"`
				Data []byte `json:"data"`
			} `json:"message"`
		}
		if err := json.Unmarshal(resp.Data, &r); err != nil {
			return out, fmt.Errorf("read audit stream at %d: %w", seq, err)
		}
		if r.Error != nil {
			if r.Error.Code == 404 {
				return out, nil
			}
			return out, fmt.Errorf("read audit stream at %d: %s (%d)", seq, r.Error.Desc, r.Error.ErrCode)
		}
		if r.Message == nil {
			return out, fmt.Errorf("read audit stream at %d: no message in the answer", seq)
		}
		var b struct {
			Events []lease.AuditEvent `json:"events"`
		}
		if err := json.Unmarshal(r.Message.Data, &b); err != nil {
			return out, fmt.Errorf("decode audit message %d: %w", r.Message.Seq, err)
		}
		out = append(out, b.Events...)
		seq = r.Message.Seq + 1
	}
}
