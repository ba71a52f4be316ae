// The push decision: a receive-pack request read, its pack received and
// scanned, its history analyzed, and every ref update judged before
// anything goes upstream.

package gitproxy

import (
	"bufio"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/go-git/go-git/v5/plumbing"

	"github.com/fenceline/fenceline/lease"
)

// push is one receive-pack request being judged.
type push struct {
	start              time.Time
	received, analyzed time.Duration // since start: pack received and scanned; paths computed
	req                *pushRequest
	lease              lease.Lease
	fence              uint64
	pack               *pushPack // nil for a delete-only push
	bases              layered   // see Proxy.bases
	repoPath           string
	r                  *http.Request // the client's request (its credentials reach the upstream)
}

// receivePack judges a push and forwards it only when every ref update
// passes. Nothing is sent upstream before the decision.
func (p *Proxy) receivePack(w http.ResponseWriter, r *http.Request, e endpoint) {
	ctx := r.Context()
	body := io.Reader(r.Body)
	if r.Header.Get("Content-Encoding") == "gzip" {
		zr, err := gzip.NewReader(r.Body)
		if err != nil {
			http.Error(w, "fenceline: request body is not valid gzip: "+err.Error(), http.StatusBadRequest)
			return
		}
		defer zr.Close()
		body = zr
	}
	br := bufio.NewReaderSize(body, 64<<10)
	ps := p.readPush(w, r, e, br)
	if ps == nil {
		return // answered
	}
	// A push whose lease is already gone is refused before its pack is
	// scanned; the pack is still read, so the client gets the report.
	if ref := p.leaseGate(ps); ref != nil {
		io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	if ps.req.hasPack() {
		pp, err := newPushPack(p.cfg.TempDir)
		if err != nil {
			io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
			p.fail(ctx, w, ps, err)
			return
		}
		defer pp.remove()
		ps.pack = pp
		if ref, unpack := p.scanPack(ctx, ps, br); ref != nil {
			p.refuseAll(ctx, w, ps, ref, unpack)
			return
		}
	} else if n, _ := io.Copy(io.Discard, io.LimitReader(br, 1)); n > 0 {
		p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "a delete-only push must not carry a pack"), "ok")
		return
	}
	ps.received = time.Since(ps.start)
	p.judgePush(ctx, w, r, ps)
}

// readPush reads a push request's commands and options, and answers what
// is not a push to judge: git's pre-flight probe (relayed), a malformed or
// signed request, fence options of the client's own (refused). It returns
// nil when it answered.
func (p *Proxy) readPush(w http.ResponseWriter, r *http.Request, e endpoint, br *bufio.Reader) *push {
	ctx := r.Context()
	req, err := readPushRequest(br)
	if errors.Is(err, errProbe) {
		if n, _ := io.Copy(io.Discard, io.LimitReader(br, 1)); n == 0 {
			p.probe(w, r, e)
			return nil
		}
		err = errors.New("a push request without ref updates must end at its flush packet")
	}
	if err != nil {
		p.badPush(w, r, br, req, err)
		return nil
	}
	ps := &push{req: req, repoPath: e.repo, start: time.Now(), r: r}

	// The fence options are the sidecar's to set: an agent's own would
	// only try to mislead the hook.
	for _, o := range req.Options {
		if k, _, _ := strings.Cut(o, "="); strings.HasPrefix(k, "fenceline-") {
			io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
			ps.lease = p.currentLease()
			p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "push option %s is reserved: the fence sets the fenceline-* options itself", clip(k)), "ok")
			return nil
		}
	}
	return ps
}

// badPush refuses a push request that could not be read (err; req is
// what was read of it): in its report-status when git reads one, else as
// an HTTP error.
func (p *Proxy) badPush(w http.ResponseWriter, r *http.Request, br *bufio.Reader, req *pushRequest, err error) {
	ctx := r.Context()
	ref := refuse(ReasonBadPush, "bad push request: %v", err)
	if errors.Is(err, errSigned) {
		ref = refuse(ReasonSignedPush, "%v", err)
	}
	if req != nil && len(req.Commands) > 0 && (req.has("report-status") || req.has("report-status-v2")) {
		// git reads the reason from its report-status.
		io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
		p.refuseAll(ctx, w, &push{req: req, lease: p.currentLease(), r: r}, ref, "ok")
		return
	}
	p.auditRefusal(ctx, p.currentLease(), 0, ref, "")
	http.Error(w, ref.msg, http.StatusBadRequest)
}

// scanPack receives the push's pack into ps.pack and scans it against the
// bases, fetching the mirror once when the pack reaches objects they
// lack. A pack not accepted is refused with the unpack status git shows.
func (p *Proxy) scanPack(ctx context.Context, ps *push, br *bufio.Reader) (*refusal, string) {
	scanErr, err := ps.pack.receive(br, p.cfg.MaxPushBytes, p.bases(ps))
	if err != nil {
		return refuse(ReasonBadPush, "pack not accepted: %v", err), "fenceline: " + oneLine(err.Error(), 200)
	}
	if errors.Is(scanErr, errUnresolved) {
		if err := p.refreshMirror(ctx, ps); err == nil {
			scanErr = ps.pack.rescan(p.bases(ps))
		}
	}
	if scanErr != nil {
		return refuse(ReasonBadPush, "pack not accepted: %v", scanErr), "fenceline: " + oneLine(scanErr.Error(), 200)
	}
	return nil, ""
}

