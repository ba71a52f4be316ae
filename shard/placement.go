package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Modes of an attempt in its shard.
const (
	ModeExclusive        = "exclusive"         // sole occupant; the shard is cleaned before and after
	ModeShared           = "shared"            // path lease beside others; leaves its paths as they are
	ModeCommitSerialized = "commit-serialized" // the shard's commit capacity, beside path leases
	ModeCommitExclusive  = "commit-exclusive"  // the whole shard, for a coordinator
)

// CommitWorkspace is the workspace of shard id's serialized commit
// capacity: one exclusive lease claiming nothing there at a time.
func CommitWorkspace(id string) string { return id + "/commit" }

// Placement is one attempt in one shard, from before its command starts
// until after it settled.
type Placement struct {
	store    *Store
	held     lease.Gate
	Pool     *Pool
	Worktree *Worktree
	Attempt  *Attempt
	Lease    lease.Lease
	Mode     string
	// Base is the checkout's HEAD when the attempt was placed.
	Base string
	// Kept are the refs cleaning before the attempt kept; Cleaned says
	// whether it cleaned, Created whether it added the worktree.
	Kept             []string
	Cleaned, Created bool
}

// Place prepares the shard lease l was granted for an attempt (att:
// id, owner, command; the rest is filled in) in mode: the attempt is
// written "running" with its lease and shard, the shard is marked dirty,
// then, under the shard's flock, an absent worktree is created and, for
// an exclusive attempt, a shard that is not clean at the checkout's HEAD
// is cleaned. held is asked under the flock before anything is touched: a
// runner that stalled until its lease was lost must not clean a shard
// another attempt has since been placed in. On an error after the attempt
// was written, the attempt is settled failed.
func (s *Store) Place(ctx context.Context, pool *Pool, l lease.Lease, mode string, att Attempt, held lease.Gate) (*Placement, error) {
	if held == nil {
		return nil, errors.New("shard: Place needs the lease's held check")
	}
	id := WorkspaceShard(l.WorkspaceID)
	wt, err := pool.Worktree(id)
	if err != nil {
		return nil, err
	}
	if (mode == ModeCommitSerialized || mode == ModeCommitExclusive) && !wt.Exists() {
		return nil, fmt.Errorf("shard %s has no worktree yet (no attempt ran there): nothing to commit", wt.ID)
	}
	base, err := Base(ctx, pool.Checkout)
	if err != nil {
		return nil, err
	}
	att.Repo, att.Shard, att.Mode, att.Leases = pool.Repo, id, mode, []string{l.LeaseID}
	a, err := s.Begin(ctx, att)
	if err != nil {
		return nil, err
	}
	p := &Placement{store: s, held: held, Pool: pool, Worktree: wt, Attempt: a, Lease: l, Mode: mode, Base: base}
	if err := p.prepare(ctx); err != nil {
		if serr := p.Settle(context.WithoutCancel(ctx), StatusFailed, -1); serr != nil {
			err = errors.Join(err, serr)
		}
		return nil, err
	}
	return p, nil
}

