package gitproxy

import (
	"cmp"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

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
	Lease lease.Source
	// Repo is the bus's name of the repository, for audit events of pushes
	// refused before a lease is known (default: the lease's repo).
	Repo string
	// Bus is read when a push is decided: the lease must still be active
	// with the same fence, and no other active lease may claim a touched path.
	Bus lease.View
	// Audit receives every refusal (nil: refusals are only logged).
	Audit lease.Auditor
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

func copyHeaders(dst, src http.Header, keys ...string) {
	for _, k := range keys {
		for _, v := range src.Values(k) {
			dst.Add(k, v)
		}
	}
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
