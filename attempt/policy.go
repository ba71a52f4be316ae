package attempt

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/sidecar"
)

// Policy is the file-write guard a lease gives the agent in its checkout:
//
//	shared workspace, path claim     the claimed paths; not the git dir; git shim
//	exclusive workspace, path claim  the claimed paths and the git dir
//	exclusive, whole-repo or none    the whole checkout and the git dir
//
// plus extra (paths the caller lets the agent write besides, already real
// and absolute: see RealPaths). A claimed path that does not exist is
// created as a directory (Landlock grants rights only on existing paths)
// and returned in created; one that resolves outside the checkout, through
// a symlink, or into the git dir of a shared workspace, is refused.
// Hidden, ConnectPorts and the supervisor's settings are the caller's.
func Policy(co *Checkout, l lease.Lease, extra []string) (p fsguard.Policy, created []string, err error) {
	p = fsguard.Policy{Root: co.Root, GitDirs: co.GitDirs, Lease: l}
	shared := l.WorkspaceMode == lease.WorkspaceShared
	switch {
	case l.Scope.Kind == scope.KindPaths:
		for _, rel := range l.Scope.Paths {
			path, made, err := ensureClaimPath(co.Root, rel)
			if err != nil {
				return p, nil, err
			}
			if shared {
				for _, g := range co.GitDirs {
					if Within(path, g) || Within(g, path) {
						return p, nil, fmt.Errorf("claim %s resolves to %s, which holds the git dir %s: a shared workspace never writes it; claim paths of the worktree", rel, path, g)
					}
				}
			}
			if made {
				created = append(created, rel)
			}
			p.Writable = append(p.Writable, path)
		}
	case shared:
		return p, nil, fmt.Errorf("lease %s: a shared workspace needs a path claim (it has %s); lease an exclusive workspace to write the whole checkout", l.LeaseID, l.Scope)
	default: // whole-repo, or an exclusive workspace claiming no paths
		p.Writable = []string{co.Root}
	}
	p.Writable = append(p.Writable, extra...)
	p.GitDirWritable = !shared && len(co.GitDirs) > 0
	p.GitShim = shared && len(co.GitDirs) > 0
	return p, created, nil
}

// ensureClaimPath returns the path of the claim rel in root, creating it as
// a directory when it does not exist (see ClaimPath).
func ensureClaimPath(root, rel string) (path string, created bool, err error) {
	path, err = ClaimPath(root, rel)
	if err != nil {
		return "", false, err
	}
	if _, err := os.Lstat(path); err == nil {
		return path, false, nil
	}
	if err := os.MkdirAll(path, 0o755); err != nil {
		return "", false, fmt.Errorf("claim %s: create it: %w", rel, err)
	}
	// The guard checks again, on the descriptor it grants, that nothing
	// swapped a symlink in meanwhile.
	return path, true, nil
}

// ClaimPath is the path of the claim rel in the checkout root (real and
// absolute), provided the claim is what it says: whatever exists of it
// resolves to its own spelling. A symlink anywhere along it — to another
// agent's claim, or out of the checkout — would make the guard grant what
// the lease service never compared, so it is refused, naming what to
// claim instead. The lease service compares claims as spelled; the disk
// decides what they are, so a caller checks each claim here before it
// asks for it.
func ClaimPath(root, rel string) (string, error) {
	path := filepath.Join(root, filepath.FromSlash(rel))
	if !Within(path, root) {
		return "", fmt.Errorf("claim %s lies outside the checkout %s", rel, root)
	}
	existing := path
	for {
		_, err := os.Lstat(existing)
		if err == nil {
			break
		}
		if !errors.Is(err, fs.ErrNotExist) || existing == root {
			return "", fmt.Errorf("claim %s: %w", rel, err)
		}
		existing = filepath.Dir(existing)
	}
	real, err := filepath.EvalSymlinks(existing)
	if err != nil {
		return "", fmt.Errorf("claim %s: %w", rel, err)
	}
	if real == existing {
		return path, nil
	}
	spelled, _ := filepath.Rel(root, existing)
	if r, err := filepath.Rel(root, real); err == nil && Within(real, root) {
		return "", fmt.Errorf("claim %s goes through a symlink: %s resolves to %s; a claim is judged by what it resolves to, so claim %s instead", rel, spelled, r, filepath.ToSlash(r))
	}
	return "", fmt.Errorf("claim %s goes through a symlink: %s resolves to %s, outside the checkout %s: refusing to make it writable", rel, spelled, real, root)
}

