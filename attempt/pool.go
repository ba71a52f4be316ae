package attempt

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/shard"
)

// Commit capacity an attempt may ask of a pool's shard (PoolUse.Commit).
const (
	CommitSerialized = "serialized" // beside path leases: the git dirs, not the files
	CommitExclusive  = "exclusive"  // the shard to itself
)

// PoolUse says how an attempt uses its repo's shard pool.
type PoolUse struct {
	// Commit is "" for an attempt placed in any shard that fits, else
	// CommitSerialized or CommitExclusive on the shard Shard.
	Commit, Shard string
	// WorkspaceID, when set and not one of the pool's shards, is a
	// workspace of the attempt's own, outside the pool.
	WorkspaceID string
	// Checkout is the runner's own checkout (absolute): a pool record
	// that names another, or a directory not known to be its pool's, is
	// refused (shard.Pool.Owns).
	Checkout string
}

// Pool is an attempt's place in its repo's shard pool.
type Pool struct {
	Store *shard.Store
	Pool  *shard.Pool
	// Mode is a shard.Mode*; an attempt placed in any shard has its mode
	// once its lease is granted (Place).
	Mode      string
	commitOn  string
	placement *shard.Placement
	settled   bool
}

// OpenPool returns the pool of repo in st, the shard store, that the
// attempt works in: nil when the repo has none (shard.ErrNoPool when use
// asks for commit capacity) or the attempt names a workspace outside it.
// It first recovers the pool's crashed attempts, asking leases (the lease
// bus) which of their leases are still active.
func OpenPool(ctx context.Context, st *shard.Store, leases lease.View, repo string, use PoolUse) (*Pool, error) {
	p, err := st.Pool(ctx, repo)
	if errors.Is(err, shard.ErrNoPool) {
		if use.Commit != "" {
			return nil, err
		}
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	if err := p.Owns(use.Checkout); err != nil {
		return nil, err
	}
	pr := &Pool{Store: st, Pool: p, commitOn: use.Shard}
	switch {
	case use.Commit == CommitSerialized:
		pr.Mode = shard.ModeCommitSerialized
	case use.Commit == CommitExclusive:
		pr.Mode = shard.ModeCommitExclusive
	case use.Commit != "":
		return nil, invalidf("commit capacity %q: want %s or %s", use.Commit, CommitSerialized, CommitExclusive)
	case use.WorkspaceID != "" && p.Shard(use.WorkspaceID) == nil:
		return nil, nil // a workspace of its own, outside the pool
	}
	if use.Commit != "" && p.Shard(use.Shard) == nil {
		return nil, invalidf("shard %s is not in the pool of %s, which has %s", use.Shard, repo, strings.Join(p.ShardIDs(), ", "))
	}
	if _, err := st.Recover(ctx, repo, leases, false); err != nil {
		return nil, fmt.Errorf("recover crashed attempts of %s: %w", repo, err)
	}
	return pr, nil
}

// Commits reports whether the attempt asks for a shard's commit capacity
// rather than a place in the pool.
func (p *Pool) Commits() bool {
	return p.Mode == shard.ModeCommitSerialized || p.Mode == shard.ModeCommitExclusive
}

// Workspace is where a lease is asked for: the workspace fields of the
// lease bus's acquire request (leasebus.AcquireRequest), which the caller
// copies there.
type Workspace struct {
	// ID names one workspace.
	ID string
	// Candidates, instead of ID, are workspaces the lease service grants
	// the lease in the first that fits of.
	Candidates []string
	// MaxSharers bounds the shared leases of the workspace (0: no bound).
	MaxSharers int
}

// Request is w, where the attempt's lease would be asked for without the
// pool, aimed at the pool: the commit capacity of its shard, or the first
// of the pool's shards that fits (the lease service picks it), at most
// the pool's sharers to a shard.
func (p *Pool) Request(w Workspace) Workspace {
	switch p.Mode {
	case shard.ModeCommitSerialized:
		w.ID = shard.CommitWorkspace(p.commitOn)
	case shard.ModeCommitExclusive:
		w.ID = p.commitOn
	default:
		if w.ID == "" {
			w.Candidates = p.Pool.ShardIDs()
		}
		w.MaxSharers = p.Pool.MaxSharers
	}
	return w
}

// place puts the attempt into the shard its lease was granted in: the
// attempt record (running), the shard made or cleaned, and the attempt's
// checkout switched to the shard.
func (r *run) place(ctx context.Context) error {
	pr := r.spec.Pool
	l := r.spec.Holder.Lease()
	if pr.Mode == "" {
		pr.Mode = shard.ModeExclusive
		if l.WorkspaceMode == lease.WorkspaceShared {
			pr.Mode = shard.ModeShared
		}
	}
	att := shard.Attempt{AttemptID: l.Owner.AttemptID, TaskID: l.Owner.TaskID, AgentID: l.Owner.AgentID, HostID: l.Owner.HostID, Command: r.spec.Argv}
	if att.AttemptID == "" {
		att.AttemptID = lease.NewAttemptID()
	}
	pl, err := pr.Store.Place(ctx, pr.Pool, l, pr.Mode, att, r.spec.Holder)
	if err != nil {
		return fmt.Errorf("place attempt %s in %s: %w", att.AttemptID, l.WorkspaceID, err)
	}
	pr.placement = pl
	how := "ready"
	switch {
	case pl.Created:
		how = "created (a repository of its own borrowing the checkout's objects)"
	case pl.Cleaned:
		how = "cleaned first"
	case pr.Mode == shard.ModeShared:
		how = "beside the shard's other path leases"
	}
	if len(pl.Kept) > 0 {
		how += ", earlier work kept as " + strings.Join(pl.Kept, ", ")
	}
	r.say("attempt %s in %s (%s, %s): %s", pl.Attempt.AttemptID, pl.Worktree.ID, pr.Mode, how, pl.Worktree.Path)
	if pr.Pool.Checkout != "" && pr.Pool.Checkout != r.co.Root {
		r.say("the pool of %s was declared from the checkout %s: the attempt works in its shard, not in %s, and what it leaves is kept there", pr.Pool.Repo, pr.Pool.Checkout, r.co.Root)
	}
	co, err := FindCheckout(ctx, pl.Worktree.Path)
	if err != nil {
		return fmt.Errorf("shard %s: %w", pl.Worktree.ID, err)
	}
	co.Repo, co.Origin = r.co.Repo, r.co.Origin
	r.home, r.co = r.co, co
	return nil
}

// snapshotGitDirs records, before the attempt starts, what of the
// checkout it may write could make git run a program or lie later,
// unconfined, in the user's git or fenceline's:
//   - an exclusive attempt without a pool (its git dir writable): the
//     checkout's executable git configuration (config files, hooks,
//     info/attributes, in its git dirs and their submodules'), every
//     repository in the worktree, and its object stores (SnapshotObjects);
//   - a path-leased attempt, pooled or not: the repositories under its
//     claims (SnapshotClaims), where it may make one whose config the
//     user's git in that directory would run, and the object stores of
//     the user's repositories there;
//   - a commit capacity: its shard's object store, which is not wiped
//     after it (its git dir is restored by Placement.CleanAfter).
//
// An exclusive attempt in a shard has its shard cleaned instead.
func (r *run) snapshotGitDirs(ctx context.Context) error {
	l := r.spec.Holder.Lease()
	if pr := r.spec.Pool; pr != nil && pr.Commits() {
		return r.snapshotObjects(r.co.GitDirs)
	}
	if l.WorkspaceMode == lease.WorkspaceShared {
		if pr := r.spec.Pool; pr != nil && pr.Mode != shard.ModeShared {
			return nil
		}
		var claims []string
		for _, rel := range l.Scope.Paths {
			p, err := ClaimPath(r.co.Root, rel)
			if err != nil {
				return err
			}
			claims = append(claims, p)
		}
		snap, err := shard.SnapshotClaims(ctx, r.co.Root, claims)
		if err != nil {
			return fmt.Errorf("before the attempt: %w", err)
		}
		r.gitSnap, r.gitSnapOf = snap, "the repositories in its claims"
		if len(snap.Dirs()) == 0 {
			return nil
		}
		return r.snapshotObjects(snap.Dirs()) // the user's repositories there
	}
	if r.spec.Pool != nil || len(r.co.GitDirs) == 0 {
		return nil
	}
	snap, err := shard.SnapshotCheckout(ctx, r.co.Root, r.co.GitDirs)
	if err != nil {
		return fmt.Errorf("before the attempt: %w", err)
	}
	r.gitSnap, r.gitSnapOf = snap, "the checkout's git configuration and hooks"
	return r.snapshotObjects(snap.Dirs())
}

// snapshotProject records the agent CLIs' project settings where an
// attempt without a pool may write the user's checkout: its claims, or
// the whole checkout for an exclusive attempt (ProjectState).
func (r *run) snapshotProject() error {
	if r.spec.Pool != nil {
		return nil
	}
	l := r.spec.Holder.Lease()
	roots := []string{r.co.Root}
	if l.WorkspaceMode == lease.WorkspaceShared {
		roots = nil
		for _, rel := range l.Scope.Paths {
			p, err := ClaimPath(r.co.Root, rel)
			if err != nil {
				return err
			}
			roots = append(roots, p)
		}
	}
	ps, err := SnapshotProjectState(r.co.Root, roots)
	if err != nil {
		return fmt.Errorf("before the attempt: %w", err)
	}
	r.project = ps
	return nil
}

// settleProject names what the attempt changed in the CLIs' project
// settings of the user's checkout.
func (r *run) settleProject() {
	ps := r.project
	if ps == nil {
		return
	}
	r.project = nil
	c, err := ps.Changes()
	if err != nil {
		r.say("%v: review the .claude, .codex and .mcp.json files there before you run claude or codex in the checkout", err)
		return
	}
	for _, l := range c.ProjectLines(10) {
		r.say("%s", l)
	}
}

// snapshotObjects records the object stores of gitDirs. The copies of
// loose objects go where the agent can neither read nor write:
// fenceline's state dir is hidden from it (HiddenPaths).
func (r *run) snapshotObjects(gitDirs []string) error {
	state := filepath.Join(r.spec.FencelineStateDir, "settle")
	keep, err := os.MkdirTemp(state, "objects-")
	if errors.Is(err, fs.ErrNotExist) {
		if err = os.MkdirAll(state, 0o700); err == nil {
			keep, err = os.MkdirTemp(state, "objects-")
		}
	}
	if err != nil {
		return fmt.Errorf("before the attempt: %w", err)
	}
	objs, err := shard.SnapshotObjects(r.co.Root, gitDirs, keep)
	if err != nil {
		os.RemoveAll(keep)
		return fmt.Errorf("before the attempt: %w", err)
	}
	r.objSnap = objs
	return nil
}

// restoreGitDirs puts back what snapshotGitDirs recorded, once every
// process of the attempt is gone, and says what it undid.
func (r *run) restoreGitDirs(ctx context.Context) {
	if snap := r.gitSnap; snap != nil {
		r.gitSnap = nil
		// A cancelled run is restored all the same: the agent is gone.
		undone, err := snap.Restore(context.WithoutCancel(ctx))
		snap.Close()
		if len(undone) > 0 {
			r.say("restored %s; undone: %s", r.gitSnapOf, strings.Join(undone, ", "))
		}
		if err != nil {
			r.say("restoring %s: %v: check %s before running git there", r.gitSnapOf, err, strings.Join(snap.Dirs(), ", "))
		}
	}
	if objs := r.objSnap; objs != nil {
		r.objSnap = nil
		defer objs.Close()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		defer cancel()
		undone, err := objs.Restore(ctx)
		if len(undone) > 0 {
			r.say("checked what the attempt wrote to the object store; undone: %s", strings.Join(undone, ", "))
		}
		if err != nil {
			r.say("checking the object store: %v: run git fsck in %s before trusting what git shows there", err, r.co.Root)
		}
	}
}

// settle records the attempt's end (once every process is gone, before
// the lease is released) and returns an exclusive attempt's shard clean.
func (r *run) settle(ctx context.Context, code int, cancelled bool) {
	r.restoreGitDirs(ctx)
	r.settleProject()
	settlePrivateState(r.priv, func(s string) { r.say("%s", s) })
	r.priv = nil
	pr := r.spec.Pool
	if pr == nil || pr.placement == nil || pr.settled {
		return
	}
	pr.settled = true
	st := shard.StatusSucceeded
	switch {
	case cancelled:
		st = shard.StatusCancelled
	case code != 0:
		st = shard.StatusFailed
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Minute)
	defer cancel()
	pl := pr.placement
	if err := pl.Settle(ctx, st, code); err != nil {
		r.say("attempt %s not settled on the bus: %v", pl.Attempt.AttemptID, err)
	} else {
		r.say("attempt %s %s (exit %d)", pl.Attempt.AttemptID, st, code)
	}
	kept, err := pl.CleanAfter(ctx)
	switch {
	case err != nil:
		r.say("%v", err)
	case pl.Mode == shard.ModeExclusive:
		msg := "nothing to keep"
		if len(kept) > 0 {
			msg = "its work kept as " + strings.Join(kept, ", ")
		}
		r.say("%s cleaned for the next attempt (%s)", pl.Worktree.ID, msg)
		if len(pl.Worktree.Undone) > 0 {
			r.say("%s: undone in its git dir (the attempt put them there): %s", pl.Worktree.ID, strings.Join(pl.Worktree.Undone, ", "))
		}
	case pl.Mode == shard.ModeCommitSerialized || pl.Mode == shard.ModeCommitExclusive:
		if len(kept) > 0 {
			r.say("%s: %s published to the checkout", pl.Worktree.ID, strings.Join(kept, ", "))
		}
		if len(pl.Worktree.Undone) > 0 {
			r.say("%s: undone in its git dir (the attempt put them there): %s", pl.Worktree.ID, strings.Join(pl.Worktree.Undone, ", "))
		}
	case pl.Mode == shard.ModeShared:
		r.say("%s: the attempt's paths stay as they are for the coordinator (shard dirty)", pl.Worktree.ID)
	}
}
