package gitproxy

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

// The pre-receive hook is the storage-side half of the git fence (docs/design.md
// invariant 5): the git server itself rejects a push whose fence is stale,
// so a zombie sidecar that passed its own checks before pausing cannot land
// a push after its lease was regranted.
//
// The repository keeps, in <git-dir>/fenceline/fences.json, the highest
// fence accepted for every path a fenced push claimed or touched. A push
// with fence F is stale when an entry with a higher fence overlaps its
// claim or any path it touches: fence tokens rise with every grant of the
// repository, and overlapping leases are never active together, so a
// higher fence on an overlapping path means the pusher's lease ended before
// that push's lease was granted.
//
// The hook believes a fence only when its MAC verifies under the fence's
// grant key, which the hook derives from its secret (fencemac.go, and
// doc.go for the exact bytes): fences are granted by the lease service,
// never minted by a runner or whoever can reach the server. A push with bad fence options is
// refused before the table is read, so nothing it says is ever recorded.

// HookConfig configures PreReceive.
type HookConfig struct {
	// GitDir is the repository (default: git rev-parse --absolute-git-dir).
	GitDir string
	// Options are the push options git gave the hook (PushOptionsFrom
	// reads them from its environment); none: the push carries none.
	Options []string
	// Repo is the repository's identity as the leases name it; a fence
	// signed for another repository is refused. Empty: the signed
	// fenceline-repo option is taken as it is (the per-repository secret
	// still binds the fence to this repository).
	Repo string
	// Key is the hook secret; nil: read from KeyFile.
	Key []byte
	// KeyFile holds the hook secret (default <git-dir>/fenceline/hook.key,
	// see HookKeyFile). It must not be readable by group or others.
	KeyFile string
	// AllowUnfenced lets pushes that carry no fenceline options at all
	// through. A push with any fenceline option is checked in full either
	// way: bad options never pass.
	AllowUnfenced bool
	// Git is the git binary (default "git").
	Git string
	// Policy, when set, is the security team's policy: a verified push is
	// asked as push on each ref and write on each touched path
	// (policyhook.go). Nil: none.
	Policy *policy.Store
	// Leases, when set, is the lease bus: a verified push lands only if
	// its lease is still active with its fence when the hook decides, so
	// a push forwarded before a revoke and delayed (a paused sidecar, a
	// slow server) is refused by the storage itself. No answer refuses.
	// Nil: fences are checked against each other only.
	Leases LeaseGetter
}

// LeaseGetter reads one lease by id: the bus, for the hook.
type LeaseGetter interface {
	Get(ctx context.Context, leaseID string) (*lease.Lease, error)
}

// Hook refusals of a lease the bus no longer vouches for.
const (
	HookLeaseLost    = ReasonLeaseLost    // the bus says the lease ended, or carries another fence
	HookLeaseUnknown = ReasonLeaseUnknown // the bus did not answer
)

// hookLeaseTimeout bounds the hook's read of the lease.
const hookLeaseTimeout = 5 * time.Second

// Reasons of the hook's refusals (HookError.Reason).
const (
	HookUnfenced     = "unfenced"       // no fenceline options, and unfenced pushes are not allowed
	HookMalformed    = "malformed"      // fenceline options that do not parse, repeat, or are unknown
	HookUnsigned     = "unsigned"       // fence options without a MAC
	HookNoSecret     = "no-secret"      // the hook has no secret to verify with
	HookBadMAC       = "bad-mac"        // the MAC does not verify
	HookOtherRepo    = "other-repo"     // a fence signed for another repository
	HookStaleFence   = ReasonStaleFence // a newer fence was accepted for an overlapping path
	HookOutsideClaim = "outside-claim"  // a touched path is outside the claim the fence was signed with
	HookBlindDelete  = "blind-delete"   // a delete naming no value, of a ref that exists
)

// HookError is a refusal by the hook, printed to the pusher: Msg names the
// lease, fence and reason.
type HookError struct {
	Msg    string
	Reason string // one of the Hook* reasons
	Lease  string // as the push claimed it ("" when it named none)
	Fence  string // as the push claimed it
	Owner  string // as the push claimed it
}

