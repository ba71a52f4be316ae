package gitproxy

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// installHook installs fenceline's pre-receive hook (the real binary) and
// its secret in the test repository, the way "fenceline hook install" does,
// and registers the secret with the lease service ("fenceline bus
// fence-secret set"): leases acquired from then on get a git grant key,
// which the env's proxies sign with.
func (e *env) installHook(allowUnfenced bool) *Installed {
	e.t.Helper()
	bin := buildFenceline(e.t) // first: the build must not eat the install's 30 s
	in, err := InstallHook(ctxT(e.t), HookInstall{GitDir: e.bare, Repo: testRepo, Fenceline: bin, AllowUnfenced: allowUnfenced})
	if err != nil {
		e.t.Fatal(err)
	}
	if err := leasebus.WriteFenceSecret(e.bus.FenceSecrets, testRepo, lease.StorageGit, in.Key); err != nil {
		e.t.Fatal(err)
	}
	e.hookKey = in.Key
	return in
}

// fenceTable is the hook's fences.json, nil when there is none.
func (e *env) fenceTable() []byte {
	e.t.Helper()
	data, err := os.ReadFile(filepath.Join(e.bare, "fenceline", "fences.json"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	return data
}

// fenceOf is the fence the hook recorded for path (0: none).
func (e *env) fenceOf(path string) uint64 {
	e.t.Helper()
	var fences map[string]fenceEntry
	if data := e.fenceTable(); data != nil {
		if err := json.Unmarshal(data, &fences); err != nil {
			e.t.Fatal(err)
		}
	}
	return fences[path].Fence
}

// hookRefusals are the reasons in the hook's refusal log, in order.
func (e *env) hookRefusals() []string {
	e.t.Helper()
	data, err := os.ReadFile(filepath.Join(e.bare, "fenceline", "refusals.jsonl"))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		e.t.Fatal(err)
	}
	var reasons []string
	for _, l := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		var r hookRefusal
		if err := json.Unmarshal([]byte(l), &r); err != nil {
			e.t.Fatalf("refusal log line %q: %v", l, err)
		}
		if r.Reason == "" || r.Message == "" || len(r.Refs) == 0 {
			e.t.Fatalf("incomplete refusal log line %q", l)
		}
		reasons = append(reasons, r.Reason)
	}
	return reasons
}

// pushOpts turns push options into git push arguments.
func pushOpts(opts []string) []string {
	var args []string
	for _, o := range opts {
		args = append(args, "-o", o)
	}
	return args
}

// updateOf is the ref update that pushing dir's HEAD to main would make.
func (e *env) updateOf(dir string) RefUpdate {
	e.t.Helper()
	return RefUpdate{Old: e.upstreamRef("refs/heads/main"), New: strings.TrimSpace(mustGit(e.t, dir, "rev-parse", "HEAD")), Ref: "refs/heads/main"}
}

// signed is what a sidecar would send for l and updates had the lease
// service granted l in repo under the storage secret secret (the service
// derives the grant key; the sidecar signs with it).
func signed(t *testing.T, secret []byte, repo string, l *lease.Lease, updates ...RefUpdate) []string {
	t.Helper()
	signedFor := *l
	signedFor.Repo = repo
	keys, err := lease.GrantKeysFor(&signedFor, secret, nil)
	if err != nil {
		t.Fatal(err)
	}
	return signedWith(t, keys.Git, &signedFor, l.Fence, updates...)
}

// signedWith is what a sidecar holding grantKey would send for l at fence
// and updates.
func signedWith(t *testing.T, grantKey []byte, l *lease.Lease, fence uint64, updates ...RefUpdate) []string {
	t.Helper()
	opts, err := FenceOptions(grantKey, *l, fence, updates)
	if err != nil {
		t.Fatal(err)
	}
	return opts
}

// withOption replaces (or adds) the option key's value.
func withOption(opts []string, key, value string) []string {
	out := []string{}
	for _, o := range opts {
		if k, _, _ := strings.Cut(o, "="); k != key {
			out = append(out, o)
		}
	}
	return append(out, key+"="+value)
}

// TestHookRefusesForgedFence is the attack found in issue 16: a push
// straight to the git server with made-up fence options landed and wrote
// fence 999999 into fences.json, locking out every real lease after it.
func TestHookRefusesForgedFence(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.installHook(false)
	server := e.gs.url("payments.git")
	dir := e.clone(e.gs.srv.URL) // the agent reaches the server directly
	e.commit(dir, "forged", "services/billing/invoice.go", "forged\n")
	before := e.upstreamRef("refs/heads/main")

	out := mustRefuse(t, dir, "not signed", "-o", OptionLease+"=x", "-o", OptionFence+"=999999", server, "HEAD:main")
	for _, want := range []string{`fence "999999" of lease "x"`, "[" + HookUnsigned + "]", "fence-secret set"} {
		if !strings.Contains(out, want) {
			t.Errorf("refusal lacks %q:\n%s", want, out)
		}
	}
	// A made-up MAC fares no better.
	mustRefuse(t, dir, "does not verify", "-o", OptionLease+"=x", "-o", OptionFence+"=999999",
		"-o", OptionMAC+"="+MACVersion+":"+strings.Repeat("00", 32), server, "HEAD:main")
	if e.upstreamRef("refs/heads/main") != before {
		t.Fatal("a forged push landed")
	}
	if data := e.fenceTable(); data != nil {
		t.Fatalf("a forged fence was recorded:\n%s", data)
	}
	if got := e.hookRefusals(); len(got) != 2 || got[0] != HookUnsigned || got[1] != HookBadMAC {
		t.Fatalf("refusal log = %v, want [%s %s]", got, HookUnsigned, HookBadMAC)
	}

	// A genuine lease, with whatever low fence the bus gives it, pushes
	// through its sidecar: the push lands and its fence is recorded.
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	work := e.clone(e.proxy(l).URL)
	head := e.commit(work, "genuine", "services/billing/invoice.go", "genuine\n")
	mustPush(t, work, "origin", "main")
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("the genuine push did not land")
	}
	if got := e.fenceOf("services/billing"); got != l.Record.Fence {
		t.Fatalf("recorded fence %d for services/billing, want %d:\n%s", got, l.Record.Fence, e.fenceTable())
	}
}

