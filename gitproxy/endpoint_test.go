package gitproxy

import (
	"bufio"
	"net/http"
	"strings"
	"testing"
)

// readRequest parses "METHOD TARGET" as net/http's server does.
func readRequest(method, target string) (*http.Request, error) {
	return http.ReadRequest(bufio.NewReader(strings.NewReader(method + " " + target + " HTTP/1.1\r\nHost: git.example.test\r\n\r\n")))
}

// TestParseEndpoint: the spellings git uses for the repository are served
// (with and without ".git", whichever the fence was given); nothing that
// only resolves to them is.
func TestParseEndpoint(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		repo, method, target string
		want                 string // e.path()+"?"+e.query(); "" refused
	}{
		{"/acme/payments.git", "GET", "/acme/payments.git/info/refs?service=git-upload-pack", "/acme/payments.git/info/refs?service=git-upload-pack"},
		{"/acme/payments.git", "GET", "/acme/payments/info/refs?service=git-receive-pack", "/acme/payments.git/info/refs?service=git-receive-pack"},
		{"/acme/payments.git", "POST", "/acme/payments.git/git-upload-pack", "/acme/payments.git/git-upload-pack?"},
		{"/acme/payments.git", "POST", "/acme/payments/git-receive-pack", "/acme/payments.git/git-receive-pack?"},
		{"/acme/payments", "POST", "/acme/payments.git/git-upload-pack", "/acme/payments/git-upload-pack?"},
		{"/acme/payments", "GET", "/acme/payments/info/refs?service=git-upload-pack", "/acme/payments/info/refs?service=git-upload-pack"},
		{"", "POST", "/infra.git/git-upload-pack", "/infra.git/git-upload-pack?"},
		{"", "GET", "/a/b/c.git/info/refs?service=git-receive-pack", "/a/b/c.git/info/refs?service=git-receive-pack"},
		{"/acme/payments.git", "POST", "/acme/payments.git.git/git-upload-pack", ""},
		{"/acme/payments", "POST", "/acme/payments.git.git/git-upload-pack", ""},
		{"/acme/payments.git", "POST", "/acme/payments.git/git-upload-pack?", ""},
		{"/acme/payments.git", "GET", "/acme/payments.git/info/refs?service=git-upload-pack&service=git-upload-pack", ""},
		{"/acme/payments.git", "GET", "/acme/payments.git/info/refs?service=git-upload-pac%6B", ""},
		{"/acme/payments.git", "GET", "http://other.example.test/acme/payments.git/info/refs?service=git-upload-pack", "/acme/payments.git/info/refs?service=git-upload-pack"},
		{"/acme/payments.git", "GET", "http://u:p@git.example.test/acme/payments.git/info/refs?service=git-upload-pack", ""},
		{"", "POST", "/a/../b.git/git-upload-pack", ""},
		{"", "POST", "/a/./b.git/git-upload-pack", ""},
		{"", "POST", "//b.git/git-upload-pack", ""},
		{"", "POST", "/git-upload-pack", ""},
		{"", "POST", "/a%2Fb.git/git-upload-pack", ""},
		{"", "POST", "/a b.git/git-upload-pack", ""},
		{"", "POST", "/api/v3/repos/acme/payments/contents/libs/tax/git-upload-pack", "/api/v3/repos/acme/payments/contents/libs/tax/git-upload-pack?"},
	} {
		r, err := readRequest(tc.method, tc.target)
		got := ""
		if err == nil {
			if e, ok := parseEndpoint(r, tc.repo); ok {
				got = e.path() + "?" + e.query()
			}
		}
		if got != tc.want {
			t.Errorf("repo %q: %s %s = %q, want %q", tc.repo, tc.method, tc.target, got, tc.want)
		}
	}
}

// FuzzParseEndpoint: whatever a request says, an endpoint it is taken
// for is one of the four of the served repository, asked for with its
// own method, its own query, and a path that is that endpoint's in one of
// the repository's two spellings.
func FuzzParseEndpoint(f *testing.F) {
	for _, s := range [][2]string{
		{"GET", "/acme/payments.git/info/refs?service=git-upload-pack"},
		{"POST", "/acme/payments/git-receive-pack"},
		{"POST", "/acme/payments.git/%2e%2e/git-upload-pack"},
		{"GET", "http://h/acme/payments.git/info/refs?service=git-receive-pack"},
		{"POST", "/acme/payments.git;x/git-upload-pack"},
	} {
		f.Add(s[0], s[1])
	}
	const repo = "/acme/payments.git"
	f.Fuzz(func(t *testing.T, method, target string) {
		r, err := readRequest(method, target)
		if err != nil {
			return
		}
		e, ok := parseEndpoint(r, repo)
		if !ok {
			return
		}
		wantMethod := http.MethodPost
		if e.refs {
			wantMethod = http.MethodGet
		}
		suffix := strings.TrimPrefix(e.path(), repo)
		switch {
		case e.repo != repo:
			t.Fatalf("%s %s served as %+v: not the repository", method, target, e)
		case e.service != serviceUpload && e.service != serviceReceive:
			t.Fatalf("%s %s served as %+v: not a smart-HTTP service", method, target, e)
		case r.Method != wantMethod, r.URL.RawQuery != e.query():
			t.Fatalf("%s %s served as %+v", method, target, e)
		case r.URL.Path != repo+suffix && r.URL.Path != strings.TrimSuffix(repo, ".git")+suffix,
			r.URL.EscapedPath() != r.URL.Path:
			t.Fatalf("%s %s (path %q) served as %+v", method, target, r.URL.Path, e)
		}
	})
}
