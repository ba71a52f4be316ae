package egress

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"net/textproto"
	"net/url"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

const realToken = "ghp_real-secret-token-0123456789"

// forge is a GitHub-shaped HTTPS API on 127.0.0.1 (a certificate for
// api.github.com from its own CA): it answers 401 unless a request
// carries the real token, records every call it serves, and echoes the
// Authorization it got in a response header (an upstream that reflects
// its request).
type forge struct {
	addr string
	ca   *testca.CA

	mu    sync.Mutex
	calls []string // "METHOD path"
	auth  []string // the Authorization of each call
}

func startForge(t testing.TB) *forge {
	t.Helper()
	return startForgeFor(t, "api.github.com")
}

// startForgeFor is startForge with a certificate for name.
func startForgeFor(t testing.TB, name string) *forge {
	t.Helper()
	f := &forge{ca: testca.New(t)}
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		f.mu.Lock()
		f.calls = append(f.calls, r.Method+" "+r.URL.Path)
		f.auth = append(f.auth, r.Header.Get("Authorization"))
		f.mu.Unlock()
		if r.URL.Path == "/echo/early-and-late" {
			// A 103 and a trailer carrying the request's credential.
			w.Header().Set("X-Echo-Early", r.Header.Get("Authorization"))
			w.WriteHeader(http.StatusEarlyHints)
			w.Header().Del("X-Echo-Early")
			w.Header().Set(http.TrailerPrefix+"X-Echo-Late", r.Header.Get("Authorization"))
			w.Header().Set("X-Echo-Bare", strings.TrimPrefix(r.Header.Get("Authorization"), "Bearer "))
		}
		w.Header().Set("X-Echo-Auth", r.Header.Get("Authorization"))
		if r.Header.Get("Authorization") != "Bearer "+realToken {
			http.Error(w, `{"message":"Bad credentials"}`, http.StatusUnauthorized)
			return
		}
		fmt.Fprintf(w, `{"ok":true,"call":%q,"body":%q}`, r.Method+" "+r.URL.Path, body)
	}))
	srv.TLS = f.ca.ServerTLS(t, name)
	srv.StartTLS()
	t.Cleanup(srv.Close)
	f.addr = srv.Listener.Addr().String()
	return f
}

func (f *forge) served(call string) bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range f.calls {
		if c == call {
			return true
		}
	}
	return false
}

// injectProxy serves a proxy that injects the real token for
// api.github.com (pinned to the forge) and judges its calls by
// GitHubRules; it returns the proxy's URL and a client that trusts the
// proxy's CA (the agent's view).
func injectProxy(t *testing.T, f *forge, lease fixedLease, audit *memAuditor) (string, *http.Client) {
	t.Helper()
	local, localFile, err := gitproxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, Config{
		Inject: map[string]Injection{"api.github.com": {
			Header:  http.Header{"Authorization": {"Bearer " + realToken}},
			RootCAs: f.ca.Pool,
			API:     GitHubRules,
		}},
		Resolve: mustPins(t, "api.github.com:443="+f.addr),
		CA:      &local, Lease: lease, Audit: audit,
	})
	pool, err := os.ReadFile(localFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	if !roots.AppendCertsFromPEM(pool) {
		t.Fatal("the proxy's CA certificate does not parse")
	}
	pu, _ := url.Parse(proxy)
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: roots}}
	t.Cleanup(tr.CloseIdleConnections)
	return proxy, &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// call makes one request as the agent would, with a placeholder key.
