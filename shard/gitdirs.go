package shard

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/gitsafe"
)

// GitDirSnapshot is what of a checkout's git dirs can make git run a
// program, as it was before an exclusive attempt without a pool worked in
// the checkout (its git dir writable): every config, config.worktree,
// commondir and gitdir file, everything under a hooks directory and in a
// rebase or cherry-pick left in progress (programDirs), and
// info/attributes — in the git dir itself and in the git dirs of its
// submodules and worktrees (modules/, worktrees/), info/grafts, shallow,
// info/exclude and the refs/replace/ refs (which change what git shows).
// Objects, other refs and reflogs are the attempt's work and are not part
// of it.
type GitDirSnapshot struct {
	dirs  []string
	files map[string]snapEntry // by absolute path
	// held are the git dirs themselves, by path: which directory was
	// there (an attempt may move it and put a link, a .git file or
	// another directory in its place) and a descriptor on it, to find it
	// wherever it was moved.
	held map[string]heldDir
	// workTree, when set, is the checkout whose repositories (its own
	// .git and those nested in it) were recorded in dotGits; roots are
	// the directories of it walked for them (the whole checkout, or the
	// claims of a path-leased attempt).
	workTree string
	roots    []string
	dotGits  map[string]snapEntry // by absolute path
	// hookDirs are the directories core.hooksPath names where the attempt
	// may write (husky's .husky/_ in the work tree): every file in them is
	// restored like a git dir's hooks.
	hookDirs []string
	// taken is a moment before the snapshot: a directory of the roots
	// unreadable at Restore whose ctime is later was made so by the
	// attempt (findRepos makes it searchable).
	taken time.Time
	// replace are each git dir's refs/replace/ refs (ref -> object): they
	// make git show another object in an object's place.
	replace map[string]map[string]string
	// others are the other worktrees' HEAD and index files, and common
	// their checked-out branches (ref -> commit, "" unborn), in the
	// common git dir: a linked worktree's attempt (or one in a checkout
	// with linked worktrees) writes the common git dir they live in.
	others        map[string]snapEntry
	common        string
	otherBranches map[string]string
}

// heldDir is a git dir as it was: its identity and a descriptor on it.
type heldDir struct {
	dev, ino uint64
	fd       int
}

type snapEntry struct {
	mode    fs.FileMode
	content []byte // a file's bytes, or a symlink's target
}

// executable reports whether rel (a path in a git dir) is one of the
// places git takes programs from (programDirs), or one that makes git
// show something else than the repository holds (info/grafts and shallow
// hide parents, info/exclude hides files from git status).
func executable(rel string) bool {
	base := filepath.Base(rel)
	switch base {
	case "config", "config.worktree", "commondir", "gitdir":
		return true
	}
	if (base == "attributes" || base == "grafts" || base == "exclude") && filepath.Base(filepath.Dir(rel)) == "info" {
		return true
	}
	if rel == "shallow" {
		return true // like grafts: git shows a commit without its parents
	}
	for d := filepath.Dir(rel); d != "." && d != "/"; d = filepath.Dir(d) {
		if slices.Contains(programDirs, filepath.Base(d)) {
			return true
		}
	}
	return slices.Contains(programDirs, base)
}

// programDirs are the git dir's directories whose files name programs git
// runs: hooks, and the todo lists of a rebase or cherry-pick left in
// progress (an exec line runs at the user's git rebase --continue).
var programDirs = []string{"hooks", "rebase-merge", "rebase-apply", "sequencer"}

// skipped are the git dir entries a snapshot does not walk: history and
// refs, the attempt's to change.
func skipped(rel string) bool {
	switch filepath.Base(rel) {
	case "objects", "refs", "logs", "lfs":
		return true
	}
	return false
}

func walkExecutable(dir string, fn func(path string, d fs.DirEntry) error) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		if d.IsDir() {
			if rel != "." && skipped(rel) {
				return filepath.SkipDir
			}
			if !slices.Contains(programDirs, filepath.Base(rel)) {
				return nil
			}
		}
		if rel == "." || !executable(rel) {
			return nil
		}
		return fn(p, d)
	})
}

