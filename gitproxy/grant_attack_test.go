//go:build integration

package gitproxy

import (
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
)

// TestStolenRunnerKeysMintNothing is issue 28 item 2: the hook accepted
// any fence signed with the repository's hook secret, which every runner
// held, so one runner minted fence 2^63-1, whole-repo, for a lease that
// does not exist, and every legitimate push after it was refused
// stale-fence for ever. Now a runner holds only what the lease service
// gave it: its bus credentials and its own lease's grant key. With them it
// tries every fence it was not granted, straight at the real hook through
// git http-backend; each is refused naming lease, fence and reason, none
// is recorded, and the legitimate pushes that follow land.
func TestStolenRunnerKeysMintNothing(t *testing.T) {
	e := newEnv(t)
	e.installHook(false)
	server := e.gs.url("payments.git")

	// The victim runner holds libs/tax; the attacker runner holds
	// services/billing, with its grant key.
	victim := e.lease([]string{"libs/tax"}, lease.WorkspaceExclusive)
	mine := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	keys := mine.GrantKeys()
	if keys == nil || len(keys.Git) == 0 {
		t.Fatal("the lease service gave the acquirer no git grant key")
	}
	stolen := keys.Git
	L := *mine.Record

	// What its bus credentials show of the victim's lease carries no key.
	for _, got := range e.busView(victim.Record.LeaseID) {
		if got.Grants != nil {
			t.Fatalf("a holder's get or list of another lease returned its grant keys")
		}
	}

	dir := e.clone(e.gs.srv.URL) // straight at the server, past any sidecar
	e.commit(dir, "attack", "libs/tax/rates.go", "rates from the attacker\n")
	up := e.updateOf(dir)
	before := up.Old

	ghost := L
	ghost.LeaseID, ghost.Fence, ghost.Scope = "lease_doesnotexist", math.MaxInt64, bustest.Claim(t, "*")
	greater := L
	greater.Fence = L.Fence + 1000
	whole := L
	whole.Scope = bustest.Claim(t, "*")
	otherClaim := L
	otherClaim.Scope = bustest.Claim(t, "libs/tax")
	victims := *victim.Record
	owner := L
	owner.Owner.AgentID = "someone-else"

	for _, tc := range []struct {
		name  string
		as    lease.Lease
		fence uint64
	}{
		{"fence 2^63-1 of a lease that does not exist, whole repo", ghost, ghost.Fence},
		{"a greater fence of its own lease", greater, greater.Fence},
		{"its own lease and fence, whole repo", whole, L.Fence},
		{"its own lease and fence, another claim", otherClaim, L.Fence},
		{"its own lease and fence, another owner", owner, L.Fence},
		{"the victim's lease, claim and fence", victims, victims.Fence},
		{"the victim's lease at a greater fence", victims, victims.Fence + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			opts := signedWith(t, stolen, &tc.as, tc.fence, up)
			out := mustRefuse(t, dir, "does not verify", append(pushOpts(opts), server, "HEAD:main")...)
			for _, want := range []string{"[" + HookBadMAC + "]", strconv.Quote(tc.as.LeaseID), strconv.Quote(strconv.FormatUint(tc.fence, 10)), "grant key"} {
				if !strings.Contains(out, want) {
					t.Errorf("refusal lacks %s:\n%s", want, out)
				}
			}
		})
	}
	if e.upstreamRef("refs/heads/main") != before {
		t.Fatal("a minted fence's push landed")
	}
	if data := e.fenceTable(); data != nil {
		t.Fatalf("a minted fence was recorded:\n%s", data)
	}
	for _, r := range e.hookRefusals() {
		if r != HookBadMAC {
			t.Fatalf("refusal log = %v, want only %s", e.hookRefusals(), HookBadMAC)
		}
	}

	// The legitimate pushes land: the victim's through its sidecar, and
	// the attacker's own, in its claim, with the fence it was granted.
	vdir := e.clone(e.proxy(victim).URL)
	head := e.commit(vdir, "rates", "libs/tax/rates.go", "rates 2027\n")
	mustPush(t, vdir, "origin", "main")
	mdir := e.clone(e.proxy(mine).URL)
	mhead := e.commit(mdir, "invoice", "services/billing/invoice.go", "invoice v2\n")
	mustPush(t, mdir, "origin", "main")
	if e.upstreamRef("refs/heads/main") != mhead || e.fenceOf("libs/tax") != victims.Fence || e.fenceOf("services/billing") != L.Fence {
		t.Fatalf("legitimate pushes (%s, then %s) did not land with their fences:\n%s", head, mhead, e.fenceTable())
	}
}

// busView is what a holder's credentials read of lease id: its get
// answer and its record in the repository's list.
func (e *env) busView(id string) []*lease.Lease {
	e.t.Helper()
	got, err := e.bus.Client.Get(ctxT(e.t), id)
	if err != nil {
		e.t.Fatal(err)
	}
	all, err := e.bus.Client.List(ctxT(e.t), testRepo, true)
	if err != nil {
		e.t.Fatal(err)
	}
	return append(all, got)
}

// TestProxyRefusesPushItCannotFence: when the lease has a git grant key
// (the repository's hook checks fences) and the upstream does not
// advertise push-options, the fence cannot travel: the proxy refuses the
// push, naming why, instead of sending it without its fence.
func TestProxyRefusesPushItCannotFence(t *testing.T) {
	e := newEnv(t)
	e.installHook(true) // a hook that lets unfenced pushes through: the worst case
	mustGit(t, e.bare, "config", "receive.advertisePushOptions", "false")
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	before := e.upstreamRef("refs/heads/main")
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	out := mustRefuse(t, dir, "does not advertise push-options", "origin", "main")
	if !strings.Contains(out, l.Record.LeaseID) {
		t.Fatalf("refusal does not name the lease:\n%s", out)
	}
	if e.upstreamRef("refs/heads/main") != before {
		t.Fatal("a push the proxy could not fence landed")
	}
	var found bool
	for _, ev := range e.audit() {
		found = found || ev.Reason == ReasonBadPush && ev.LeaseID == l.Record.LeaseID && strings.Contains(ev.Message, "push-options")
	}
	if !found {
		t.Fatal("the refusal is not audited")
	}
}
