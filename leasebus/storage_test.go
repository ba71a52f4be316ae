package leasebus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
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

func acquirePath(t *testing.T, c *Client, path string) (*Lease, error) {
	t.Helper()
	return c.Acquire(ctxT(t), AcquireRequest{Repo: "r", Scope: claim(t, path), Owner: owner(1), TTL: Duration(time.Minute)}, Credential("cred-"+path))
}

func TestAuditStreamFitsSmallVolume(t *testing.T) {
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

func TestStoreFullIsNamedAndNothingAcknowledgedIsLost(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	dir := testutil.Tmpfs(t, "32m")
	b := startStoreBus(t, filepath.Join(dir, "bus"))
	var held []*Lease
	for _, p := range []string{"a", "b", "c"} {
		l, err := acquirePath(t, b.c, p)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, l)
	}

	free := fill(t, dir)
	// The first writes after the fill may still land (a block's last page
	// is already allocated). Then one finds the disk full: it either
	// reaches JetStream (and goes unanswered) or is refused by the probe;
	// either way the client is told the store is full, well within its
	// timeout.
	b.c.Timeout = 8 * time.Second
	var err error
	for i := 0; ; i++ {
		start := time.Now()
		var l *Lease
		if l, err = acquirePath(t, b.c, fmt.Sprintf("d%d", i)); err == nil {
			held = append(held, l)
			if i == 100 {
				t.Fatal("100 acquires landed on a full store")
			}
			continue
		}
		if took := time.Since(start); took > 7*time.Second {
			t.Fatalf("acquire on a full store took %s to fail", took)
		}
		break
	}
	if !errors.Is(err, ErrStoreFull) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("acquire on a full store: %v, want ErrStoreFull", err)
	}
	if !strings.Contains(err.Error(), dir) {
		t.Fatalf("the error does not name the store's volume %s: %v", dir, err)
	}
	// Once the service has seen the fault, writes are refused at once.
	start := time.Now()
	_, err = acquirePath(t, b.c, "e")
	if !errors.Is(err, ErrStoreFull) {
		t.Fatalf("second acquire on a full store: %v, want ErrStoreFull", err)
	}
	if took := time.Since(start); took > time.Second {
		t.Fatalf("second acquire on a full store took %s; the service knew the store was full", took)
	}
	// Reads go on.
	if ls, err := b.c.List(ctxT(t), "r", false); err != nil || len(ls) != len(held) {
		t.Fatalf("list on a full store: %d leases, %v; want the %d acknowledged", len(ls), err, len(held))
	}

	free()
	var got *Lease
	checkFor(t, 15*time.Second, 100*time.Millisecond, func() error {
		got, err = acquirePath(t, b.c, "f")
		return err
	})
	for _, l := range held {
		if got.Fence <= l.Fence {
			t.Fatalf("fence %d after recovery is not above acknowledged fence %d", got.Fence, l.Fence)
		}
		r, err := b.c.Renew(ctxT(t), RenewRequest{LeaseID: l.LeaseID, Repo: "r", Credential: Credential("cred-" + l.Scope.Paths[0]), Version: l.Version})
		if err != nil {
			t.Fatalf("renew acknowledged lease %s after recovery: %v", l.LeaseID, err)
		}
		if r.Fence != l.Fence {
			t.Fatalf("lease %s came back with fence %d, was %d", l.LeaseID, r.Fence, l.Fence)
		}
	}

	// And all of it survives a restart of the bus.
	b.stop()
	b.start()
	ls, err := b.c.List(ctxT(t), "r", false)
	if err != nil || len(ls) != len(held)+1 {
		t.Fatalf("after a restart: %d leases, %v; want %d", len(ls), err, len(held)+1)
	}
}

func TestReadOnlyStoreIsNamed(t *testing.T) {
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