// SnapshotGitDirs records the executable configuration of gitDirs.
func SnapshotGitDirs(ctx context.Context, gitDirs []string) (*GitDirSnapshot, error) {
	s := &GitDirSnapshot{dirs: slices.Clone(gitDirs), files: map[string]snapEntry{}, held: map[string]heldDir{}}
	for _, dir := range gitDirs {
		if err := s.hold(dir); err != nil {
			s.Close()
			return nil, err
		}
	}
	if err := s.snapshotDirs(gitDirs); err != nil {
		s.Close()
		return nil, err
	}
	s.replace = map[string]map[string]string{}
	for _, dir := range gitDirs {
		// A git dir git cannot read refs from (a nested .git that is no
		// repository) has none to replace objects with.
		if refs, err := replaceRefs(ctx, dir); err == nil {
			s.replace[dir] = refs
		}
	}
	return s, nil
}

// gitTimeout bounds the git commands of a snapshot and its restore.
const gitTimeout = 30 * time.Second

// replaceRefs lists the refs/replace/ refs of git dir dir.
func replaceRefs(ctx context.Context, dir string) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, gitTimeout)
	defer cancel()
	out, err := git(ctx, dir, []string{"GIT_DIR=" + dir}, "for-each-ref", "--format=%(refname) %(objectname)", "refs/replace/")
	if err != nil {
		return nil, err
	}
	refs := map[string]string{}
	for _, l := range strings.Split(strings.TrimSpace(out), "\n") {
		if ref, id, ok := strings.Cut(l, " "); ok {
			refs[ref] = id
		}
	}
	return refs, nil
}

// restoreReplaceRefs puts each git dir's refs/replace/ back as it was.
func (s *GitDirSnapshot) restoreReplaceRefs(ctx context.Context) (undone []string, errs []error) {
	for _, dir := range s.dirs {
		was, ok := s.replace[dir]
		if !ok {
			continue
		}
		if h, held := s.held[dir]; held && !h.isAt(dir) {
			continue
		}
		now, err := replaceRefs(ctx, dir)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var in strings.Builder
		for ref, id := range now {
			if old, ok := was[ref]; !ok {
				fmt.Fprintf(&in, "delete %s\n", ref)
				undone = append(undone, s.name(filepath.Join(dir, ref))+" (added)")
			} else if old != id {
				fmt.Fprintf(&in, "update %s %s\n", ref, old)
				undone = append(undone, s.name(filepath.Join(dir, ref))+" (changed)")
			}
		}
		for ref, id := range was {
			if _, ok := now[ref]; !ok {
				fmt.Fprintf(&in, "update %s %s\n", ref, id)
				undone = append(undone, s.name(filepath.Join(dir, ref))+" (removed)")
			}
		}
		if in.Len() == 0 {
			continue
		}
		ctx, cancel := context.WithTimeout(ctx, gitTimeout)
		cmd, err := gitsafe.Git{Dir: dir, Env: []string{"GIT_DIR=" + dir}}.Command(ctx, "update-ref", "--stdin")
		if err == nil {
			cmd.Stdin = strings.NewReader(in.String())
			var out []byte
			if out, err = cmd.CombinedOutput(); err != nil {
				err = fmt.Errorf("restore refs/replace in %s: %w: %s", dir, err, strings.TrimSpace(string(out)))
			}
		}
		cancel()
		if err != nil {
			errs = append(errs, err)
		}
	}
	return undone, errs
}

// SnapshotCheckout is SnapshotGitDirs, and also records every repository
// of workTree: its own .git (a directory, or a file naming its git dir)
// and those nested in it, .git entries and directories git takes for a
// git dir themselves (a bare repository: HEAD, objects/ and refs/). git
// status in the checkout runs git in every nested repository registered
// as a gitlink, and the user's git in a nested directory runs with that
// repository's config and hooks: one the attempt made, or whose .git it
// pointed elsewhere, is disarmed by Restore; the git dirs of nested
// repositories that were there are restored like the checkout's.
func SnapshotCheckout(ctx context.Context, workTree string, gitDirs []string) (*GitDirSnapshot, error) {
	return snapshotRepos(ctx, workTree, []string{workTree}, gitDirs)
}

