package gitproxy

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/go-git/go-billy/v5/osfs"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/cache"
	"github.com/go-git/go-git/v5/plumbing/format/idxfile"
	"github.com/go-git/go-git/v5/plumbing/storer"
	"github.com/go-git/go-git/v5/storage/filesystem"
)

// objectCacheSize bounds the decoded objects go-git keeps per store while
// a push is analysed; with git index-pack doing the indexing, this is what
// keeps the proxy's memory flat whatever the size of the push.
const objectCacheSize = 4 * cache.MiByte

// quarantine holds one push's pack while it is judged: the pack as the
// client sent it (spool, forwarded unchanged when the push is accepted) and
// a scratch object store with the pack indexed by git index-pack --fix-thin,
// whose objects/info/alternates names the base stores, so thin-pack deltas
// resolve against objects the upstream already has.
type quarantine struct {
	dir      string   // scratch bare-repository layout
	spool    *os.File // the pack as received
	packSize int64
	index    *idxfile.MemoryIndex // of the indexed pack; nil when the push has no pack
}

// newQuarantine makes the scratch layout under parent with bases as
// alternates (each an objects directory).
func newQuarantine(parent string, bases []string) (*quarantine, error) {
	dir, err := os.MkdirTemp(parent, "push-")
	if err != nil {
		return nil, fmt.Errorf("make push quarantine: %w", err)
	}
	q := &quarantine{dir: dir}
	for _, d := range []string{"objects/pack", "objects/info", "refs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			q.remove()
			return nil, fmt.Errorf("make push quarantine: %w", err)
		}
	}
	files := map[string]string{
		"HEAD":                    "ref: refs/heads/main\n",
		"objects/info/alternates": strings.Join(bases, "\n") + "\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o600); err != nil {
			q.remove()
			return nil, fmt.Errorf("make push quarantine: %w", err)
		}
	}
	q.spool, err = os.Create(filepath.Join(dir, "incoming.pack"))
	if err != nil {
		q.remove()
		return nil, fmt.Errorf("make push quarantine: %w", err)
	}
	return q, nil
}

func (q *quarantine) remove() {
	if q.spool != nil {
		q.spool.Close()
	}
	os.RemoveAll(q.dir)
}

// errPackTooLarge is returned when a push exceeds the configured limit.
var errPackTooLarge = errors.New("push is larger than the proxy accepts")

// receive spools the pack from r and indexes it at the same time: the
// bytes go to the spool file and into git index-pack as they arrive, so
// indexing overlaps the upload. It returns the indexing error separately
// (the pack may still be complete, e.g. a thin pack whose bases must first
// be fetched); a spooling error means the pack never arrived whole.
func (q *quarantine) receive(ctx context.Context, g gitRunner, r io.Reader, limit int64) (indexErr, err error) {
	cmd := g.command(ctx, q.dir, "index-pack", "--stdin", "--fix-thin")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return nil, fmt.Errorf("start git index-pack: %w", err)
	}
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 4096}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start git index-pack: %w", err)
	}
	idx := &stickyWriter{w: stdin}
	n, err := io.Copy(io.MultiWriter(q.spool, idx), io.LimitReader(r, limit+1))
	stdin.Close()
	waitErr := cmd.Wait()
	q.packSize = n
	switch {
	case err != nil:
		return nil, fmt.Errorf("read pack: %w", err)
	case n > limit:
		return nil, fmt.Errorf("%w (%d bytes): split it or raise the limit", errPackTooLarge, limit)
	case n == 0:
		return nil, errors.New("the push has ref updates but no pack")
	}
	if waitErr != nil {
		return fmt.Errorf("git index-pack: %w: %s", waitErr, strings.TrimSpace(stderr.String())), nil
	}
	return nil, q.loadIndex()
}

// reindex indexes the spooled pack again, after the base stores changed.
func (q *quarantine) reindex(ctx context.Context, g gitRunner) error {
	if _, err := q.spool.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("rewind pack: %w", err)
	}
	cmd := g.command(ctx, q.dir, "index-pack", "--stdin", "--fix-thin")
	cmd.Stdin = bufio.NewReaderSize(q.spool, 64<<10)
	var stderr strings.Builder
	cmd.Stderr = &limitedWriter{w: &stderr, n: 4096}
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("git index-pack: %w: %s", err, strings.TrimSpace(stderr.String()))
	}
	return q.loadIndex()
}

