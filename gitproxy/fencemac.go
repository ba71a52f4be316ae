package gitproxy

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/fenceline/fenceline/lease"
)

// A fence reaches the pre-receive hook as push options, and the hook
// believes it only when the lease service granted it: the options carry
// an HMAC-SHA256 under the lease's git grant key, which the service
// derives from the repository's storage secret for that grant alone and
// hands only to the lease's acquirer (lease.GitGrantKey). The hook holds
// the storage secret, derives the grant key of the fence the options name
// and verifies; runners and sidecars never hold the storage secret, so
// they can sign only the fence they were granted (doc.go has the bytes).

// Push options of a signed fence (besides OptionLease, OptionFence,
// OptionRepo and OptionClaim).
const (
	// OptionOwner names the lease's owner ("task=… agent=… attempt=…").
	OptionOwner = "fenceline-owner"
	// OptionMAC carries the fence's MAC: "<version>:<hex HMAC-SHA256>".
	OptionMAC = "fenceline-mac"
)

// MACVersion is the version of the signed message this package makes and
// the only one the hook accepts; a future format gets a new tag, and a
// hook refuses a tag it does not know, naming it. v2: the MAC's key is the
// lease's git grant key (v1 signed with the repository's secret itself,
// which every runner held).
const MACVersion = "v2"

// macDomain opens every v1 message, so a MAC made for something else under
// the same key never verifies as a fence.
const macDomain = "fenceline-git-fence v1"

// HookKeySize is the size of a hook secret made by GenerateHookKey.
const HookKeySize = 32

// minHookKeySize is the shortest secret a key file may hold.
const minHookKeySize = 16

// RefUpdate is one ref update of a push, as git gives it to a pre-receive
// hook: "<old> <new> <ref>".
type RefUpdate struct{ Old, New, Ref string }

// FenceOptions returns the push options that carry lease l's fence to the
// hook, signed with grantKey, the lease's git grant key from the lease
// service (lease.GrantKeys.Git): lease, fence, owner, repo, claim (when it
// fits in one pkt-line, lease.GitClaim) and the MAC over them and updates.
// Without a key there is no MAC, and a hook refuses the push naming what
// is missing.
func FenceOptions(grantKey []byte, l lease.Lease, fence uint64, updates []RefUpdate) ([]string, error) {
	f := fenceFields{Repo: l.Repo, Lease: l.LeaseID, Owner: l.Owner.String(), Fence: strconv.FormatUint(fence, 10)}
	opts := []string{OptionLease + "=" + f.Lease, OptionFence + "=" + f.Fence, OptionOwner + "=" + f.Owner, OptionRepo + "=" + f.Repo}
	if c := lease.GitClaim(l.Scope); c != "" {
		f.Claim = c
		opts = append(opts, OptionClaim+"="+f.Claim)
	}
	if len(grantKey) == 0 {
		return opts, nil
	}
	msg, err := fenceMessage(f, updates)
	if err != nil {
		return nil, err
	}
	return append(opts, OptionMAC+"="+MACVersion+":"+hex.EncodeToString(fenceMAC(grantKey, msg))), nil
}

// fenceFields are the signed values, exactly as the options carry them
// ("" for an option not sent).
type fenceFields struct{ Repo, Lease, Owner, Fence, Claim string }

// fenceMessage is the v1 message a fence's MAC is made over:
//
//	fenceline-git-fence v1\n
//	repo <repo>\n
//	lease <lease id>\n
//	owner <owner>\n
//	fence <fence, as sent>\n
//	claim <claim>\n
//	update <old> <new> <ref>\n    one per ref update, sorted bytewise
//
// No value may contain a newline or NUL, so the encoding is unambiguous.
func fenceMessage(f fenceFields, updates []RefUpdate) ([]byte, error) {
	lines := make([]string, 0, len(updates))
	for _, u := range updates {
		lines = append(lines, "update "+u.Old+" "+u.New+" "+u.Ref)
	}
	slices.Sort(lines)
	head := []string{macDomain, "repo " + f.Repo, "lease " + f.Lease, "owner " + f.Owner, "fence " + f.Fence, "claim " + f.Claim}
	var b strings.Builder
	for _, l := range append(head, lines...) {
		if strings.ContainsAny(l, "\n\x00") {
			return nil, fmt.Errorf("fence field %q contains a newline or NUL: it cannot be signed", clip(l))
		}
		b.WriteString(l)
		b.WriteByte('\n')
	}
	return []byte(b.String()), nil
}