// SnapshotClaims records the repositories under the claims (real paths
// in workTree) of a path-leased attempt, whose git dir is not writable
// but whose claims are: a repository it makes there, or the config of
// one the user had there, would run in the user's git in that directory.
// Restore disarms and restores them as SnapshotCheckout's.
func SnapshotClaims(ctx context.Context, workTree string, claims []string) (*GitDirSnapshot, error) {
	return snapshotRepos(ctx, workTree, claims, nil)
}

func snapshotRepos(ctx context.Context, workTree string, roots, gitDirs []string) (*GitDirSnapshot, error) {
	taken := time.Now().Add(-time.Second) // ctime comes from a coarser clock
	dotGits, nested, _, err := findRepos(workTree, roots, gitDirs, time.Time{})
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", workTree, err)
	}
	s, err := SnapshotGitDirs(ctx, append(slices.Clone(gitDirs), nested...))
	if err != nil {
		return nil, err
	}
	s.workTree, s.roots, s.dotGits, s.taken = workTree, roots, dotGits, taken
	if err := s.snapshotHooksPath(ctx); err != nil {
		s.Close()
		return nil, fmt.Errorf("snapshot %s: %w", workTree, err)
	}
	if err := s.snapshotOthers(ctx, gitDirs); err != nil {
		s.Close()
		return nil, fmt.Errorf("snapshot %s: %w", workTree, err)
	}
	return s, nil
}

// Dirs are the git dirs the snapshot restores: the checkout's and those
// of the repositories nested in it.
func (s *GitDirSnapshot) Dirs() []string { return slices.Clone(s.dirs) }

// snapshotOthers records the other worktrees of the repository (the main
// one when gitDirs are a linked worktree's, and every linked one but
// this): their HEAD and index, and the branch each has checked out.
func (s *GitDirSnapshot) snapshotOthers(ctx context.Context, gitDirs []string) error {
	if len(gitDirs) == 0 {
		return nil
	}
	own, common := gitDirs[0], gitDirs[len(gitDirs)-1]
	var admins []string
	if own != common {
		admins = append(admins, common)
	}
	ents, _ := os.ReadDir(filepath.Join(common, "worktrees"))
	for _, e := range ents {
		if d := filepath.Join(common, "worktrees", e.Name()); e.IsDir() && d != own {
			admins = append(admins, d)
		}
	}
	s.common, s.others, s.otherBranches = common, map[string]snapEntry{}, map[string]string{}
	for _, d := range admins {
		for _, f := range []string{"HEAD", "index"} {
			p := filepath.Join(d, f)
			fi, err := os.Lstat(p)
			if err != nil || !fi.Mode().IsRegular() {
				continue
			}
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s.others[p] = snapEntry{mode: fi.Mode(), content: b}
			if ref, ok := strings.CutPrefix(strings.TrimSpace(string(b)), "ref: "); ok && f == "HEAD" && strings.HasPrefix(ref, "refs/") {
				id, _ := s.revParse(ctx, ref)
				s.otherBranches[ref] = id
			}
		}
	}
	return nil
}

// revParse is ref's commit in the common git dir, "" when it has none.
func (s *GitDirSnapshot) revParse(ctx context.Context, ref string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, gitTimeout)
	defer cancel()
	out, err := git(ctx, s.common, []string{"GIT_DIR=" + s.common}, "rev-parse", "--verify", "-q", ref)
	return strings.TrimSpace(out), err
}