func (e *HookError) Error() string { return e.Msg }

// fenceEntry is one path's highest accepted fence.
type fenceEntry struct {
	Fence uint64 `json:"fence"`
	Lease string `json:"lease"`
	Owner string `json:"owner,omitempty"`
}

func ownerSuffix(owner string) string {
	if owner == "" {
		return ""
	}
	return ", " + owner
}

// knownOptions are the fenceline push options this hook reads.
var knownOptions = []string{OptionLease, OptionFence, OptionOwner, OptionRepo, OptionClaim, OptionMAC}

// PreReceive checks the ref updates read from stdin ("<old> <new> <ref>"
// lines, as git gives a pre-receive hook) and records the push's fence when
// it passes. A refusal is a *HookError, also appended to the repository's
// refusal log, <git-dir>/fenceline/refusals.jsonl.
func PreReceive(ctx context.Context, cfg HookConfig, stdin io.Reader) error {
	if cfg.Git == "" {
		cfg.Git = "git"
	}
	g := gitRunner{path: cfg.Git}
	var cmds []command
	sc := bufio.NewScanner(stdin)
	for sc.Scan() {
		c, err := parseCommand(sc.Text())
		if err != nil {
			return fmt.Errorf("pre-receive input: %w", err)
		}
		cmds = append(cmds, c)
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("read pre-receive input: %w", err)
	}
	gitDir := cfg.GitDir
	if gitDir == "" {
		out, err := g.runHere(ctx, "rev-parse", "--absolute-git-dir")
		if err != nil {
			return err
		}
		gitDir = strings.TrimSpace(string(out))
	}
	err := preReceive(ctx, g, cfg, gitDir, cmds)
	var he *HookError
	if errors.As(err, &he) {
		logRefusal(gitDir, he, cmds)
	}
	return err
}

// preReceive decides a push at the git server: a fence in its options,
// signed for this repository and these ref updates, whose touched paths
// stay in its claim and pass the policy, of a lease still active, and no
// older than the fence last recorded for anything it touches.
func preReceive(ctx context.Context, g gitRunner, cfg HookConfig, gitDir string, cmds []command) error {
	opts, bad := hookOptions(cfg.Options)
	if len(opts) == 0 {
		if cfg.AllowUnfenced {
			return nil
		}
		return &HookError{Reason: HookUnfenced, Msg: "fenceline: push refused: it carries no fence (push through the fenceline sidecar, or install the hook with --allow-unfenced)"}
	}
	f := &hookFence{leaseID: opts[OptionLease], fenceStr: opts[OptionFence], owner: opts[OptionOwner], repo: opts[OptionRepo]}
	if bad != nil {
		return f.deny(bad)
	}
	if he := f.verify(cfg, gitDir, opts, cmds); he != nil {
		return f.deny(he)
	}
	if he := hookBlindDeletes(ctx, g, cmds); he != nil {
		return f.deny(he)
	}
	touched, err := hookTouched(ctx, g, cmds)
	if err != nil {
		return err
	}
	// The paths come from the server's own objects: a push whose paths the
	// proxy misjudged (from objects the agent forged, say) is refused here
	// when they leave the claim the fence was signed with.
	if outside := f.outsideClaim(touched); len(outside) > 0 {
		return f.deny(&HookError{Reason: HookOutsideClaim, Msg: fmt.Sprintf("%s is outside its claim %s", andMore(outside), strings.Join(f.claim.Paths, " "))})
	}
	if he := hookPolicy(ctx, g, cfg.Policy, f.repo, f.leaseID, f.owner, f.claim, cmds, touched); he != nil {
		return f.deny(he)
	}
	resources := f.resources(touched)

	// Last before recording: the lease must still be active, with this
	// fence (the proxy confirmed it before forwarding; a revoke since then
	// is the storage's to enforce).
	if he := hookLeaseActive(ctx, cfg.Leases, f.leaseID, f.fence); he != nil {
		return f.deny(he)
	}
	return f.record(gitDir, resources)
}

