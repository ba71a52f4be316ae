package gitproxy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"

	"github.com/go-git/go-billy/v5/osfs"
	"github.com/go-git/go-git/v5/plumbing"
	"github.com/go-git/go-git/v5/plumbing/cache"
	"github.com/go-git/go-git/v5/plumbing/format/packfile"
	"github.com/go-git/go-git/v5/plumbing/storer"
	"github.com/go-git/go-git/v5/storage/filesystem"
	"github.com/go-git/go-git/v5/storage/memory"
)

// objectCacheSize bounds the decoded objects go-git keeps per base store
// while a push is analysed.
const objectCacheSize = 4 * cache.MiByte

// pushPack is one push's pack while it is judged. The bytes go to a spool
// file exactly as received (they are forwarded unchanged when the push is
// accepted) and through go-git's pack scanner on the way in, so the scan
// overlaps the upload. The push rule needs only history and trees: the
// scan keeps every commit, tree and tag of the pack (deltas resolved
// against the pack itself or, for a thin pack, the base stores) and inflates
// blobs only to step over them. The upstream verifies blobs itself.
type pushPack struct {
	dir   string   // scratch directory, removed with the push
	spool *os.File // the pack as received
	size  int64

	objs *memory.ObjectStorage // commits, trees and tags of the pack
	// unresolved names a delta base found neither in the pack nor in the
	// base stores (a thin pack against objects the stores lack).
	unresolved plumbing.Hash
}

func newPushPack(parent string) (*pushPack, error) {
	dir, err := os.MkdirTemp(parent, "push-")
	if err != nil {
		return nil, fmt.Errorf("make push spool: %w", err)
	}
	spool, err := os.Create(filepath.Join(dir, "incoming.pack"))
	if err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("make push spool: %w", err)
	}
	return &pushPack{dir: dir, spool: spool}, nil
}

func (pp *pushPack) remove() {
	pp.spool.Close()
	os.RemoveAll(pp.dir)
}

// errPackTooLarge is returned when a push exceeds the configured limit.
var errPackTooLarge = errors.New("push is larger than the proxy accepts")

// receive spools and scans the pack from r. A scan error is returned
// separately: the pack may be whole but refer to bases the stores lack,
// and rescan can try again once they have them.
func (pp *pushPack) receive(r io.Reader, limit int64, bases storer.EncodedObjectStorer) (scanErr, err error) {
	counted := &countingReader{r: io.LimitReader(r, limit+1)}
	tee := io.TeeReader(counted, pp.spool)
	scanErr = pp.scan(tee, bases)
	// Whatever the scan made of it, the rest of the body is read: the
	// client gets a report only after it has sent everything.
	if _, err := io.Copy(pp.spool, counted); err != nil {
		return nil, fmt.Errorf("read pack: %w", err)
	}
	pp.size = counted.n
	switch {
	case counted.err != nil:
		return nil, fmt.Errorf("read pack: %w", counted.err)
	case pp.size > limit:
		return nil, fmt.Errorf("%w (%d bytes): split it or raise the limit", errPackTooLarge, limit)
	case pp.size == 0:
		return nil, errors.New("the push has ref updates but no pack")
	}
	return scanErr, nil
}

// rescan scans the spooled pack again, after the base stores changed.
func (pp *pushPack) rescan(bases storer.EncodedObjectStorer) error {
	if _, err := pp.spool.Seek(0, io.SeekStart); err != nil {
		return fmt.Errorf("rewind pack: %w", err)
	}
	return pp.scan(bufio.NewReaderSize(io.LimitReader(pp.spool, pp.size), 64<<10), bases)
}

// errUnresolved reports a delta base nobody has.
var errUnresolved = errors.New("delta base not found")

