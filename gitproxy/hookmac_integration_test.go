//go:build integration

package gitproxy

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
)

// TestHookRefusesBadMACs: a MAC under another key, for other ref updates
// (a replay), over another claim or repo, of an unknown version, or beside
// a repeated option is refused, and nothing is recorded; the same fence
// signed with the repository's secret for this push lands.
func TestHookRefusesBadMACs(t *testing.T) {
	e := newEnv(t)
	in := e.installHook(false)
	server := e.gs.url("payments.git")
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive).Record
	dir := e.clone(e.gs.srv.URL)
	e.commit(dir, "one", "services/billing/a.go", "a\n")
	up := e.updateOf(dir)
	before := up.Old

	otherKey, err := GenerateHookKey()
	if err != nil {
		t.Fatal(err)
	}
	wider := *l
	wider.Scope = bustest.Claim(t, "services")
	otherClaim, _ := json.Marshal(bustest.Claim(t, "libs/tax"))
	replayed := up
	replayed.New = before // the options of another push (here: moving main to its old value)
	genuine := signed(t, in.Key, testRepo, l, up)

	for _, tc := range []struct {
		name, want, reason string
		opts               []string
	}{
		{"wrong key", "does not verify", HookBadMAC, signed(t, otherKey, testRepo, l, up)},
		{"other ref updates", "does not verify", HookBadMAC, signed(t, in.Key, testRepo, l, replayed)},
		{"other ref name", "does not verify", HookBadMAC, signed(t, in.Key, testRepo, l, RefUpdate{up.Old, up.New, "refs/heads/other"})},
		{"claim swapped", "does not verify", HookBadMAC, withOption(signed(t, in.Key, testRepo, &wider, up), OptionClaim, string(otherClaim))},
		{"claim dropped", "does not verify", HookBadMAC, withOption(signed(t, in.Key, testRepo, l, up), OptionClaim, "")},
		{"fence raised", "does not verify", HookBadMAC, withOption(genuine, OptionFence, "999999")},
		{"lease swapped", "does not verify", HookBadMAC, withOption(genuine, OptionLease, "lease_other")},
		{"owner swapped", "does not verify", HookBadMAC, withOption(genuine, OptionOwner, "task=t agent=someone-else attempt=a")},
		{"repo swapped", "does not verify", HookBadMAC, withOption(signed(t, in.Key, "github.com/acme/other", l, up), OptionRepo, testRepo)},
		{"signed for another repo", "signed for repository", HookOtherRepo, signed(t, in.Key, "github.com/acme/other", l, up)},
		{"unknown version", `version "v9"`, HookBadMAC, withOption(genuine, OptionMAC, "v9:"+strings.Repeat("ab", 32))},
		{"repeated fence", "given twice", HookMalformed, append(append([]string{}, genuine...), OptionFence+"=999999")},
		{"unknown option", "not one fenceline knows", HookMalformed, append(append([]string{}, genuine...), "fenceline-fence2=1")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := mustRefuse(t, dir, tc.want, append(pushOpts(tc.opts), server, "HEAD:main")...)
			if !strings.Contains(out, "["+tc.reason+"]") || !strings.Contains(out, "of lease") {
				t.Fatalf("refusal does not name lease, fence and reason %s:\n%s", tc.reason, out)
			}
		})
	}
	if e.upstreamRef("refs/heads/main") != before {
		t.Fatal("a push with a bad fence landed")
	}
	if data := e.fenceTable(); data != nil {
		t.Fatalf("a bad fence was recorded:\n%s", data)
	}
	// fenceline's side signs exactly this push: it lands, its fence is kept.
	mustPush(t, dir, append(pushOpts(genuine), server, "HEAD:main")...)
	if e.upstreamRef("refs/heads/main") != up.New || e.fenceOf("services/billing") != l.Fence {
		t.Fatalf("the signed push did not land with fence %d:\n%s", l.Fence, e.fenceTable())
	}
	// Its options, captured, do not carry another push.
	e.commit(dir, "two", "services/billing/b.go", "b\n")
	mustRefuse(t, dir, "does not verify", append(pushOpts(genuine), server, "HEAD:main")...)
}

// TestHookAllowUnfenced: --allow-unfenced lets a push with no fenceline
// options at all through and records nothing; any fenceline option makes
// the push checked in full.
func TestHookAllowUnfenced(t *testing.T) {
	e := newEnv(t)
	e.installHook(true)
	server := e.gs.url("payments.git")
	dir := e.clone(e.gs.srv.URL)
	head := e.commit(dir, "person", "services/billing/a.go", "a\n")
	mustPush(t, dir, server, "HEAD:main")
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("an unfenced push did not land under --allow-unfenced")
	}
	if data := e.fenceTable(); data != nil {
		t.Fatalf("an unfenced push recorded a fence:\n%s", data)
	}
	e.commit(dir, "forged", "services/billing/a.go", "b\n")
	mustRefuse(t, dir, "not signed", "-o", OptionLease+"=x", "-o", OptionFence+"=999999", server, "HEAD:main")
	mustRefuse(t, dir, "malformed fence options", "-o", OptionLease+"=x", server, "HEAD:main")
	mustRefuse(t, dir, "malformed fence options", "-o", OptionMAC+"=v1:00", server, "HEAD:main")
	if e.upstreamRef("refs/heads/main") != head || e.fenceTable() != nil {
		t.Fatal("a push with bad fence options landed or was recorded under --allow-unfenced")
	}
}

// TestSidecarWithoutGrantKey: a lease granted while the lease service held
// no secret of the repository has no grant key; its sidecar still fences
// pushes, and the hook refuses them saying what is missing.
func TestSidecarWithoutGrantKey(t *testing.T) {
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	e.installHook(false)
	if l.GrantKeys() != nil {
		t.Fatalf("a lease granted before the secret was registered has grant keys")
	}
	dir := e.clone(e.proxy(l).URL)
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	out := mustRefuse(t, dir, "not signed (no "+OptionMAC+" option)", "origin", "main")
	if !strings.Contains(out, l.Record.LeaseID) || !strings.Contains(out, "fence-secret set") {
		t.Fatalf("refusal does not name the lease and the missing secret:\n%s", out)
	}
	// The sidecar's own checks still run first.
	e.commit(dir, "y", "libs/tax/rates.go", "y\n")
	mustRefuse(t, dir, "libs/tax/rates.go is outside lease", "origin", "main")
	if e.fenceTable() != nil {
		t.Fatal("an unsigned fence was recorded")
	}
}

// TestProxyRefusesAgentFenceOptions: the fence options are the sidecar's;
// an agent that sets its own through the sidecar is refused there.
func TestProxyRefusesAgentFenceOptions(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	before := e.upstreamRef("refs/heads/main")
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	mustRefuse(t, dir, "push option fenceline-fence is reserved", "-o", OptionFence+"=999999", "origin", "main")
	if e.upstreamRef("refs/heads/main") != before || e.fenceTable() != nil {
		t.Fatal("a push with the agent's own fence option reached the server")
	}
	var found bool
	for _, ev := range e.audit() {
		found = found || ev.Reason == ReasonBadPush && ev.LeaseID == l.Record.LeaseID && strings.Contains(ev.Message, "reserved")
	}
	if !found {
		t.Fatal("the refusal is not audited")
	}
	mustPush(t, dir, "origin", "main")
	if e.fenceOf("services/billing") != l.Record.Fence {
		t.Fatalf("fence not recorded:\n%s", e.fenceTable())
	}
}
