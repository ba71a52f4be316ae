// Refusal replies: the report-status that makes git print each refused
// ref's reason, and the audit of every refusal.

package gitproxy

import (
	"context"
	"net/http"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// refuseAll refuses every ref of a push for one reason.
func (p *Proxy) refuseAll(ctx context.Context, w http.ResponseWriter, ps *push, ref *refusal, unpack string) {
	all := make([]*refusal, len(ps.req.Commands))
	for i := range all {
		all[i] = ref
	}
	p.respond(ctx, w, ps, all, unpack, []*refusal{ref})
}

// refuseRefs refuses a push of which some refs were refused: the push
// goes as a whole or not at all, so the rest are refused too.
func (p *Proxy) refuseRefs(ctx context.Context, w http.ResponseWriter, ps *push, refused []*refusal) {
	var first string
	var causes []*refusal
	for i, ref := range refused {
		if ref != nil {
			causes = append(causes, ref)
			if first == "" {
				first = ps.req.Commands[i].Ref
			}
		}
	}
	for i := range refused {
		if refused[i] == nil {
			refused[i] = refuse(ReasonWholePush, "not pushed: %s in the same push was refused", first)
		}
	}
	p.respond(ctx, w, ps, refused, "ok", causes)
}

// respond writes the report-status that makes git push print each reason,
// and audits the causes.
func (p *Proxy) respond(ctx context.Context, w http.ResponseWriter, ps *push, refused []*refusal, unpack string, causes []*refusal) {
	for _, c := range causes {
		p.auditRefusal(ctx, ps.lease, ps.fence, c, refsOf(ps.req.Commands, refused, c))
	}
	rw := &reportWriter{req: ps.req}
	for _, c := range causes {
		rw.progress(c.msg)
	}
	reasons := make([]string, len(refused))
	for i, ref := range refused {
		reasons[i] = ref.msg
	}
	rw.report(unpack, reasons)
	w.Header().Set("Content-Type", "application/x-git-receive-pack-result")
	w.Header().Set("Cache-Control", "no-cache")
	if !ps.req.has("report-status") && !ps.req.has("report-status-v2") && !ps.req.has("side-band-64k") && !ps.req.has("side-band") {
		http.Error(w, causes[0].msg, http.StatusForbidden)
		return
	}
	w.Write(rw.bytes())
}

func refsOf(cmds []command, refused []*refusal, c *refusal) string {
	var refs []string
	for i, r := range refused {
		if r == c {
			refs = append(refs, cmds[i].Ref)
		}
	}
	return strings.Join(refs, " ")
}

// auditRefusal records a refused request, push or ref with lease, owner, fence and
// reason. Recording failures are logged; the push stays refused.
func (p *Proxy) auditRefusal(ctx context.Context, l lease.Lease, fence uint64, ref *refusal, refs string) {
	if fence == 0 {
		fence = l.Fence
	}
	if l.Repo == "" {
		l.Repo = p.cfg.Repo
	}
	msg := ref.msg
	if refs != "" {
		msg = "push to " + refs + " refused: " + strings.TrimPrefix(msg, "fenceline: ")
	}
	p.log.Warn("refused", "lease", l.LeaseID, "fence", fence, "reason", ref.code, "refs", refs, "detail", ref.msg)
	if p.cfg.Audit == nil || l.Repo == "" {
		return
	}
	ev := lease.AuditEvent{
		Time:     time.Now().UTC(),
		Type:     lease.EventDenied,
		Boundary: lease.BoundaryGit,
		Repo:     l.Repo,
		LeaseID:  l.LeaseID,
		Owner:    l.Owner,
		Scope:    l.Scope,
		Fence:    fence,
		Reason:   ref.code,
		Message:  msg,
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), p.cfg.BusTimeout)
	defer cancel()
	if err := p.cfg.Audit.Record(ctx, ev); err != nil {
		p.log.Error("audit of a refused push not recorded", "lease", l.LeaseID, "fence", fence, "reason", ref.code, "err", err)
	}
}

// fail answers the fence's own error without forwarding anything, in the
// push's report-status.
func (p *Proxy) fail(ctx context.Context, w http.ResponseWriter, ps *push, err error) {
	p.log.Error("push not handled", "err", err)
	p.refuseAll(ctx, w, ps, refuse(ReasonFenceError, "push not handled: %v", err), "ok")
}