// RealPaths makes each path absolute and real; each must exist, and none
// may be the root of the filesystem. flag names the paths in errors.
func RealPaths(flag string, ps []string) ([]string, error) {
	var out []string
	for _, p := range ps {
		abs, err := filepath.Abs(p)
		if err == nil {
			abs, err = filepath.EvalSymlinks(abs)
		}
		if err != nil {
			return nil, invalidf("%s %s: %v (it must exist)", flag, p, err)
		}
		if abs == "/" {
			return nil, invalidf("%s %s: the whole filesystem cannot be writable", flag, p)
		}
		out = append(out, abs)
	}
	return out, nil
}

// HiddenPaths are what the agent may not read: the secrets the caller
// names — fenceline's state dir (lease credentials, the embedded bus's
// store and its bus credentials, the Postgres fence secret, the sidecar's
// CA key and spooled packs) and any other (a sidecar's state dir, a fence
// secret file kept elsewhere, bus credentials) — except files the agent's
// env points git and the agent's HTTP clients at (the local CA
// certificate, the CA bundle with it). Empty names are skipped.
func HiddenPaths(env []string, secrets ...string) []string {
	var keep []string
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if (strings.HasPrefix(k, "GIT_CONFIG_VALUE_") || slices.Contains(sidecar.CABundleVars, k)) && filepath.IsAbs(v) {
			keep = append(keep, filepath.Clean(v))
		}
	}
	var roots []string
	for _, p := range secrets {
		if p == "" {
			continue
		}
		if abs, err := filepath.Abs(p); err == nil && !slices.ContainsFunc(roots, func(r string) bool { return Within(abs, r) }) {
			roots = append(roots, abs)
		}
	}
	var hidden []string
	for _, root := range roots {
		hidden = append(hidden, hideExcept(topMissing(root), keep)...)
	}
	return hidden
}

// topMissing is p, or, when p's parent does not exist, its topmost missing
// ancestor: hiding that hides p once it is created, and the guard needs
// the directories above a hidden path to exist.
func topMissing(p string) string {
	for {
		parent := filepath.Dir(p)
		if parent == p {
			return p
		}
		if _, err := os.Lstat(parent); err == nil {
			return p
		}
		p = parent
	}
}

// hideExcept lists paths that hide root but for the paths in keep: root
// itself when none lies inside it, else every entry along the way that
// leads to none of them. Entries created later stay unreadable.
func hideExcept(root string, keep []string) []string {
	var inside []string
	for _, k := range keep {
		if k != root && Within(k, root) {
			inside = append(inside, k)
		}
	}
	if len(inside) == 0 {
		return []string{root}
	}
	ents, err := os.ReadDir(root)
	if err != nil {
		return []string{root}
	}
	var out []string
	for _, e := range ents {
		p := filepath.Join(root, e.Name())
		switch {
		case slices.Contains(inside, p):
		case slices.ContainsFunc(inside, func(k string) bool { return Within(k, p) }):
			out = append(out, hideExcept(p, inside)...)
		default:
			out = append(out, p)
		}
	}
	return out
}

// Ports parses TCP port numbers the agent may connect to directly; flag
// names them in errors.
func Ports(flag string, ss []string) ([]uint16, error) {
	var ps []uint16
	for _, s := range ss {
		n, err := strconv.ParseUint(strings.TrimSpace(s), 10, 16)
		if err != nil || n == 0 {
			return nil, invalidf("%s %q: want a TCP port number (1-65535)", flag, s)
		}
		ps = append(ps, uint16(n))
	}
	return ps, nil
}

// Summary says in one line what the guard lets the agent do.
func Summary(co *Checkout, p fsguard.Policy, guarded bool) string {
	if !guarded {
		return "file guard: NONE (no Landlock): writes and connects are not confined; writes stop only when the lease is lost"
	}
	var ws []string
	for _, w := range p.Writable {
		if rel, err := filepath.Rel(co.Root, w); err == nil && !strings.HasPrefix(rel, "..") {
			ws = append(ws, rel)
		} else {
			ws = append(ws, w)
		}
	}
	gitDir := "read-only"
	if p.GitDirWritable {
		gitDir = "writable"
	}
	portList := func(ps []uint16, none string) string {
		if len(ps) == 0 {
			return none
		}
		var ss []string
		for _, n := range ps {
			ss = append(ss, strconv.Itoa(int(n)))
		}
		return strings.Join(ss, ", ")
	}
	what := strings.Join(ws, ", ")
	if what == "" {
		what = "no files" // commit capacity: the git dirs only
	}
	return fmt.Sprintf("file guard: the agent writes %s in %s (git dir %s) and its own temp dir; TCP connects to ports: %s; listens on kernel-chosen ports and: %s",
		what, co.Root, gitDir, portList(p.ConnectPorts, "none"), portList(p.BindPorts, "none"))
}
