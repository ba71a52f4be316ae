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
	"fmt"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
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

// renewTimes renews l n times, one commit each, and returns it as the last
// renewal left it.
func renewTimes(t testing.TB, b *bus, l *lease.Lease, cred Credential, n int) *lease.Lease {
	t.Helper()
	ctx := ctxT(t)
	for range n {
		var err error
		if l, err = b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
			t.Fatal(err)
		}
	}
	return l
}

// logStreamOf is JetStream on nc and the lease log stream's handle.
func logStreamOf(t testing.TB, ctx context.Context, nc *nats.Conn) (jetstream.JetStream, jetstream.Stream) {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	return js, stream
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
	a = renewTimes(t, b, a, credA, logKeep+20)
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
	if _, err := b.svc.store.load(ctx, key, old, 0, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	l = renewTimes(t, b, l, cred, logKeep+10)
	if _, err := b.svc.store.load(ctx, key, old, 0, time.Now, nil); !errors.Is(err, errBehind) || errors.Is(err, errDamaged) {
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

// A view the log moved past whose fresh read then fails vouches for none
// of its leases: the lease index keeps nothing of the view it replaced
// (here a lease the log has revoked since), so a heartbeat's cached get
// finds no view and asks the log, rather than hear the old view's
// "active".
func TestViewBehindTheLogFailingToReadVouchesForNothing(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const behindRepo = "github.com/acme/behind-failing"
	key := RepoKey(behindRepo)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: behindRepo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	revoked, err := b.c.Acquire(ctx, AcquireRequest{Repo: behindRepo, Scope: claim(t, "b"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	old := newRepoState("")
	if _, err := b.svc.store.load(ctx, key, old, 0, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Revoke(ctx, revoked.LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	renewTimes(t, b, l, cred, logKeep+10)
	// A record the fresh read cannot fold, written as the service writes.
	js, _ := logStreamOf(t, ctx, b.nc)
	bad := nats.NewMsg(logSubjectFor(key))
	bad.Header.Set(writerHeader, b.svc.store.writer)
	bad.Data = []byte("not a record")
	if _, err := js.PublishMsg(ctx, bad); err != nil {
		t.Fatal(err)
	}

	// The actor holds the old view, indexed as a reload leaves it.
	a := b.svc.actor(key, behindRepo)
	a.busy.Lock()
	a.state, a.kept = old, seqWindow{}
	a.stale = true
	b.svc.indexLeases(key, a.entries())
	a.busy.Unlock()
	if got, _, ok := b.svc.cachedLease(revoked.LeaseID); !ok || !got.Active() {
		t.Fatalf("set-up: the old view should vouch for the lease as active: %+v %v", got, ok)
	}
	if r := a.ask(ctx, &call{op: "sync", req: &syncRequest{}}); r.Error == nil {
		t.Fatal("sync over a damaged log succeeded")
	}
	for _, id := range []string{revoked.LeaseID, l.LeaseID} {
		if got, _, ok := b.svc.cachedLease(id); ok {
			t.Errorf("after the failed fresh read the index still vouches for %s: %+v (status %s)", id, got, got.Status)
		}
	}
}

// A first load reads a repo's log back from its last record to the newest
// snapshot, each record by its sequence, and no further than the audit
// needs: the records before the snapshot that the audit stream does not
// cover yet are handed on for their events, none is read twice, and the
// state is the one the forward walk (every record the stream keeps) folds.
// A message the service did not write on the chain sends the load back to
// the forward walk, which passes over it.
func TestFirstLoadReadsBackToTheSnapshot(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const backRepo = "github.com/acme/back"
	key := RepoKey(backRepo)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: backRepo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	ended, err := b.c.Acquire(ctx, AcquireRequest{Repo: backRepo, Scope: claim(t, "b"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Revoke(ctx, ended.LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	l = renewTimes(t, b, l, cred, logKeep+40)

	// Every record the stream keeps of the repo, read forward: where the
	// newest snapshot is.
	js, stream := logStreamOf(t, ctx, b.nc)
	var seqs []uint64
	snap := -1
	for next := uint64(1); ; {
		m, err := stream.GetMsg(ctx, next, jetstream.WithGetMsgSubject(logSubjectFor(key)))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		var rec logRecord
		if err := json.Unmarshal(m.Data, &rec); err != nil {
			t.Fatal(err)
		}
		if rec.Kind == recordSnapshot {
			snap = len(seqs)
		}
		seqs = append(seqs, m.Sequence)
		next = m.Sequence + 1
	}
	if len(seqs) != logKeep || snap < 0 || snap == len(seqs)-1 {
		t.Fatalf("the log keeps %d records of the repo, the newest snapshot at %d: want %d with deltas after a snapshot", len(seqs), snap, logKeep)
	}

	walked := newRepoState("")
	ws := &store{js: js}
	wstream, err := ws.logStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ws.walk(ctx, wstream, logSubjectFor(key), walked, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	same := func(got *repoState) error {
		if got.repo != backRepo || got.seq != walked.seq || got.fence != walked.fence || len(got.leases) != len(walked.leases) || len(got.ended) != len(walked.ended) {
			return fmt.Errorf("state %s at %d fence %d, %d active %d ended; the walk's: %s at %d fence %d, %d active %d ended",
				got.repo, got.seq, got.fence, len(got.leases), len(got.ended), walked.repo, walked.seq, walked.fence, len(walked.leases), len(walked.ended))
		}
		for id, e := range walked.leases {
			if g := got.leases[id]; g == nil || g.Version != e.Version || g.Fence != e.Fence {
				return fmt.Errorf("lease %s: %+v, the walk's %+v", id, g, e)
			}
		}
		if got.leases[l.LeaseID] == nil || got.leases[l.LeaseID].Version != l.Version || got.ended[ended.LeaseID] == nil {
			return fmt.Errorf("the renewed lease or the revoked one is not as acknowledged")
		}
		return nil
	}
	for _, tc := range []struct {
		name    string
		audited uint64
		// records read one by one besides the last, and handed on
		reads, handed int
	}{
		{"everything audited", seqs[len(seqs)-1], len(seqs) - 1 - snap, len(seqs) - snap},
		{"audited to before the snapshot", seqs[snap-3], len(seqs) - 1 - (snap - 2), len(seqs) - (snap - 2)},
		// Back past the oldest record kept: one read finds nothing.
		{"nothing known of the audit", 0, len(seqs), len(seqs)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := NewServiceMetrics()
			ld := &store{js: js, metrics: m}
			st := newRepoState("")
			var handed []uint64
			if _, err := ld.load(ctx, key, st, tc.audited, time.Now, func(seq uint64, _ []lease.AuditEvent) { handed = append(handed, seq) }); err != nil {
				t.Fatal(err)
			}
			if err := same(st); err != nil {
				t.Fatal(err)
			}
			if got := int(promtest.ToFloat64(m.reads.WithLabelValues("record"))); got != tc.reads {
				t.Errorf("%d records read one by one, want %d", got, tc.reads)
			}
			if got := int(promtest.ToFloat64(m.reads.WithLabelValues("last"))); got != 1 {
				t.Errorf("%d reads of the last record, want 1", got)
			}
			if !slices.Equal(handed, seqs[len(seqs)-tc.handed:]) {
				t.Errorf("handed on %d records (%v…), want the last %d", len(handed), handed[:min(3, len(handed))], tc.handed)
			}
		})
	}

	// A message nobody wrote as the service, stored on the log's subject
	// (a server's answer sent there): the chain back breaks at once, the
	// forward walk passes over it.
	ack, err := js.Publish(ctx, logSubjectFor(key), []byte(`{"not":"a record"}`))
	if err != nil {
		t.Fatal(err)
	}
	st := newRepoState("")
	m := NewServiceMetrics()
	if _, err := (&store{js: js, metrics: m}).load(ctx, key, st, 0, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	walked.seq = ack.Sequence // the state's sequence moves on to it; nothing else
	if err := same(st); err != nil {
		t.Fatalf("after a foreign message on the log: %v", err)
	}
	if got := int(promtest.ToFloat64(m.reads.WithLabelValues("record"))); got <= len(seqs) {
		t.Fatalf("after a foreign message on the log, %d records read: want the forward walk's (more than %d)", got, len(seqs))
	}
}
