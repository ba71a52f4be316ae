package attempt

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// maxProtectWalk bounds the entries ProtectPaths reads under the
// writable paths of one attempt.
const maxProtectWalk = 1 << 20

// ProtectPaths narrows writable (the guard's writable paths for lease l in
// checkout co) by the security team's policy: every writable directory in
// the checkout that holds a path the policy refuses to l (action write)
// is replaced by its parts that hold none, down to single files, so that
// Landlock — the kernel — keeps a protected path unwritable even under a
// claim that covers it, whole-repo included. A refused directory is not
// granted at all, so nothing can be created in it. It returns writable
// itself when the policy refuses nothing in it, the repo-relative paths
// it kept out, and (at most maxShadowed) those a shadow policy would keep
// out, for the audit (shadow-refused).
//
// The kernel's rules are paths that exist at the start: a name a rule
// protects that is created later, in a directory that holds nothing
// protected, is refused at the git fence and hook (every touched path is
// asked as write), not by the file guard. Symlinks in a split directory
// are not granted (Landlock would grant their targets).
func ProtectPaths(co *Checkout, l lease.Lease, writable []string, st *policy.Store) (out, protected, shadowed []string, err error) {
	if st == nil || st.Empty() {
		return writable, nil, nil, nil
	}
	w := &protectWalk{co: co, l: l, st: st}
	for _, p := range writable {
		rel, err := filepath.Rel(co.Root, p)
		if err != nil || !Within(p, co.Root) {
			out = append(out, p) // outside the checkout: the policy names repo paths only
			continue
		}
		if rel == "." {
			rel = ""
		}
		grants, err := w.grants(p, filepath.ToSlash(rel))
		if err != nil {
			return nil, nil, nil, err
		}
		out = append(out, grants...)
	}
	return out, w.protected, w.shadowed, nil
}

// maxShadowed bounds the shadow-refused paths ProtectPaths reports.
const maxShadowed = 64

type protectWalk struct {
	co        *Checkout
	l         lease.Lease
	st        *policy.Store
	seen      int
	protected []string
	shadowed  []string
}

func (w *protectWalk) refused(rel string) bool {
	if rel == "" {
		return false // the root: refusing it would refuse everything, say so per path
	}
	d := w.st.Decide(policy.LeaseRequest(w.l, policy.ActionWrite, policy.Resource{Kind: policy.KindPath, Name: rel}))
	if d.Shadow != nil && len(w.shadowed) < maxShadowed {
		w.shadowed = append(w.shadowed, rel+": "+d.Shadow.String())
	}
	return !d.Allowed()
}

// grants returns what of path (repo-relative rel) may be granted: path
// itself when nothing in it is refused, else its parts.
func (w *protectWalk) grants(path, rel string) ([]string, error) {
	if w.refused(rel) {
		w.protected = append(w.protected, rel)
		return nil, nil
	}
	if slices.Contains(w.co.GitDirs, path) {
		return []string{path}, nil // the git dir: granted as the workspace mode says (GitDirWritable)
	}
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, fmt.Errorf("policy: protect paths under %s: %w", path, err)
	}
	if !fi.IsDir() {
		return []string{path}, nil
	}
	ents, err := os.ReadDir(path)
	if err != nil {
		return nil, fmt.Errorf("policy: protect paths under %s: %w", path, err)
	}
	w.seen += len(ents)
	if w.seen > maxProtectWalk {
		return nil, fmt.Errorf("policy: more than %d entries under the writable paths of %s: too many to check against the policy's protected paths; claim narrower paths", maxProtectWalk, w.co.Root)
	}
	var parts []string
	split := false
	for _, e := range ents {
		cp, crel := filepath.Join(path, e.Name()), e.Name()
		if rel != "" {
			crel = rel + "/" + e.Name()
		}
		if slices.Contains(w.co.GitDirs, cp) {
			continue // in a split directory, granted (or not) by the workspace mode alone (GitDirWritable)
		}
		if e.Type()&os.ModeSymlink != 0 {
			parts = append(parts, "") // kept out if the directory is split
			continue
		}
		g, err := w.grants(cp, crel)
		if err != nil {
			return nil, err
		}
		if len(g) != 1 || g[0] != cp {
			split = true
		}
		parts = append(parts, g...)
	}
	if !split {
		return []string{path}, nil
	}
	return slices.DeleteFunc(parts, func(s string) bool { return s == "" }), nil
}

// policyGate is the file guard's gate of an attempt under a policy: its
// lease's gate, and refused from the moment the policy comes to protect a
// path the attempt's guard was started granting. Landlock cannot take a
// right back from a running process, so the supervisor then refuses every
// write (as after a loss): the write rights the policy removed go within
// the bus's delivery time, and the others with them, until a new attempt
// starts under the new policy.
type policyGate struct {
	Gate
	refused atomic.Pointer[error]
	cancel  context.CancelFunc
	wg      sync.WaitGroup
}

// Gate is fsguard.Gate: whether the lease allows writes now.
type Gate = fsguard.Gate

// watchPolicy returns gate wrapped so that writes are refused once st
// protects a path of writable (the guard's paths before ProtectPaths
// split them) beyond protected (those it protected at the start). stop
// ends the watch.
func watchPolicy(ctx context.Context, gate Gate, st *policy.Store, co *Checkout, l lease.Lease, writable, protected []string, say func(string)) (g Gate, stop func()) {
	if st == nil {
		return gate, func() {}
	}
	ctx, cancel := context.WithCancel(ctx)
	pg := &policyGate{Gate: gate, cancel: cancel}
	pg.wg.Go(func() {
		for {
			changed := st.Changed()
			select {
			case <-ctx.Done():
				return
			case <-changed:
			}
			_, now, _, err := ProtectPaths(co, l, writable, st)
			var added []string
			for _, p := range now {
				if !slices.Contains(protected, p) {
					added = append(added, p)
				}
			}
			if err == nil && len(added) == 0 {
				continue
			}
			if err == nil {
				err = fmt.Errorf("the policy now protects %s, which this attempt's file guard was started granting", strings.Join(added, ", "))
			}
			refusal := fmt.Errorf("%w: %w: its writes are refused from now on; start a new attempt to work under the new policy", lease.ErrPolicyForbids, err)
			pg.refused.Store(&refusal)
			say("policy: " + refusal.Error())
			return
		}
	})
	return pg, func() { cancel(); pg.wg.Wait() }
}

// Fence refuses once the policy protects a path the guard grants, else
// asks the lease's gate.
func (g *policyGate) Fence() (uint64, error) {
	if err := g.refused.Load(); err != nil {
		return 0, *err
	}
	return g.Gate.Fence()
}
