package gitproxy

import (
	"context"
	"errors"
	"fmt"
	"slices"

	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/filemode"
	"github.com/go-git/go-git/v5/plumbing/object"
	"github.com/go-git/go-git/v5/plumbing/storer"
)

// changeKind is what a ref update does to history.
type changeKind int

const (
	kindCreate      changeKind = iota // a new ref
	kindFastForward                   // old is an ancestor of new
	kindRewrite                       // non-fast-forward: history of the ref is rewritten
	kindDelete                        // the ref goes away
)

func (k changeKind) String() string {
	return [...]string{"create", "fast-forward", "non-fast-forward update", "delete"}[k]
}

// refChange is the analysis of one command: what it does and every path
// its new commits touch.
type refChange struct {
	cmd        command
	kind       changeKind
	newCommits int
	paths      []string // sorted, unique, repo-relative
	notCommit  string   // set when the new object is not (a tag of) a commit: its type
	absent     bool     // a delete of a ref the upstream does not have (see Proxy.blindDeletes)
}

// analyzer computes touched paths with go-git. A commit is new when it was
// in the pushed pack: the client sends what the upstream lacks, and the
// upstream's own connectivity check refuses a push that references a commit
// it has neither in the pack nor in its store. Whatever the pack holds,
// every update is also judged by what it moves: the paths that differ
// between the ref's old tip and its new one, and for a new ref between the
// upstream's default branch (where they meet) and the new tip.
type analyzer struct {
	// final: the stores are as complete as they will get, so a ref's old
	// value that is not there is an error, not a reason to fetch the
	// mirror and try again.
	final  bool
	st     storer.EncodedObjectStorer
	pushed func(plumbing.Hash) bool
	// base is the upstream's default branch tip (ZeroHash: the upstream
	// has none): a new ref is judged against it.
	base plumbing.Hash
	memo map[plumbing.Hash][]string // touched paths of each new commit
}

func newAnalyzer(st storer.EncodedObjectStorer, pushed func(plumbing.Hash) bool) *analyzer {
	return &analyzer{st: st, pushed: pushed, memo: make(map[plumbing.Hash][]string)}
}

// analyze examines every command of a push.
func (a *analyzer) analyze(ctx context.Context, cmds []command) ([]refChange, error) {
	out := make([]refChange, len(cmds))
	for i, c := range cmds {
		rc, err := a.command(ctx, c)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", c.Ref, err)
		}
		out[i] = rc
	}
	return out, nil
}

func (a *analyzer) command(ctx context.Context, c command) (refChange, error) {
	rc := refChange{cmd: c}
	if c.isDelete() {
		rc.kind = kindDelete
		return rc, nil
	}
	tip, typ, err := a.peel(plumbing.NewHash(c.New))
	if err != nil {
		return rc, err
	}
	if tip == nil {
		rc.notCommit = typ
		return rc, nil
	}
	touched := make(map[string]struct{})
	n, err := a.walkNew(ctx, tip, touched)
	if err != nil {
		return rc, err
	}
	rc.newCommits = n
	if c.isCreate() {
		rc.kind = kindCreate
		if err := a.sinceBase(ctx, tip, touched); err != nil {
			return rc, err
		}
	} else {
		old, _, err := a.peel(plumbing.NewHash(c.Old))
		switch {
		case errors.Is(err, plumbing.ErrObjectNotFound) && !a.final:
			return rc, fmt.Errorf("old value %s: %w", c.Old, err)
		case errors.Is(err, plumbing.ErrObjectNotFound):
			return rc, fmt.Errorf("the ref's old value %s is in neither the agent's repository nor the upstream's mirror, so what the update changes cannot be judged: %w", c.Old, err)
		case err != nil:
			return rc, err
		case old == nil:
			// The ref held no commit (a tag of a tree, say): the update
			// brings in every path of the new tip.
			rc.kind = kindRewrite
			if err := a.addEntry(object.TreeEntry{Mode: filemode.Dir, Hash: tip.TreeHash}, "", touched); err != nil {
				return rc, err
			}
		default:
			ff, err := a.isAncestor(ctx, old, tip)
			if err != nil {
				return rc, err
			}
			rc.kind = kindFastForward
			if !ff {
				rc.kind = kindRewrite
			}
			// What the update does to the ref's content is the diff
			// between the two tips, whether or not its commits are new:
			// a fast-forward onto commits the upstream already has moves
			// their changes into the ref.
			if err := a.diff(ctx, old, tip, touched); err != nil {
				return rc, err
			}
		}
	}
	rc.paths = make([]string, 0, len(touched))
	for p := range touched {
		rc.paths = append(rc.paths, p)
	}
	slices.Sort(rc.paths)
	return rc, nil
}