// hookOptions are the fenceline-* push options, by name, and the first
// thing wrong with them (an option given twice, or one the hook does not
// know), nil when nothing is.
func hookOptions(options []string) (map[string]string, *HookError) {
	opts := map[string]string{}
	var bad *HookError
	for _, o := range options {
		k, v, _ := strings.Cut(o, "=")
		if !strings.HasPrefix(k, "fenceline-") {
			continue
		}
		if _, dup := opts[k]; dup && bad == nil {
			bad = &HookError{Reason: HookMalformed, Msg: fmt.Sprintf("push option %s is given twice", k)}
		}
		if !slices.Contains(knownOptions, k) && bad == nil {
			bad = &HookError{Reason: HookMalformed, Msg: fmt.Sprintf("push option %s is not one fenceline knows (%s)", clip(k), strings.Join(knownOptions, ", "))}
		}
		opts[k] = v
	}
	return opts, bad
}

// hookFence is the fence a push's options carry, as the hook reads it.
type hookFence struct {
	leaseID, fenceStr, owner string // as the push names them
	repo                     string // the repository it was signed for
	fence                    uint64 // set by verify
	claim                    scope.Claim
}

// deny makes e the refusal of a push under f, naming the fence.
func (f *hookFence) deny(e *HookError) *HookError {
	e.Lease, e.Fence, e.Owner = f.leaseID, f.fenceStr, f.owner
	e.Msg = fmt.Sprintf("fenceline: push refused: fence %q of lease %q (owner %q): %s [%s]", f.fenceStr, f.leaseID, f.owner, e.Msg, e.Reason)
	return e
}

// verify checks the fence options (opts): a lease and a positive fence,
// signed with the lease's grant key (derived from the hook's secret) over
// the push's ref updates (cmds), for this repository; and reads the claim
// the fence was signed with.
func (f *hookFence) verify(cfg HookConfig, gitDir string, opts map[string]string, cmds []command) *HookError {
	fence, err := strconv.ParseUint(f.fenceStr, 10, 64)
	if err != nil || fence == 0 || f.leaseID == "" {
		return &HookError{Reason: HookMalformed, Msg: fmt.Sprintf("malformed fence options: want %s=<lease id> and %s=<positive integer>", OptionLease, OptionFence)}
	}
	f.fence = fence
	mac, signed := opts[OptionMAC]
	if !signed {
		return &HookError{Reason: HookUnsigned, Msg: fmt.Sprintf("it is not signed (no %s option): this server accepts only fences the lease service granted, signed by the lease's fenceline sidecar with the grant key the service gave it (register this repository's hook secret with the bus: fenceline bus fence-secret set --repo REPO --git HOOK-SECRET-FILE)", OptionMAC)}
	}
	key := cfg.Key
	if len(key) == 0 {
		file := cfg.KeyFile
		if file == "" {
			file = HookKeyFile(gitDir)
		}
		if key, err = readHookKey(file); err != nil {
			return &HookError{Reason: HookNoSecret, Msg: fmt.Sprintf("this hook cannot verify fences: %v (run fenceline hook install --git-dir %s --repo REPO as the git server's user)", err, gitDir)}
		}
	}
	claimStr := opts[OptionClaim]
	updates := make([]RefUpdate, len(cmds))
	for i, c := range cmds {
		updates[i] = RefUpdate(c)
	}
	fields := fenceFields{Repo: f.repo, Lease: f.leaseID, Owner: f.owner, Fence: f.fenceStr, Claim: claimStr}
	msg, err := fenceMessage(fields, updates)
	var grant []byte
	if err == nil {
		grant, err = grantKeyOf(key, fields)
	}
	if err == nil {
		err = verifyFenceMAC(grant, msg, mac)
	}
	if err != nil {
		return &HookError{Reason: HookBadMAC, Msg: err.Error()}
	}
	if cfg.Repo != "" && repoid.Normalize(f.repo) != repoid.Normalize(cfg.Repo) {
		return &HookError{Reason: HookOtherRepo, Msg: fmt.Sprintf("it was signed for repository %q; this repository is %q", f.repo, cfg.Repo)}
	}
	if claimStr != "" {
		if err := json.Unmarshal([]byte(claimStr), &f.claim); err != nil {
			return &HookError{Reason: HookMalformed, Msg: fmt.Sprintf("malformed %s option: %v", OptionClaim, err)}
		}
	}
	return nil
}