// judgePush decides a received push: its history analyzed, the lease
// checked with the bus, each ref update judged against the other leases
// and the policies, the lease confirmed last. Any refusal refuses the
// whole push; otherwise it is forwarded.
func (p *Proxy) judgePush(ctx context.Context, w http.ResponseWriter, r *http.Request, ps *push) {
	changes, err := p.analyze(ctx, ps)
	ps.analyzed = time.Since(ps.start)
	if err != nil {
		p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "cannot read the pushed history: %v", err), "ok")
		return
	}
	// The decision is taken now, against the bus; the lease itself is
	// confirmed last (confirm).
	if ref := p.leaseGate(ps); ref != nil {
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	others, ref := p.busCheck(ctx, ps)
	if ref != nil {
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	refused, ref := p.blindDeletes(ctx, ps, changes)
	if ref != nil {
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	if p.judgeChanges(ctx, ps, others, changes, refused) {
		p.refuseRefs(ctx, w, ps, refused)
		return
	}
	// Judging took bus reads and upstream reads: the lease is confirmed
	// once more, last, so that what goes upstream was vouched for by the
	// service moments ago, not before all that.
	if ref := p.confirm(ctx, ps); ref != nil {
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	p.forward(w, r, ps, changes)
}

// judgeChanges judges each ref update not already refused (refused[i])
// against the lease, the other leases (others) and the policy, then the
// security team's policy, and reports whether any was refused.
func (p *Proxy) judgeChanges(ctx context.Context, ps *push, others []*lease.Lease, changes []refChange, refused []*refusal) bool {
	anyRefused := false
	for i, rc := range changes {
		if refused[i] == nil {
			refused[i] = judge(ps.lease, others, rc, p.cfg.Policy)
		}
		if refused[i] == nil {
			refused[i] = judgePolicy(ctx, p.cfg.Cedar, ps.lease, rc, p.cfg.Audit, p.log)
		}
		anyRefused = anyRefused || refused[i] != nil
	}
	return anyRefused
}

// blindDeletes looks up, on the upstream, the refs that commands delete
// without naming their value. One the upstream lacks is deleted by no one:
// the command passes whatever the policy (the upstream warns, as it does
// to a direct push). One it has would go whatever its value, so the
// command is refused: the client's view of the ref is stale.
func (p *Proxy) blindDeletes(ctx context.Context, ps *push, changes []refChange) ([]*refusal, *refusal) {
	refused := make([]*refusal, len(changes))
	var refs map[string]string
	for i := range changes {
		c := changes[i].cmd
		if !c.isBlindDelete() {
			continue
		}
		if refs == nil {
			var err error
			if refs, err = p.upstreamRefs(ctx, ps, "git-receive-pack"); err != nil {
				return nil, refuse(ReasonBadPush, "deleting %s, which the push names no value for: %v", c.Ref, err)
			}
		}
		if oid, ok := refs[c.Ref]; ok {
			refused[i] = refuse(ReasonStaleDelete, "%s exists on the server (at %s), but the push deletes it without naming its value: fetch, then delete it again", c.Ref, oid)
			continue
		}
		changes[i].absent = true
	}
	return refused, nil
}

// analyze computes each command's touched paths, fetching the mirror once
// when the pushed history reaches objects the bases lack. A push that
// creates a ref first asks the upstream for its default branch: a new ref
// is judged against it.
func (p *Proxy) analyze(ctx context.Context, ps *push) ([]refChange, error) {
	var base plumbing.Hash
	for _, c := range ps.req.Commands {
		if c.isCreate() && !c.isDelete() {
			refs, err := p.upstreamRefs(ctx, ps, "git-upload-pack")
			if err != nil {
				return nil, fmt.Errorf("a new ref is judged against the upstream's default branch: %w", err)
			}
			if h, ok := refs["HEAD"]; ok {
				base = plumbing.NewHash(h)
			}
			break
		}
	}
	run := func(final bool) ([]refChange, error) {
		st := p.bases(ps)
		if ps.pack != nil {
			st = append(layered{ps.pack.objs}, st...)
		}
		a := newAnalyzer(st, ps.pack.pushed)
		a.final = final
		a.base = base
		return a.analyze(ctx, ps.req.Commands)
	}
	changes, err := run(false)
	if errors.Is(err, plumbing.ErrObjectNotFound) {
		// The bases lack something the upstream has: fetch the mirror
		// (when there is one) and look again, this time for good.
		if err := p.refreshMirror(ctx, ps); err != nil {
			p.log.Debug("no mirror refresh", "err", err)
		}
		changes, err = run(true)
	}
	return changes, err
}
