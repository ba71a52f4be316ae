package shard

import (
	"bufio"
	"bytes"
	"compress/zlib"
	"context"
	"crypto/sha1"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ObjectSnapshot is what the object stores of a checkout's git dirs held
// before an exclusive attempt without a pool (its git dir writable) ran:
// the identity of every file under objects/ (device, inode, size, mtime,
// ctime: an unprivileged writer cannot set ctime back, so a file whose
// identity is unchanged was not written), a copy of each loose object
// (within a budget) and of the small files that point git at other
// stores. Restore then checks only what the attempt wrote.
//
// git trusts an object store's names: it does not hash a loose object or
// a packed one when it reads it, and it believes a commit-graph or a
// multi-pack-index over the objects. An attempt that rewrites a loose
// object in place makes the user's git checkout and git worktree add
// write its bytes under the object's id (git diff shows nothing); one
// that writes a commit-graph makes git show, log -p and diff show a
// commit with another tree or other parents.
type ObjectSnapshot struct {
	keep   string
	copies *os.File // the loose objects' copies, one after another
	stores []*objectStore
	lfs    []*lfsStore // each git dir's LFS objects
}

// objectStore is one git dir's objects/ as it was.
type objectStore struct {
	gitDir, dir string
	top         string // what paths are named relative to
	self        fileID
	files       map[string]fileID   // by path relative to dir
	copies      map[string][2]int64 // loose object -> offset and length of its copy
	small       map[string][]byte   // info/alternates, info/http-alternates, info/packs
}

// fileID is what tells a file was written: any write, chmod, rename or
// link changes its ctime, which the writer cannot set.
type fileID struct {
	dev, ino     uint64
	size         int64
	mtime, ctime unix.Timespec
}

func statID(p string) (fileID, error) {
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return fileID{}, err
	}
	return fileID{dev: uint64(st.Dev), ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}, nil
}

// LooseCopyBudget bounds the bytes of loose objects an ObjectSnapshot
// copies (git packs loose objects past gc.auto, 6700 by default, so a
// repository seldom has many). A rewritten loose object without a copy
// is removed, not put back.
const LooseCopyBudget = 256 << 20

var (
	looseName = regexp.MustCompile(`^[0-9a-f]{2}/([0-9a-f]{38}|[0-9a-f]{62})$`)
	packName  = regexp.MustCompile(`^pack/(pack-[0-9a-f]+)\.([a-z]+)$`)
)

// smallFiles point git at other object stores or list packs: put back as
// they were.
var smallFiles = []string{"info/alternates", "info/http-alternates", "info/packs"}

// SnapshotObjects records the object stores of gitDirs (those that have
// one) and of their submodules' git dirs (modules/), copying loose
// objects into keep, a directory the attempt can neither read nor write.
// What Restore undoes is named relative to top, the work tree.
func SnapshotObjects(top string, gitDirs []string, keep string) (o *ObjectSnapshot, err error) {
	o = &ObjectSnapshot{keep: keep}
	if err := os.MkdirAll(keep, 0o700); err != nil {
		return nil, err
	}
	if o.copies, err = os.OpenFile(filepath.Join(keep, "loose"), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			o.Close()
		}
	}()
	w := bufio.NewWriterSize(o.copies, 1<<20)
	var off int64
	budget := int64(LooseCopyBudget)
	for _, gd := range withModules(gitDirs) {
		ls, err := snapshotLFS(gd, top)
		if err != nil {
			return nil, err
		}
		o.lfs = append(o.lfs, ls)
		dir := filepath.Join(gd, "objects")
		fi, err := os.Lstat(dir)
		if err != nil || !fi.IsDir() {
			continue
		}
		st := &objectStore{gitDir: gd, dir: dir, top: top, files: map[string]fileID{}, copies: map[string][2]int64{}, small: map[string][]byte{}}
		if st.self, err = statID(dir); err != nil {
			return nil, err
		}
		err = filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err != nil || !d.Type().IsRegular() {
				return err
			}
			rel, _ := filepath.Rel(dir, p)
			id, err := statID(p)
			if err != nil {
				return err
			}
			st.files[rel] = id
			switch {
			case slices.Contains(smallFiles, rel):
				b, err := os.ReadFile(p)
				if err != nil {
					return err
				}
				st.small[rel] = b
			case looseName.MatchString(rel) && id.size <= budget:
				b, err := os.ReadFile(p)
				if err != nil {
					return err
				}
				if _, err := w.Write(b); err != nil {
					return err
				}
				st.copies[rel] = [2]int64{off, int64(len(b))}
				off += int64(len(b))
				budget -= int64(len(b))
			}
			return nil
		})
		if err != nil {
			return nil, fmt.Errorf("snapshot the objects of %s: %w", gd, err)
		}
		o.stores = append(o.stores, st)
	}
	if err := w.Flush(); err != nil {
		return nil, err
	}
	return o, nil
}

