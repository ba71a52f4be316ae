package shard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// KeptRefPrefix is where cleaning keeps work it would otherwise drop.
const KeptRefPrefix = "refs/fenceline/attempts/"

// Worktree is the git side of one shard: the worktree at Path on Branch,
// linked to the checkout's repository.
type Worktree struct {
	Checkout string // the repository's main checkout (its common git dir)
	Dir      string // the pool's directory (lock files live here)
	ID       string
	Path     string
	Branch   string
}

// Base is the checkout's current HEAD commit: what shards are created and
// cleaned at.
func Base(ctx context.Context, checkout string) (string, error) {
	out, err := git(ctx, checkout, nil, "rev-parse", "--verify", "HEAD^{commit}")
	if err != nil {
		return "", fmt.Errorf("base of %s: %w", checkout, err)
	}
	return strings.TrimSpace(out), nil
}

// Lock takes the shard's flock (Dir/.<id>.lock), waiting for it until ctx
// ends. Creating and cleaning happen under it.
//
// Lock order: a shard's lock, then the pool's (Dir/.pool.lock), which
// serializes what reads or writes the administrative files of every
// worktree in the common git dir (git worktree add and prune, checkout -B):
// git worktree add of one shard fails reading another's half-written
// ones.
func (w *Worktree) Lock(ctx context.Context) (unlock func(), err error) {
	return lockFile(ctx, w.Dir, "."+w.ID+".lock")
}

func (w *Worktree) lockPool(ctx context.Context) (unlock func(), err error) {
	return lockFile(ctx, w.Dir, ".pool.lock")
}

func lockFile(ctx context.Context, dir, name string) (unlock func(), err error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	path := filepath.Join(dir, name)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|unix.O_CLOEXEC, 0o644)
	if err != nil {
		return nil, fmt.Errorf("lock %s: %w", name, err)
	}
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB)
		if err == nil {
			return func() {
				unix.Flock(int(f.Fd()), unix.LOCK_UN)
				f.Close()
			}, nil
		}
		if !errors.Is(err, unix.EWOULDBLOCK) && !errors.Is(err, unix.EINTR) {
			f.Close()
			return nil, fmt.Errorf("lock %s: flock: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, ctx.Err())
		case <-tick.C:
		}
	}
}

// Exists reports whether the shard's worktree is there.
func (w *Worktree) Exists() bool {
	fi, err := os.Lstat(filepath.Join(w.Path, ".git"))
	return err == nil && fi.Mode().IsRegular()
}

