package leasebus

// Durability across restarts of the embedded bus and the lease service:
// acknowledged grants, renewals and releases survive (with SyncAlways, also
// when the server goes down under a running service), fences continue
// above everything issued before, leases whose holders died are reclaimed
// by the restarted service's own timer, judged from its own observation
// (invariant 4), and the per-repo snapshot rolls the log up and reloads.

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type ackedLease struct {
	l    *lease.Lease
	cred Credential
}

// Ways to restart the bus in tests.
const (
	restartClean = "clean-stop"                        // service stopped, then the server
	restartCrash = "server-shutdown-under-service"     // the server goes first, the service dies after
	restartCopy  = "store-copied-without-any-shutdown" // no clean shutdown at all: the store's files mid-run
)

// restart restarts the server and the service on the same store (or, for
// restartCopy, on a copy of the store's files taken while everything runs:
// recovery without any shutdown marker or flushed index — the files as
// the OS has them, which is not a test of fsync itself).
func (b *bus) restart(how string) {
	b.t.Helper()
	switch how {
	case restartCrash:
		b.srv.Shutdown()
		b.srv.WaitForShutdown()
		b.srv = nil
		b.nc.Close() // the service's process dies with it: nothing more gets out
	case restartCopy:
		dir := b.t.TempDir()
		if err := os.CopyFS(dir, os.DirFS(b.dir)); err != nil {
			b.t.Fatalf("copy the store: %v", err)
		}
		b.stop()
		b.dir = dir
	}
	b.stop()
	b.start("127.0.0.1:0")
}

// The lease service keeps serving when the embedded server restarts under
// it on the same address (its connection reconnects): its state and the
// log agree, nothing acknowledged is lost, fences continue.
func TestServiceSurvivesBusRestart(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "svc"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	addr := b.srv.Addr().String()
	b.srv.Shutdown()
	b.srv.WaitForShutdown()
	srv, err := EmbeddedStartServer(serverConfig(t, ServerConfig{Listen: addr, StoreDir: b.dir}))
	if err != nil {
		t.Fatal(err)
	}
	b.srv = srv
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		_, err := b.c.Get(ctx, l.LeaseID)
		return err
	})
	r, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version})
	if err != nil || r.Version != l.Version+1 {
		t.Fatalf("renew after the bus restarted: %+v %v", r, err)
	}
	n, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil || n.Fence != l.Fence+1 {
		t.Fatalf("acquire after the bus restarted: %+v %v", n, err)
	}
	// A second service loading the log from scratch sees the same.
	b.stop()
	b.start("127.0.0.1:0")
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || got.Version != r.Version || !got.Active() {
		t.Fatalf("after a full restart: %+v %v", got, err)
	}
}

// logMessages counts the messages of one repo's lease log.
func logMessages(t testing.TB, ctx context.Context, js jetstream.JetStream, repo string) (uint64, *logRecord) {
	t.Helper()
	st, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	subj := logSubjectFor(RepoKey(repo))
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(subj))
	if err != nil {
		t.Fatal(err)
	}
	first, err := st.GetMsg(ctx, 1, jetstream.WithGetMsgSubject(subj))
	if err != nil {
		t.Fatal(err)
	}
	var rec logRecord
	if err := json.Unmarshal(first.Data, &rec); err != nil {
		t.Fatal(err)
	}
	return info.State.Subjects[subj], &rec
}