// restoreOthers puts the other worktrees' HEAD, index and checked-out
// branches back; a branch the attempt moved is kept at
// refs/fenceline/undone/<its name under refs/>.
func (s *GitDirSnapshot) restoreOthers(ctx context.Context) (undone []string, errs []error) {
	if s.common == "" {
		return nil, nil
	}
	if h, held := s.held[s.common]; held && !h.isAt(s.common) {
		return nil, nil
	}
	paths := make([]string, 0, len(s.others))
	for p := range s.others {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		was := s.others[p]
		if now, err := os.ReadFile(p); err == nil && bytes.Equal(now, was.content) {
			if fi, err := os.Lstat(p); err == nil && fi.Mode().IsRegular() {
				continue
			}
		}
		undone = append(undone, s.name(p)+" (changed)")
		if err := writeEntry(p, was); err != nil {
			errs = append(errs, err)
		}
	}
	refs := make([]string, 0, len(s.otherBranches))
	for r := range s.otherBranches {
		refs = append(refs, r)
	}
	slices.Sort(refs)
	for _, ref := range refs {
		was := s.otherBranches[ref]
		now, _ := s.revParse(ctx, ref)
		if now == was {
			continue
		}
		ctx, cancel := context.WithTimeout(ctx, gitTimeout)
		env := []string{"GIT_DIR=" + s.common}
		msg := ref + " (moved"
		if now != "" {
			keep := "refs/fenceline/undone/" + strings.TrimPrefix(ref, "refs/")
			if _, err := git(ctx, s.common, env, "update-ref", keep, now); err != nil {
				errs = append(errs, err)
			} else {
				msg += " to " + now + ", kept as " + keep
			}
		}
		var err error
		if was == "" {
			_, err = git(ctx, s.common, env, "update-ref", "-d", ref)
		} else {
			_, err = git(ctx, s.common, env, "update-ref", ref, was)
		}
		cancel()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		undone = append(undone, msg+"; put back: another worktree has it checked out)")
	}
	return undone, errs
}

// snapshotHooksPath records the hooks directory the checkout's
// core.hooksPath names when the attempt may write it (it lies in the
// roots or in a git dir, and is not a git dir's own hooks/, recorded
// anyway).
func (s *GitDirSnapshot) snapshotHooksPath(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, gitTimeout)
	defer cancel()
	// fenceline's own git sets core.hooksPath (to /dev/null) on its
	// command line: the repository's is the last value of another scope.
	out, err := git(ctx, s.workTree, nil, "config", "--show-scope", "--get-all", "core.hooksPath")
	var v string
	for _, l := range strings.Split(out, "\n") {
		if scope, val, ok := strings.Cut(l, "\t"); ok && scope != "command" {
			v = strings.TrimSpace(val)
		}
	}
	if err != nil || v == "" || strings.HasPrefix(v, "~") {
		return nil // none set (git config exits 1), or in a HOME the attempt cannot write
	}
	if !filepath.IsAbs(v) {
		v = filepath.Join(s.workTree, v) // hooks run at the work tree's top
	}
	v = filepath.Clean(v)
	if real, err := filepath.EvalSymlinks(v); err == nil {
		v = real
	}
	writable := slices.ContainsFunc(s.roots, func(r string) bool { return pathIn(v, r) }) ||
		slices.ContainsFunc(s.dirs, func(d string) bool { return pathIn(v, d) })
	if !writable || filepath.Base(v) == "hooks" && slices.ContainsFunc(s.dirs, func(d string) bool { return pathIn(v, d) }) {
		return nil
	}
	s.hookDirs = append(s.hookDirs, v)
	return walkAll(v, func(p string, d fs.DirEntry) error {
		e, err := readEntry(p, d)
		if err != nil {
			return err
		}
		s.files[p] = e
		return nil
	})
}

// walkAll calls fn for every path beneath dir (a hooks directory).
func walkAll(dir string, fn func(path string, d fs.DirEntry) error) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if p == dir {
			return nil
		}
		return fn(p, d)
	})
}