// scan reads the pack from r (hiding the reader's other methods: go-git
// must treat it as a stream) and keeps its commits, trees and tags.
func (pp *pushPack) scan(r io.Reader, bases storer.EncodedObjectStorer) error {
	pp.objs = &memory.NewStorage().ObjectStorage
	pp.unresolved = plumbing.ZeroHash
	sc := packfile.NewScanner(struct{ io.Reader }{r})
	_, count, err := sc.Header()
	if err != nil {
		return fmt.Errorf("pack header: %w", err)
	}
	kept := make(map[int64]*plumbing.MemoryObject) // by pack offset: the non-blob objects
	var buf bytes.Buffer
	for i := uint32(0); i < count; i++ {
		h, err := sc.NextObjectHeader()
		if err != nil {
			return fmt.Errorf("pack object %d of %d: %w", i+1, count, err)
		}
		var (
			typ  plumbing.ObjectType
			base []byte
		)
		switch h.Type {
		case plumbing.CommitObject, plumbing.TreeObject, plumbing.TagObject:
			typ = h.Type
		case plumbing.OFSDeltaObject:
			b, ok := kept[h.OffsetReference]
			if !ok {
				continue // a delta of a blob (or of a delta of one)
			}
			typ = b.Type()
			if base, err = contents(b); err != nil {
				return err
			}
		case plumbing.REFDeltaObject:
			b, err := pp.objs.EncodedObject(plumbing.AnyObject, h.Reference)
			if errors.Is(err, plumbing.ErrObjectNotFound) {
				b, err = bases.EncodedObject(plumbing.AnyObject, h.Reference)
			}
			if errors.Is(err, plumbing.ErrObjectNotFound) {
				pp.unresolved = h.Reference
				continue
			}
			if err != nil {
				return fmt.Errorf("delta base %s: %w", h.Reference, err)
			}
			if b.Type() == plumbing.BlobObject {
				continue
			}
			typ = b.Type()
			if base, err = contents(b); err != nil {
				return err
			}
		default:
			continue // a blob: the scanner steps over it
		}
		buf.Reset()
		if _, _, err := sc.NextObject(&buf); err != nil {
			return fmt.Errorf("pack object %d of %d: %w", i+1, count, err)
		}
		content := buf.Bytes()
		if base != nil {
			if content, err = packfile.PatchDelta(base, content); err != nil {
				return fmt.Errorf("pack object %d of %d: apply delta: %w", i+1, count, err)
			}
		}
		o := &plumbing.MemoryObject{}
		o.SetType(typ)
		o.Write(content)
		if _, err := pp.objs.SetEncodedObject(o); err != nil {
			return err
		}
		kept[h.Offset] = o
	}
	if _, err := sc.Checksum(); err != nil {
		return fmt.Errorf("pack trailer: %w", err)
	}
	if !pp.unresolved.IsZero() {
		return fmt.Errorf("%w: %s (a thin pack against an object neither the agent's repository nor the upstream mirror has)", errUnresolved, pp.unresolved)
	}
	return nil
}

func contents(o plumbing.EncodedObject) ([]byte, error) {
	r, err := o.Reader()
	if err != nil {
		return nil, err
	}
	defer r.Close()
	return io.ReadAll(r)
}

// pushed reports whether commit h came in the pack.
func (pp *pushPack) pushed(h plumbing.Hash) bool {
	return pp != nil && pp.objs != nil && pp.objs.HasEncodedObject(h) == nil
}

// countingReader counts what it reads and remembers a read error that is
// not EOF (a client gone mid-pack).
type countingReader struct {
	r   io.Reader
	n   int64
	err error
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.n += int64(n)
	if err != nil && !errors.Is(err, io.EOF) {
		c.err = err
	}
	return n, err
}

// baseStores opens the git dirs whose objects a push may build on.
func baseStores(gitDirs []string) layered {
	var l layered
	for _, d := range gitDirs {
		l = append(l, verified{filesystem.NewStorage(osfs.New(d), cache.NewObjectLRU(objectCacheSize))})
	}
	return l
}

// layered reads objects from the first store that has them. It is read-only.
type layered []storer.EncodedObjectStorer

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