// hookBlindDeletes refuses a delete that names no value of a ref the
// server has: such a delete goes whatever the ref holds, and the proxy
// lets one through only for a ref the server lacked when it looked.
func hookBlindDeletes(ctx context.Context, g gitRunner, cmds []command) *HookError {
	for _, c := range cmds {
		if !c.isBlindDelete() {
			continue
		}
		if out, err := g.runHere(ctx, "show-ref", "--verify", "--hash", c.Ref); err == nil {
			return &HookError{Reason: HookBlindDelete, Msg: fmt.Sprintf("%s exists (at %s), but the push deletes it without naming its value: fetch, then delete it again", c.Ref, strings.TrimSpace(string(out)))}
		}
	}
	return nil
}

// outsideClaim are the touched paths a claim of paths does not contain
// (none for any other claim).
func (f *hookFence) outsideClaim(touched []string) []string {
	if f.claim.Kind != scope.KindPaths {
		return nil
	}
	var outside []string
	for _, p := range touched {
		if !f.claim.ContainsPath(p) {
			outside = append(outside, p)
		}
	}
	return outside
}

// resources are the push's resources: its claim, and the touched paths
// the claim does not cover (all of them for a lease that claims nothing).
func (f *hookFence) resources(touched []string) []string {
	var resources []string
	switch f.claim.Kind {
	case scope.KindWholeRepo:
		resources = []string{""}
	case scope.KindPaths:
		resources = append(resources, f.claim.Paths...)
		for _, p := range touched {
			if !f.claim.ContainsPath(p) {
				resources = append(resources, p)
			}
		}
	default:
		resources = touched
	}
	return resources
}

// record refuses the push when a newer fence was recorded for anything
// overlapping its resources, and otherwise records its fence for each (in
// the repository's fence file, under its lock).
func (f *hookFence) record(gitDir string, resources []string) error {
	return withFenceFile(gitDir, func(fences map[string]fenceEntry) (bool, error) {
		idx := newFenceIndex(fences)
		for _, r := range resources {
			if path, e, ok := idx.newerOverlapping(r, f.fence); ok {
				what := r
				if what == "" {
					what = "the whole repository"
				}
				if path != r && path != "" {
					what += " (" + path + ")"
				}
				return false, &HookError{Reason: HookStaleFence, Lease: f.leaseID, Fence: f.fenceStr, Owner: f.owner, Msg: fmt.Sprintf(
					"fenceline: push refused: fence %d of lease %s (%s) is stale: %s was pushed under fence %d (lease %s%s) [%s]",
					f.fence, f.leaseID, f.owner, what, e.Fence, e.Lease, ownerSuffix(e.Owner), HookStaleFence)}
			}
		}
		for _, r := range resources {
			if e, ok := fences[r]; !ok || e.Fence < f.fence {
				fences[r] = fenceEntry{Fence: f.fence, Lease: f.leaseID, Owner: f.owner}
			}
		}
		return true, nil
	})
}

// hookLeaseActive refuses unless leases (nil: not asked) says leaseID is
// active with fence.
func hookLeaseActive(ctx context.Context, leases LeaseGetter, leaseID string, fence uint64) *HookError {
	if leases == nil {
		return nil
	}
	ctx, cancel := context.WithTimeout(ctx, hookLeaseTimeout)
	defer cancel()
	cur, err := leases.Get(ctx, leaseID)
	switch {
	case err != nil:
		return &HookError{Reason: HookLeaseUnknown, Msg: fmt.Sprintf("the lease bus did not confirm the lease: %v", err)}
	case !cur.Active():
		return &HookError{Reason: HookLeaseLost, Msg: fmt.Sprintf("the lease is %s (%s)", cur.Status, cur.Reason)}
	case cur.Fence != fence:
		return &HookError{Reason: HookLeaseLost, Msg: fmt.Sprintf("the bus says the lease carries fence %d", cur.Fence)}
	}
	return nil
}