// findRepos walks roots (in workTree) for repositories, not descending
// into git dirs: entries named .git (directories, files, links), and
// directories git takes for a git dir themselves (looksLikeGitDir; the
// work tree's top, whose .git git finds first, is not one). It returns
// them, and the git dirs among them that are not gitDirs.
//
// A directory it cannot read is skipped, unless its ctime is after
// openSince (not zero): the attempt made it unreadable, and a repository
// inside it would still be found by whoever cds there by name. Such a
// directory is made searchable (u+rx) and walked; opened says so.
func findRepos(workTree string, roots, gitDirs []string, openSince time.Time) (found map[string]snapEntry, nested, opened []string, err error) {
	found = map[string]snapEntry{}
	var walk func(dir string) error
	walk = func(dir string) error {
		ents, err := os.ReadDir(dir)
		if errors.Is(err, fs.ErrPermission) && !openSince.IsZero() {
			if note := openDir(dir, openSince); note != "" {
				opened = append(opened, dir+" ("+note+")")
				ents, err = os.ReadDir(dir)
			}
		}
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, fs.ErrPermission) || errors.Is(err, unix.ENOTDIR) {
				return nil
			}
			return err
		}
		if dir != workTree && looksLikeGitDir(dir, ents) {
			found[dir] = snapEntry{mode: fs.ModeDir | 0o755}
			if !slices.Contains(gitDirs, dir) {
				nested = append(nested, dir)
			}
			return nil
		}
		for _, d := range ents {
			p := filepath.Join(dir, d.Name())
			if d.Name() == ".git" {
				e, err := readEntry(p, d)
				if err != nil {
					return err
				}
				found[p] = e
				if d.IsDir() && !slices.Contains(gitDirs, p) {
					nested = append(nested, p)
				}
				continue
			}
			if d.IsDir() && !slices.Contains(gitDirs, p) {
				if err := walk(p); err != nil {
					return err
				}
			}
		}
		return nil
	}
	for _, r := range roots {
		if fi, err := os.Lstat(r); err != nil || !fi.IsDir() {
			continue
		}
		if err := walk(r); err != nil {
			return nil, nil, nil, err
		}
	}
	return found, nested, opened, nil
}

// openDir makes dir, which cannot be read, searchable (u+rx) when its
// ctime is after since, and says what it did ("" when it did nothing).
func openDir(dir string, since time.Time) string {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR || time.Unix(st.Ctim.Unix()).Before(since) {
		return ""
	}
	mode := st.Mode & 0o7777
	if err := unix.Chmod(dir, mode|0o500); err != nil {
		return ""
	}
	return fmt.Sprintf("unreadable since the snapshot, mode %#o: made searchable, %#o, to look for repositories in it", mode, mode|0o500)
}

// looksLikeGitDir reports whether dir, holding ents, is one git takes for
// a git dir when it finds no .git in it (is_git_directory): a HEAD that is
// not a directory, and objects/ and refs/, or a commondir naming where
// they are. git follows links there: objects or refs may be a link to a
// directory anywhere.
func looksLikeGitDir(dir string, ents []fs.DirEntry) bool {
	var head, objects, refs, common bool
	isDir := func(e fs.DirEntry) bool {
		if e.Type()&fs.ModeSymlink != 0 {
			fi, err := os.Stat(filepath.Join(dir, e.Name()))
			return err == nil && fi.IsDir()
		}
		return e.IsDir()
	}
	for _, e := range ents {
		switch e.Name() {
		case "HEAD":
			head = !e.IsDir()
		case "objects":
			objects = isDir(e)
		case "refs":
			refs = isDir(e)
		case "commondir":
			common = !e.IsDir()
		case ".git":
			return false // git takes that first
		}
	}
	return head && (objects && refs || common)
}

// disarmTree disarms every repository in the directory root, its own
// .git included (a shard moved aside, kept for its files: what an
// attempt left there must not run in the git of whoever looks into it).
// It says what it did, by path.
func disarmTree(root string) (undone []string) {
	found, _, opened, err := findRepos("", []string{root}, nil, time.Unix(1, 0)) // all of it was the attempt's
	if err != nil {
		return []string{fmt.Sprintf("%s (not searched for repositories: %v)", root, err)}
	}
	undone = opened
	paths := make([]string, 0, len(found))
	for p := range found {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		gd, what := p, p
		if filepath.Base(p) == ".git" {
			to, err := aside(p)
			if err != nil {
				undone = append(undone, fmt.Sprintf("%s (not moved aside: %v)", p, err))
				continue
			}
			gd, what = to, p+" (moved to "+filepath.Base(to)
			if !found[p].mode.IsDir() {
				undone = append(undone, what+")")
				continue
			}
			what += ", "
		} else {
			what += " ("
		}
		head, err := disarm(gd)
		if err != nil {
			undone = append(undone, fmt.Sprintf("%s (HEAD not moved aside: %v)", p, err))
			continue
		}
		undone = append(undone, what+"its HEAD moved to "+head+": git takes it for no repository)")
	}
	return undone
}