// Ready is the warm-shard check: the worktree exists and its HEAD is base.
// (The record says whether it is clean; nobody writes a shard between its
// cleaning and the next lease.)
func (w *Worktree) Ready(ctx context.Context, base string) error {
	if !w.Exists() {
		return fmt.Errorf("shard %s: no worktree at %s", w.ID, w.Path)
	}
	head, err := git(ctx, w.Path, nil, "rev-parse", "--verify", "HEAD")
	if err != nil {
		return fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if h := strings.TrimSpace(head); h != base {
		return fmt.Errorf("shard %s is at %s, not at the base %s", w.ID, short(h), short(base))
	}
	return nil
}

// Create adds the shard's worktree at base with the real git worktree add
// on its branch. An existing branch with commits past base is kept as
// KeptRefPrefix+keepID first. A directory already there without a .git
// (a create that died half-way, or an agent that deleted its .git) is
// moved aside, never deleted: it may hold an attempt's work. Call it under
// Lock.
func (w *Worktree) Create(ctx context.Context, base, keepID string) (kept []string, err error) {
	if w.Exists() {
		return nil, nil
	}
	defer func() {
		if err != nil && len(kept) > 0 { // callers drop kept on an error: say where the work went
			err = fmt.Errorf("%w (kept before the failure: %s)", err, strings.Join(kept, ", "))
		}
	}()
	if _, err := os.Lstat(w.Path); err == nil {
		aside := fmt.Sprintf("%s.orphan-%s-%d", w.Path, keepID, time.Now().UnixNano())
		if err := os.Rename(w.Path, aside); err != nil {
			return nil, fmt.Errorf("shard %s: move the directory without a .git at %s aside: %w", w.ID, w.Path, err)
		}
		kept = append(kept, aside)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	unlock, err := w.lockPool(ctx)
	if err != nil {
		return kept, err
	}
	defer unlock()
	if _, err := git(ctx, w.Checkout, nil, "worktree", "prune"); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	tip, err := git(ctx, w.Checkout, nil, "rev-parse", "--verify", "-q", "refs/heads/"+w.Branch)
	if err == nil {
		if k, err := keepPast(ctx, w.Checkout, strings.TrimSpace(tip), base, keepID); err != nil {
			return kept, fmt.Errorf("shard %s: %w", w.ID, err)
		} else if k != "" {
			kept = append(kept, k)
		}
	}
	if _, err := git(ctx, w.Checkout, nil, "worktree", "add", "-q", "-f", "-B", w.Branch, w.Path, base); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	return kept, nil
}

// Clean returns the worktree to base: commits of its branch (or a
// detached HEAD) past base and uncommitted, not ignored files are kept as
// refs under KeptRefPrefix+keepID first, then (when HEAD is not on the
// shard's branch) git checkout -f -B <branch> <base>, git reset --hard
// <base> and git clean -ffdx. Call it under Lock
// and under an exclusive lease on the shard: no live attempt may be in it.
func (w *Worktree) Clean(ctx context.Context, base, keepID string) (kept []string, err error) {
	if !w.Exists() {
		k, err := w.Create(ctx, base, keepID)
		return k, err
	}
	keep := func(ref string, err error) error {
		if err != nil {
			return fmt.Errorf("shard %s: keep work: %w", w.ID, err)
		}
		if ref != "" {
			kept = append(kept, ref)
		}
		return nil
	}
	if err := keep(w.snapshot(ctx, keepID)); err != nil {
		return kept, err
	}
	tip, terr := git(ctx, w.Path, nil, "rev-parse", "--verify", "-q", "refs/heads/"+w.Branch)
	tip = strings.TrimSpace(tip)
	if terr == nil {
		if err := keep(keepPast(ctx, w.Path, tip, base, keepID)); err != nil {
			return kept, err
		}
	}
	if head, err := git(ctx, w.Path, nil, "rev-parse", "--verify", "-q", "HEAD"); err == nil && strings.TrimSpace(head) != tip {
		if err := keep(keepPast(ctx, w.Path, strings.TrimSpace(head), base, keepID+"-head")); err != nil {
			return kept, err
		}
	}
	for _, d := range []string{"rebase-merge", "rebase-apply"} {
		if p, err := git(ctx, w.Path, nil, "rev-parse", "--git-path", d); err == nil {
			p = strings.TrimSpace(p)
			if !filepath.IsAbs(p) {
				p = filepath.Join(w.Path, p)
			}
			if _, err := os.Lstat(p); err == nil {
				git(ctx, w.Path, nil, "rebase", "--quit")
			}
		}
	}
	if ref, err := git(ctx, w.Path, nil, "symbolic-ref", "-q", "HEAD"); err != nil || strings.TrimSpace(ref) != "refs/heads/"+w.Branch {
		// Back onto the shard's branch; git checks every worktree for it.
		unlock, err := w.lockPool(ctx)
		if err != nil {
			return kept, err
		}
		_, err = git(ctx, w.Path, nil, "checkout", "-q", "-f", "-B", w.Branch, base)
		unlock()
		if err != nil {
			return kept, fmt.Errorf("shard %s: clean: %w", w.ID, err)
		}
	}
	for _, args := range [][]string{
		{"reset", "-q", "--hard", base},
		{"clean", "-q", "-ffdx"},
	} {
		if _, err := git(ctx, w.Path, nil, args...); err != nil {
			return kept, fmt.Errorf("shard %s: clean: %w", w.ID, err)
		}
	}
	out, err := git(ctx, w.Path, nil, "status", "--porcelain", "--ignored", "--untracked-files=all")
	if err != nil {
		return kept, fmt.Errorf("shard %s: check it is clean: %w", w.ID, err)
	}
	if strings.TrimSpace(out) != "" {
		return kept, fmt.Errorf("shard %s is not clean after cleaning:\n%s", w.ID, out)
	}
	return kept, nil
}

// keepPast keeps commit (when it has commits base lacks) as the ref
// KeptRefPrefix+id and returns the ref, or "" when nothing needed keeping.
func keepPast(ctx context.Context, dir, commit, base, id string) (string, error) {
	if commit == "" || commit == base {
		return "", nil
	}
	if _, err := git(ctx, dir, nil, "merge-base", "--is-ancestor", commit, base); err == nil {
		return "", nil // everything in it is in base
	}
	ref := KeptRefPrefix + id
	if _, err := git(ctx, dir, nil, "update-ref", ref, commit); err != nil {
		return "", err
	}
	return ref, nil
}

// snapshot keeps uncommitted changes and untracked (not ignored) files as
// a commit on top of HEAD, the ref KeptRefPrefix+id+"-worktree", using a
// copy of the worktree's index so the real one is left alone.
func (w *Worktree) snapshot(ctx context.Context, id string) (string, error) {
	st, err := git(ctx, w.Path, nil, "status", "--porcelain", "--untracked-files=all")
	if err != nil || strings.TrimSpace(st) == "" {
		return "", err
	}
	idx, err := git(ctx, w.Path, nil, "rev-parse", "--git-path", "index")
	if err != nil {
		return "", err
	}
	idx = strings.TrimSpace(idx)
	if !filepath.IsAbs(idx) {
		idx = filepath.Join(w.Path, idx)
	}
	tmp, err := os.CreateTemp(w.Dir, "."+w.ID+".index-")
	if err != nil {
		return "", err
	}
	tmpName := tmp.Name()
	defer os.Remove(tmpName)
	if b, err := os.ReadFile(idx); err == nil {
		tmp.Write(b)
	}
	tmp.Close()
	env := []string{"GIT_INDEX_FILE=" + tmpName}
	if _, err := git(ctx, w.Path, env, "add", "-A"); err != nil {
		return "", err
	}
	tree, err := git(ctx, w.Path, env, "write-tree")
	if err != nil {
		return "", err
	}
	args := []string{"commit-tree", strings.TrimSpace(tree), "-m", "fenceline: files left in " + w.ID + " when it was cleaned (attempt " + id + ")"}
	if head, err := git(ctx, w.Path, nil, "rev-parse", "--verify", "-q", "HEAD"); err == nil {
		args = append(args, "-p", strings.TrimSpace(head))
	}
	c, err := git(ctx, w.Path, env, args...)
	if err != nil {
		return "", err
	}
	ref := KeptRefPrefix + id + "-worktree"
	if _, err := git(ctx, w.Path, nil, "update-ref", ref, strings.TrimSpace(c)); err != nil {
		return "", err
	}
	return ref, nil
}

// gitEnv is the environment fenceline's own git commands run with: none
// of the caller's GIT_* repository overrides, and an identity for the
// commits that keep work.
func gitEnv(extra []string) []string {
	var env []string
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		switch k {
		case "GIT_DIR", "GIT_WORK_TREE", "GIT_INDEX_FILE", "GIT_COMMON_DIR", "GIT_OBJECT_DIRECTORY",
			"GIT_ALTERNATE_OBJECT_DIRECTORIES", "GIT_NAMESPACE", "GIT_CEILING_DIRECTORIES", "GIT_OPTIONAL_LOCKS":
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "GIT_AUTHOR_NAME=fenceline", "GIT_AUTHOR_EMAIL=fenceline@localhost",
		"GIT_COMMITTER_NAME=fenceline", "GIT_COMMITTER_EMAIL=fenceline@localhost", "GIT_TERMINAL_PROMPT=0")
	return append(env, extra...)
}

func git(ctx context.Context, dir string, env []string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", append([]string{"-C", dir}, args...)...)
	cmd.Env = gitEnv(env)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		if msg := strings.TrimSpace(stderr.String()); msg != "" {
			return stdout.String(), fmt.Errorf("git %s: %w: %s", strings.Join(args, " "), err, msg)
		}
		return stdout.String(), fmt.Errorf("git %s: %w", strings.Join(args, " "), err)
	}
	return stdout.String(), nil
}

func short(c string) string {
	if len(c) > 12 {
		return c[:12]
	}
	return c
}
