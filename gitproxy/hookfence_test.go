package gitproxy

import (
	"encoding/hex"
	"strings"
	"testing"
)

// FuzzHookFence: whatever push options a push carries, the hook's reading
// of them (hookOptions) and its check of the fence (hookFence.verify)
// never panic; a fence passes only with the MAC made with the grant key of
// exactly its fields and ref updates; and such a fence, signed, is
// refused only when its options do not parse.
func FuzzHookFence(f *testing.F) {
	key := []byte("0123456789abcdef0123456789abcdef")
	cmds := []command{{Old: strings.Repeat("1", 40), New: strings.Repeat("2", 40), Ref: "refs/heads/main"}}
	f.Add("fenceline-lease=lease_a\nfenceline-fence=7\nfenceline-repo=github.com/acme/payments\nfenceline-owner=task=t agent=a\nfenceline-claim={\"kind\":\"paths\",\"paths\":[\"a\"]}", true)
	f.Add("fenceline-lease=l\nfenceline-fence=1\nfenceline-lease=l", true)
	f.Add("fenceline-lease=l\nfenceline-fence=1\nfenceline-mac=v1:00", false)
	f.Add("fenceline-fence=0\nfenceline-claim={\nother=x", true)
	f.Fuzz(func(t *testing.T, options string, sign bool) {
		opts, bad := hookOptions(strings.Split(options, "\n"))
		hf := &hookFence{leaseID: opts[OptionLease], fenceStr: opts[OptionFence], owner: opts[OptionOwner], repo: opts[OptionRepo]}
		fields := fenceFields{Repo: hf.repo, Lease: hf.leaseID, Owner: hf.owner, Fence: hf.fenceStr, Claim: opts[OptionClaim]}
		updates := make([]RefUpdate, len(cmds))
		for i, c := range cmds {
			updates[i] = RefUpdate(c)
		}
		genuine := ""
		grant, err := grantKeyOf(key, fields)
		msg, err2 := fenceMessage(fields, updates)
		if err == nil && err2 == nil {
			genuine = MACVersion + ":" + hex.EncodeToString(fenceMAC(grant, msg))
		}
		if sign && genuine != "" {
			opts[OptionMAC] = genuine
		}
		he := hf.verify(HookConfig{Key: key}, "", opts, cmds)
		if he == nil && (genuine == "" || opts[OptionMAC] != genuine) {
			t.Fatalf("options %q passed without the genuine MAC (%q)", options, genuine)
		}
		if he == nil && bad != nil {
			return // preReceive refuses bad before it verifies
		}
		if sign && genuine != "" && he != nil && he.Reason != HookMalformed {
			t.Fatalf("options %q, signed: refused %s (%s), want passed or malformed", options, he.Reason, he.Msg)
		}
	})
}