// disarm makes the git dir dir no repository git would find: its HEAD is
// moved aside (git takes no directory without one for a git dir), its
// contents kept. It returns HEAD's new name.
func disarm(dir string) (string, error) {
	head := filepath.Join(dir, "HEAD")
	if _, err := os.Lstat(head); err != nil {
		return "", nil
	}
	to, err := aside(head)
	return filepath.Base(to), err
}

// hold records which directory dir is and keeps a descriptor on it.
func (s *GitDirSnapshot) hold(dir string) error {
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return fmt.Errorf("snapshot git dir %s: %w", dir, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("snapshot git dir %s: not a directory", dir)
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("snapshot git dir %s: %w", dir, err)
	}
	s.held[dir] = heldDir{dev: uint64(st.Dev), ino: st.Ino, fd: fd}
	return nil
}

// Close releases the descriptors the snapshot holds.
func (s *GitDirSnapshot) Close() {
	for d, h := range s.held {
		unix.Close(h.fd)
		delete(s.held, d)
	}
}

func (s *GitDirSnapshot) snapshotDirs(gitDirs []string) error {
	for _, dir := range gitDirs {
		err := walkExecutable(dir, func(p string, d fs.DirEntry) error {
			e, err := readEntry(p, d)
			if err != nil {
				return err
			}
			s.files[p] = e
			return nil
		})
		if err != nil {
			return fmt.Errorf("snapshot git dir %s: %w", dir, err)
		}
	}
	return nil
}

