package gitproxy

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// The pre-receive hook judges a verified push by the policy too, from the
// server's own objects: a commit that touches a protected path is refused
// naming the rule and version, even with a genuine signed fence, and the
// same push passes with no policy. (The real git server holds the
// objects; the hook runs in-process, as git would run it in the
// repository, with GIT_DIR set.)
func TestHookRefusesWhatThePolicyForbids(t *testing.T) {
	e := newEnv(t)
	dir := e.clone(e.gs.srv.URL)
	head := e.commit(dir, "workflow", ".github/workflows/ci.yml", "on: push\n")
	mustGit(t, dir, "push", "--quiet", "origin", "HEAD:refs/heads/staging") // the objects, onto the server (no hook installed)
	upd := RefUpdate{Old: e.upstreamRef("refs/heads/main"), New: head, Ref: "refs/heads/main"}
	l := e.lease(nil, lease.WorkspaceExclusive)
	secret := []byte("0123456789abcdef0123456789abcdef")
	opts := signed(t, secret, testRepo, l.Record, upd)
	t.Setenv("GIT_DIR", e.bare)

	var st policy.Store
	if err := st.Put(policy.Document{Mode: policy.ModeEnforce, Version: 4, Text: `@id("no-workflows")
forbid (principal, action, resource is Fenceline::Path)
when { resource.path like ".github/workflows*" };`}); err != nil {
		t.Fatal(err)
	}
	stdin := func() *strings.Reader { return strings.NewReader(upd.Old + " " + upd.New + " " + upd.Ref + "\n") }
	cfg := HookConfig{GitDir: e.bare, Repo: testRepo, Key: secret, Options: opts, Policy: &st}
	err := PreReceive(context.Background(), cfg, stdin())
	var he *HookError
	if !errors.As(err, &he) || he.Reason != HookPolicy || !strings.Contains(he.Msg, `policy rule "no-workflows" (default policy, version 4)`) || !strings.Contains(he.Msg, ".github/workflows/ci.yml") {
		t.Fatalf("pre-receive with the policy: %v, want refused by no-workflows naming the path", err)
	}
	if data := e.fenceTable(); data != nil {
		t.Fatalf("a refused push recorded its fence:\n%s", data)
	}
	cfg.Policy = nil
	if err := PreReceive(context.Background(), cfg, stdin()); err != nil {
		t.Fatalf("the same push with no policy: %v", err)
	}
}