// withModules is gitDirs and the git dirs of their submodules, found
// under each one's modules/ (nested submodules under theirs).
func withModules(gitDirs []string) []string {
	var out []string
	var add func(gd string)
	add = func(gd string) {
		if slices.Contains(out, gd) {
			return
		}
		out = append(out, gd)
		filepath.WalkDir(filepath.Join(gd, "modules"), func(p string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			if ents, err := os.ReadDir(p); err == nil && looksLikeGitDir(p, ents) {
				add(p)
				return filepath.SkipDir
			}
			return nil
		})
	}
	for _, gd := range gitDirs {
		add(gd)
	}
	return out
}

// Close removes the copies the snapshot kept.
func (o *ObjectSnapshot) Close() {
	if o.copies != nil {
		o.copies.Close()
		o.copies = nil
	}
	if o.keep != "" {
		os.RemoveAll(o.keep)
	}
}

// Restore checks what the attempt wrote to each object store, once every
// process of it is gone, and says what it undid:
//   - a loose object (new, or written since the snapshot) must hash to its
//     name; one that does not is put back from its copy, else removed;
//   - a pack or pack index written is verified (git index-pack --verify:
//     every object hashed, the index made anew and compared); one that
//     fails is moved aside with its companion files, but an index that
//     fails beside the repository's own pack (unchanged) is written anew
//     from that pack;
//   - derived files written (commit-graph, commit-graphs/,
//     multi-pack-index and its bitmap and reverse index, pack bitmaps,
//     reverse indexes, mtimes, promisor marks) are removed; git needs none
//     of them, and a commit-graph or multi-pack-index the user had is
//     written anew from the checked objects;
//   - info/alternates, http-alternates and packs are put back as they
//     were, and anything under objects/ that is neither a directory nor a
//     regular file (a link elsewhere) is removed;
//   - an LFS object (lfs/objects) added or written must hash to its name,
//     else it is removed (git lfs fetch brings it back).
//
// Objects the attempt added that hash to their names (its commits) stay.
func (o *ObjectSnapshot) Restore(ctx context.Context) (undone []string, err error) {
	var errs []error
	for _, st := range o.stores {
		u, e := st.restore(ctx, o.copies)
		undone, errs = append(undone, u...), append(errs, e...)
	}
	for _, ls := range o.lfs {
		u, e := ls.restore()
		undone, errs = append(undone, u...), append(errs, e...)
	}
	return undone, errors.Join(errs...)
}