// isHeld reports whether the directory at dir is the one held.
func (h heldDir) isAt(dir string) bool {
	var st unix.Stat_t
	return unix.Lstat(dir, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR && uint64(st.Dev) == h.dev && st.Ino == h.ino
}

// pathIn reports whether p is dir or lies under it.
func pathIn(p, dir string) bool {
	r, err := filepath.Rel(dir, p)
	return err == nil && r != ".." && !strings.HasPrefix(r, "../")
}

// aside renames whatever is at p out of git's way, next to it.
func aside(p string) (string, error) {
	to := p + ".fenceline-undone-" + strconv.FormatInt(time.Now().UnixNano(), 36)
	return to, os.Rename(p, to)
}

// putBack makes every git dir the directory it was: what the attempt put
// in its place (a symlink, a .git file, another directory) is moved
// aside, and the git dir itself, found through the held descriptor, is
// renamed back from wherever the attempt moved it.
func (s *GitDirSnapshot) putBack() (undone []string, errs []error) {
	for _, dir := range s.dirs {
		h, ok := s.held[dir]
		if !ok || h.isAt(dir) {
			continue
		}
		what := s.name(dir)
		now, rerr := os.Readlink("/proc/self/fd/" + strconv.Itoa(h.fd))
		found := rerr == nil && h.isAt(now)
		fi, lerr := os.Lstat(dir)
		if !found {
			if e, nested := s.dotGits[dir]; nested && e.mode.IsDir() && dir != filepath.Join(s.workTree, ".git") {
				continue // a nested repository the attempt removed: its work (a stand-in is moved aside)
			}
			if lerr == nil && fi.IsDir() {
				// The original is gone and another directory (a copy, say)
				// stands in for it: restored in place like the original,
				// nothing is written through a link.
				unix.Close(h.fd)
				delete(s.held, dir)
				if err := s.hold(dir); err != nil {
					errs = append(errs, err)
					continue
				}
				undone = append(undone, what+" (replaced by another directory, the original removed: restored in it)")
				continue
			}
			if lerr == nil {
				if to, err := aside(dir); err != nil {
					errs = append(errs, fmt.Errorf("move aside what the attempt put at %s: %w", dir, err))
				} else {
					undone = append(undone, what+" (replaced; the attempt's moved to "+s.name(to)+")")
				}
			}
			errs = append(errs, fmt.Errorf("the git dir %s was removed by the attempt", dir))
			continue
		}
		if lerr == nil {
			to, err := aside(dir)
			if err != nil {
				errs = append(errs, fmt.Errorf("move aside what the attempt put at %s: %w", dir, err))
				continue
			}
			undone = append(undone, what+" (replaced; the attempt's moved to "+s.name(to)+")")
		}
		if err := os.Rename(now, dir); err != nil {
			errs = append(errs, fmt.Errorf("put the git dir %s back from %s: %w", dir, now, err))
			continue
		}
		undone = append(undone, what+" (moved to "+s.name(now)+"; put back)")
	}
	return undone, errs
}

// name is p as reported: relative to the work tree or a git dir.
func (s *GitDirSnapshot) name(p string) string {
	if s.workTree != "" && pathIn(p, s.workTree) {
		r, _ := filepath.Rel(s.workTree, p)
		return r
	}
	return rel(s.dirs, p)
}

// restoreDotGits undoes the repositories of the work tree the attempt
// added or changed: a .git there now is moved aside (a nested
// repository's git dir stops being one), a .git file or link that was
// there is written back, and a git dir the attempt made (the .git moved
// aside, or a bare repository) is disarmed: git finds no repository in
// it, and the user's git in that directory runs none of its config.
func (s *GitDirSnapshot) restoreDotGits() (undone []string, errs []error) {
	if s.workTree == "" {
		return nil, nil
	}
	now, _, opened, err := findRepos(s.workTree, s.roots, s.dirs, s.taken)
	if err != nil {
		return nil, []error{err}
	}
	for _, o := range opened {
		undone = append(undone, s.name(o))
	}
	paths := make([]string, 0, len(now))
	for p := range now {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	for _, p := range paths {
		e := now[p]
		was, ok := s.dotGits[p]
		switch {
		case ok && was.mode.IsDir() && e.mode.IsDir():
			if h, held := s.held[p]; !held || h.isAt(p) {
				continue // the same directory: its contents are restored as a git dir
			}
		case ok && e.mode == was.mode && bytes.Equal(e.content, was.content):
			continue
		}
		if filepath.Base(p) != ".git" { // a bare repository
			head, err := disarm(p)
			if err != nil {
				errs = append(errs, fmt.Errorf("disarm the repository %s: %w", p, err))
				continue
			}
			undone = append(undone, s.name(p)+" (a repository the attempt made: its HEAD moved to "+head+", git no longer takes it for one)")
			continue
		}
		to, err := aside(p)
		if err != nil {
			errs = append(errs, fmt.Errorf("move aside %s: %w", p, err))
			continue
		}
		what := s.name(to)
		if e.mode.IsDir() {
			head, err := disarm(to)
			if err != nil {
				errs = append(errs, fmt.Errorf("disarm the repository %s: %w", to, err))
			} else if head != "" {
				what += ", its HEAD moved to " + head
			}
		}
		if !ok {
			undone = append(undone, s.name(p)+" (added; moved to "+what+")")
			continue
		}
		undone = append(undone, s.name(p)+" (changed; the attempt's moved to "+what+")")
		if !was.mode.IsDir() {
			if err := writeEntry(p, was); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for p, was := range s.dotGits {
		if _, ok := now[p]; ok || was.mode.IsDir() {
			continue
		}
		undone = append(undone, s.name(p)+" (removed)")
		if err := writeEntry(p, was); err != nil {
			errs = append(errs, err)
		}
	}
	return undone, errs
}

func readEntry(p string, d fs.DirEntry) (snapEntry, error) {
	switch {
	case d.IsDir():
		return snapEntry{mode: fs.ModeDir | 0o755}, nil
	case d.Type()&fs.ModeSymlink != 0:
		t, err := os.Readlink(p)
		return snapEntry{mode: fs.ModeSymlink, content: []byte(t)}, err
	case d.Type().IsRegular():
		fi, err := d.Info()
		if err != nil {
			return snapEntry{}, err
		}
		b, err := os.ReadFile(p)
		return snapEntry{mode: fi.Mode(), content: b}, err
	default:
		return snapEntry{mode: d.Type()}, nil
	}
}

// Restore puts the executable configuration back as it was when the
// snapshot was taken: what was added (a hook, a config.worktree, a
// symlink) is removed, what was changed is rewritten (by renaming a new
// file over it, never through a link), what was removed is written back.
// It returns what it undid, relative to the git dirs.
func (s *GitDirSnapshot) Restore(ctx context.Context) (undone []string, err error) {
	undone, errs := s.putBack()
	u, e := s.restoreDotGits()
	undone, errs = append(undone, u...), append(errs, e...)
	u, e = s.restoreReplaceRefs(ctx)
	undone, errs = append(undone, u...), append(errs, e...)
	u, e = s.restoreOthers(ctx)
	undone, errs = append(undone, u...), append(errs, e...)
	seen := map[string]bool{}
	var gone []string // git dirs not in their place: nothing is written there
	for _, dir := range append(slices.Clone(s.dirs), s.hookDirs...) {
		if h, ok := s.held[dir]; ok && !h.isAt(dir) {
			gone = append(gone, dir)
			continue
		}
		walk := walkExecutable
		if slices.Contains(s.hookDirs, dir) {
			walk = walkAll
			if fi, err := os.Lstat(dir); err == nil && !fi.IsDir() {
				// A link or file in its place: moved aside, the hooks written back.
				to, err := aside(dir)
				if err != nil {
					errs = append(errs, err)
					gone = append(gone, dir)
					continue
				}
				undone = append(undone, s.name(dir)+" (replaced; moved to "+s.name(to)+")")
			}
			if err := os.MkdirAll(dir, 0o755); err != nil {
				errs = append(errs, err)
				gone = append(gone, dir)
				continue
			}
		}
		var extra []string
		werr := walk(dir, func(p string, d fs.DirEntry) error {
			seen[p] = true
			was, ok := s.files[p]
			if !ok {
				extra = append(extra, p)
				if d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			now, err := readEntry(p, d)
			if err != nil {
				return err
			}
			if now.mode == was.mode && bytes.Equal(now.content, was.content) {
				return nil
			}
			if was.mode.IsDir() || now.mode.IsDir() {
				extra = append(extra, p) // replaced: removed, then written back below
				seen[p] = false
				if d.IsDir() {
					return filepath.SkipDir
				}
				return nil
			}
			undone = append(undone, s.name(p)+" (changed)")
			return writeEntry(p, was)
		})
		if werr != nil {
			errs = append(errs, werr)
		}
		for _, p := range extra {
			if _, ok := s.files[p]; !ok {
				undone = append(undone, s.name(p)+" (added)")
			}
			if err := os.RemoveAll(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	var missing []string
	for p := range s.files {
		if !seen[p] && !slices.ContainsFunc(gone, func(d string) bool { return pathIn(p, d) }) {
			missing = append(missing, p)
		}
	}
	slices.Sort(missing) // directories before what is in them
	for _, p := range missing {
		undone = append(undone, s.name(p)+" (removed)")
		if err := writeEntry(p, s.files[p]); err != nil {
			errs = append(errs, err)
		}
	}
	slices.Sort(undone)
	return undone, errors.Join(errs...)
}

func rel(dirs []string, p string) string {
	for _, d := range dirs {
		if r, err := filepath.Rel(d, p); err == nil && r != "" && r[0] != '.' {
			return filepath.Join(filepath.Base(d), r)
		}
	}
	return p
}

func writeEntry(p string, e snapEntry) error {
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	switch {
	case e.mode.IsDir():
		return os.MkdirAll(p, e.mode.Perm())
	case e.mode&fs.ModeSymlink != 0:
		tmp := p + ".fenceline-tmp"
		os.Remove(tmp)
		if err := os.Symlink(string(e.content), tmp); err != nil {
			return err
		}
		return os.Rename(tmp, p)
	case e.mode.IsRegular():
		tmp := p + ".fenceline-tmp"
		os.Remove(tmp)
		if err := os.WriteFile(tmp, e.content, e.mode.Perm()); err != nil {
			return err
		}
		if err := os.Chmod(tmp, e.mode.Perm()); err != nil {
			return err
		}
		return os.Rename(tmp, p)
	}
	return nil
}
