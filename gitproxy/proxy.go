package gitproxy

import (
	"bufio"
	"bytes"
	"cmp"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/go-git/go-git/v5/plumbing"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// LeaseSource is the lease the proxy pushes under; *leasebus.Holder is one.
// Fence returns an error once the holder no longer considers the lease
// held.
type LeaseSource interface {
	Fence() (uint64, error)
	Lease() lease.Lease
}

// LeaseView reads the bus at decision time; *leasebus.Client is one.
type LeaseView interface {
	Get(ctx context.Context, leaseID string) (*lease.Lease, error)
	List(ctx context.Context, repo string, all bool) ([]*lease.Lease, error)
}

// Auditor records refusals; *leasebus.Auditor is one.
type Auditor interface {
	Record(ctx context.Context, ev lease.AuditEvent) error
}

// Push options and HTTP headers that carry the fence to the upstream.
const (
	OptionLease  = "fenceline-lease"
	OptionFence  = "fenceline-fence"
	OptionRepo   = "fenceline-repo"
	OptionClaim  = "fenceline-claim"
	HeaderLease  = "Fenceline-Lease"
	HeaderFence  = "Fenceline-Fence"
	defaultLimit = 4 << 30
)

// Config configures a Proxy. Upstream and Bus are required; without a
// Lease every push is refused (fetches still pass).
type Config struct {
	// Upstream is the URL of the repository on the smart-HTTP git server,
	// e.g. https://git.example.com/acme/payments.git. The fence serves
	// git's smart-HTTP endpoints of that repository, at the same path
	// (/acme/payments.git/info/refs…, also spelled without ".git"), and
	// refuses every other request. A URL without a path serves the
	// endpoints of every repository on the server and then may carry no
	// credential (UpstreamHeader, user info).
	Upstream string
	// Lease is the lease pushes are made under.
	Lease LeaseSource
	// Repo is the bus's name of the repository, for audit events of pushes
	// refused before a lease is known (default: the lease's repo).
	Repo string
	// Bus is read when a push is decided: the lease must still be active
	// with the same fence, and no other active lease may claim a touched path.
	Bus LeaseView
	// Audit receives every refusal (nil: refusals are only logged).
	Audit Auditor
	// Policy for history rewrites and ref deletions.
	Policy Policy
	// Cedar, when set, is the security team's policy: every ref update
	// is asked as push on its ref and as write on every path it touches
	// (policyhook.go). It only narrows what Policy allows. Nil: none.
	Cedar *policy.Store
	// ObjectDirs are git directories whose objects resolve thin-pack bases
	// and the parents of pushed commits — normally the agent's repository
	// (for a linked worktree, its common git dir).
	ObjectDirs []string
	// MirrorDir keeps a mirror of each upstream repository, fetched when a
	// push needs objects that ObjectDirs lack. Empty disables the mirror.
	MirrorDir string
	// TempDir holds each push's pack while it is judged (default os.TempDir()).
	TempDir string
	// MaxPushBytes bounds the pack of one push (default 4 GiB).
	MaxPushBytes int64
	// UpstreamHeader is added to every request the fence sends upstream —
	// only ever one of git's smart-HTTP endpoints of Upstream's repository
	// — e.g. the Authorization the sidecar holds so the agent never sees it.
	UpstreamHeader http.Header
	// UpstreamCAFile, when set, is the CA bundle git uses to fetch the mirror.
	UpstreamCAFile string
	// Transport for upstream requests (default: http.DefaultTransport's
	// settings with large buffers).
	Transport http.RoundTripper
	// The fence sent to the git server's pre-receive hook is signed with
	// the lease's git grant key, which Lease gives when it is a
	// lease.Granter (a *leasebus.Holder is: the lease service hands the key
	// to the acquirer). Without one the fence still travels, unsigned, and
	// a hook that checks fences refuses the push saying the MAC is missing.
	// BusTimeout bounds the bus reads of one decision (default 5 s).
	BusTimeout time.Duration
	// Git is the git binary (default "git" from PATH).
	Git    string
	Logger *slog.Logger
}

// Validate reports what is wrong with c.
func (c *Config) Validate() error {
	if c.Upstream == "" {
		return errors.New("gitproxy: no upstream: set the URL of the git server to push to")
	}
	up, err := ParseUpstream(c.Upstream)
	if err != nil {
		return fmt.Errorf("gitproxy: %w", err)
	}
	repo := strings.TrimSuffix(up.Path, "/")
	if repo != "" {
		if err := checkRepoPath(repo); err != nil || up.RawPath != "" || up.RawQuery != "" || up.Fragment != "" {
			return fmt.Errorf("gitproxy: upstream %s: the path names the one repository the fence serves: %v", up.Redacted(), cmp.Or(err, errors.New("want no escapes, query or fragment")))
		}
	}
	for k := range c.UpstreamHeader {
		if !isToken(k) {
			return fmt.Errorf("gitproxy: upstream header name %q is not an HTTP token", k)
		}
	}
	if repo == "" && (len(c.UpstreamHeader) > 0 || up.User != nil) {
		return fmt.Errorf("gitproxy: upstream %s names no repository: the fence lends its upstream credential only to one repository's git endpoints; give the repository's URL, e.g. %s://%s/acme/payments.git", up.Redacted(), up.Scheme, up.Host)
	}
	if c.Bus == nil {
		return errors.New("gitproxy: no bus: pushes are decided against the lease bus")
	}
	if c.MaxPushBytes < 0 || c.BusTimeout < 0 {
		return errors.New("gitproxy: MaxPushBytes and BusTimeout must not be negative")
	}
	return nil
}

// Proxy is the git smart-HTTP fence: an http.Handler in front of one
// upstream repository. Fetches and clones pass through untouched; pushes
// are judged; nothing else is served (see endpoint.go).
type Proxy struct {
	cfg      Config
	upstream *url.URL // scheme, user info and host of the git server
	repo     string   // the repository served, e.g. /acme/payments.git ("": any)
	git      gitRunner
	client   *http.Client
	log      *slog.Logger

	pushOptions sync.Map // upstream repo path -> bool: advertises push-options
	mirrorMu    sync.Map // mirror dir -> *sync.Mutex
}

// New returns a Proxy for cfg.
func New(cfg Config) (*Proxy, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.TempDir == "" {
		cfg.TempDir = os.TempDir()
	}
	if cfg.MaxPushBytes == 0 {
		cfg.MaxPushBytes = defaultLimit
	}
	if cfg.BusTimeout == 0 {
		cfg.BusTimeout = 5 * time.Second
	}
	if cfg.Transport == nil {
		tr := http.DefaultTransport.(*http.Transport).Clone()
		tr.WriteBufferSize = 256 << 10 // packs go upstream in large writes
		tr.ReadBufferSize = 64 << 10
		cfg.Transport = tr
	}
	if cfg.Git == "" {
		cfg.Git = "git"
	}
	gitPath, err := exec.LookPath(cfg.Git)
	if err != nil {
		return nil, fmt.Errorf("gitproxy: git is needed to index pushed packs: %w", err)
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	up, _ := url.Parse(cfg.Upstream)
	p := &Proxy{
		cfg:      cfg,
		upstream: &url.URL{Scheme: up.Scheme, User: up.User, Host: up.Host},
		repo:     strings.TrimSuffix(up.Path, "/"),
		git:      gitRunner{path: gitPath},
		client: &http.Client{
			Transport: cfg.Transport,
			// A redirect goes back to git, which follows it through
			// the fence (judged again) or without the credential; the
			// fence never carries the credential to where it points.
			CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse },
		},
		log: log,
	}
	return p, nil
}

// pass relays a fetch's request to e upstream and streams the answer
// back: the URL is e's, the client's headers only git's own, and the
// upstream's cookies stay with the fence (they would be the credential's).
func (p *Proxy) pass(e endpoint) *httputil.ReverseProxy {
	return &httputil.ReverseProxy{
		Rewrite: func(r *httputil.ProxyRequest) {
			r.Out.URL = p.endpointURL(e)
			r.Out.Host = p.upstream.Host
			r.Out.Header = http.Header{}
			copyHeaders(r.Out.Header, r.In.Header, gitRequestHeaders...)
			p.addUpstreamHeader(r.Out.Header)
		},
		ModifyResponse: func(resp *http.Response) error {
			resp.Header.Del("Set-Cookie")
			return nil
		},
		Transport:     p.cfg.Transport,
		FlushInterval: -1,
		ErrorHandler: func(w http.ResponseWriter, r *http.Request, err error) {
			p.log.Warn("upstream unreachable", "path", e.path(), "err", err)
			http.Error(w, "fenceline: upstream git server unreachable: "+err.Error(), http.StatusBadGateway)
		},
	}
}

func (p *Proxy) addUpstreamHeader(h http.Header) {
	for k, vs := range p.cfg.UpstreamHeader {
		h.Del(k)
		for _, v := range vs {
			h.Add(k, v)
		}
	}
}

// ServeHTTP routes a request for one of git's smart-HTTP endpoints of the
// repository: push requests are judged, fetches pass through (reads fail
// open). Every other request is refused (refuseRequest).
func (p *Proxy) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e, ok := parseEndpoint(r, p.repo)
	switch {
	case !ok:
		p.refuseRequest(w, r)
	case e.service == serviceReceive && e.refs:
		p.advertisement(w, r, e)
	case e.service == serviceReceive:
		p.receivePack(w, r, e)
	default:
		p.pass(e).ServeHTTP(w, r)
	}
}

