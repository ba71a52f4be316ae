package gitproxy

import (
	"bytes"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// post sends a hand-made receive-pack request through the proxy at base
// and returns the status and body.
func post(t *testing.T, base string, body []byte) (int, string) {
	t.Helper()
	resp, err := http.Post(base+"/payments.git/git-receive-pack", "application/x-git-receive-pack-request", bytes.NewReader(body))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// TestErrorsReachGitInReport: the fence's own errors after the request
// head was read go back in report-status, like its refusals.
func TestErrorsReachGitInReport(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.gs.srv.URL)
	srv := e.proxy(l, func(c *Config) { c.ObjectDirs = []string{filepath.Join(dir, ".git")} })
	base := e.upstreamRef("refs/heads/main")
	head := e.commit(dir, "x", "services/billing/x.go", "package billing // x\n")

	// A malformed second command: reported against both refs.
	status, body := post(t, srv.URL, appendFlush(appendPkt(appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status"), "nothex ", head, " refs/heads/b")))
	if status != http.StatusOK || !strings.Contains(body, "ng refs/heads/b fenceline: bad push request") || !strings.Contains(body, "ng refs/heads/main fenceline: bad push request") {
		t.Fatalf("malformed second command: %d %q", status, body)
	}
	// The upstream gone when the push is forwarded.
	pack := gitPack(t, dir, head, base)
	e.gs.srv.Close()
	status, body = post(t, srv.URL, append(appendFlush(appendPkt(nil, base, " ", head, " refs/heads/main\x00report-status")), pack...))
	if status != http.StatusOK || !strings.Contains(body, "ng refs/heads/main fenceline: the upstream git server did not answer") {
		t.Fatalf("upstream gone: %d %q", status, body)
	}
}
