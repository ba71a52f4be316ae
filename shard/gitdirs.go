package shard

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
)

// GitDirSnapshot is what of a checkout's git dirs can make git run a
// program, as it was before an exclusive attempt without a pool worked in
// the checkout (its git dir writable): every config, config.worktree,
// commondir and gitdir file, everything under a hooks directory, and
// info/attributes — in the git dir itself and in the git dirs of its
// submodules and worktrees (modules/, worktrees/). Objects, refs and
// reflogs are the attempt's work and are not part of it.
type GitDirSnapshot struct {
	dirs  []string
	files map[string]snapEntry // by absolute path
}

type snapEntry struct {
	mode    fs.FileMode
	content []byte // a file's bytes, or a symlink's target
}

// executable reports whether rel (a path in a git dir) is one of the
// places git takes programs from.
func executable(rel string) bool {
	base := filepath.Base(rel)
	switch base {
	case "config", "config.worktree", "commondir", "gitdir":
		return true
	}
	if base == "attributes" && filepath.Base(filepath.Dir(rel)) == "info" {
		return true
	}
	for d := filepath.Dir(rel); d != "." && d != "/"; d = filepath.Dir(d) {
		if filepath.Base(d) == "hooks" {
			return true
		}
	}
	return base == "hooks"
}

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
			if filepath.Base(rel) != "hooks" {
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
func SnapshotGitDirs(gitDirs []string) (*GitDirSnapshot, error) {
	s := &GitDirSnapshot{dirs: slices.Clone(gitDirs), files: map[string]snapEntry{}}
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
			return nil, fmt.Errorf("snapshot git dir %s: %w", dir, err)
		}
	}
	return s, nil
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
func (s *GitDirSnapshot) Restore() (undone []string, err error) {
	var errs []error
	seen := map[string]bool{}
	for _, dir := range s.dirs {
		var extra []string
		werr := walkExecutable(dir, func(p string, d fs.DirEntry) error {
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
			undone = append(undone, rel(s.dirs, p)+" (changed)")
			return writeEntry(p, was)
		})
		if werr != nil {
			errs = append(errs, werr)
		}
		for _, p := range extra {
			if _, ok := s.files[p]; !ok {
				undone = append(undone, rel(s.dirs, p)+" (added)")
			}
			if err := os.RemoveAll(p); err != nil {
				errs = append(errs, err)
			}
		}
	}
	var missing []string
	for p := range s.files {
		if !seen[p] {
			missing = append(missing, p)
		}
	}
	slices.Sort(missing) // directories before what is in them
	for _, p := range missing {
		undone = append(undone, rel(s.dirs, p)+" (removed)")
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