func (q *quarantine) loadIndex() error {
	idxs, err := filepath.Glob(filepath.Join(q.dir, "objects", "pack", "*.idx"))
	if err != nil || len(idxs) != 1 {
		return fmt.Errorf("git index-pack left %d indexes, want 1", len(idxs))
	}
	f, err := os.Open(idxs[0])
	if err != nil {
		return fmt.Errorf("open pack index: %w", err)
	}
	defer f.Close()
	idx := idxfile.NewMemoryIndex()
	if err := idxfile.NewDecoder(bufio.NewReader(f)).Decode(idx); err != nil {
		return fmt.Errorf("decode pack index: %w", err)
	}
	q.index = idx
	return nil
}

// pushed reports whether h was in the pack the client sent. index-pack
// --fix-thin appends the bases of a thin pack after the client's objects,
// over the old trailer, so the client's objects are exactly those at an
// offset before it.
func (q *quarantine) pushed(h plumbing.Hash) bool {
	if q.index == nil {
		return false
	}
	off, err := q.index.FindOffset(h)
	return err == nil && off < q.packSize-20
}

// store returns an object store over the quarantine and then each base
// (git dirs), in that order.
func (q *quarantine) store(bases []string) storer.EncodedObjectStorer {
	l := layered{filesystem.NewStorage(osfs.New(q.dir), cache.NewObjectLRU(objectCacheSize))}
	for _, b := range bases {
		l = append(l, filesystem.NewStorage(osfs.New(b), cache.NewObjectLRU(objectCacheSize)))
	}
	return l
}

// layered reads objects from the first store that has them. It is read-only.
type layered []*filesystem.Storage

var _ storer.EncodedObjectStorer = layered(nil)

func (l layered) NewEncodedObject() plumbing.EncodedObject { return &plumbing.MemoryObject{} }

func (l layered) SetEncodedObject(plumbing.EncodedObject) (plumbing.Hash, error) {
	return plumbing.ZeroHash, errors.New("gitproxy: the push analysis store is read-only")
}

func (l layered) EncodedObject(t plumbing.ObjectType, h plumbing.Hash) (plumbing.EncodedObject, error) {
	for _, s := range l {
		o, err := s.EncodedObject(t, h)
		if err == nil {
			return o, nil
		}
		if !errors.Is(err, plumbing.ErrObjectNotFound) {
			return nil, err
		}
	}
	return nil, plumbing.ErrObjectNotFound
}

func (l layered) IterEncodedObjects(plumbing.ObjectType) (storer.EncodedObjectIter, error) {
	return nil, errors.New("gitproxy: the push analysis store cannot be iterated")
}

func (l layered) HasEncodedObject(h plumbing.Hash) error {
	for _, s := range l {
		if s.HasEncodedObject(h) == nil {
			return nil
		}
	}
	return plumbing.ErrObjectNotFound
}

func (l layered) EncodedObjectSize(h plumbing.Hash) (int64, error) {
	for _, s := range l {
		if n, err := s.EncodedObjectSize(h); err == nil {
			return n, nil
		}
	}
	return 0, plumbing.ErrObjectNotFound
}

func (l layered) AddAlternate(string) error {
	return errors.New("gitproxy: the push analysis store takes no alternates")
}

// stickyWriter passes writes on until the first error, then swallows them:
// when index-pack gives up early, the spool must still receive the whole
// pack.
type stickyWriter struct {
	w   io.Writer
	err error
}

func (s *stickyWriter) Write(p []byte) (int, error) {
	if s.err == nil {
		_, s.err = s.w.Write(p)
	}
	return len(p), nil
}

// limitedWriter keeps the first n bytes written to it.
type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	if l.n > 0 {
		k := min(len(p), l.n)
		l.w.Write(p[:k])
		l.n -= k
	}
	return len(p), nil
}