// sinceBase adds what a new ref at tip adds to the upstream's default
// branch: the paths that differ between each merge base of the two and
// tip, or every path of tip when they share no history (or the upstream
// has no default branch).
func (a *analyzer) sinceBase(ctx context.Context, tip *object.Commit, touched map[string]struct{}) error {
	root := object.TreeEntry{Mode: filemode.Dir, Hash: tip.TreeHash}
	if a.base.IsZero() {
		return a.addEntry(root, "", touched)
	}
	base, err := object.GetCommit(a.st, a.base)
	if errors.Is(err, plumbing.ErrObjectNotFound) && !a.final {
		return fmt.Errorf("the upstream's default branch %s: %w", a.base, err)
	}
	if err != nil {
		return fmt.Errorf("the upstream's default branch %s cannot be read, so what the new ref adds cannot be judged: %w", a.base, err)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	mbs, err := tip.MergeBase(base)
	if err != nil {
		return fmt.Errorf("merge base of %s and the default branch %s: %w", tip.Hash, a.base, err)
	}
	if len(mbs) == 0 {
		return a.addEntry(root, "", touched)
	}
	for _, mb := range mbs {
		if err := a.diff(ctx, mb, tip, touched); err != nil {
			return err
		}
	}
	return nil
}

// peel follows annotated tags to the commit they name. It returns a nil
// commit and the object type when the chain ends elsewhere.
func (a *analyzer) peel(h plumbing.Hash) (*object.Commit, string, error) {
	for range 16 {
		o, err := a.st.EncodedObject(plumbing.AnyObject, h)
		if err != nil {
			return nil, "", fmt.Errorf("object %s: %w", h, err)
		}
		switch o.Type() {
		case plumbing.CommitObject:
			c, err := object.DecodeCommit(a.st, o)
			return c, "", err
		case plumbing.TagObject:
			t, err := object.DecodeTag(a.st, o)
			if err != nil {
				return nil, "", err
			}
			h = t.Target
		default:
			return nil, o.Type().String(), nil
		}
	}
	return nil, "", fmt.Errorf("tag chain at %s is longer than 16", h)
}

// walkNew visits every new commit reachable from tip and adds the paths
// each changes against each of its parents (all of its tree for a root
// commit). A commit that touches a path and a later one that reverts it
// both count: the walk looks at every commit, not at the net result.
func (a *analyzer) walkNew(ctx context.Context, tip *object.Commit, touched map[string]struct{}) (int, error) {
	if !a.pushed(tip.Hash) {
		return 0, nil
	}
	seen := map[plumbing.Hash]bool{tip.Hash: true}
	stack := []*object.Commit{tip}
	n := 0
	for len(stack) > 0 {
		if err := ctx.Err(); err != nil {
			return n, err
		}
		c := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		n++
		paths, err := a.commitPaths(ctx, c)
		if err != nil {
			return n, err
		}
		for _, p := range paths {
			touched[p] = struct{}{}
		}
		for _, ph := range c.ParentHashes {
			if seen[ph] || !a.pushed(ph) {
				continue
			}
			seen[ph] = true
			p, err := object.GetCommit(a.st, ph)
			if err != nil {
				return n, fmt.Errorf("parent %s of %s: %w", ph, c.Hash, err)
			}
			stack = append(stack, p)
		}
	}
	return n, nil
}

// commitPaths returns the paths commit c changes against its parents:
// the union over every parent for a merge.
func (a *analyzer) commitPaths(ctx context.Context, c *object.Commit) ([]string, error) {
	if p, ok := a.memo[c.Hash]; ok {
		return p, nil
	}
	set := make(map[string]struct{})
	if c.NumParents() == 0 {
		if err := a.addEntry(object.TreeEntry{Mode: filemode.Dir, Hash: c.TreeHash}, "", set); err != nil {
			return nil, err
		}
	}
	for _, ph := range c.ParentHashes {
		p, err := object.GetCommit(a.st, ph)
		if err != nil {
			return nil, fmt.Errorf("parent %s of %s: %w", ph, c.Hash, err)
		}
		if err := a.diff(ctx, p, c, set); err != nil {
			return nil, err
		}
	}
	paths := make([]string, 0, len(set))
	for p := range set {
		paths = append(paths, p)
	}
	a.memo[c.Hash] = paths
	return paths, nil
}

// diff adds every path that differs between the trees of from and to.
func (a *analyzer) diff(ctx context.Context, from, to *object.Commit, set map[string]struct{}) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if err := a.diffTrees(from.TreeHash, to.TreeHash, "", set); err != nil {
		return fmt.Errorf("diff %s..%s: %w", from.Hash, to.Hash, err)
	}
	return nil
}

