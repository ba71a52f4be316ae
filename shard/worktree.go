package shard

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/gitsafe"
)

// KeptRefPrefix is where cleaning keeps work it would otherwise drop.
const KeptRefPrefix = "refs/fenceline/attempts/"

// Worktree is the git side of one shard: a repository of its own at Path
// (git dir Path/.git) on Branch, which borrows the checkout's objects
// read-only through objects/info/alternates. Its refs, config, hooks and
// index are its own: an attempt that writes its git dir writes nothing of
// the checkout's or of another shard's (see the package comment).
type Worktree struct {
	Checkout string // the repository's main checkout (its common git dir)
	Dir      string // the pool's directory (lock files live here)
	ID       string
	Path     string
	Branch   string
	// Undone is what the last Clean removed or rewrote in the shard's git
	// dir because an attempt put it there (hooks, config, links ...).
	Undone []string
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

// Exists reports whether the shard's repository is there: Path/.git is a
// directory (not a symlink, not a file pointing elsewhere).
func (w *Worktree) Exists() bool {
	fi, err := os.Lstat(w.gitDir())
	return err == nil && fi.IsDir()
}

func (w *Worktree) gitDir() string { return filepath.Join(w.Path, ".git") }

// g runs fenceline's git on the shard's own repository. GIT_DIR,
// GIT_COMMON_DIR and GIT_WORK_TREE are named, so nothing an attempt wrote
// (a commondir file, core.worktree, a .git file) points it elsewhere.
func (w *Worktree) g(ctx context.Context, env []string, args ...string) (string, error) {
	gd := w.gitDir()
	return git(ctx, w.Path, append([]string{"GIT_DIR=" + gd, "GIT_COMMON_DIR=" + gd, "GIT_WORK_TREE=" + w.Path}, env...), args...)
}

// Ready is the warm-shard check: the repository exists and its HEAD is
// base. (The record says whether it is clean; nobody writes a shard
// between its cleaning and the next lease.)
func (w *Worktree) Ready(ctx context.Context, base string) error {
	if !w.Exists() {
		return fmt.Errorf("shard %s: no repository at %s", w.ID, w.gitDir())
	}
	head, err := w.g(ctx, nil, "rev-parse", "--verify", "HEAD")
	if err != nil {
		return fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if h := strings.TrimSpace(head); h != base {
		return fmt.Errorf("shard %s is at %s, not at the base %s", w.ID, short(h), short(base))
	}
	return nil
}

// Create makes the shard's repository at base: git init, the checkout's
// objects as its alternate, fenceline's own config, and a checkout of
// base on the shard's branch. A directory already there without a .git
// directory (a create that died half-way, or an agent that deleted or
// replaced its .git) is moved aside, never deleted: it may hold an
// attempt's work. Every repository in it (a .git file naming a git dir
// the attempt planted, say) is disarmed (w.Undone). Call it under Lock.
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
		w.Undone = append(w.Undone, disarmTree(aside)...)
	} else if !errors.Is(err, fs.ErrNotExist) {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if err := os.MkdirAll(w.Path, 0o755); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if _, err := w.g(ctx, nil, "init", "-q", "--template=", "-b", w.Branch); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if _, err := w.restoreGitDir(ctx); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if _, err := w.g(ctx, nil, "checkout", "-q", "-f", "-B", w.Branch, base); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	if err := w.syncRemoteRefs(ctx); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	return kept, nil
}

// Clean returns the shard to base. First its git dir is made fenceline's
// again (restoreGitDir: what names a program, points elsewhere or is not
// a plain file goes; w.Undone says what was undone). Then commits of its
// branch (or a detached HEAD) past base and uncommitted, not ignored
// files are kept as refs under KeptRefPrefix+keepID, fetched into the
// checkout (the fetch hashes every object it takes). Then the shard's own
// refs, reflogs, objects and index go, and base is checked out again on
// the shard's branch from the checkout's objects, every file's content
// hashed against the index (git update-index --refresh) before git reset
// --hard and git clean -ffdx. Call it under Lock and under an exclusive
// lease on the shard: no live attempt may be in it.
//
// When cleaning fails in the shard (an attempt may have broken its own
// objects, or left files git cannot remove), the shard is moved aside,
// its files kept on disk (named in kept) and every repository in it
// disarmed, and made anew at base: one attempt must not take its shard
// out of the pool.
func (w *Worktree) Clean(ctx context.Context, base, keepID string) (kept []string, err error) {
	w.Undone = nil
	if !w.Exists() {
		k, err := w.Create(ctx, base, keepID)
		return k, err
	}
	kept, err = w.clean(ctx, base, keepID)
	if err == nil || ctx.Err() != nil {
		return kept, err
	}
	aside := fmt.Sprintf("%s.orphan-%s-%d", w.Path, keepID, time.Now().UnixNano())
	if rerr := os.Rename(w.Path, aside); rerr != nil {
		return kept, fmt.Errorf("%w; moving the shard aside: %w", err, rerr)
	}
	w.Undone = append(w.Undone, fmt.Sprintf("the whole shard (cleaning failed: %v; moved to %s)", err, aside))
	w.Undone = append(w.Undone, disarmTree(aside)...)
	// Refs the failed cleaning kept are in the shard moved aside.
	k, cerr := w.Create(ctx, base, keepID)
	kept = append(k, aside)
	if cerr != nil {
		return kept, fmt.Errorf("%w; making it anew: %w", err, cerr)
	}
	return kept, nil
}

func (w *Worktree) clean(ctx context.Context, base, keepID string) (kept []string, err error) {
	if w.Undone, err = w.restoreGitDir(ctx); err != nil {
		return nil, fmt.Errorf("shard %s: %w", w.ID, err)
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
	tip, terr := w.g(ctx, nil, "rev-parse", "--verify", "-q", "refs/heads/"+w.Branch)
	tip = strings.TrimSpace(tip)
	if terr == nil {
		if err := keep(w.keepPast(ctx, tip, base, keepID)); err != nil {
			return kept, err
		}
	}
	if head, err := w.g(ctx, nil, "rev-parse", "--verify", "-q", "HEAD"); err == nil && strings.TrimSpace(head) != tip {
		if err := keep(w.keepPast(ctx, strings.TrimSpace(head), base, keepID+"-head")); err != nil {
			return kept, err
		}
	}
	if len(kept) > 0 {
		if err := w.publish(ctx, kept); err != nil {
			return nil, fmt.Errorf("shard %s: keep work: %w", w.ID, err)
		}
	}
	if err := w.wipe(); err != nil {
		return kept, fmt.Errorf("shard %s: clean: %w", w.ID, err)
	}
	if _, err := w.g(ctx, nil, "read-tree", base); err != nil {
		return kept, fmt.Errorf("shard %s: clean: %w", w.ID, err)
	}
	w.g(ctx, nil, "update-index", "-q", "--refresh") // exits 1 when files differ: reset rewrites those
	for _, args := range [][]string{
		{"update-ref", "refs/heads/" + w.Branch, base},
		{"symbolic-ref", "HEAD", "refs/heads/" + w.Branch},
		{"reset", "-q", "--hard", base},
		{"clean", "-q", "-ffdx"},
	} {
		if _, err := w.g(ctx, nil, args...); err != nil {
			return kept, fmt.Errorf("shard %s: clean: %w", w.ID, err)
		}
	}
	if err := w.syncRemoteRefs(ctx); err != nil {
		return kept, fmt.Errorf("shard %s: %w", w.ID, err)
	}
	out, err := w.g(ctx, nil, "status", "--porcelain", "--ignored", "--untracked-files=all")
	if err != nil {
		return kept, fmt.Errorf("shard %s: check it is clean: %w", w.ID, err)
	}
	if strings.TrimSpace(out) != "" {
		return kept, fmt.Errorf("shard %s is not clean after cleaning:\n%s", w.ID, out)
	}
	return kept, nil
}

// keepPast keeps commit (when it has commits base lacks) as the ref
// KeptRefPrefix+id in the shard and returns the ref, or "" when nothing
// needed keeping.
func (w *Worktree) keepPast(ctx context.Context, commit, base, id string) (string, error) {
	if commit == "" || commit == base {
		return "", nil
	}
	if _, err := w.g(ctx, nil, "merge-base", "--is-ancestor", commit, base); err == nil {
		return "", nil // everything in it is in base
	}
	ref := KeptRefPrefix + id
	if _, err := w.g(ctx, nil, "update-ref", ref, commit); err != nil {
		return "", err
	}
	return ref, nil
}

// publish fetches the kept refs from the shard into the checkout, under
// the pool's lock. The fetch takes objects as a pack and hashes each one:
// an object the attempt forged in its own store does not enter the
// checkout under another's id (the fetch fails instead).
func (w *Worktree) publish(ctx context.Context, refs []string) error {
	unlock, err := w.lockPool(ctx)
	if err != nil {
		return err
	}
	defer unlock()
	args := []string{"fetch", "-q", "--no-tags", "--no-write-fetch-head", "--no-auto-gc", w.gitDir()}
	for _, r := range refs {
		args = append(args, "+"+r+":"+r)
	}
	_, err = git(ctx, w.Checkout, nil, args...)
	return err
}

// snapshot keeps uncommitted changes and untracked (not ignored) files as
// a commit on top of HEAD, the ref KeptRefPrefix+id+"-worktree", using a
// copy of the shard's index so the real one is left alone.
func (w *Worktree) snapshot(ctx context.Context, id string) (string, error) {
	st, err := w.g(ctx, nil, "status", "--porcelain", "--untracked-files=all")
	if err != nil || strings.TrimSpace(st) == "" {
		return "", err
	}
	tmp, err := os.CreateTemp(w.Dir, "."+w.ID+".index-")
	if err != nil {
		return "", err
	}
	tmpName := tmp.Name()
	defer os.Remove(tmpName)
	index := filepath.Join(w.gitDir(), "index")
	if b, err := readRegular(index); err == nil {
		if _, err := tmp.Write(b); err != nil {
			tmp.Close()
			return "", fmt.Errorf("copy %s's index: %w", w.ID, err)
		}
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("copy %s's index: %w", w.ID, err)
	}
	// The copy keeps the index's mtime: git tells a file changed in the
	// same tick as the index was written ("racily clean") by comparing the
	// two, and a copy made now would make a same-size edit look unchanged.
	if fi, err := os.Lstat(index); err == nil {
		if err := os.Chtimes(tmpName, fi.ModTime(), fi.ModTime()); err != nil {
			return "", fmt.Errorf("copy %s's index: %w", w.ID, err)
		}
	}
	env := []string{"GIT_INDEX_FILE=" + tmpName}
	if _, err := w.g(ctx, env, "add", "-A"); err != nil {
		return "", err
	}
	tree, err := w.g(ctx, env, "write-tree")
	if err != nil {
		return "", err
	}
	args := []string{"commit-tree", strings.TrimSpace(tree), "-m", "fenceline: files left in " + w.ID + " when it was cleaned (attempt " + id + ")"}
	if head, err := w.g(ctx, nil, "rev-parse", "--verify", "-q", "HEAD"); err == nil {
		args = append(args, "-p", strings.TrimSpace(head))
	}
	c, err := w.g(ctx, env, args...)
	if err != nil {
		return "", err
	}
	ref := KeptRefPrefix + id + "-worktree"
	if _, err := w.g(ctx, nil, "update-ref", ref, strings.TrimSpace(c)); err != nil {
		return "", err
	}
	return ref, nil
}

// readRegular reads path when it is a regular file (never through a
// symlink, never a fifo).
func readRegular(path string) ([]byte, error) {
	fi, err := os.Lstat(path)
	if err != nil {
		return nil, err
	}
	if !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file", path)
	}
	return os.ReadFile(path)
}

// restoreGitDir makes the shard's git dir fenceline's again and says what
// it undid. An attempt may have written anything there; after this
// nothing in it runs a program or points outside the shard:
//   - every entry that is neither a directory nor a regular file
//     (a symlink into the checkout's git dir, a fifo) is removed;
//   - hooks/ is emptied; commondir, gitdir, config.worktree, worktrees/,
//     info/attributes, info/grafts, refs/replace/ and a nested .git are
//     removed, and everything in objects/info but alternates (a forged
//     commit-graph gives a commit another tree and parents);
//   - config is rewritten: fenceline's, with the checkout's origin URL
//     and a few keys that name no program;
//   - objects/info/alternates names the checkout's objects alone.
func (w *Worktree) restoreGitDir(ctx context.Context) (undone []string, err error) {
	gd := w.gitDir()
	err = filepath.WalkDir(gd, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() || d.Type().IsRegular() {
			return nil
		}
		rel, _ := filepath.Rel(gd, p)
		undone = append(undone, rel+" ("+d.Type().String()+")")
		return os.Remove(p)
	})
	if err != nil {
		return undone, fmt.Errorf("restore git dir: %w", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(gd, "hooks")); len(ents) > 0 {
		for _, e := range ents {
			undone = append(undone, "hooks/"+e.Name())
		}
	}
	// .git: git upload-pack, which the fetch into the checkout runs on
	// this git dir, would serve a repository there instead.
	for _, rel := range []string{"hooks", "commondir", "gitdir", "config.worktree", "worktrees", "info/attributes", "info/grafts", "refs/replace", ".git"} {
		p := filepath.Join(gd, rel)
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if rel != "hooks" {
			undone = append(undone, rel)
		}
		if err := os.RemoveAll(p); err != nil {
			return undone, fmt.Errorf("restore git dir: %w", err)
		}
	}
	// objects/info holds only the alternates file fenceline writes: git
	// believes a commit-graph (a commit's tree and parents) over the
	// commit objects, and http-alternates or packs name other stores.
	if ents, err := os.ReadDir(filepath.Join(gd, "objects", "info")); err == nil {
		for _, e := range ents {
			if e.Name() == "alternates" {
				continue
			}
			undone = append(undone, "objects/info/"+e.Name())
			if err := os.RemoveAll(filepath.Join(gd, "objects", "info", e.Name())); err != nil {
				return undone, fmt.Errorf("restore git dir: %w", err)
			}
		}
	}
	cfg, alt, err := w.ownConfig(ctx)
	if err != nil {
		return undone, err
	}
	if old, err := os.ReadFile(filepath.Join(gd, "config")); err == nil && string(old) != cfg {
		undone = append(undone, "config")
	}
	if err := os.MkdirAll(filepath.Join(gd, "objects", "info"), 0o755); err != nil {
		return undone, fmt.Errorf("restore git dir: %w", err)
	}
	if err := writeReplace(filepath.Join(gd, "config"), cfg); err != nil {
		return undone, err
	}
	if err := writeReplace(filepath.Join(gd, "objects", "info", "alternates"), alt+"\n"); err != nil {
		return undone, err
	}
	return undone, nil
}

// ownConfig is the shard's config and its alternates line. The checkout
// is asked (through gitsafe) for its common git dir and for the few keys
// copied over, none of which names a program.
func (w *Worktree) ownConfig(ctx context.Context) (cfg, alternates string, err error) {
	common, err := git(ctx, w.Checkout, nil, "rev-parse", "--path-format=absolute", "--git-common-dir")
	if err != nil {
		return "", "", fmt.Errorf("checkout git dir: %w", err)
	}
	alternates = filepath.Join(strings.TrimSpace(common), "objects")
	listed, err := git(ctx, w.Checkout, nil, "config", "--local", "--list", "--null")
	if err != nil {
		return "", "", fmt.Errorf("checkout config: %w", err)
	}
	vals := map[string]string{}
	for _, ent := range strings.Split(listed, "\x00") {
		k, v, _ := strings.Cut(ent, "\n")
		switch k {
		case "remote.origin.url", "core.autocrlf", "core.eol", "core.symlinks", "core.ignorecase", "core.filemode", "extensions.objectformat":
			vals[k] = v
		}
	}
	var b strings.Builder
	b.WriteString("[core]\n\trepositoryformatversion = ")
	if vals["extensions.objectformat"] != "" {
		b.WriteString("1\n")
	} else {
		b.WriteString("0\n")
	}
	b.WriteString("\tbare = false\n\tlogallrefupdates = true\n")
	for _, k := range []string{"core.autocrlf", "core.eol", "core.symlinks", "core.ignorecase", "core.filemode"} {
		if v, ok := vals[k]; ok {
			fmt.Fprintf(&b, "\t%s = %s\n", strings.TrimPrefix(k, "core."), quote(v))
		}
	}
	if v := vals["extensions.objectformat"]; v != "" {
		fmt.Fprintf(&b, "[extensions]\n\tobjectformat = %s\n", quote(v))
	}
	if v := vals["remote.origin.url"]; v != "" {
		fmt.Fprintf(&b, "[remote \"origin\"]\n\turl = %s\n\tfetch = +refs/heads/*:refs/remotes/origin/*\n", quote(v))
	}
	return b.String(), alternates, nil
}

// quote writes v as a git config value.
func quote(v string) string {
	r := strings.NewReplacer("\\", "\\\\", "\"", "\\\"", "\n", "\\n", "\t", "\\t")
	return "\"" + r.Replace(v) + "\""
}

// writeReplace writes path by renaming a new file over it: never through
// a link an attempt left there.
func writeReplace(path, content string) error {
	tmp := path + ".fenceline-tmp"
	os.Remove(tmp)
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		return fmt.Errorf("restore git dir: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("restore git dir: %w", err)
	}
	return nil
}

// wipe removes the shard's own refs, reflogs, objects, LFS objects, index
// and in-progress operations once its work is kept: what remains is
// borrowed from the checkout, whose objects the attempt could not write.
func (w *Worktree) wipe() error {
	gd := w.gitDir()
	for _, rel := range []string{"refs", "logs", "packed-refs", "index", "ORIG_HEAD", "FETCH_HEAD", "MERGE_HEAD", "CHERRY_PICK_HEAD", "REVERT_HEAD", "rebase-merge", "rebase-apply", "sequencer", "shallow", "lfs"} {
		if err := os.RemoveAll(filepath.Join(gd, rel)); err != nil {
			return err
		}
	}
	ents, err := os.ReadDir(filepath.Join(gd, "objects"))
	if err != nil {
		return err
	}
	for _, e := range ents {
		if e.Name() != "info" {
			if err := os.RemoveAll(filepath.Join(gd, "objects", e.Name())); err != nil {
				return err
			}
		}
	}
	for _, d := range []string{"refs/heads", "refs/tags"} {
		if err := os.MkdirAll(filepath.Join(gd, d), 0o755); err != nil {
			return err
		}
	}
	return writeReplace(filepath.Join(gd, "HEAD"), "ref: refs/heads/"+w.Branch+"\n")
}

// syncRemoteRefs copies the checkout's refs/remotes/origin/* into the
// shard (their objects are the checkout's), so an agent sees origin's
// branches as the checkout knows them.
func (w *Worktree) syncRemoteRefs(ctx context.Context) error {
	out, err := git(ctx, w.Checkout, nil, "for-each-ref", "--format=%(objectname) %(refname)", "refs/remotes/origin/")
	if err != nil || strings.TrimSpace(out) == "" {
		return err
	}
	var in strings.Builder
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		id, ref, ok := strings.Cut(l, " ")
		if ok && ref != "refs/remotes/origin/HEAD" {
			fmt.Fprintf(&in, "update %s %s\n", ref, id)
		}
	}
	gd := w.gitDir()
	g := gitsafe.Git{Dir: w.Path, Env: []string{"GIT_DIR=" + gd, "GIT_COMMON_DIR=" + gd, "GIT_WORK_TREE=" + w.Path}}
	cmd, err := g.Command(ctx, "update-ref", "--stdin")
	if err != nil {
		return err
	}
	cmd.Stdin = strings.NewReader(in.String())
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("copy origin's refs: %w: %s", err, strings.TrimSpace(string(out)))
	}
	return nil
}

// identity is who the commits that keep work are by.
var identity = []string{"GIT_AUTHOR_NAME=fenceline", "GIT_AUTHOR_EMAIL=fenceline@localhost",
	"GIT_COMMITTER_NAME=fenceline", "GIT_COMMITTER_EMAIL=fenceline@localhost"}

// git runs fenceline's own git in dir through gitsafe: none of the
// caller's GIT_* variables, no hook, and no program the repository's
// configuration names (an attempt may have planted them).
func git(ctx context.Context, dir string, env []string, args ...string) (string, error) {
	return gitsafe.Git{Dir: dir, Env: append(append([]string(nil), identity...), env...)}.Output(ctx, args...)
}

func short(c string) string {
	if len(c) > 12 {
		return c[:12]
	}
	return c
}