func TestSnapshotRollupAndReload(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const snapRepo = "github.com/acme/snapshot"
	credA, credB := NewCredential(), NewCredential()
	a, err := b.c.Acquire(ctx, AcquireRequest{Repo: snapRepo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, credA)
	if err != nil {
		t.Fatal(err)
	}
	bl, err := b.c.Acquire(ctx, AcquireRequest{Repo: snapRepo, Scope: claim(t, "b"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, credB)
	if err != nil {
		t.Fatal(err)
	}
	if bl, err = b.c.Release(ctx, bl.LeaseID, credB); err != nil {
		t.Fatal(err)
	}
	// Each sequential renewal is one commit: drive past what the log keeps
	// of a repo (logKeep), so that the grants' records are gone from it.
	for range logKeep + 20 {
		if a, err = b.c.Renew(ctx, RenewRequest{LeaseID: a.LeaseID, Credential: credA, Version: a.Version}); err != nil {
			t.Fatal(err)
		}
	}
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	// The stream keeps logKeep records of the repo, snapshots among them.
	if n, first := logMessages(t, ctx, js, snapRepo); n != logKeep || first.Prev == 0 {
		t.Fatalf("after %d commits the log of the repo holds %d messages, the first on %d: want %d, the first records gone", logKeep+23, n, first.Prev, logKeep)
	}

	check := func(stage string) {
		t.Helper()
		got, err := b.c.Get(ctx, a.LeaseID)
		if err != nil || !got.Active() || got.Version != a.Version || got.Fence != a.Fence {
			t.Fatalf("%s: active lease %+v %v, want v%d fence %d", stage, got, err, a.Version, a.Fence)
		}
		got, err = b.c.Get(ctx, bl.LeaseID)
		if err != nil || got.Status != lease.StatusReleased {
			t.Fatalf("%s: ended lease %+v %v", stage, got, err)
		}
		if got, err := b.c.Release(ctx, bl.LeaseID, credB); err != nil || got.Status != lease.StatusReleased || got.Version != bl.Version {
			t.Fatalf("%s: repeated release by its owner: %+v %v", stage, got, err)
		}
		if _, err := b.c.Release(ctx, bl.LeaseID, credA); !errors.Is(err, lease.ErrNotOwner) {
			t.Fatalf("%s: release by another owner: %v", stage, err)
		}
		if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: snapRepo, Scope: claim(t, "a/x"), Owner: owner(3), TTL: lease.Duration(time.Minute)}, NewCredential()); !errors.Is(err, lease.ErrConflict) {
			t.Fatalf("%s: claim under the active lease granted: %v", stage, err)
		}
	}
	check("before restart")
	b.restart(restartClean)
	check("after restart onto a snapshot")

	// Deltas on top of the snapshot, then another restart: a load reads
	// the snapshot and the deltas after it.
	for range 5 {
		if a, err = b.c.Renew(ctx, RenewRequest{LeaseID: a.LeaseID, Credential: credA, Version: a.Version}); err != nil {
			t.Fatal(err)
		}
	}
	c, err := b.c.Acquire(ctx, AcquireRequest{Repo: snapRepo, Scope: claim(t, "c"), Owner: owner(4), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if c.Fence != bl.Fence+1 {
		t.Fatalf("fence after the snapshot is %d, want %d", c.Fence, bl.Fence+1)
	}
	b.restart(restartCopy)
	check("after restart onto snapshot + deltas")
	d, err := b.c.Acquire(ctx, AcquireRequest{Repo: snapRepo, Scope: claim(t, "d"), Owner: owner(5), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil || d.Fence != c.Fence+1 {
		t.Fatalf("fence after the second restart: %+v %v, want %d", d, err, c.Fence+1)
	}
	if got, err := b.c.Get(ctx, c.LeaseID); err != nil || !got.Active() || got.Fence != c.Fence {
		t.Fatalf("lease granted after the snapshot lost: %+v %v", got, err)
	}
}

// A repo whose log cannot be folded (here: a record that is not JSON)
// is taken out of service on its own; every other repo is served.
func TestDamagedLogTakesOnlyItsRepoOut(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const other = "github.com/acme/other"
	kept, err := b.c.Acquire(ctx, AcquireRequest{Repo: other, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	// Written as the service writes (a record nobody wrote is passed over).
	bad := nats.NewMsg(logSubjectFor(RepoKey(repo)))
	bad.Header.Set(writerHeader, b.svc.store.writer)
	bad.Data = []byte("not a record")
	if _, err := js.PublishMsg(ctx, bad); err != nil {
		t.Fatal(err)
	}
	b.svc.Stop()
	b.svc, err = StartService(ctx, b.nc, ServiceConfig{})
	if err != nil {
		t.Fatalf("one damaged log stopped the service: %v", err)
	}
	_, err = b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "b"), Owner: owner(3), TTL: lease.Duration(time.Minute)}, NewCredential())
	if !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "damaged") {
		t.Fatalf("acquire in the damaged repo: want ErrUnavailable naming the damage, got %v", err)
	}
	got, err := b.c.Get(ctx, kept.LeaseID)
	if err != nil || !got.Active() || got.Fence != kept.Fence {
		t.Fatalf("lease of the healthy repo after restart: %+v %v", got, err)
	}
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: other, Scope: claim(t, "b"), Owner: owner(4), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatalf("healthy repo not served: %v", err)
	}
}

// A view the log stream has moved past — logKeep records of its repo
// written since it was read, so the records after it are gone — is read
// afresh from the snapshot the stream keeps, not taken for a damaged log.
func TestViewBehindTheLogIsReadAfresh(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const behindRepo = "github.com/acme/behind"
	key := RepoKey(behindRepo)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: behindRepo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	old := newRepoState("")
	if _, err := b.svc.store.load(ctx, key, old, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	for range logKeep + 10 {
		if l, err = b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := b.svc.store.load(ctx, key, old, time.Now, nil); !errors.Is(err, errBehind) || errors.Is(err, errDamaged) {
		t.Fatalf("reading on from a view the log moved past: %v, want errBehind", err)
	}
	// The actor, handed that view, reads the log afresh.
	a := b.svc.actor(key, behindRepo)
	a.busy.Lock()
	a.state, a.kept = old, seqWindow{}
	a.stale = true
	a.busy.Unlock()
	if r := a.ask(ctx, &call{op: "sync", req: &syncRequest{}}); r.Error != nil {
		t.Fatalf("sync of a view behind the log: %v", r.Error.err())
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || got.Version != l.Version || !got.Active() {
		t.Fatalf("after reading afresh: %+v %v, want version %d", got, err, l.Version)
	}
}
