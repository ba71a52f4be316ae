// Delivery: a push that passed goes upstream with the fence as push
// options and headers, and the upstream's answer goes back unchanged.

package gitproxy

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// gitGrantKey is the git grant key of the proxy's lease, nil when its
// source holds none.
func (p *Proxy) gitGrantKey() []byte {
	if g, ok := p.cfg.Lease.(lease.Granter); ok {
		if k := g.GrantKeys(); k != nil {
			return k.Git
		}
	}
	return nil
}

// forward sends the push upstream: the client's commands and push
// options plus the fence (as push options when the upstream takes them,
// and as headers), then the pack exactly as received. The upstream's
// answer goes back to the client unchanged.
func (p *Proxy) forward(w http.ResponseWriter, r *http.Request, ps *push, changes []refChange) {
	var extra []string
	takes := ps.req.has("push-options") || p.takesPushOptions(r, ps.repoPath)
	if !takes && p.gitGrantKey() != nil {
		// The lease has a git grant key: the repository's hook checks
		// fences, and a push without one would be refused there or, worse,
		// land unfenced past a hook that lets unfenced pushes through.
		p.refuseAll(r.Context(), w, ps, refuse(ReasonBadPush, "cannot fence this push: the git server does not advertise push-options for %s, so the fence (lease %s, fence %d) cannot reach its pre-receive hook; set receive.advertisePushOptions=true on the server (fenceline hook install does)", ps.repoPath, ps.lease.LeaseID, ps.fence), "ok")
		return
	}
	if takes {
		updates := make([]RefUpdate, len(ps.req.Commands))
		for i, c := range ps.req.Commands {
			updates[i] = RefUpdate(c)
		}
		var err error
		extra, err = FenceOptions(p.gitGrantKey(), ps.lease, ps.fence, updates)
		if err != nil {
			p.refuseAll(r.Context(), w, ps, refuse(ReasonBadPush, "cannot sign the fence: %v", err), "ok")
			return
		}
	}
	head := ps.req.encodeHead(extra)
	body := io.Reader(bytes.NewReader(head))
	length := int64(len(head))
	if ps.pack != nil {
		if _, err := ps.pack.spool.Seek(0, io.SeekStart); err != nil {
			p.fail(r.Context(), w, ps, fmt.Errorf("rewind pack: %w", err))
			return
		}
		body = io.MultiReader(body, bufio.NewReaderSize(ps.pack.spool, 64<<10))
		length += ps.pack.size
	}
	out, err := p.upstreamRequest(r, endpoint{repo: ps.repoPath, service: serviceReceive}, http.MethodPost, body)
	if err != nil {
		p.fail(r.Context(), w, ps, err)
		return
	}
	out.ContentLength = length
	out.Header.Set(HeaderLease, ps.lease.LeaseID)
	out.Header.Set(HeaderFence, strconv.FormatUint(ps.fence, 10))
	resp, err := p.client.Do(out)
	if err != nil {
		p.log.Warn("push not delivered", "lease", ps.lease.LeaseID, "fence", ps.fence, "err", err)
		p.refuseAll(r.Context(), w, ps, refuse(ReasonUpstream, "the upstream git server did not answer the push (it may or may not have landed: fetch to see): %v", err), "ok")
		return
	}
	defer resp.Body.Close()
	copyHeaders(w.Header(), resp.Header, "Content-Type", "Cache-Control", "Expires", "Pragma", "WWW-Authenticate")
	w.WriteHeader(resp.StatusCode)
	io.Copy(flushWriter{w}, resp.Body)
	paths := 0
	for _, c := range changes {
		paths += len(c.paths)
	}
	p.log.Info("push forwarded", "lease", ps.lease.LeaseID, "fence", ps.fence, "refs", len(changes), "paths", paths,
		"status", resp.StatusCode, "packBytes", packSize(ps.pack), "received", ps.received, "analyzed", ps.analyzed, "total", time.Since(ps.start))
}

func packSize(pp *pushPack) int64 {
	if pp == nil {
		return 0
	}
	return pp.size
}

// flushWriter flushes after every write so progress reaches git at once.
type flushWriter struct{ w http.ResponseWriter }

func (f flushWriter) Write(b []byte) (int, error) {
	n, err := f.w.Write(b)
	http.NewResponseController(f.w).Flush()
	return n, err
}