func call(t *testing.T, c *http.Client, method, path, contentType, body string, hdr ...string) (int, string, http.Header) {
	t.Helper()
	req, err := http.NewRequest(method, "https://api.github.com"+path, strings.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer placeholder")
	if contentType != "" {
		req.Header.Set("Content-Type", contentType)
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatalf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.Header
}

func gql(q string) string {
	b, _ := json.Marshal(map[string]any{"query": q})
	return string(b)
}

// TestInjectedCredential (issue 31): the agent holds a placeholder; the
// proxy terminates its TLS with the run's CA, replaces the placeholder
// with the real key, and forwards over TLS verified against the host's
// own CA. The real key never comes back to the agent, not even from an
// upstream that echoes its request.
func TestInjectedCredential(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	_, c := injectProxy(t, f, testLease, &memAuditor{})
	code, body, hdr := call(t, c, "GET", "/user", "", "")
	if code != http.StatusOK {
		t.Fatalf("GET /user with the injected key: %d %s", code, body)
	}
	if strings.Contains(body, realToken) || strings.Contains(fmt.Sprint(hdr), realToken) {
		t.Fatalf("the real key reached the agent: %v %s", hdr, body)
	}
	f.mu.Lock()
	got := f.auth[len(f.auth)-1]
	f.mu.Unlock()
	if got != "Bearer "+realToken {
		t.Fatalf("the forge got Authorization %q, want the real key (the placeholder replaced)", got)
	}
	// Without the proxy's CA the agent's client refuses the minted
	// certificate: the proxy does not pass the forge's own through.
	if _, err := (&http.Client{Transport: &http.Transport{Proxy: c.Transport.(*http.Transport).Proxy}}).Get("https://api.github.com/user"); err == nil {
		t.Fatal("a client without the run's CA accepted the intercepted host")
	}
}

// TestAPIWritesJudgedLikePushes (issue 31): through an injected GitHub
// host, calls that move refs, write contents or merge are refused (403
// naming the rule, the lease and the call; audited at the net boundary)
// and never reach the forge, whatever their spelling (GHES prefix, case,
// dot segments, method override, GraphQL aliases, fragments, batches,
// persisted queries); reading, issues, comments and opening a pull
// request go through.
func TestAPIWritesJudgedLikePushes(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	audit := &memAuditor{}
	_, c := injectProxy(t, f, testLease, audit)
	const ctJSON = "application/json"
	allowed := []struct{ method, path, ct, body string }{
		{"GET", "/repos/acme/payments", "", ""},
		{"GET", "/repos/acme/payments/contents/libs/tax/rates.go", "", ""},
		{"POST", "/repos/acme/payments/pulls", ctJSON, `{"title":"t","head":"agent/x","base":"main"}`},
		{"POST", "/repos/acme/payments/issues/3/comments", ctJSON, `{"body":"done"}`},
		{"POST", "/graphql", ctJSON, gql(`query { viewer { login } }`)},
		{"POST", "/graphql", ctJSON, gql(`query { repository(owner:"acme", name:"payments") { ref(qualifiedName:"main") { name } } }`)},
		{"POST", "/graphql", ctJSON, gql(`mutation { addComment(input:{subjectId:"x", body:"mergePullRequest please"}) { clientMutationId } }`)},
	}
	for _, a := range allowed {
		if code, body, _ := call(t, c, a.method, a.path, a.ct, a.body); code != http.StatusOK {
			t.Errorf("%s %s %s: %d %s, want it through", a.method, a.path, a.body, code, body)
		}
	}
	refused := []struct {
		method, path, ct, body, rule string
		hdr                          []string
	}{
		{"PUT", "/repos/acme/payments/contents/libs/tax/rates.go", ctJSON, `{"message":"x","content":"eA=="}`, "github-contents", nil},
		{"DELETE", "/repos/acme/payments/contents/README.md", ctJSON, `{}`, "github-contents", nil},
		{"POST", "/repos/acme/payments/git/refs", ctJSON, `{"ref":"refs/heads/x","sha":"a"}`, "github-git-data", nil},
		{"PATCH", "/repos/acme/payments/git/refs/heads/main", ctJSON, `{"sha":"a","force":true}`, "github-git-data", nil},
		{"POST", "/repos/acme/payments/git/commits", ctJSON, `{}`, "github-git-data", nil},
		{"PUT", "/repos/acme/payments/pulls/12/merge", ctJSON, `{}`, "github-merge", nil},
		{"POST", "/repos/acme/payments/merges", ctJSON, `{}`, "github-merge", nil},
		{"PATCH", "/repos/acme/payments", ctJSON, `{"default_branch":"evil"}`, "github-repository", nil},
		{"POST", "/repos/acme/payments/releases", ctJSON, `{"tag_name":"v9"}`, "github-releases", nil},
		{"POST", "/repos/acme/payments/actions/workflows/deploy.yml/dispatches", ctJSON, `{"ref":"main"}`, "github-workflows", nil},
		{"PUT", "/api/v3/repos/acme/payments/contents/x", ctJSON, `{}`, "github-contents", nil},
		{"PUT", "/REPOS/acme/payments/Contents/x", ctJSON, `{}`, "github-contents", nil},
		{"POST", "/graphql", ctJSON, gql(`mutation { updateRef(input:{refId:"r", oid:"a", force:true}) { ref { name } } }`), "github-graphql", nil},
		{"POST", "/graphql", ctJSON, gql(`mutation M { ok: addComment(input:{}) { x } sneaky: mergePullRequest(input:{pullRequestId:"p"}) { x } }`), "github-graphql", nil},
		{"POST", "/graphql", ctJSON, gql(`mutation { ...F } fragment F on Mutation { createCommitOnBranch(input:{}) { commit { oid } } }`), "github-graphql", nil},
		{"POST", "/graphql", ctJSON, `[` + gql(`query { viewer { login } }`) + `,` + gql(`mutation { deleteRef(input:{refId:"r"}) { x } }`) + `]`, "github-graphql", nil},
		{"POST", "/graphql", "application/graphql", `mutation { mergeBranch(input:{}) { x } }`, "github-graphql", nil},
		{"POST", "/graphql", ctJSON, `{"extensions":{"persistedQuery":{"version":1,"sha256Hash":"abc"}}}`, "", nil},
		{"POST", "/graphql", ctJSON, `not json`, "", nil},
		{"POST", "/repos/acme/payments/./contents/x", ctJSON, `{}`, "", nil},
		{"POST", "/repos/acme/payments/issues", ctJSON, `{}`, "", []string{"X-HTTP-Method-Override", "PUT"}},
	}
	for _, r := range refused {
		code, body, _ := call(t, c, r.method, r.path, r.ct, r.body, r.hdr...)
		if code != http.StatusForbidden {
			t.Errorf("%s %s %s: %d %s, want it refused", r.method, r.path, r.body, code, body)
			continue
		}
		for _, want := range []string{"lease_egress1", "fence 7", "refused", r.rule} {
			if !strings.Contains(body, want) {
				t.Errorf("%s %s: refusal lacks %q:\n%s", r.method, r.path, want, body)
			}
		}
	}
	f.mu.Lock()
	for _, served := range f.calls {
		for _, r := range refused {
			if strings.EqualFold(served, r.method+" "+r.path) && !strings.HasPrefix(r.path, "/graphql") {
				t.Errorf("the forge served a refused call: %s", served)
			}
		}
	}
	graphql := 0
	for _, served := range f.calls {
		if served == "POST /graphql" {
			graphql++
		}
	}
	f.mu.Unlock()
	if graphql != 3 {
		t.Errorf("the forge served %d GraphQL calls, want the 3 allowed ones", graphql)
	}
	if n := len(audit.events()); n != len(refused) {
		t.Errorf("%d refusals audited, want %d", n, len(refused))
	}
	for _, ev := range audit.events() {
		if ev.Boundary != lease.BoundaryNet || ev.LeaseID != "lease_egress1" || ev.Type != lease.EventDenied {
			t.Errorf("audit event: %+v", ev)
		}
	}
}

// TestWholeRepoLeaseMovesItsOwnRefs: a whole-repo lease may write its own
// repository through the API (nothing of it lies outside its claim), not
// another one.
func TestWholeRepoLeaseMovesItsOwnRefs(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	whole := testLease
	whole.Status = lease.StatusActive
	whole.Scope = scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}}
	_, c := injectProxy(t, f, whole, &memAuditor{})
	if code, body, _ := call(t, c, "PUT", "/repos/acme/payments/contents/x", "application/json", `{}`); code != http.StatusOK {
		t.Fatalf("whole-repo lease writing its own repository: %d %s", code, body)
	}
	if code, body, _ := call(t, c, "PUT", "/repos/acme/other/contents/x", "application/json", `{}`); code != http.StatusForbidden {
		t.Fatalf("whole-repo lease writing another repository: %d %s", code, body)
	}
}