func (p *Placement) prepare(ctx context.Context) error {
	s, wt := p.store, p.Worktree
	unlock, err := wt.Lock(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	if _, err := p.held.Fence(); err != nil {
		return fmt.Errorf("shard %s not prepared: the lease is not held (%w)", wt.ID, err)
	}
	var prev Shard
	err = p.setShard(ctx, func(sh *Shard) {
		prev = *sh
		sh.State = StateDirty // until cleaned again: a crash from here on leaves it dirty
		sh.LastAttempt = p.Attempt.AttemptID
		sh.Running = append(sh.Running, p.Attempt.AttemptID)
	})
	if err != nil {
		return err
	}
	keepID := prev.LastAttempt
	if keepID == "" {
		keepID = p.Attempt.AttemptID
	}
	switch {
	case p.Mode == ModeCommitSerialized || p.Mode == ModeCommitExclusive:
		if !wt.Exists() {
			return fmt.Errorf("shard %s has no worktree yet (no attempt ran there): nothing to commit", wt.ID)
		}
		// Not cleaned (it commits on the shard's branch), but its git dir
		// is made fenceline's first: an attempt whose cleaning never ran
		// (its lease lost, its runner dead) may have left a commondir
		// naming the checkout's git dir, which git in the shard would
		// report, and fenceline make writable, as the shard's.
		return p.restoreBefore(ctx)
	case !wt.Exists():
		if p.Kept, err = wt.Create(ctx, p.Base, keepID); err != nil {
			return err
		}
		p.Created = true
		s.audit(ctx, p.event(EventCreated, "", fmt.Sprintf("shard %s created: a repository of its own at %s (the checkout's objects as its alternate) on %s at %s%s", wt.ID, wt.Path, wt.Branch, short(p.Base), keptText(p.Kept))))
	case p.Mode == ModeExclusive && (prev.State != StateClean || prev.Base != p.Base || wt.Ready(ctx, p.Base) != nil):
		why := fmt.Sprintf("it was %s at %s", prev.State, short(prev.Base))
		if p.Kept, err = wt.Clean(ctx, p.Base, keepID); err != nil {
			return err
		}
		p.Cleaned = true
		s.audit(ctx, p.event(EventCleaned, why, fmt.Sprintf("shard %s cleaned before attempt %s (%s): reset to %s%s%s", wt.ID, p.Attempt.AttemptID, why, short(p.Base), keptText(p.Kept), undoneText(wt.Undone))))
	case p.Mode == ModeShared && prev.State != StateClean && len(prev.Running) == 0:
		// A dirty shard nobody is in: what an attempt whose cleaning never
		// ran planted in its git dir would run in this attempt's git.
		return p.restoreBefore(ctx)
	default:
		return nil
	}
	err = p.setShard(ctx, func(sh *Shard) {
		sh.Base = p.Base
		if p.Cleaned {
			sh.CleanedAt = time.Now().UTC()
		}
	})
	if err != nil {
		return err
	}
	return nil
}

// restoreBefore makes the shard's git dir fenceline's before an attempt
// that does not clean the shard, and audits what it undid.
func (p *Placement) restoreBefore(ctx context.Context) error {
	wt := p.Worktree
	var err error
	if wt.Undone, err = wt.restoreGitDir(ctx); err != nil {
		return fmt.Errorf("shard %s: %w", wt.ID, err)
	}
	if len(wt.Undone) > 0 {
		p.store.audit(ctx, p.event(EventCleaned, "git dir restored", fmt.Sprintf("shard %s: git dir restored before attempt %s (%s)%s", wt.ID, p.Attempt.AttemptID, p.Mode, undoneText(wt.Undone))))
	}
	return nil
}

// setShard changes the placement's shard in the pool record with fn and
// keeps the record it wrote. The record must still place the pool where
// the placement began (its checkout and directory, checked then with
// Owns): a record rewritten meanwhile on the bus is refused.
func (p *Placement) setShard(ctx context.Context, fn func(*Shard)) error {
	pool, err := p.store.SetShard(ctx, p.Pool.Repo, p.Worktree.ID, fn)
	if err != nil {
		return err
	}
	if pool.Checkout != p.Pool.Checkout || pool.Dir != p.Pool.Dir {
		return fmt.Errorf("%w: the pool record of %s now places the pool at %s (checkout %s), not %s (checkout %s) where attempt %s began: rewritten on the bus; re-declare the pool", ErrBadRecord, pool.Repo, pool.Dir, pool.Checkout, p.Pool.Dir, p.Pool.Checkout, p.Attempt.AttemptID)
	}
	p.Pool = pool
	return nil
}

// Settle records how the attempt ended. Call it once every process of the
// attempt is gone and before its lease is released.
func (p *Placement) Settle(ctx context.Context, st Status, code int) error {
	a, err := p.store.Settle(ctx, p.Pool.Repo, p.Attempt.AttemptID, st, code)
	if err != nil {
		return err
	}
	p.Attempt = a
	err = p.setShard(ctx, func(sh *Shard) {
		sh.Running = slices.DeleteFunc(sh.Running, func(id string) bool { return id == a.AttemptID })
	})
	if err != nil {
		return err
	}
	return nil
}

// CleanAfter returns an exclusive attempt's shard to its base once the
// attempt settled, keeping its commits and files as refs, and marks it
// clean. After a commit capacity's attempt it restores the shard's git dir
// and publishes the shard's branch to the checkout instead (publish). The lease it was placed under is asked under the shard's flock:
// when it is not held (lost, so another attempt may be in the shard)
// nothing is touched and the shard stays dirty. Other modes leave the
// shard as it is.
func (p *Placement) CleanAfter(ctx context.Context) (kept []string, err error) {
	if p.Mode == ModeCommitSerialized || p.Mode == ModeCommitExclusive {
		return p.publish(ctx)
	}
	if p.Mode != ModeExclusive {
		return nil, nil
	}
	s, wt := p.store, p.Worktree
	unlock, err := wt.Lock(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if _, err := p.held.Fence(); err != nil {
		return nil, fmt.Errorf("shard %s left dirty, not cleaned: the lease is not held (%w)", wt.ID, err)
	}
	base, err := Base(ctx, p.Pool.Checkout)
	if err != nil {
		return nil, err
	}
	kept, err = wt.Clean(ctx, base, p.Attempt.AttemptID)
	if err != nil {
		return kept, err
	}
	err = p.setShard(ctx, func(sh *Shard) {
		if sh.LastAttempt == p.Attempt.AttemptID {
			sh.State = StateClean
		}
		sh.Base, sh.CleanedAt = base, time.Now().UTC()
	})
	if err != nil {
		return kept, err
	}
	s.audit(ctx, p.event(EventCleaned, "attempt settled", fmt.Sprintf("shard %s cleaned after attempt %s (%s): reset to %s%s%s", wt.ID, p.Attempt.AttemptID, p.Attempt.Status, short(base), keptText(kept), undoneText(wt.Undone))))
	return kept, nil
}

func (p *Placement) event(typ, reason, msg string) lease.AuditEvent {
	return lease.AuditEvent{
		Type: typ, Repo: p.Pool.Repo, LeaseID: p.Lease.LeaseID, Owner: p.Lease.Owner,
		Scope: p.Lease.Scope, Fence: p.Lease.Fence, Reason: reason, Message: msg,
	}
}

func keptText(kept []string) string {
	if len(kept) == 0 {
		return "; nothing to keep"
	}
	return "; work kept as " + strings.Join(kept, ", ")
}

// undoneText names what cleaning undid in the shard's git dir.
func undoneText(undone []string) string {
	if len(undone) == 0 {
		return ""
	}
	return "; undone in its git dir: " + strings.Join(undone, ", ")
}

// EventPublished is the audit event of a shard's branch fetched into the
// checkout after a commit capacity's attempt.
const EventPublished = "published"

// publish ends a commit capacity's attempt: under the shard's flock, with
// the lease still held, the shard's git dir is made fenceline's again
// (what the attempt planted there would otherwise run in the shard's other
// attempts' git) and the shard's branch is fetched into the checkout under
// the same name, refs/heads/<branch>: the one ref of the checkout fenceline
// writes for it, judged by name. It returns that ref.
func (p *Placement) publish(ctx context.Context) ([]string, error) {
	s, wt := p.store, p.Worktree
	unlock, err := wt.Lock(ctx)
	if err != nil {
		return nil, err
	}
	defer unlock()
	if _, err := p.held.Fence(); err != nil {
		return nil, fmt.Errorf("shard %s: branch not published: the lease is not held (%w)", wt.ID, err)
	}
	if wt.Undone, err = wt.restoreGitDir(ctx); err != nil {
		return nil, fmt.Errorf("shard %s: %w", wt.ID, err)
	}
	ref := "refs/heads/" + wt.Branch
	tip, err := wt.g(ctx, nil, "rev-parse", "--verify", "-q", ref)
	if err != nil {
		return nil, nil // no branch: nothing to publish
	}
	if err := wt.publish(ctx, []string{ref}); err != nil {
		return nil, fmt.Errorf("shard %s: publish %s: %w", wt.ID, wt.Branch, err)
	}
	s.audit(ctx, p.event(EventPublished, "commit attempt settled", fmt.Sprintf("shard %s: %s published to the checkout at %s after attempt %s (%s)%s", wt.ID, wt.Branch, short(strings.TrimSpace(tip)), p.Attempt.AttemptID, p.Attempt.Status, undoneText(wt.Undone))))
	return []string{ref}, nil
}