// hookRefusal is one line of the repository's refusal log.
type hookRefusal struct {
	Time    time.Time `json:"time"`
	Reason  string    `json:"reason"`
	Lease   string    `json:"lease,omitempty"`
	Fence   string    `json:"fence,omitempty"`
	Owner   string    `json:"owner,omitempty"`
	Refs    []string  `json:"refs"`
	Message string    `json:"message"`
}

// logRefusal appends a refusal to <git-dir>/fenceline/refusals.jsonl, the
// storage side's own audit trail (the hook holds no bus credentials). A
// failure to log leaves the push refused.
func logRefusal(gitDir string, he *HookError, cmds []command) {
	rec := hookRefusal{Time: time.Now().UTC(), Reason: he.Reason, Lease: he.Lease, Fence: he.Fence, Owner: he.Owner, Message: he.Msg, Refs: []string{}}
	for _, c := range cmds {
		rec.Refs = append(rec.Refs, c.Ref)
	}
	line, err := json.Marshal(rec)
	if err != nil {
		return
	}
	dir := filepath.Join(gitDir, "fenceline")
	if os.MkdirAll(dir, 0o700) != nil {
		return
	}
	f, err := os.OpenFile(filepath.Join(dir, "refusals.jsonl"), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	f.Write(append(line, '\n'))
}

// fenceIndex finds recorded fences overlapping a path: its ancestors (and
// "", the whole repository) by lookup, its descendants by a range of the
// sorted keys — O(log n) per path, whatever the table's size.
type fenceIndex struct {
	fences map[string]fenceEntry
	keys   []string // sorted
}

func newFenceIndex(fences map[string]fenceEntry) *fenceIndex {
	keys := make([]string, 0, len(fences))
	for k := range fences {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return &fenceIndex{fences: fences, keys: keys}
}

// newerOverlapping returns a recorded path overlapping p (p == "" is the
// whole repository) whose fence is above fence.
func (x *fenceIndex) newerOverlapping(p string, fence uint64) (string, fenceEntry, bool) {
	newer := func(k string) (fenceEntry, bool) {
		e, ok := x.fences[k]
		return e, ok && e.Fence > fence
	}
	// p itself and its ancestors, up to the whole repository.
	for a := p; ; {
		if e, ok := newer(a); ok {
			return a, e, true
		}
		if a == "" {
			break
		}
		i := strings.LastIndexByte(a, '/')
		if i < 0 {
			a = ""
		} else {
			a = a[:i]
		}
	}
	// Its descendants: every key when p is the whole repository.
	prefix := p + "/"
	start := 0
	if p != "" {
		start, _ = slices.BinarySearch(x.keys, prefix)
	}
	for _, k := range x.keys[start:] {
		if p != "" && !strings.HasPrefix(k, prefix) {
			break
		}
		if e, ok := newer(k); ok {
			return k, e, true
		}
	}
	return "", fenceEntry{}, false
}

// hookTouched lists the paths a push touches by the rule the proxy applies
// (doc.go, "The push rule"): the paths that differ between each update's
// old and new tip, for a new ref between the default branch (HEAD, where
// they meet) and the new tip, and what every new commit changes against
// each of its parents (root commits in full). It runs git in the hook's
// environment, where the pushed objects are visible in quarantine and the
// refs are still as they were before the push.
func hookTouched(ctx context.Context, g gitRunner, cmds []command) ([]string, error) {
	set := map[string]struct{}{}
	add := func(out []byte, sep string) {
		for _, l := range strings.Split(string(out), sep) {
			if l != "" {
				set[l] = struct{}{}
			}
		}
	}
	diff := func(from, to string) error {
		out, err := g.runHere(ctx, "diff-tree", "-r", "-z", "--name-only", "--no-renames", "--no-commit-id", from, to)
		add(out, "\x00")
		return err
	}
	var base string // the default branch's tip, once looked up
	var tips []string
	for _, c := range cmds {
		if c.isDelete() {
			continue
		}
		out, err := g.runHere(ctx, "rev-parse", "--verify", "--quiet", c.New+"^{commit}")
		if err != nil {
			continue // not a commit: no paths (the proxy lets only whole-repo leases push one)
		}
		tip := strings.TrimSpace(string(out))
		tips = append(tips, tip)
		if !c.isCreate() {
			old := c.Old + "^{tree}"
			if _, err := g.runHere(ctx, "rev-parse", "--verify", "--quiet", old); err != nil {
				old = emptyTree // the ref held no tree-ish: every path of the new tip counts
			}
			if err := diff(old, tip); err != nil {
				return nil, err
			}
			continue
		}
		if base == "" {
			base = emptyTree
			if out, err := g.runHere(ctx, "rev-parse", "--verify", "--quiet", "HEAD^{commit}"); err == nil {
				base = strings.TrimSpace(string(out))
			}
		}
		var mbs []string
		if base != emptyTree {
			out, err := g.runHere(ctx, "merge-base", "--all", base, tip)
			if err == nil {
				mbs = strings.Fields(string(out))
			}
		}
		if len(mbs) == 0 {
			mbs = []string{emptyTree} // no shared history: all of the new tip
		}
		for _, mb := range mbs {
			if err := diff(mb, tip); err != nil {
				return nil, err
			}
		}
	}
	if len(tips) > 0 {
		args := append([]string{"log", "--format=", "--name-only", "--no-renames", "-z", "-m", "--root"}, tips...)
		out, err := g.runHere(ctx, append(args, "--not", "--all")...)
		if err != nil {
			return nil, err
		}
		add(out, "\x00")
	}
	paths := make([]string, 0, len(set))
	for p := range set {
		paths = append(paths, strings.TrimPrefix(p, "\n"))
	}
	slices.Sort(paths)
	return slices.Compact(paths), nil
}

// emptyTree is git's id of the empty tree, which every repository knows.
const emptyTree = "4b825dc642cb6eb9a060e54bf8d69288fbee4904"

// withFenceFile runs f on the repository's fence table under an exclusive
// lock and writes the table back (atomically) when f says so.
func withFenceFile(gitDir string, f func(map[string]fenceEntry) (bool, error)) error {
	dir := filepath.Join(gitDir, "fenceline")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("fence table: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return fmt.Errorf("fence table: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return fmt.Errorf("lock fence table: %w", err)
	}
	path := filepath.Join(dir, "fences.json")
	fences := map[string]fenceEntry{}
	data, err := os.ReadFile(path)
	switch {
	case errors.Is(err, os.ErrNotExist):
	case err != nil:
		return fmt.Errorf("read fence table: %w", err)
	default:
		if err := json.Unmarshal(data, &fences); err != nil {
			return fmt.Errorf("fence table %s is damaged (%v): refusing pushes until it is repaired", path, err)
		}
	}
	write, err := f(fences)
	if err != nil || !write {
		return err
	}
	data, err = json.MarshalIndent(fences, "", " ")
	if err != nil {
		return fmt.Errorf("encode fence table: %w", err)
	}
	tmp := path + ".tmp"
	if err := writeFileSync(tmp, data); err != nil {
		return fmt.Errorf("write fence table: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write fence table: %w", err)
	}
	return nil
}

func writeFileSync(path string, data []byte) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}

// PushOptionsFrom reads the push options git gives a hook in its
// environment (GIT_PUSH_OPTION_COUNT, GIT_PUSH_OPTION_<i>) through getenv,
// for HookConfig.Options: the hook command reads its environment, gitproxy
// does not.
func PushOptionsFrom(getenv func(string) string) []string {
	n, _ := strconv.Atoi(getenv("GIT_PUSH_OPTION_COUNT"))
	opts := make([]string, 0, n)
	for i := range n {
		opts = append(opts, getenv(fmt.Sprintf("GIT_PUSH_OPTION_%d", i)))
	}
	return opts
}