// TestInjectedHostSmugglingAndUpgrades: requests are parsed by the proxy
// and forwarded one by one, so a request hidden in another's body by
// disagreeing Content-Length and Transfer-Encoding is judged like any
// (never forwarded raw), and a protocol upgrade is refused.
func TestInjectedHostSmugglingAndUpgrades(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	proxy, c := injectProxy(t, f, testLease, &memAuditor{})
	// A raw TLS connection through CONNECT, as a hostile client writes it.
	pu, _ := url.Parse(proxy)
	raw, err := net.Dial("tcp", pu.Host)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(20 * time.Second))
	fmt.Fprintf(raw, "CONNECT api.github.com:443 HTTP/1.1\r\nHost: api.github.com:443\r\n\r\n")
	br := bufio.NewReader(raw)
	if resp, err := http.ReadResponse(br, nil); err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("CONNECT: %v %v", resp, err)
	}
	tc := tls.Client(raw, &tls.Config{ServerName: "api.github.com", RootCAs: c.Transport.(*http.Transport).TLSClientConfig.RootCAs, NextProtos: []string{"http/1.1"}})
	hidden := "PUT /repos/acme/payments/contents/smuggled HTTP/1.1\r\nHost: api.github.com\r\nContent-Length: 2\r\n\r\n{}"
	fmt.Fprintf(tc, "POST /repos/acme/payments/issues HTTP/1.1\r\nHost: api.github.com\r\nContent-Length: %d\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n%s", 5+len(hidden), hidden)
	tr := bufio.NewReader(tc)
	for range 2 {
		resp, err := http.ReadResponse(tr, nil)
		if err != nil {
			break
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
	}
	if f.served("PUT /repos/acme/payments/contents/smuggled") {
		t.Fatal("a smuggled contents write reached the forge")
	}
	code, body, _ := call(t, c, "GET", "/repos/acme/payments", "", "", "Upgrade", "websocket", "Connection", "Upgrade")
	if code != http.StatusForbidden || !strings.Contains(body, "upgrade") {
		t.Fatalf("a websocket upgrade to an injected host: %d %s", code, body)
	}
}