func (st *objectStore) restore(ctx context.Context, copies io.ReaderAt) (undone []string, errs []error) {
	if fi, err := os.Lstat(st.dir); err != nil || !fi.IsDir() {
		if err == nil {
			if to, aerr := aside(st.dir); aerr == nil {
				undone = append(undone, st.name(".")+" (not a directory: moved to "+to+")")
			}
		}
		return undone, []error{fmt.Errorf("the object store %s was replaced: check the repository with git fsck", st.dir)}
	}
	if id, err := statID(st.dir); err == nil && (id.dev != st.self.dev || id.ino != st.self.ino) {
		undone = append(undone, st.name(".")+" (replaced by another directory: every file in it checked)")
	}
	var packs []string   // pack bases to verify
	var removed []string // derived files removed
	err := filepath.WalkDir(st.dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(st.dir, p)
		what, err := st.checkFile(p, rel, d, copies)
		if what != "" {
			undone = append(undone, st.name(rel)+" ("+what+")")
			if derived(rel) {
				removed = append(removed, rel)
			}
		}
		if m := packName.FindStringSubmatch(rel); what == "" && m != nil && (m[2] == "pack" || m[2] == "idx") && !slices.Contains(packs, m[1]) {
			if was, ok := st.files[rel]; !ok || !sameFile(p, was) {
				packs = append(packs, m[1])
			}
		}
		return err
	})
	if err != nil {
		errs = append(errs, fmt.Errorf("check the objects of %s: %w", st.gitDir, err))
	}
	for _, base := range packs {
		u, err := st.verifyPack(ctx, base)
		if u != "" {
			undone = append(undone, st.name(filepath.Join("pack", base))+" ("+u+")")
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	u, e := st.regenerate(ctx, removed)
	return append(undone, u...), append(errs, e...)
}

// name is rel (under objects/) as reported: from the work tree.
func (st *objectStore) name(rel string) string {
	p := filepath.Join(st.dir, rel)
	if r, err := filepath.Rel(st.top, p); err == nil && !strings.HasPrefix(r, "..") {
		return r
	}
	return p
}

func sameFile(p string, was fileID) bool {
	id, err := statID(p)
	return err == nil && id == was
}

// checkFile undoes what the attempt did to the file p (rel under
// objects/) and says what, "" when it did nothing or nothing needs
// undoing. Packs and their indexes are verified later (verifyPack).
func (st *objectStore) checkFile(p, rel string, d fs.DirEntry, copies io.ReaderAt) (string, error) {
	if !d.Type().IsRegular() {
		return d.Type().String() + " made by the attempt: removed", os.Remove(p)
	}
	was, existed := st.files[rel]
	if existed && sameFile(p, was) {
		return "", nil
	}
	how := "added"
	if existed {
		how = "written"
	}
	switch {
	case looseName.MatchString(rel):
		if looseObjectOK(p, strings.Replace(rel, "/", "", 1)) {
			return "", nil
		}
		how += " by the attempt, its content does not hash to its name: "
		if c, ok := st.copies[rel]; ok {
			b := make([]byte, c[1])
			if _, err := copies.ReadAt(b, c[0]); err != nil {
				return "", err
			}
			return how + "put back", writeEntry(p, snapEntry{mode: 0o444, content: b})
		}
		if existed {
			return how + "removed; no copy was kept: git fetch it again", os.Remove(p)
		}
		return how + "removed", os.Remove(p)
	case slices.Contains(smallFiles, rel):
		if b, ok := st.small[rel]; ok {
			return "written by the attempt: put back", writeEntry(p, snapEntry{mode: 0o644, content: b})
		}
		return "added by the attempt: removed", os.Remove(p)
	case derived(rel):
		return how + " by the attempt: removed", os.Remove(p)
	}
	return "", nil
}

// regenerate writes anew, from the checked objects, the commit-graph and
// multi-pack-index the repository had when removed lists the attempt's.
func (st *objectStore) regenerate(ctx context.Context, removed []string) (undone []string, errs []error) {
	for _, r := range []struct {
		prefix string
		args   []string
	}{
		{"info/commit-graph", []string{"commit-graph", "write", "--reachable", "--no-progress"}},
		{"pack/multi-pack-index", []string{"multi-pack-index", "write", "--no-progress"}},
	} {
		if !st.had(r.prefix) || !slices.ContainsFunc(removed, func(rel string) bool { return strings.HasPrefix(rel, r.prefix) }) {
			continue
		}
		if _, err := git(ctx, st.gitDir, []string{"GIT_DIR=" + st.gitDir}, r.args...); err != nil {
			errs = append(errs, err)
			continue
		}
		undone = append(undone, st.name(r.prefix)+" (the repository's: written anew)")
		st.record(r.prefix)
	}
	return undone, errs
}

// record takes the files under objects/ whose paths start with prefix,
// as fenceline wrote them, for the store's own.
func (st *objectStore) record(prefix string) {
	for rel := range st.files {
		if strings.HasPrefix(rel, prefix) {
			delete(st.files, rel)
		}
	}
	filepath.WalkDir(st.dir, func(p string, d fs.DirEntry, err error) error {
		rel, _ := filepath.Rel(st.dir, p)
		if err == nil && d.Type().IsRegular() && strings.HasPrefix(rel, prefix) {
			if id, err := statID(p); err == nil {
				st.files[rel] = id
			}
		}
		return nil
	})
}

// had reports whether the store held a file whose path starts with
// prefix before the attempt.
func (st *objectStore) had(prefix string) bool {
	for rel := range st.files {
		if strings.HasPrefix(rel, prefix) {
			return true
		}
	}
	return false
}

// derived reports whether rel (under objects/) is a file git derives from
// the objects and believes over them.
func derived(rel string) bool {
	if strings.HasPrefix(rel, "info/commit-graph") || strings.HasPrefix(rel, "pack/multi-pack-index") {
		return true
	}
	if m := packName.FindStringSubmatch(rel); m != nil {
		switch m[2] {
		case "bitmap", "rev", "mtimes", "promisor":
			return true
		}
	}
	return false
}

// verifyPack checks the pack pack/base.pack against its index with git
// index-pack --verify (every object hashed, the index written anew and
// compared byte for byte). A pack that fails, or an index without its
// pack, is moved aside with its companion files.
func (st *objectStore) verifyPack(ctx context.Context, base string) (undone string, err error) {
	pack := filepath.Join(st.dir, "pack", base)
	_, perr := os.Lstat(pack + ".pack")
	_, ierr := os.Lstat(pack + ".idx")
	if perr == nil && ierr == nil {
		if _, verr := git(ctx, st.gitDir, []string{"GIT_DIR=" + st.gitDir}, "index-pack", "--verify", pack+".pack"); verr == nil {
			return "", nil
		} else if ctx.Err() != nil {
			return "", verr
		}
	} else if perr == nil {
		return "", nil // a pack without its index: git does not read it
	}
	if was, ok := st.files[filepath.Join("pack", base+".pack")]; ok && sameFile(pack+".pack", was) {
		return st.reindex(ctx, base)
	}
	var moved []string
	ents, _ := os.ReadDir(filepath.Dir(pack))
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), base+".") && !strings.Contains(e.Name(), ".fenceline-undone-") {
			to, aerr := aside(filepath.Join(filepath.Dir(pack), e.Name()))
			if aerr != nil {
				err = errors.Join(err, aerr)
				continue
			}
			moved = append(moved, filepath.Base(to))
		}
	}
	msg := "written by the attempt, does not verify: moved aside to " + strings.Join(moved, ", ")
	if _, ok := st.files[filepath.Join("pack", base+".pack")]; ok {
		msg += "; it was the repository's: run git fsck, and fetch what it lacks"
	}
	return msg, err
}