// diffTrees adds the paths under prefix where trees a and b differ,
// descending only into subtrees whose ids differ: identical subtrees are
// skipped by id, so the cost follows the change, not the tree.
func (a *analyzer) diffTrees(ha, hb plumbing.Hash, prefix string, set map[string]struct{}) error {
	if ha == hb {
		return nil
	}
	ta, err := object.GetTree(a.st, ha)
	if err != nil {
		return fmt.Errorf("tree %s: %w", ha, err)
	}
	tb, err := object.GetTree(a.st, hb)
	if err != nil {
		return fmt.Errorf("tree %s: %w", hb, err)
	}
	old := make(map[string]object.TreeEntry, len(ta.Entries))
	for _, e := range ta.Entries {
		old[e.Name] = e
	}
	for _, e := range tb.Entries {
		o, ok := old[e.Name]
		delete(old, e.Name)
		path := prefix + e.Name
		switch {
		case !ok:
			if err := a.addEntry(e, path, set); err != nil {
				return err
			}
		case o.Hash == e.Hash && o.Mode == e.Mode:
		case o.Mode == filemode.Dir && e.Mode == filemode.Dir:
			if err := a.diffTrees(o.Hash, e.Hash, path+"/", set); err != nil {
				return err
			}
		default: // changed, or a file became a directory or back
			if err := a.addEntry(o, path, set); err != nil {
				return err
			}
			if err := a.addEntry(e, path, set); err != nil {
				return err
			}
		}
	}
	for name, o := range old { // removed
		if err := a.addEntry(o, prefix+name, set); err != nil {
			return err
		}
	}
	return nil
}

// addEntry adds path, or every file under it when it is a directory.
func (a *analyzer) addEntry(e object.TreeEntry, path string, set map[string]struct{}) error {
	if e.Mode != filemode.Dir {
		set[path] = struct{}{}
		return nil
	}
	t, err := object.GetTree(a.st, e.Hash)
	if err != nil {
		return fmt.Errorf("tree %s: %w", e.Hash, err)
	}
	for _, c := range t.Entries {
		p := c.Name
		if path != "" {
			p = path + "/" + c.Name
		}
		if err := a.addEntry(c, p, set); err != nil {
			return err
		}
	}
	return nil
}

// isAncestor reports whether old is reachable from tip, walking breadth
// first so that the common case — new commits built right on old — ends
// after a few steps.
func (a *analyzer) isAncestor(ctx context.Context, old, tip *object.Commit) (bool, error) {
	if old.Hash == tip.Hash {
		return true, nil
	}
	seen := map[plumbing.Hash]bool{tip.Hash: true}
	queue := []plumbing.Hash{tip.Hash}
	for len(queue) > 0 {
		if err := ctx.Err(); err != nil {
			return false, err
		}
		c, err := object.GetCommit(a.st, queue[0])
		queue = queue[1:]
		if err != nil {
			return false, fmt.Errorf("walk history: %w", err)
		}
		for _, ph := range c.ParentHashes {
			if ph == old.Hash {
				return true, nil
			}
			if !seen[ph] {
				seen[ph] = true
				queue = append(queue, ph)
			}
		}
	}
	return false, nil
}

// verified is a base store whose commits, trees and tags are believed
// only when their content hashes to the id they were asked for. The base
// stores are git dirs the agent can write (its own repository, for
// ObjectDirs), and go-git takes a loose object's id from its file name:
// a tree forged under the id of the upstream tip's root tree would make
// the push's diff whatever the agent likes. Blobs are hashed too: they are
// read only as delta bases, and a base whose type is forged (an upstream
// commit rewritten as a "blob") would make the pack's scan drop the delta
// against it, and with it a pushed commit the fence never judged. A forged
// object counts as not found, so the upstream's mirror is asked for the
// genuine one.
type verified struct {
	storer.EncodedObjectStorer
}

// errForged reports an object whose content does not hash to its id.
var errForged = errors.New("object content does not hash to its id (forged or corrupt)")

func (v verified) EncodedObject(t plumbing.ObjectType, h plumbing.Hash) (plumbing.EncodedObject, error) {
	o, err := v.EncodedObjectStorer.EncodedObject(t, h)
	if err != nil {
		return o, err
	}
	content, err := contents(o)
	if err != nil {
		return nil, fmt.Errorf("object %s: %w", h, err)
	}
	if got := plumbing.ComputeHash(o.Type(), content); got != h {
		// Not found here: the next store (the upstream's mirror) is asked.
		return nil, fmt.Errorf("%s %s: %w (its content hashes to %s): %w", o.Type(), h, errForged, got, plumbing.ErrObjectNotFound)
	}
	m := &plumbing.MemoryObject{}
	m.SetType(o.Type())
	m.Write(content)
	return m, nil
}