// TestInjectedHostFollowsThePolicy: an injected host is opened by the
// proxy, not tunnelled, and still a connect the security team's policy
// judges: a rule forbidding it refuses every request to it, naming the
// rule and the version, from the policy's next version on.
func TestInjectedHostFollowsThePolicy(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	local, _, err := gitproxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	var st policy.Store
	audit := &memAuditor{}
	p, err := New(Config{
		Inject:  map[string]Injection{"api.github.com": {Header: http.Header{"Authorization": {"Bearer " + realToken}}, RootCAs: f.ca.Pool}},
		Resolve: mustPins(t, "api.github.com:443="+f.addr),
		CA:      &local, Lease: testLease, Audit: audit, Policy: &st,
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	t.Cleanup(func() { srv.Close(); p.Close() })
	roots := x509.NewCertPool()
	roots.AddCert(local.Leaf)
	pu, _ := url.Parse(srv.URL)
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: roots}, DisableKeepAlives: true}
	t.Cleanup(tr.CloseIdleConnections)
	c := &http.Client{Transport: tr, Timeout: 20 * time.Second}
	if code, body, _ := call(t, c, "GET", "/user", "", ""); code != http.StatusOK {
		t.Fatalf("before any policy: %d %s", code, body)
	}
	if err := st.Put(policy.Document{Mode: policy.ModeEnforce, Version: 3, Text: `@id("no-github-api")
forbid (principal, action == Fenceline::Action::"connect", resource is Fenceline::Host)
when { resource.name == "api.github.com" };`}); err != nil {
		t.Fatal(err)
	}
	code, body, _ := call(t, c, "GET", "/user", "", "")
	if code != http.StatusForbidden || !strings.Contains(body, "no-github-api") || !strings.Contains(body, "version 3") {
		t.Fatalf("after the policy: %d %s, want 403 naming the rule and version", code, body)
	}
	if evs := audit.events(); len(evs) != 1 || evs[0].Reason != policy.ReasonPolicy {
		t.Fatalf("audit: %+v, want one refusal with reason policy", evs)
	}
}

