//go:build integration

package leasebus

import (
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

func TestStoreFullIsNamedAndNothingAcknowledgedIsLost(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	dir := testutil.Tmpfs(t, "32m")
	b := startStoreBus(t, filepath.Join(dir, "bus"))
	var held []*lease.Lease
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
		var l *lease.Lease
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
	if !errors.Is(err, ErrStoreFull) || !errors.Is(err, lease.ErrUnavailable) {
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
	var got *lease.Lease
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
