package shard

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"

	"golang.org/x/sys/unix"
)

// Git LFS keeps file contents in the git dir's lfs/objects, each named by
// the SHA-256 of its bytes, and its smudge filter writes them into the
// work tree at the user's git checkout and git worktree add without
// hashing them (it checks only the size). An attempt that rewrites one
// in place makes the user's checkout write its bytes. lfsStore records
// the store's files before the attempt; restore checks what it wrote.

// lfsName is an LFS object's path under lfs/objects: oid[0:2]/oid[2:4]/oid.
var lfsName = regexp.MustCompile(`^([0-9a-f]{2})/([0-9a-f]{2})/([0-9a-f]{64})$`)

// lfsStore is one git dir's lfs/objects as it was.
type lfsStore struct {
	dir, top string
	files    map[string]fileID // by path relative to dir
}

// snapshotLFS records gitDir's lfs/objects (nil when it has none: one the
// attempt makes is checked whole).
func snapshotLFS(gitDir, top string) (*lfsStore, error) {
	ls := &lfsStore{dir: filepath.Join(gitDir, "lfs", "objects"), top: top, files: map[string]fileID{}}
	err := filepath.WalkDir(ls.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == ls.dir && os.IsNotExist(err) {
				return fs.SkipAll
			}
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(ls.dir, p)
		id, err := statID(p)
		if err != nil {
			return err
		}
		ls.files[rel] = id
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("snapshot the LFS objects of %s: %w", gitDir, err)
	}
	return ls, nil
}

// restore removes every file the attempt added to the store or wrote
// since the snapshot that is not an LFS object whose bytes hash to its
// name (anything else in the store too: a link out, a misnamed file),
// and says what it removed. git lfs fetch brings a removed object back.
func (ls *lfsStore) restore() (undone []string, errs []error) {
	err := filepath.WalkDir(ls.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			if p == ls.dir && os.IsNotExist(err) {
				return fs.SkipAll
			}
			return err
		}
		if d.IsDir() {
			return nil
		}
		rel, _ := filepath.Rel(ls.dir, p)
		was, existed := ls.files[rel]
		if existed && sameFile(p, was) {
			return nil
		}
		m := lfsName.FindStringSubmatch(filepath.ToSlash(rel))
		if d.Type().IsRegular() && m != nil && m[1] == m[3][:2] && m[2] == m[3][2:4] && lfsObjectOK(p, m[3]) {
			return nil
		}
		how := "added"
		if existed {
			how = "written"
		}
		what := how + " by the attempt, its content does not hash to its name: removed"
		if !d.Type().IsRegular() {
			what = d.Type().String() + " made by the attempt: removed"
		}
		if existed {
			what += "; git lfs fetch brings it back"
		}
		if err := os.Remove(p); err != nil {
			errs = append(errs, err)
			return nil
		}
		undone = append(undone, ls.name(rel)+" ("+what+")")
		return nil
	})
	if err != nil {
		errs = append(errs, fmt.Errorf("check the LFS objects in %s: %w", ls.dir, err))
	}
	return undone, errs
}

// name is rel (under lfs/objects) as reported: from the work tree.
func (ls *lfsStore) name(rel string) string {
	p := filepath.Join(ls.dir, rel)
	if r, err := filepath.Rel(ls.top, p); err == nil && !filepath.IsAbs(r) && r != ".." && (len(r) < 3 || r[:3] != "../") {
		return r
	}
	return p
}

// lfsObjectOK reports whether the file at p hashes (SHA-256) to oid.
func lfsObjectOK(p, oid string) bool {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return false
	}
	return hex.EncodeToString(h.Sum(nil)) == oid
}