// TestAPIRulesReadAsTheForgeReads (issue 31, attack): a call the forge
// reads as a ref-moving write is refused however the agent spells it: a
// trailing slash (Rails and Grape route /merges/ as /merges), a
// lower-case method, a GraphQL body that is JSON under a GraphQL content
// type (GitHub reads JSON whatever the type), a "Query" key beside
// "query" (encoding/json folds case; the forge does not), a second
// "query" key (a parser that takes the first) or parameter (Rack takes
// the last), a parameter
// after a ';' (Go's URL parser drops it; Rack 2 splits there), a body in
// another charset or compressed (the proxy would judge bytes the forge
// decodes).
func TestAPIRulesReadAsTheForgeReads(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	audit := &memAuditor{}
	_, c := injectProxy(t, f, testLease, audit)
	const ctJSON = "application/json"
	mut := `mutation { createRef(input:{repositoryId:"r", name:"refs/heads/x", oid:"a"}) { ref { name } } }`
	q := url.QueryEscape
	attacks := []struct{ method, path, ct, body string }{
		{"POST", "/repos/acme/payments/merges/", ctJSON, `{"base":"main","head":"evil"}`},
		{"PUT", "/repos/acme/payments/pulls/12/merge/", ctJSON, `{}`},
		{"PATCH", "/repos/acme/payments/", ctJSON, `{"default_branch":"evil"}`},
		{"POST", "/repos/acme/payments/releases/", ctJSON, `{"tag_name":"v9"}`},
		{"put", "/repos/acme/payments/contents/x", ctJSON, `{}`},
		{"Post", "/repos/acme/payments/git/refs", ctJSON, `{}`},
		{"POST", "/graphql/", ctJSON, gql(mut)},
		{"POST", "/graphql", "application/graphql; charset=utf-16le", utf16le(mut)},
		{"POST", "/graphql", "application/graphql", gql(mut)},
		{"POST", "/graphql", "application/graphql", "\ufeff" + gql(mut)},
		{"POST", "/graphql", ctJSON, strings.TrimSuffix(gql(mut), "}") + `,"Query":"{ viewer { login } }"}`},
		{"POST", "/graphql", ctJSON, strings.TrimSuffix(gql(mut), "}") + `,"query":"{ viewer { login } }"}`},
		{"POST", "/graphql?query=" + q("{ viewer { login } }") + "&query=" + q(mut), "", ""},
		{"POST", "/graphql?x=1;query=" + q(mut), "", ""},
	}
	for _, a := range attacks {
		code, body, _ := call(t, c, a.method, a.path, a.ct, a.body)
		if code != http.StatusForbidden || !strings.Contains(body, "lease_egress1") {
			t.Errorf("%s %s %s: %d %s, want it refused", a.method, a.path, a.body, code, body)
		}
	}
	// A compressed body: the proxy would judge the compressed bytes (and
	// might refuse them by chance: the refusal must name the encoding).
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write([]byte(mut))
	zw.Close()
	if code, body, _ := call(t, c, "POST", "/graphql", "application/graphql", gz.String(), "Content-Encoding", "gzip"); code != http.StatusForbidden || !strings.Contains(body, "gzip") {
		t.Errorf("a gzipped GraphQL document: %d %s, want it refused", code, body)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.calls) != 0 {
		t.Errorf("the forge served refused calls: %q", f.calls)
	}
}

// utf16le is s in UTF-16, little-endian (s is ASCII).
func utf16le(s string) string {
	var b strings.Builder
	for _, c := range []byte(s) {
		b.WriteByte(c)
		b.WriteByte(0)
	}
	return b.String()
}

// TestAPIRulesCoverEveryRoute (issue 31, attack): GitHub serves every
// repository call under /repositories/ID too (its own pagination links
// use that form), a deployment with auto_merge (the default) merges the
// default branch into its ref, createLinkedBranch creates a branch and
// a ruleset changed through GraphQL lifts a protection: each is refused like the /repos/OWNER/NAME call it equals.
func TestAPIRulesCoverEveryRoute(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	whole := testLease
	whole.Status = lease.StatusActive
	whole.Scope = scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}}
	_, c := injectProxy(t, f, whole, &memAuditor{})
	const ctJSON = "application/json"
	attacks := []struct{ method, path, body string }{
		{"PUT", "/repositories/1296269/contents/libs/tax/rates.go", `{"message":"x","content":"eA=="}`},
		{"PATCH", "/repositories/1296269/git/refs/heads/main", `{"sha":"a","force":true}`},
		{"PUT", "/repositories/1296269/pulls/12/merge", `{}`},
		{"PATCH", "/repositories/1296269", `{"default_branch":"evil"}`},
		{"PUT", "/api/v3/repositories/1296269/contents/x", `{}`},
		{"POST", "/repos/acme/other/deployments", `{"ref":"evil","auto_merge":true}`},
		{"POST", "/graphql", gql(`mutation { createLinkedBranch(input:{issueId:"i", oid:"a", name:"evil", repositoryId:"r"}) { linkedBranch { id } } }`)},
		{"POST", "/graphql", gql(`mutation { updateRepositoryRuleset(input:{repositoryRulesetId:"x", enforcement:DISABLED}) { ruleset { id } } }`)},
		{"POST", "/graphql", gql(`mutation { createDeployment(input:{repositoryId:"r", refId:"x", autoMerge:true}) { deployment { id } } }`)},
	}
	for _, a := range attacks {
		code, body, _ := call(t, c, a.method, a.path, ctJSON, a.body)
		if code != http.StatusForbidden || !strings.Contains(body, "lease_egress1") {
			t.Errorf("%s %s %s: %d %s, want it refused", a.method, a.path, a.body, code, body)
		}
	}
	if code, body, _ := call(t, c, "GET", "/repositories/1296269/contents/x", "", ""); code != http.StatusOK {
		t.Errorf("reading under /repositories/ID: %d %s, want it through", code, body)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.calls) != 1 {
		t.Errorf("the forge served refused calls: %q", f.calls)
	}
}