// upstreamRequest is r's request for endpoint e upstream: the git
// client's protocol headers, then the sidecar's own (its credential wins).
func (p *Proxy) upstreamRequest(r *http.Request, e endpoint, method string, body io.Reader) (*http.Request, error) {
	out, err := http.NewRequestWithContext(r.Context(), method, p.endpointURL(e).String(), body)
	if err != nil {
		return nil, err
	}
	copyHeaders(out.Header, r.Header, "Authorization", "Git-Protocol", "User-Agent", "Accept", "Content-Type")
	p.addUpstreamHeader(out.Header)
	return out, nil
}

// advertisement relays the receive-pack ref advertisement and remembers
// whether the upstream takes push options, so the fence can travel as one.
func (p *Proxy) advertisement(w http.ResponseWriter, r *http.Request, e endpoint) {
	out, err := p.upstreamRequest(r, e, http.MethodGet, nil)
	if err != nil {
		http.Error(w, "fenceline: "+err.Error(), http.StatusBadRequest)
		return
	}
	resp, err := p.client.Do(out)
	if err != nil {
		http.Error(w, "fenceline: upstream git server unreachable: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		http.Error(w, "fenceline: read upstream advertisement: "+err.Error(), http.StatusBadGateway)
		return
	}
	if resp.StatusCode == http.StatusOK && resp.Header.Get("Content-Encoding") == "" {
		p.pushOptions.Store(e.repo, advertisesPushOptions(body))
		body = withoutCapability(body, "push-cert")
	}
	copyHeaders(w.Header(), resp.Header, "Content-Type", "Cache-Control", "Expires", "Pragma", "WWW-Authenticate", "Location")
	w.WriteHeader(resp.StatusCode)
	w.Write(body)
}

// advertisesPushOptions reads the capabilities of a receive-pack
// advertisement ("# service=…", flush, then "<oid> <ref>\0<caps>").
func advertisesPushOptions(body []byte) bool {
	pr := newPktReader(bufio.NewReader(bytes.NewReader(body)))
	for range 3 {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			continue
		}
		if err != nil {
			return false
		}
		if _, caps, ok := bytes.Cut(line, []byte{0}); ok {
			for _, c := range strings.Fields(string(caps)) {
				if c == "push-options" {
					return true
				}
			}
			return false
		}
	}
	return false
}