func fenceMAC(key, msg []byte) []byte {
	m := hmac.New(sha256.New, key)
	m.Write(msg)
	return m.Sum(nil)
}

// grantKeyOf derives, from the hook's storage secret, the git grant key of
// the fence f names: the key the lease service gave that fence's acquirer.
func grantKeyOf(secret []byte, f fenceFields) ([]byte, error) {
	return lease.GitGrantKey(secret, f.Repo, f.Lease, f.Owner, f.Fence, f.Claim)
}

// verifyFenceMAC checks an OptionMAC value against msg in constant time,
// under key, the grant key of the fence the options name. A refusal says
// why: an unknown version, a malformed value, or a MAC that does not
// match.
func verifyFenceMAC(key, msg []byte, value string) error {
	version, sum, ok := strings.Cut(value, ":")
	if !ok {
		return fmt.Errorf("malformed %s %q: want %s:<hex>", OptionMAC, clip(value), MACVersion)
	}
	if version == "v1" {
		return fmt.Errorf("%s version v1 was signed with the repository's hook secret itself, which this hook no longer accepts from anyone: it takes only fences signed with a grant key from the lease service (%s); upgrade the sidecar, and register the hook secret with the bus (fenceline bus fence-secret set)", OptionMAC, MACVersion)
	}
	if version != MACVersion {
		return fmt.Errorf("%s version %q is not one this hook knows (it knows %s): upgrade fenceline on the git server", OptionMAC, clip(version), MACVersion)
	}
	got, err := hex.DecodeString(sum)
	if err != nil || len(got) != sha256.Size {
		return fmt.Errorf("malformed %s: want %d hex-encoded bytes", OptionMAC, sha256.Size)
	}
	if !hmac.Equal(got, fenceMAC(key, msg)) {
		return errors.New("its MAC does not verify: it was not made with the grant key the lease service gave this lease for this fence, owner, claim and repo, over this push's ref updates (a fence the service never granted, a grant key used for another fence or claim, a replay from another push, or another repository's grant)")
	}
	return nil
}

// GenerateHookKey returns a new random hook secret.
func GenerateHookKey() ([]byte, error) {
	key := make([]byte, HookKeySize)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("generate hook secret: %w", err)
	}
	return key, nil
}

// HookKeyFile is where a repository's hook reads its secret by default:
// <git-dir>/fenceline/hook.key.
func HookKeyFile(gitDir string) string { return filepath.Join(gitDir, "fenceline", "hook.key") }

// ReadKeyFile reads a hook secret (hex, one line) from path.
func ReadKeyFile(path string) ([]byte, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read git hook secret: %w", err)
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(data)))
	if err != nil {
		return nil, fmt.Errorf("git hook secret %s is not hex (it is written by fenceline hook install): %w", path, err)
	}
	if len(key) < minHookKeySize {
		return nil, fmt.Errorf("git hook secret %s holds %d bytes; want at least %d (write a new one with fenceline hook install)", path, len(key), minHookKeySize)
	}
	return key, nil
}

// readHookKey reads the hook's own secret and refuses one that other users
// could read: whoever reads it can mint fences.
func readHookKey(path string) ([]byte, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return nil, fmt.Errorf("git hook secret %s has mode %04o: others may read it, and whoever reads it can mint fences (chmod 600 %s)", path, fi.Mode().Perm(), path)
	}
	return ReadKeyFile(path)
}

// WriteKeyFile writes key to path (hex, mode 0600), creating its directory
// (mode 0700) when missing. It does not replace an existing file.
func WriteKeyFile(path string, key []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("write git hook secret: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("write git hook secret: %w", err)
	}
	if _, err := f.WriteString(hex.EncodeToString(key) + "\n"); err != nil {
		f.Close()
		return fmt.Errorf("write git hook secret %s: %w", path, err)
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return fmt.Errorf("write git hook secret %s: %w", path, err)
	}
	return f.Close()
}

// HookInstall says how to install the fence's pre-receive hook.
type HookInstall struct {
	// GitDir is the server's repository (bare, usually).
	GitDir string
	// Repo is the repository's identity as the leases name it, e.g.
	// github.com/acme/payments: the hook accepts fences for it only.
	Repo string
	// Fenceline is the fenceline binary the hook runs (absolute path).
	Fenceline string
	// AllowUnfenced lets pushes that carry no fenceline options at all
	// through (people pushing directly); bad fences are refused either way.
	AllowUnfenced bool
	// Git is the git binary (default "git").
	Git string
	// BusArgs are global fenceline flags the hook runs with (--nats URL,
	// --creds FILE), so that its refusals also go to the bus's audit
	// stream; none: they go only to <git-dir>/fenceline/refusals.jsonl.
	BusArgs []string
}