// TestWholeRepoLeaseIsThatRepoOnly (issue 31, attack): a whole-repo
// lease of gitlab.com/group/sub/payments may write that project through
// the API, not sub/payments (another namespace's project whose path its
// own ends with).
func TestWholeRepoLeaseIsThatRepoOnly(t *testing.T) {
	t.Parallel()
	f := startForgeFor(t, "gitlab.com")
	whole := testLease
	whole.Repo = "gitlab.com/group/sub/payments"
	whole.Status = lease.StatusActive
	whole.Scope = scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}}
	c := gitlabClient(t, f, whole)
	put := func(project string) int {
		req, _ := http.NewRequest("PUT", "https://gitlab.com/api/v4/projects/"+project+"/repository/files/x", strings.NewReader(`{}`))
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := put("group%2Fsub%2Fpayments"); code != http.StatusOK {
		t.Errorf("the lease's own project: %d, want it through", code)
	}
	for _, other := range []string{"sub%2Fpayments", "payments"} {
		if code := put(other); code != http.StatusForbidden {
			t.Errorf("project %s under a lease of group/sub/payments: %d, want it refused", other, code)
		}
	}
}

// TestInjectedCredentialNotInEarlyHintsOrTrailers (issue 31, attack): an
// upstream that echoes its request's credential in a 103 Early Hints
// response or in a trailer does not show it to the agent either: both
// are response headers, sent before and after the one the proxy scrubbed;
// nor does the token echoed without its "Bearer " scheme.
func TestInjectedCredentialNotInEarlyHintsOrTrailers(t *testing.T) {
	t.Parallel()
	f := startForge(t)
	_, c := injectProxy(t, f, testLease, &memAuditor{})
	var early []string
	trace := &httptrace.ClientTrace{Got1xxResponse: func(code int, h textproto.MIMEHeader) error {
		for k, vs := range h {
			early = append(early, fmt.Sprintf("%d %s: %q", code, k, vs))
		}
		return nil
	}}
	req, err := http.NewRequestWithContext(httptrace.WithClientTrace(t.Context(), trace), "GET", "https://api.github.com/echo/early-and-late", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Authorization", "Bearer placeholder")
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if !f.served("GET /echo/early-and-late") {
		t.Fatal("the forge did not serve the call")
	}
	for _, e := range early {
		if strings.Contains(e, realToken) {
			t.Errorf("the real key came back in an informational response: %s", e)
		}
	}
	for k, vs := range resp.Trailer {
		if strings.Contains(strings.Join(vs, " "), realToken) {
			t.Errorf("the real key came back in trailer %s", k)
		}
	}
	for k, vs := range resp.Header {
		if strings.Contains(strings.Join(vs, " "), realToken) {
			t.Errorf("the real key came back without its scheme in header %s", k)
		}
	}
}

// TestAPIRulesRefuseMintingCredentials (issue 31, attack): an agent that
// cannot read the injected key must not be able to make the forge give
// it (or whoever prompted it) another: GitLab's token rotation answers
// with a fresh token, project and deploy tokens are answered likewise,
// and an SSH or deploy key or a collaborator added through the API
// pushes past the lease from anywhere. Refused even under a whole-repo
// lease of that repository.
func TestAPIRulesRefuseMintingCredentials(t *testing.T) {
	t.Parallel()
	whole := testLease
	whole.Status = lease.StatusActive
	whole.Scope = scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}}
	gh := startForge(t)
	_, c := injectProxy(t, gh, whole, &memAuditor{})
	for _, a := range []struct{ method, path string }{
		{"POST", "/user/keys"},
		{"POST", "/user/ssh_signing_keys"},
		{"POST", "/repos/acme/payments/keys"},
		{"PUT", "/repos/acme/payments/collaborators/outsider"},
		{"POST", "/api/v3/user/keys"},
	} {
		code, body, _ := call(t, c, a.method, a.path, "application/json", `{"key":"ssh-ed25519 AAAA","read_only":false}`)
		if code != http.StatusForbidden || !strings.Contains(body, "lease_egress1") {
			t.Errorf("%s %s: %d %s, want it refused", a.method, a.path, code, body)
		}
	}
	gl := startForgeFor(t, "gitlab.com")
	whole.Repo = "gitlab.com/acme/payments"
	glc := gitlabClient(t, gl, whole)
	for _, a := range []struct{ method, path string }{
		{"POST", "/api/v4/personal_access_tokens/self/rotate"},
		{"POST", "/api/v4/user/personal_access_tokens"},
		{"POST", "/api/v4/projects/acme%2Fpayments/access_tokens"},
		{"POST", "/api/v4/projects/acme%2Fpayments/access_tokens/7/rotate"},
		{"POST", "/api/v4/projects/acme%2Fpayments/deploy_tokens"},
		{"POST", "/api/v4/projects/acme%2Fpayments/deploy_keys"},
		{"POST", "/api/v4/projects/acme%2Fpayments/members"},
		{"POST", "/api/v4/user/keys"},
	} {
		req, _ := http.NewRequest(a.method, "https://gitlab.com"+a.path, strings.NewReader(`{}`))
		resp, err := glc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s %s: %d, want it refused", a.method, a.path, resp.StatusCode)
		}
	}
	for _, f := range []*forge{gh, gl} {
		f.mu.Lock()
		if len(f.calls) != 0 {
			t.Errorf("the forge served refused calls: %q", f.calls)
		}
		f.mu.Unlock()
	}
}

// gitlabClient is the agent's client through a proxy that injects the
// real token for gitlab.com (pinned to f) and judges its calls by
// GitLabRules under lease.
func gitlabClient(t *testing.T, f *forge, lease fixedLease) *http.Client {
	t.Helper()
	local, localFile, err := gitproxy.LoadOrCreateCA(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	proxy := startProxy(t, Config{
		Inject: map[string]Injection{"gitlab.com": {
			Header: http.Header{"Authorization": {"Bearer " + realToken}}, RootCAs: f.ca.Pool, API: GitLabRules,
		}},
		Resolve: mustPins(t, "gitlab.com:443="+f.addr),
		CA:      &local, Lease: lease, Audit: &memAuditor{},
	})
	pem, err := os.ReadFile(localFile)
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	pu, _ := url.Parse(proxy)
	tr := &http.Transport{Proxy: http.ProxyURL(pu), TLSClientConfig: &tls.Config{RootCAs: roots}}
	t.Cleanup(tr.CloseIdleConnections)
	return &http.Client{Transport: tr, Timeout: 20 * time.Second}
}

// TestGitLabRulesCoverEveryCommitRoute (issue 31, attack): GitLab commits
// through more than its commits and files APIs: a changelog is committed,
// a submodule update is a commit, a release creates its tag, a pull
// mirror moves refs to another repository's and a push mirror sends the
// repository elsewhere, a merge request added to a merge train is
// merged, and a branch rule changed through GraphQL lifts a protection.
// And gitlab.com serves git too: a push over smart HTTP to the injected
// host would carry the real token to any repository it may write. Each
// is refused.
func TestGitLabRulesCoverEveryCommitRoute(t *testing.T) {
	t.Parallel()
	gl := startForgeFor(t, "gitlab.com")
	c := gitlabClient(t, gl, testLease)
	for _, a := range []struct{ method, path string }{
		{"POST", "/api/v4/projects/acme%2Fpayments/repository/changelog"},
		{"PUT", "/api/v4/projects/acme%2Fpayments/repository/submodules/libs%2Fvendor"},
		{"POST", "/api/v4/projects/acme%2Fpayments/releases"},
		{"POST", "/api/v4/projects/acme%2Fpayments/mirror/pull"},
		{"POST", "/api/v4/projects/acme%2Fpayments/remote_mirrors"},
		{"POST", "/api/v4/projects/acme%2Fpayments/merge_trains/merge_requests/12"},
		{"POST", "/acme/other.git/git-receive-pack"},
		{"POST", "/acme/other/git-receive-pack"},
		{"POST", "/api/graphql"},
	} {
		body := `{"ref":"evil","tag_name":"v9","version":"1.0.0"}`
		if a.path == "/api/graphql" {
			body = gql(`mutation { branchRuleUpdate(input:{id:"gid://gitlab/Projects::BranchRule/1", name:"main"}) { errors } }`)
		}
		req, _ := http.NewRequest(a.method, "https://gitlab.com"+a.path, strings.NewReader(body))
		req.Header.Set("Content-Type", "application/json")
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusForbidden {
			t.Errorf("%s %s: %d, want it refused", a.method, a.path, resp.StatusCode)
		}
	}
	gl.mu.Lock()
	defer gl.mu.Unlock()
	if len(gl.calls) != 0 {
		t.Errorf("the forge served refused calls: %q", gl.calls)
	}
}

// TestMethodOverrideInAFormBody (issue 31, attack): GitLab names a
// project by its path as one escaped segment (acme%2Fpayments), which the
// decoded path split in two, so the rule on PUT /projects/ID never
// matched one; and Rails (GitLab's API
// is mounted in it) runs Rack::MethodOverride, which turns a POST whose
// form body holds _method=PUT into a PUT: a rule judging PUT only (the
// project's settings: its default branch) saw a POST. A POST whose body
// is not JSON is judged as any write; a JSON body that merely mentions
// _method is not read as one.
func TestMethodOverrideInAFormBody(t *testing.T) {
	t.Parallel()
	gl := startForgeFor(t, "gitlab.com")
	c := gitlabClient(t, gl, testLease)
	send := func(method, path, ct, body string) int {
		req, _ := http.NewRequest(method, "https://gitlab.com"+path, strings.NewReader(body))
		if ct != "" {
			// "A|B" sends two Content-Type headers.
			req.Header["Content-Type"] = strings.Split(ct, "|")
		}
		resp, err := c.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	for _, a := range []struct{ method, ct, body string }{
		{"PUT", "application/json", `{"default_branch":"evil"}`}, // the project named by its path, one escaped segment
		{"POST", "application/x-www-form-urlencoded", "_method=PUT&default_branch=evil"},
		{"POST", "application/json|application/x-www-form-urlencoded", "_method=PUT&default_branch=evil"},
		{"POST", "", "default_branch=evil&%5Fmethod=put"},
		{"POST", "multipart/form-data; boundary=b", "--b\r\nContent-Disposition: form-data; name=\"_method\"\r\n\r\nPUT\r\n--b--\r\n"},
	} {
		if code := send(a.method, "/api/v4/projects/acme%2Fpayments", a.ct, a.body); code != http.StatusForbidden {
			t.Errorf("%s %q %q: %d, want it refused", a.method, a.ct, a.body, code)
		}
	}
	if code := send("POST", "/api/v4/projects/acme%2Fpayments/issues?x=1;_method=PUT", "application/json", `{}`); code != http.StatusForbidden {
		t.Errorf("a _method parameter after ';': %d, want it refused", code)
	}
	if code := send("PUT", "/api/v4/projects/acme%2Fpayments/issues/3", "application/json", `{"title":"x"}`); code != http.StatusOK {
		t.Errorf("updating an issue: %d, want it through", code)
	}
	if code := send("POST", "/api/v4/projects/acme%2Fpayments/issues", "application/json", `{"title":"rename _method"}`); code != http.StatusOK {
		t.Errorf("a JSON issue mentioning _method: %d, want it through", code)
	}
	gl.mu.Lock()
	defer gl.mu.Unlock()
	if len(gl.calls) != 2 {
		t.Errorf("the forge served refused calls: %q", gl.calls)
	}
}

// TestRulesForGitHubHosts: GitHub Enterprise Cloud with data residency
// serves its API at api.SUBDOMAIN.ghe.com; a key injected for it gets
// GitHub's rules like api.github.com's, not none.
func TestRulesForGitHubHosts(t *testing.T) {
	for _, h := range []string{"api.github.com", "github.example.com", "api.acme.ghe.com", "API.ACME.GHE.COM"} {
		if got := RulesFor(h); len(got) == 0 || got[0].Name != GitHubRules[0].Name {
			t.Errorf("RulesFor(%q): %d rules, want GitHub's", h, len(got))
		}
	}
	if got := RulesFor("api.openai.com"); got != nil {
		t.Errorf("RulesFor(api.openai.com): %d rules, want none", len(got))
	}
}