// reindex writes anew, from the repository's own pack pack/base.pack
// (unchanged since the snapshot), the index the attempt wrote or forged:
// the attempt's index and the files derived from it are moved aside.
func (st *objectStore) reindex(ctx context.Context, base string) (undone string, err error) {
	dir := filepath.Join(st.dir, "pack")
	var moved []string
	ents, _ := os.ReadDir(dir)
	for _, e := range ents {
		n := e.Name()
		if n == base+".pack" || !strings.HasPrefix(n, base+".") || strings.Contains(n, ".fenceline-undone-") {
			continue
		}
		to, err := aside(filepath.Join(dir, n))
		if err != nil {
			return "", err
		}
		moved = append(moved, filepath.Base(to))
	}
	if _, err := git(ctx, st.gitDir, []string{"GIT_DIR=" + st.gitDir}, "index-pack", filepath.Join(dir, base+".pack")); err != nil {
		return "", fmt.Errorf("write the index of %s anew: %w", filepath.Join(dir, base+".pack"), err)
	}
	st.record(filepath.Join("pack", base+"."))
	return "its index written by the attempt does not match the repository's pack: moved aside to " +
		strings.Join(moved, ", ") + ", the index written anew from the pack", nil
}

// looseObjectOK reports whether the loose object at p is what its name
// id says: a zlib stream of "<type> <size>\x00<content>" whose hash
// (SHA-1 or SHA-256, by the name's length) is id.
func looseObjectOK(p, id string) bool {
	f, err := os.OpenFile(p, os.O_RDONLY|unix.O_NOFOLLOW, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	zr, err := zlib.NewReader(bufio.NewReader(f))
	if err != nil {
		return false
	}
	var h hash.Hash = sha1.New()
	if len(id) == 64 {
		h = sha256.New()
	}
	br := bufio.NewReader(zr)
	var hdr []byte
	for len(hdr) < 32 {
		c, err := br.ReadByte()
		if err != nil {
			return false
		}
		hdr = append(hdr, c)
		if c == 0 {
			break
		}
	}
	typ, size, ok := bytes.Cut(bytes.TrimSuffix(hdr, []byte{0}), []byte{' '})
	if !ok || hdr[len(hdr)-1] != 0 {
		return false
	}
	switch string(typ) {
	case "blob", "tree", "commit", "tag":
	default:
		return false
	}
	n, err := strconv.ParseInt(string(size), 10, 64)
	if err != nil || n < 0 {
		return false
	}
	h.Write(hdr)
	got, err := io.Copy(h, br) // to the end: zlib checks its own checksum there
	if err != nil || got != n {
		return false
	}
	return hex.EncodeToString(h.Sum(nil)) == id
}