// withoutCapability removes capability name (and name=value) from a
// receive-pack advertisement; the rest is returned byte for byte. The
// proxy drops push-cert: it does not vouch for certificates, so git
// --signed=if-asked pushes unsigned and --signed=yes says the receiving
// end does not support signed pushes.
func withoutCapability(body []byte, name string) []byte {
	br := bufio.NewReader(bytes.NewReader(body))
	pr := newPktReader(br)
	off := 0
	for range 3 {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			off += pktHeaderLen
			continue
		}
		if err != nil {
			return body
		}
		end := off + pktHeaderLen + len(line)
		refPart, caps, ok := bytes.Cut(line, []byte{0})
		if !ok {
			off = end
			continue
		}
		nl := bytes.HasSuffix(caps, []byte("\n"))
		var kept []string
		for _, c := range strings.Fields(string(caps)) {
			if c != name && !strings.HasPrefix(c, name+"=") {
				kept = append(kept, c)
			}
		}
		payload := string(refPart) + "\x00" + strings.Join(kept, " ")
		if nl {
			payload += "\n"
		}
		out := append([]byte(nil), body[:off]...)
		out = appendPkt(out, payload)
		return append(out, body[end:]...)
	}
	return body
}

func copyHeaders(dst, src http.Header, keys ...string) {
	for _, k := range keys {
		for _, v := range src.Values(k) {
			dst.Add(k, v)
		}
	}
}

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
	req, err := readPushRequest(br)
	if errors.Is(err, errProbe) {
		if n, _ := io.Copy(io.Discard, io.LimitReader(br, 1)); n == 0 {
			p.probe(w, r, e)
			return
		}
		err = errors.New("a push request without ref updates must end at its flush packet")
	}
	if err != nil {
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
		return
	}
	ps := &push{req: req, repoPath: e.repo, start: time.Now(), r: r}

	// The fence options are the sidecar's to set: an agent's own would
	// only try to mislead the hook.
	for _, o := range req.Options {
		if k, _, _ := strings.Cut(o, "="); strings.HasPrefix(k, "fenceline-") {
			io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
			ps.lease = p.currentLease()
			p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "push option %s is reserved: the fence sets the fenceline-* options itself", clip(k)), "ok")
			return
		}
	}

	// A push whose lease is already gone is refused before its pack is
	// scanned; the pack is still read, so the client gets the report.
	if ref := p.leaseGate(ps); ref != nil {
		io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
		p.refuseAll(ctx, w, ps, ref, "ok")
		return
	}
	if req.hasPack() {
		pp, err := newPushPack(p.cfg.TempDir)
		if err != nil {
			io.Copy(io.Discard, io.LimitReader(br, p.cfg.MaxPushBytes))
			p.fail(ctx, w, ps, err)
			return
		}
		defer pp.remove()
		ps.pack = pp
		scanErr, err := pp.receive(br, p.cfg.MaxPushBytes, p.bases(ps))
		if err != nil {
			p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "pack not accepted: %v", err), "fenceline: "+oneLine(err.Error(), 200))
			return
		}
		if errors.Is(scanErr, errUnresolved) {
			if err := p.refreshMirror(ctx, ps); err == nil {
				scanErr = pp.rescan(p.bases(ps))
			}
		}
		if scanErr != nil {
			p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "pack not accepted: %v", scanErr), "fenceline: "+oneLine(scanErr.Error(), 200))
			return
		}
	} else if n, _ := io.Copy(io.Discard, io.LimitReader(br, 1)); n > 0 {
		p.refuseAll(ctx, w, ps, refuse(ReasonBadPush, "a delete-only push must not carry a pack"), "ok")
		return
	}

	ps.received = time.Since(ps.start)
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
	if anyRefused {
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

// probe relays git's pre-flight request (a lone flush packet), so the
// upstream answers it, authentication included.
func (p *Proxy) probe(w http.ResponseWriter, r *http.Request, e endpoint) {
	out, err := p.upstreamRequest(r, e, http.MethodPost, strings.NewReader("0000"))
	if err != nil {
		http.Error(w, "fenceline: "+err.Error(), http.StatusBadRequest)
		return
	}
	resp, err := p.client.Do(out)
	if err != nil {
		http.Error(w, "fenceline: upstream git server unreachable: "+err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	copyHeaders(w.Header(), resp.Header, "Content-Type", "Cache-Control", "WWW-Authenticate", "Location")
	w.WriteHeader(resp.StatusCode)
	io.Copy(w, resp.Body)
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

func (p *Proxy) baseGitDirs(ps *push) []string {
	dirs := append([]string(nil), p.cfg.ObjectDirs...)
	if m := p.mirrorDir(ps); m != "" {
		dirs = append(dirs, m)
	}
	return dirs
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

// upstreamRefs reads the upstream's ref advertisement of ps's repository
// for service (git-upload-pack names HEAD too), with the client's
// credentials and the sidecar's: ref name -> object id.
func (p *Proxy) upstreamRefs(ctx context.Context, ps *push, service string) (map[string]string, error) {
	u := p.endpointURL(endpoint{repo: ps.repoPath, service: service, refs: true})
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u.String(), nil)
	if err != nil {
		return nil, err
	}
	copyHeaders(req.Header, ps.r.Header, "Authorization", "User-Agent")
	p.addUpstreamHeader(req.Header)
	resp, err := p.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("read the upstream's refs: %w", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("read the upstream's refs: %s answered %s", u.Redacted(), resp.Status)
	}
	refs, err := parseAdvertisement(bufio.NewReader(io.LimitReader(resp.Body, 256<<20)))
	if err != nil {
		return nil, fmt.Errorf("read the upstream's refs: %w", err)
	}
	return refs, nil
}

// parseAdvertisement reads a smart-HTTP v0 ref advertisement: "# service=…",
// flush, then "<oid> <ref>[\0<caps>]" lines up to a flush.
func parseAdvertisement(br *bufio.Reader) (map[string]string, error) {
	pr := newPktReader(br)
	refs := map[string]string{}
	header, lines := false, 0
	for {
		line, err := pr.next()
		if errors.Is(err, errFlush) {
			if header && lines == 0 {
				header = false // the flush after "# service=…"
				continue
			}
			return refs, nil
		}
		if err != nil {
			return nil, err
		}
		s := strings.TrimSuffix(string(line), "\n")
		if lines == 0 && strings.HasPrefix(s, "# service=") {
			header = true
			continue
		}
		lines++
		s, _, _ = strings.Cut(s, "\x00")
		oid, ref, ok := strings.Cut(s, " ")
		if !ok || !validOID(oid) {
			return nil, fmt.Errorf("malformed advertisement line %q", clip(s))
		}
		if oid != zeroOID && !strings.HasSuffix(ref, "^{}") {
			refs[ref] = oid
		}
	}
}

// bases are the object stores a push builds on, opened once per push (each
// store loads its pack indexes on first use) and again after the mirror
// was fetched.
func (p *Proxy) bases(ps *push) layered {
	if ps.bases == nil {
		ps.bases = baseStores(p.baseGitDirs(ps))
	}
	return ps.bases
}

// mirrorDir is where the upstream repository of ps is mirrored, or "".
func (p *Proxy) mirrorDir(ps *push) string {
	if p.cfg.MirrorDir == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(p.upstream.String() + ps.repoPath))
	return filepath.Join(p.cfg.MirrorDir, hex.EncodeToString(sum[:8])+".git")
}

// refreshMirror fetches every ref of the upstream repository into its
// mirror, creating the mirror on first use.
func (p *Proxy) refreshMirror(ctx context.Context, ps *push) error {
	dir := p.mirrorDir(ps)
	if dir == "" {
		return errors.New("no mirror configured")
	}
	mu, _ := p.mirrorMu.LoadOrStore(dir, &sync.Mutex{})
	mu.(*sync.Mutex).Lock()
	defer mu.(*sync.Mutex).Unlock()
	if _, err := os.Stat(filepath.Join(dir, "objects")); err != nil {
		if _, err := p.git.run(ctx, dir, "init", "--quiet", "--bare", dir); err != nil {
			return err
		}
	}
	args := []string{}
	for k, vs := range p.cfg.UpstreamHeader {
		for _, v := range vs {
			args = append(args, "-c", "http.extraHeader="+k+": "+v)
		}
	}
	if p.cfg.UpstreamCAFile != "" {
		args = append(args, "-c", "http.sslCAInfo="+p.cfg.UpstreamCAFile)
	}
	// The credential goes to the repository's smart-HTTP endpoints only:
	// git follows no redirect with it (http.extraHeader would go along).
	args = append(args, "-c", "http.followRedirects=false")
	u := *p.upstream
	u.Path = ps.repoPath
	args = append(args, "fetch", "--quiet", "--no-tags", "--prune", u.String(), "+refs/*:refs/*")
	start := time.Now()
	_, err := p.git.run(ctx, dir, args...)
	ps.bases = nil // the mirror has new packs: reopen the stores
	p.log.Debug("mirror fetched", "mirror", dir, "took", time.Since(start), "err", err)
	return err
}

// takesPushOptions reports whether the upstream's receive-pack
// advertisement for repo offers push-options: as last relayed to a client,
// else fetched now by the proxy itself (a client may push without the
// advertisement passing through here first).
func (p *Proxy) takesPushOptions(r *http.Request, repo string) bool {
	if v, ok := p.pushOptions.Load(repo); ok {
		return v == true
	}
	out, err := p.upstreamRequest(r, endpoint{repo: repo, service: serviceReceive, refs: true}, http.MethodGet, nil)
	if err != nil {
		return false
	}
	out.Header.Del("Content-Type")
	resp, err := p.client.Do(out)
	if err != nil {
		return false
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil || resp.StatusCode != http.StatusOK || resp.Header.Get("Content-Encoding") != "" {
		return false
	}
	takes := advertisesPushOptions(body)
	p.pushOptions.Store(repo, takes)
	return takes
}

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