// Installed is what InstallHook did.
type Installed struct {
	GitDir  string // absolute
	KeyFile string // the hook's secret
	Key     []byte
	NewKey  bool   // false: an existing secret was kept
	Hook    string // the hook script
}

// hookMarker identifies a pre-receive hook written by InstallHook.
const hookMarker = "# fenceline pre-receive hook"

// InstallHook installs the fence in a repository on the git server: a
// random secret in <git-dir>/fenceline/hook.key (mode 0600, kept when it
// exists), the pre-receive hook that runs fenceline with it, and
// receive.advertisePushOptions so the fence can travel. Run it as the user
// the git server runs hooks as: that user must own the secret, and no
// agent's user may read it. An existing pre-receive hook that is not
// fenceline's is left alone and reported.
func InstallHook(ctx context.Context, in HookInstall) (*Installed, error) {
	if in.GitDir == "" || in.Repo == "" || in.Fenceline == "" {
		return nil, errors.New("hook install: the git dir, the repo identity and the fenceline binary are required")
	}
	if strings.ContainsAny(in.Repo, "\n\x00") {
		return nil, fmt.Errorf("hook install: repo %q contains a newline or NUL", in.Repo)
	}
	if in.Git == "" {
		in.Git = "git"
	}
	g := gitRunner{path: in.Git}
	out, err := g.run(ctx, in.GitDir, "rev-parse", "--absolute-git-dir")
	if err != nil {
		return nil, fmt.Errorf("hook install: %s is not a git repository: %w", in.GitDir, err)
	}
	res := &Installed{GitDir: strings.TrimSpace(string(out))}
	res.KeyFile = HookKeyFile(res.GitDir)
	res.Hook = filepath.Join(res.GitDir, "hooks", "pre-receive")

	if old, err := os.ReadFile(res.Hook); err == nil && !strings.Contains(string(old), hookMarker) {
		return nil, fmt.Errorf("hook install: %s exists and is not fenceline's: move it aside (or call it from a wrapper that also runs fenceline hook pre-receive) and install again", res.Hook)
	} else if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("hook install: %w", err)
	}

	res.Key, err = ReadKeyFile(res.KeyFile)
	switch {
	case err == nil:
		if err := os.Chmod(res.KeyFile, 0o600); err != nil {
			return nil, fmt.Errorf("hook install: %w", err)
		}
	case errors.Is(err, fs.ErrNotExist):
		if res.Key, err = GenerateHookKey(); err != nil {
			return nil, err
		}
		if err := WriteKeyFile(res.KeyFile, res.Key); err != nil {
			return nil, fmt.Errorf("hook install: %w", err)
		}
		res.NewKey = true
	default:
		return nil, fmt.Errorf("hook install: %w", err)
	}

	args := []string{shellQuote(in.Fenceline)}
	for _, a := range in.BusArgs {
		if strings.ContainsAny(a, "\n\x00") {
			return nil, fmt.Errorf("hook install: bus argument %q contains a newline or NUL", a)
		}
		args = append(args, shellQuote(a))
	}
	args = append(args, "hook", "pre-receive", "--repo", shellQuote(in.Repo))
	if in.AllowUnfenced {
		args = append(args, "--allow-unfenced")
	}
	script := "#!/bin/sh\n" + hookMarker + " (fenceline hook install): it refuses pushes whose fence is\n" +
		"# missing, forged or stale; its secret is " + res.KeyFile + ".\n" +
		"exec " + strings.Join(args, " ") + "\n"
	if err := os.MkdirAll(filepath.Dir(res.Hook), 0o755); err != nil {
		return nil, fmt.Errorf("hook install: %w", err)
	}
	tmp := res.Hook + ".fenceline-tmp"
	if err := os.WriteFile(tmp, []byte(script), 0o755); err != nil {
		return nil, fmt.Errorf("hook install: %w", err)
	}
	if err := os.Rename(tmp, res.Hook); err != nil {
		return nil, fmt.Errorf("hook install: %w", err)
	}
	if _, err := g.run(ctx, res.GitDir, "config", "receive.advertisePushOptions", "true"); err != nil {
		return nil, fmt.Errorf("hook install: %w", err)
	}
	return res, nil
}

// shellQuote quotes s for sh.
func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }
