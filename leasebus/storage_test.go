package leasebus

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// fill writes a file on dir's volume until the volume is full, and returns
// a function that removes it again.
func fill(t *testing.T, dir string) (free func()) {
	t.Helper()
	name := filepath.Join(dir, "fill")
	f, err := os.Create(name)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for {
		if _, err := f.Write(buf); err != nil {
			if !errors.Is(err, syscall.ENOSPC) {
				t.Fatalf("fill %s: %v", dir, err)
			}
			break
		}
	}
	f.Close()
	return func() {
		if err := os.Remove(name); err != nil {
			t.Fatal(err)
		}
	}
}

// storeBus is the embedded bus as `fenceline bus serve` runs it: the
// service probes the store, and KeepStore restarts JetStream after a fault.
type storeBus struct {
	*bus
	stopKeeping func()
}

func startStoreBus(t *testing.T, dir string) *storeBus {
	t.Helper()
	b := &storeBus{bus: &bus{t: t, dir: dir}}
	b.cfg.StoreProbe = func(ctx context.Context) error { return EmbeddedStoreProbe(b.srv, b.dir)(ctx) }
	b.start()
	t.Cleanup(b.stop)
	return b
}

func (b *storeBus) start() {
	b.bus.start("127.0.0.1:0")
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	srv, log := b.srv, b.svc.log
	wg.Go(func() { EmbeddedKeepStore(ctx, srv, b.dir, log) })
	b.stopKeeping = func() { cancel(); wg.Wait() }
}

func (b *storeBus) stop() {
	if b.stopKeeping != nil {
		b.stopKeeping()
		b.stopKeeping = nil
	}
	b.bus.stop()
}

func acquirePath(t *testing.T, c *Client, path string) (*lease.Lease, error) {
	t.Helper()
	return c.Acquire(ctxT(t), AcquireRequest{Repo: "r", Scope: claim(t, path), Owner: owner(1), TTL: lease.Duration(time.Minute)}, Credential("cred-"+path))
}

func TestAuditStreamFitsSmallVolume(t *testing.T) {
	t.Parallel()
	dir := testutil.Tmpfs(t, "32m")
	b := startStoreBus(t, filepath.Join(dir, "bus"))
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctxT(t), AuditStream)
	if err != nil {
		t.Fatal(err)
	}
	got := s.CachedInfo().Config.MaxBytes
	if got < auditMinBytes || got > 32<<20 {
		t.Fatalf("audit stream MaxBytes = %d, want between %d and the 32 MiB volume", got, auditMinBytes)
	}
	if _, err := acquirePath(t, b.c, "a"); err != nil {
		t.Fatal(err)
	}

	// A restart keeps the size the stream was made with.
	b.stop()
	b.start()
	if js, err = JetStream(context.Background(), b.nc); err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctxT(t), AuditStream)
	if err != nil {
		t.Fatal(err)
	}
	if again := st.CachedInfo().Config.MaxBytes; again != got {
		t.Fatalf("after a restart the audit stream's MaxBytes is %d, was %d", again, got)
	}
}

func TestReadOnlyStoreIsNamed(t *testing.T) {
	t.Parallel()
	dir := testutil.Tmpfs(t, "16m")
	store := filepath.Join(dir, "bus")
	b := startStoreBus(t, store)
	if _, err := acquirePath(t, b.c, "a"); err != nil {
		t.Fatal(err)
	}
	b.stop()

	// (A volume with files open for writing cannot be remounted read-only,
	// so the running case is the probe's, checked directly.)
	testutil.Remount(t, dir, "ro")
	defer testutil.Remount(t, dir, "rw")
	if err := CheckStoreDir(store); !errors.Is(err, ErrStoreReadOnly) || !strings.Contains(err.Error(), store) {
		t.Fatalf("probe of a read-only store: %v, want ErrStoreReadOnly naming %s", err, store)
	}
	if err := StatStore(store); !errors.Is(err, ErrStoreReadOnly) {
		t.Fatalf("statfs probe of a read-only store: %v, want ErrStoreReadOnly", err)
	}
	// A bus does not start on a read-only store, and says so at once.
	start := time.Now()
	_, err := EmbeddedStartServer(ServerConfig{Listen: "127.0.0.1:0", StoreDir: store})
	if !errors.Is(err, ErrStoreReadOnly) || !strings.Contains(err.Error(), store) {
		t.Fatalf("start on a read-only store: %v, want ErrStoreReadOnly naming %s", err, store)
	}
	if took := time.Since(start); took > 2*time.Second {
		t.Fatalf("start on a read-only store took %s to fail", took)
	}
	_, err = EmbeddedStartServer(ServerConfig{Listen: "127.0.0.1:0", StoreDir: filepath.Join(dir, "new")})
	if !errors.Is(err, ErrStoreReadOnly) {
		t.Fatalf("start on a new store on a read-only volume: %v, want ErrStoreReadOnly", err)
	}
}
