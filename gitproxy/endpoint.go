package gitproxy

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
)

// The fence lends the upstream credential (Config.UpstreamHeader) to git
// and to nothing else: it serves the smart-HTTP endpoints of its one
// repository and refuses every other request, so an agent cannot reach a
// forge's REST API, another repository or a dumb-HTTP file on the same
// host with the sidecar's credential. The upstream request is built from
// the endpoint, never from the client's bytes: what the upstream is asked
// for is exactly one of the four requests below.

// Git's smart-HTTP services.
const (
	serviceUpload  = "git-upload-pack"  // fetch, clone, ls-remote (protocol v2's ls-refs too)
	serviceReceive = "git-receive-pack" // push
)

// endpoint is one of git's smart-HTTP endpoints of a repository:
//
//	GET  <repo>/info/refs?service=git-upload-pack|git-receive-pack
//	POST <repo>/git-upload-pack
//	POST <repo>/git-receive-pack
type endpoint struct {
	repo    string // the repository's path on the upstream, e.g. /acme/payments.git
	service string // serviceUpload or serviceReceive
	refs    bool   // GET info/refs (the advertisement); else the POST of service
}

// path and query are the endpoint's request URI on the upstream.
func (e endpoint) path() string {
	if e.refs {
		return e.repo + "/info/refs"
	}
	return e.repo + "/" + e.service
}

func (e endpoint) query() string {
	if e.refs {
		return "service=" + e.service
	}
	return ""
}

// parseEndpoint reads the endpoint r asks for, or reports that r is not
// one. repo is the repository served ("" serves any repository path). A
// request names an endpoint only byte for byte: its path has no escapes,
// no empty, "." or ".." segment, no parameters, and names repo in one of
// the two spellings git clients use for it (with and without ".git", see
// sameRepo), matched case-sensitively; the query is exactly git's
// "service=…" on info/refs and absent on the POSTs; the method is GET for
// info/refs and POST for the services (no HEAD: dumb HTTP is not served).
func parseEndpoint(r *http.Request, repo string) (endpoint, bool) {
	u := r.URL
	if u.Opaque != "" || u.User != nil || u.Fragment != "" || u.EscapedPath() != u.Path {
		return endpoint{}, false
	}
	var e endpoint
	var got string
	switch {
	case strings.HasSuffix(u.Path, "/info/refs"):
		got, e.refs = strings.TrimSuffix(u.Path, "/info/refs"), true
		switch u.RawQuery {
		case "service=" + serviceUpload:
			e.service = serviceUpload
		case "service=" + serviceReceive:
			e.service = serviceReceive
		default:
			return endpoint{}, false
		}
		if r.Method != http.MethodGet {
			return endpoint{}, false
		}
	case strings.HasSuffix(u.Path, "/"+serviceUpload), strings.HasSuffix(u.Path, "/"+serviceReceive):
		i := strings.LastIndexByte(u.Path, '/')
		got, e.service = u.Path[:i], u.Path[i+1:]
		if r.Method != http.MethodPost || u.RawQuery != "" || u.ForceQuery {
			return endpoint{}, false
		}
	default:
		return endpoint{}, false
	}
	var ok bool
	e.repo, ok = sameRepo(got, repo)
	return e, ok
}

// sameRepo returns the served repository's path when got names it: repo
// with or without its ".git" suffix (git clients spell a forge's
// repository both ways; "x.git.git" is not one of them). With no repo, got is served when it is
// a valid repository path.
func sameRepo(got, repo string) (string, bool) {
	if repo == "" {
		return got, checkRepoPath(got) == nil
	}
	if base := strings.TrimSuffix(repo, ".git"); got == base || got == base+".git" {
		return repo, true
	}
	return "", false
}

// checkRepoPath reports what is wrong with a repository path as the fence
// serves it: "/" then segments of letters, digits and "-._~" (no escapes,
// no empty, "." or ".." segment, no trailing slash).
func checkRepoPath(p string) error {
	if !strings.HasPrefix(p, "/") || p == "/" {
		return errors.New("want a path that starts with / and names the repository, e.g. /acme/payments.git")
	}
	for _, seg := range strings.Split(p[1:], "/") {
		if seg == "" || seg == "." || seg == ".." {
			return errors.New("want no empty, . or .. segment and no trailing slash")
		}
		for _, c := range []byte(seg) {
			if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || strings.IndexByte("-._~", c) >= 0) {
				return fmt.Errorf("want letters, digits and -._~ in each segment, not %q", c)
			}
		}
	}
	return nil
}

// endpointURL is e's URL on the upstream.
func (p *Proxy) endpointURL(e endpoint) *url.URL {
	u := *p.upstream
	u.Path, u.RawPath, u.RawQuery = e.path(), "", e.query()
	return &u
}

// refuseRequest answers a request that is none of git's smart-HTTP
// endpoints of the repository: 403, one line naming the path, and an
// audit event like every other refusal of the fence.
func (p *Proxy) refuseRequest(w http.ResponseWriter, r *http.Request) {
	repo := p.repo
	if repo == "" {
		repo = "a repository"
	}
	ref := refuse(ReasonNotGitEndpoint, "%s %s refused: the git fence serves only git's smart-HTTP endpoints of %s "+
		"(GET info/refs?service=git-upload-pack or git-receive-pack, POST git-upload-pack, POST git-receive-pack); "+
		"API hosts go through the egress proxy",
		r.Method, clip(r.URL.EscapedPath()), repo)
	p.auditRefusal(r.Context(), p.currentLease(), 0, ref, "")
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("X-Content-Type-Options", "nosniff")
	w.WriteHeader(http.StatusForbidden)
	fmt.Fprintln(w, ref.msg)
}

// gitRequestHeaders are the client headers a forwarded request keeps:
// those git's smart-HTTP client sends. Others never reach the upstream
// (X-Original-URL, X-HTTP-Method-Override and the like route a request
// elsewhere on some web stacks).
var gitRequestHeaders = []string{
	"Accept", "Accept-Encoding", "Accept-Language", "Authorization", "Content-Encoding",
	"Content-Type", "Git-Protocol", "Pragma", "User-Agent",
}
