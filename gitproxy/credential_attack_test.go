//go:build integration

package gitproxy

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/lease"
)

// forgeToken is the credential the sidecar holds for the forge: the bot
// account's, which the agent must never get to use beyond git.
const forgeToken = "Bearer forge-bot-token"

// forge is a git host with a REST API beside its repositories, as GitHub
// Enterprise and GitLab are: git http-backend serves the repositories'
// paths, the API writes files and names the token's account. Everything
// wants the credential. Like some web stacks, it routes by
// X-Original-URL and X-HTTP-Method-Override when a request carries them.
type forge struct {
	git http.Handler
	// redirectPushRefs: the receive-pack advertisement answers 302 to
	// /user, as a forge does for a renamed repository.
	redirectPushRefs atomic.Bool
	mu               sync.Mutex
	seen             []forgeRequest // guarded by mu: every request that carried the credential
}

// forgeRequest is what one credentialed request asked the forge for.
type forgeRequest struct {
	method, uri, host string
	routed            string // X-Original-URL or X-HTTP-Method-Override, when sent
}

func (f *forge) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("Authorization") != forgeToken {
		http.Error(w, "credential required", http.StatusUnauthorized)
		return
	}
	method, path := r.Method, r.URL.EscapedPath()
	routed := strings.TrimSpace(r.Header.Get("X-Original-URL") + " " + r.Header.Get("X-HTTP-Method-Override"))
	if u := r.Header.Get("X-Original-URL"); u != "" {
		path = u
	}
	if m := r.Header.Get("X-HTTP-Method-Override"); m != "" {
		method = m
	}
	f.mu.Lock()
	f.seen = append(f.seen, forgeRequest{method: r.Method, uri: r.RequestURI, host: r.Host, routed: routed})
	f.mu.Unlock()
	switch {
	case strings.HasPrefix(path, "/api/v3/repos/") && (method == http.MethodPost || method == http.MethodPut):
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"content":{"path":%q},"commit":{"message":"written by the bot"}}`, path)
	case path == "/user" || path == "/api/v3/user":
		fmt.Fprint(w, `{"login":"fenceline-bot"}`)
	case path == "/redirect-me",
		f.redirectPushRefs.Load() && r.URL.Query().Get("service") == "git-receive-pack":
		http.Redirect(w, r, "/user", http.StatusFound)
	default:
		f.git.ServeHTTP(w, r)
	}
}

// credentialed returns the requests that reached the forge with the
// credential.
func (f *forge) credentialed() []forgeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.seen)
}

// forgeEnv is a forge serving acme/payments.git (seeded like newEnv's
// repository) and acme/other.git, a fence in front of it holding the
// forge's credential, and the egress proxy that routes the forge's host
// into the fence.
type forgeEnv struct {
	*env
	forge    *forge
	host     string // the forge's host:port
	bare     string // acme/payments.git on disk
	leaseID  string
	fence    string // the fence's URL (reverse mode)
	egress   string // the egress proxy's URL
	upstream string // the forge's URL
}

func newForgeEnv(t *testing.T) *forgeEnv {
	t.Helper()
	e := newEnv(t)
	bare, err := gitserver.NewBare(filepath.Join(e.gs.root, "acme", "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	mustGit(t, e.bare, "push", "--quiet", bare, "main")
	if _, err := gitserver.NewBare(filepath.Join(e.gs.root, "acme", "other.git")); err != nil {
		t.Fatal(err)
	}
	backend, err := gitserver.Handler(e.gs.root, gitEnv(t.TempDir())...)
	if err != nil {
		t.Fatal(err)
	}
	f := &forge{git: backend}
	host := httptest.NewServer(f)
	t.Cleanup(host.Close)

	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	fence, err := New(Config{
		Upstream:       host.URL + "/acme/payments.git",
		Lease:          l,
		Repo:           testRepo,
		Bus:            e.bus.Client,
		Audit:          e.bus.Auditor,
		MirrorDir:      t.TempDir(),
		TempDir:        t.TempDir(),
		UpstreamHeader: http.Header{"Authorization": {forgeToken}},
	})
	if err != nil {
		t.Fatal(err)
	}
	hostPort := strings.TrimPrefix(host.URL, "http://")
	fwd, err := egress.New(egress.Config{Intercept: map[string]http.Handler{hostPort: fence}})
	if err != nil {
		t.Fatal(err)
	}
	proxySrv := httptest.NewServer(fwd)
	t.Cleanup(func() { proxySrv.Close(); fwd.Close() })
	return &forgeEnv{env: e, forge: f, host: hostPort, bare: bare, leaseID: l.Record.LeaseID,
		fence: serve(t, fence), egress: proxySrv.URL, upstream: host.URL}
}

// rawRequest sends one HTTP/1.1 request, written out byte for byte (its
// request-target exactly as given), to the fence at addr, or through the
// egress proxy at addr when tunnel names the host to CONNECT to, and
// returns the status and body.
func rawRequest(t *testing.T, addr, tunnel, method, target string, header ...string) (int, string) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	br := bufio.NewReader(c)
	if tunnel != "" {
		fmt.Fprintf(c, "CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n", tunnel, tunnel)
		resp, err := http.ReadResponse(br, nil)
		if err != nil || resp.StatusCode != http.StatusOK {
			t.Fatalf("CONNECT %s: %v %v", tunnel, resp, err)
		}
	}
	host := tunnel
	if host == "" {
		host = addr
	}
	req := fmt.Sprintf("%s %s HTTP/1.1\r\nHost: %s\r\nContent-Length: 4\r\nConnection: close\r\n", method, target, host)
	for _, h := range header {
		req += h + "\r\n"
	}
	if _, err := io.WriteString(c, req+"\r\n0000"); err != nil {
		t.Fatal(err)
	}
	resp, err := http.ReadResponse(br, &http.Request{Method: method})
	if err != nil {
		t.Fatalf("%s %s: %v", method, target, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

// gitEndpoints are the only requests the forge may see with its
// credential: git's smart-HTTP endpoints of the leased repository.
var gitEndpoints = []string{
	"GET /acme/payments.git/info/refs?service=git-upload-pack",
	"GET /acme/payments.git/info/refs?service=git-receive-pack",
	"POST /acme/payments.git/git-upload-pack",
	"POST /acme/payments.git/git-receive-pack",
}

// checkForgeSawOnlyGit fails when the forge answered anything but git's
// smart-HTTP endpoints of acme/payments.git with the credential, or was
// asked for another host or routed by a header.
func (fe *forgeEnv) checkForgeSawOnlyGit(t *testing.T) {
	t.Helper()
	for _, r := range fe.forge.credentialed() {
		if !slices.Contains(gitEndpoints, r.method+" "+r.uri) || r.host != fe.host || r.routed != "" {
			t.Errorf("the forge got the credential with %s %s (Host %s, routed %q)", r.method, r.uri, r.host, r.routed)
		}
	}
}

// TestAttackUpstreamCredentialBeyondGit: the fence holds the forge's
// credential for git. An agent asking the fence for anything but git's
// smart-HTTP endpoints of the leased repository — the forge's REST API
// (a file written to main without a push, the bot's identity), another
// repository, dumb-HTTP files, other methods, any spelling of a path that
// resolves elsewhere — is refused with 403 naming the path, audited, and
// the credential never reaches the forge with it; directly, through the
// egress proxy's plain-HTTP interception and through its CONNECT tunnel.
// git clone (shallow too), fetch, pull, push and ls-remote through the
// fence keep working, on protocol v0 and v2.
func TestAttackUpstreamCredentialBeyondGit(t *testing.T) {
	fe := newForgeEnv(t)
	api := "/api/v3/repos/acme/payments/contents/libs/tax/git-upload-pack"
	attacks := []struct{ method, target string }{
		{"POST", api},
		{"PUT", api},
		{"GET", "/user"},
		{"GET", "/api/v3/user"},
		{"GET", "/redirect-me"},
		{"POST", "/acme/payments.git/../../" + api},
		{"POST", "/acme/payments.git/%2e%2e/%2e%2e" + api},
		{"POST", "/acme/payments.git/..%2F..%2Fapi%2Fv3%2Frepos%2Facme%2Fpayments%2Fcontents%2Flibs%2Ftax/git-upload-pack"},
		{"POST", "/api%2Fv3%2Frepos%2Facme%2Fpayments%2Fcontents%2Flibs%2Ftax/git-upload-pack"},
		{"POST", "//acme/payments.git/git-upload-pack"},
		{"POST", "/acme//payments.git/git-upload-pack"},
		{"POST", "/acme/payments.git//git-upload-pack"},
		{"POST", "/acme/payments.git/./git-upload-pack"},
		{"POST", "/acme/payments.git/git-upload-pack/"},
		{"POST", "/acme/payments.git/git-upload-pack?x=/user"},
		{"POST", "/acme/payments.git;x=1/git-upload-pack"},
		{"POST", "/acme/payments.git/git-upload-pack;x=1"},
		{"POST", "/acme/payments.gi%74/git-upload-pack"},
		{"POST", "/acme/payments.git/git-upload-pack%00"},
		{"POST", "/acme/payments.git.git/git-upload-pack"},
		{"POST", "/ACME/payments.git/git-upload-pack"},
		{"POST", "/acme/PAYMENTS.git/git-upload-pack"},
		{"POST", "/acme/payments.GIT/git-upload-pack"},
		{"POST", "/acme/payments.git/GIT-UPLOAD-PACK"},
		{"POST", "/acme/other.git/git-upload-pack"},
		{"POST", "/acme/other.git/git-receive-pack"},
		{"GET", "/acme/other.git/info/refs?service=git-upload-pack"},
		{"GET", "/acme/payments.git/info/refs"},
		{"GET", "/acme/payments.git/info/refs?service=git-upload-archive"},
		{"GET", "/acme/payments.git/info/refs?service=git-upload-pack&x=1"},
		{"GET", "/acme/payments.git/info/refs?service=git-upload-pack#frag"},
		{"GET", "/acme/payments.git/HEAD"},
		{"GET", "/acme/payments.git/objects/info/packs"},
		{"GET", "/acme/payments.git/git-upload-pack"},
		{"HEAD", "/acme/payments.git/info/refs?service=git-upload-pack"},
		{"PUT", "/acme/payments.git/git-receive-pack"},
		{"DELETE", "/acme/payments.git/git-receive-pack"},
		{"PATCH", "/acme/payments.git/git-upload-pack"},
		{"PROPFIND", "/acme/payments.git/"},
		{"GET", "http://" + "FORGE" + "/user"},
		{"POST", "http://" + "FORGE" + api},
	}
	for _, a := range attacks {
		target := strings.ReplaceAll(a.target, "FORGE", fe.host)
		for _, via := range []struct{ name, addr, tunnel, target string }{
			{"fence", strings.TrimPrefix(fe.fence, "http://"), "", target},
			{"egress-connect", strings.TrimPrefix(fe.egress, "http://"), fe.host, target},
			{"egress-plain", strings.TrimPrefix(fe.egress, "http://"), "", absolute(fe.host, target)},
		} {
			if via.target == "" {
				continue
			}
			t.Run(via.name+" "+a.method+" "+target, func(t *testing.T) {
				status, body := rawRequest(t, via.addr, via.tunnel, a.method, via.target)
				says := strings.Contains(body, "the git fence serves only git's smart-HTTP endpoints of /acme/payments.git") &&
					strings.Count(strings.TrimSpace(body), "\n") == 0 && strings.Contains(body, a.method+" "+requestPath(via.target)+" refused")
				if status != http.StatusForbidden || (!says && a.method != http.MethodHead) {
					t.Errorf("%s %s got %d:\n%s", a.method, via.target, status, body)
				}
			})
		}
	}
	// A header that some web stacks route by rides on an allowed request.
	for _, h := range []string{"X-Original-URL: " + api, "X-HTTP-Method-Override: PUT"} {
		status, body := rawRequest(t, strings.TrimPrefix(fe.fence, "http://"), "", "POST", "/acme/payments.git/git-upload-pack", h)
		if strings.Contains(body, "written by the bot") {
			t.Errorf("POST git-upload-pack with %q reached the API: %d %s", h, status, body)
		}
	}
	fe.checkForgeSawOnlyGit(t)

	refused := 0
	for _, ev := range fe.audit() {
		if ev.Reason == ReasonNotGitEndpoint && ev.LeaseID == fe.leaseID && ev.Owner.AgentID != "" &&
			strings.Contains(ev.Message, "serves only git's smart-HTTP endpoints") {
			refused++
		}
	}
	if refused == 0 {
		t.Errorf("no refusal was audited with reason %s naming the lease", ReasonNotGitEndpoint)
	}

	// git itself keeps working through the fence, in both spellings of
	// the repository, and over the egress proxy.
	dir := filepath.Join(t.TempDir(), "work")
	mustGit(t, "", "clone", "--quiet", fe.fence+"/acme/payments.git", dir)
	mustGit(t, "", "ls-remote", fe.fence+"/acme/payments")
	mustGit(t, "", "-c", "protocol.version=0", "ls-remote", fe.fence+"/acme/payments.git/")
	if out, err := gitCmd(t, "", []string{"GIT_CONFIG_COUNT=1", "GIT_CONFIG_KEY_0=http.proxy", "GIT_CONFIG_VALUE_0=" + fe.egress},
		"ls-remote", fe.upstream+"/acme/payments"); err != nil {
		t.Fatalf("ls-remote through the egress proxy: %v\n%s", err, out)
	}
	// Both wire protocols, a shallow clone and its deepening.
	v0 := filepath.Join(t.TempDir(), "v0")
	mustGit(t, "", "-c", "protocol.version=0", "clone", "--quiet", fe.fence+"/acme/payments.git", v0)
	mustGit(t, v0, "-c", "protocol.version=0", "fetch", "--quiet", "origin")
	shallow := filepath.Join(t.TempDir(), "shallow")
	mustGit(t, "", "-c", "protocol.version=2", "clone", "--quiet", "--depth=1", fe.fence+"/acme/payments", shallow)
	mustGit(t, shallow, "-c", "protocol.version=2", "fetch", "--quiet", "--unshallow", "origin")
	head := fe.commit(dir, "in scope", "services/billing/x.go", "x\n")
	mustGit(t, dir, "-c", "protocol.version=2", "push", "--quiet", "origin", "main")
	mustGit(t, dir, "-c", "protocol.version=2", "fetch", "--quiet", "origin")
	mustGit(t, v0, "-c", "protocol.version=0", "pull", "--quiet", "--ff-only", "origin", "main")
	if got := strings.TrimSpace(mustGit(t, fe.bare, "rev-parse", "main")); got != head {
		t.Fatalf("the push through the fence did not land: %s, want %s", got, head)
	}
	fe.commit(dir, "out of scope", "libs/tax/rates.go", "x\n")
	mustRefuse(t, dir, "libs/tax/rates.go is outside lease "+fe.leaseID, "origin", "main")
	out, err := gitCmd(t, "", nil, "ls-remote", fe.fence+"/acme/other.git")
	if err == nil || !strings.Contains(out, "serves only git's smart-HTTP endpoints of /acme/payments.git") {
		t.Fatalf("ls-remote of another repository on the forge: err=%v\n%s", err, out)
	}
	fe.checkForgeSawOnlyGit(t)
}

// absolute is target as an absolute-form request-target for host, or ""
// when target is one already or not a path.
func absolute(host, target string) string {
	if !strings.HasPrefix(target, "/") {
		return ""
	}
	return (&url.URL{Scheme: "http", Host: host}).String() + target
}

// TestUpstreamRedirectCarriesNoCredential: a redirect from the forge (a
// renamed repository) is relayed to git, never followed by the fence with
// the credential, so it cannot carry the credential to another path.
func TestUpstreamRedirectCarriesNoCredential(t *testing.T) {
	fe := newForgeEnv(t)
	fe.forge.redirectPushRefs.Store(true)
	for _, target := range []string{
		"/acme/payments.git/info/refs?service=git-receive-pack",
		"/acme/payments.git/info/refs?service=git-upload-pack", // not redirected: the control
	} {
		status, body := rawRequest(t, strings.TrimPrefix(fe.fence, "http://"), "", "GET", target)
		if strings.Contains(body, "fenceline-bot") {
			t.Errorf("GET %s: the fence followed the redirect with the credential: %d %s", target, status, body)
		}
	}
	dir := filepath.Join(t.TempDir(), "work")
	mustGit(t, "", "clone", "--quiet", fe.fence+"/acme/payments.git", dir)
	fe.commit(dir, "in scope", "services/billing/x.go", "x\n")
	if out, ok := pushOut(t, dir, "origin", "main"); ok {
		t.Errorf("push against a redirecting advertisement landed:\n%s", out)
	}
	fe.checkForgeSawOnlyGit(t)
}

// requestPath is the path of an origin- or absolute-form request-target.
func requestPath(target string) string {
	if rest, ok := strings.CutPrefix(target, "http://"); ok {
		target = rest[strings.IndexByte(rest, '/'):]
	}
	path, _, _ := strings.Cut(target, "?")
	return path
}