// TestFenceMessageIsUnambiguous: fields that would let one message pass
// for another are refused, and the order of ref updates does not matter.
func TestFenceMessageIsUnambiguous(t *testing.T) {
	t.Parallel()
	a := RefUpdate{strings.Repeat("a", 40), strings.Repeat("b", 40), "refs/heads/a"}
	b := RefUpdate{strings.Repeat("c", 40), strings.Repeat("d", 40), "refs/heads/b"}
	f := fenceFields{Repo: "r", Lease: "l", Owner: "o", Fence: "1"}
	m1, err := fenceMessage(f, []RefUpdate{a, b})
	if err != nil {
		t.Fatal(err)
	}
	m2, _ := fenceMessage(f, []RefUpdate{b, a})
	if !bytes.Equal(m1, m2) {
		t.Fatal("the message depends on the order of ref updates")
	}
	want := "fenceline-git-fence v1\nrepo r\nlease l\nowner o\nfence 1\nclaim \nupdate " + a.Old + " " + a.New + " refs/heads/a\nupdate " + b.Old + " " + b.New + " refs/heads/b\n"
	if string(m1) != want {
		t.Fatalf("message =\n%q\nwant\n%q", m1, want)
	}
	if _, err := fenceMessage(fenceFields{Repo: "r\nlease x", Lease: "l", Fence: "1"}, nil); err == nil {
		t.Fatal("a newline in a field was accepted")
	}
}

// FuzzFenceMAC: two different fences never share a signed message, a MAC
// verifies only for its own message, and no option value makes the hook's
// check panic or pass without the key.
func FuzzFenceMAC(f *testing.F) {
	u := RefUpdate{strings.Repeat("1", 40), strings.Repeat("2", 40), "refs/heads/main"}
	f.Add("github.com/acme/payments", "lease_a", "task=t agent=a attempt=x", "7", `{"kind":"paths","paths":["a"]}`,
		"github.com/acme/payments", "lease_a", "task=t agent=a attempt=x", "7", `{"kind":"paths","paths":["a"]}`, "v1:00")
	f.Add("r", "l", "", "1", "", "r\nlease l", "", "", "1", "", "v1:"+strings.Repeat("ab", 32))
	f.Add("r", "l 1", "", "", "", "r", "l", "", "1", "", "v2:")
	key := []byte("0123456789abcdef0123456789abcdef")
	f.Fuzz(func(t *testing.T, repo, lease, owner, fence, claim, repo2, lease2, owner2, fence2, claim2, mac string) {
		f1 := fenceFields{Repo: repo, Lease: lease, Owner: owner, Fence: fence, Claim: claim}
		f2 := fenceFields{Repo: repo2, Lease: lease2, Owner: owner2, Fence: fence2, Claim: claim2}
		m1, err1 := fenceMessage(f1, []RefUpdate{u})
		m2, err2 := fenceMessage(f2, []RefUpdate{u})
		if err1 != nil || err2 != nil {
			return
		}
		same := f1 == f2
		if bytes.Equal(m1, m2) != same {
			t.Fatalf("messages equal=%v for fields equal=%v:\n%q\n%q", bytes.Equal(m1, m2), same, m1, m2)
		}
		good := MACVersion + ":" + hex.EncodeToString(fenceMAC(key, m1))
		if err := verifyFenceMAC(key, m1, good); err != nil {
			t.Fatalf("a genuine MAC does not verify: %v", err)
		}
		if err := verifyFenceMAC(key, m2, good); (err == nil) != same {
			t.Fatalf("the MAC of one fence verifies another: %q / %q", m1, m2)
		}
		if mac != good && verifyFenceMAC(key, m1, mac) == nil {
			t.Fatalf("made-up MAC %q verified", mac)
		}
	})
}

// BenchmarkFenceMAC: what signing (sidecar) and verifying (hook) a fence
// costs, for one ref update and for a thousand.
func BenchmarkFenceMAC(b *testing.B) {
	key, _ := GenerateHookKey()
	claim := `{"kind":"paths","paths":["services/billing"],"tables":[]}`
	for _, n := range []int{1, 1000} {
		updates := make([]RefUpdate, n)
		for i := range updates {
			updates[i] = RefUpdate{strings.Repeat("1", 40), strings.Repeat("2", 40), "refs/heads/b" + strings.Repeat("x", i%7) + string(rune('a'+i%26))}
		}
		b.Run(strconv.Itoa(n)+" updates", func(b *testing.B) {
			for b.Loop() {
				msg, err := fenceMessage(fenceFields{Repo: "github.com/acme/payments", Lease: "lease_06h2zm1zvrhtjjp4", Owner: "task=job_4821 agent=codex-worker-4 attempt=att_06h2zm1zvrhtjjp5", Fence: "118", Claim: claim}, updates)
				if err != nil {
					b.Fatal(err)
				}
				if err := verifyFenceMAC(key, msg, MACVersion+":"+hex.EncodeToString(fenceMAC(key, msg))); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
