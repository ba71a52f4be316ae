//go:build integration

package gitproxy

import (
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// TestDeleteOfMissingRefAsDirect is issue 19's third finding: deleting a
// ref the server does not have gave HTTP 400 and "unexpected disconnect"
// through the fence, where a direct push warns and succeeds.
func TestDeleteOfMissingRefAsDirect(t *testing.T) {
	e := newEnv(t)
	direct := e.clone(e.gs.srv.URL)
	out := mustPush(t, direct, "origin", ":refs/heads/nope")
	if !strings.Contains(out, "deleting a non-existent ref") {
		t.Fatalf("direct delete of a missing ref: no warning:\n%s", out)
	}

	e.installHook(false)
	// A path lease may not delete refs (policy), but this deletes none.
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	out = mustPush(t, dir, "origin", ":refs/heads/nope")
	if !strings.Contains(out, "deleting a non-existent ref") {
		t.Fatalf("fenced delete of a missing ref: no warning:\n%s", out)
	}
	// A delete of a ref that exists is still judged.
	mustRefuse(t, dir, "deleting refs/heads/main is not allowed for path lease", "origin", ":refs/heads/main")
}

// TestBlindDeleteOfExistingRef: a delete that names no value would remove
// the ref whatever it holds. The proxy refuses one for a ref the upstream
// has; the hook refuses one that reaches the server after the ref
// appeared.
func TestBlindDeleteOfExistingRef(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	l := e.lease(nil, lease.WorkspaceExclusive) // may delete refs
	srv := e.proxy(l)
	main := e.upstreamRef("refs/heads/main")

	status, body := post(t, srv.URL, appendFlush(appendPkt(nil, zeroOID, " ", zeroOID, " refs/heads/main\x00report-status")))
	if status != http.StatusOK || !strings.Contains(body, "ng refs/heads/main fenceline: refs/heads/main exists on the server") {
		t.Fatalf("blind delete of main: %d %q", status, body)
	}
	if e.upstreamRef("refs/heads/main") != main {
		t.Fatal("main was deleted")
	}

	// The hook, for the same command reaching the server signed.
	u := RefUpdate{Old: zeroOID, New: zeroOID, Ref: "refs/heads/main"}
	t.Setenv("GIT_DIR", e.bare)
	err := PreReceive(ctxT(t), HookConfig{GitDir: e.bare, Repo: testRepo, Key: e.hookKey, Options: signed(t, e.hookKey, testRepo, l.Record, u)},
		strings.NewReader(zeroOID+" "+zeroOID+" refs/heads/main\n"))
	if he, ok := err.(*HookError); !ok || he.Reason != HookBlindDelete || !strings.Contains(he.Msg, "refs/heads/main exists") {
		t.Fatalf("hook on a blind delete of main: %v, want a %s refusal", err, HookBlindDelete)
	}
	// And lets one for a missing ref through.
	u.Ref = "refs/heads/nope"
	if err := PreReceive(ctxT(t), HookConfig{GitDir: e.bare, Repo: testRepo, Key: e.hookKey, Options: signed(t, e.hookKey, testRepo, l.Record, u)},
		strings.NewReader(zeroOID+" "+zeroOID+" refs/heads/nope\n")); err != nil {
		t.Fatalf("hook on a delete of a missing ref: %v", err)
	}
}

// TestSignedPushes is issue 19's fourth finding: the proxy relayed the
// upstream's push-cert capability and then refused every signed push.
// It drops the capability: --signed=if-asked pushes unsigned, as against a
// server that does not ask; --signed=yes fails in git with a clear message.
func TestSignedPushes(t *testing.T) {
	e := newEnv(t)
	mustGit(t, e.bare, "config", "receive.certNonceSeed", "seed")
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	srv := e.proxy(l)

	adv := func(base string) string {
		resp, err := http.Get(base + "/payments.git/info/refs?service=git-receive-pack")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return string(b)
	}
	if up := adv(e.gs.srv.URL); !strings.Contains(up, "push-cert=") {
		t.Fatalf("upstream does not advertise push-cert (test setup): %q", up)
	}
	if got := adv(srv.URL); strings.Contains(got, "push-cert") || !strings.Contains(got, "report-status") {
		t.Fatalf("proxy advertisement %q: want push-cert dropped, the rest kept", got)
	}

	dir := e.clone(srv.URL)
	head := e.commit(dir, "bill", "services/billing/x.go", "package billing\n")
	mustPush(t, dir, "--signed=if-asked", "origin", "main")
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("--signed=if-asked push did not land")
	}
	e.commit(dir, "bill", "services/billing/y.go", "package billing\n")
	out, ok := pushOut(t, dir, "--signed=yes", "origin", "main")
	if ok || !strings.Contains(out, "does not support --signed push") {
		t.Fatalf("--signed=yes: accepted=%v, want git's refusal:\n%s", ok, out)
	}

	// A certificate sent anyway is refused in the report, per ref.
	base := e.upstreamRef("refs/heads/main")
	var b []byte
	b = appendPkt(b, "push-cert\x00report-status side-band-64k\n")
	for _, l := range []string{"certificate version 0.1\n", "pusher agent 1 +0000\n", "\n", base + " " + base + " refs/heads/main\n", "-----BEGIN PGP SIGNATURE-----\n", "push-cert-end\n"} {
		b = appendPkt(b, l)
	}
	status, body := post(t, srv.URL, appendFlush(b))
	if status != http.StatusOK || !strings.Contains(body, "ng refs/heads/main fenceline: signed pushes") {
		t.Fatalf("signed push: %d %q", status, body)
	}
}
