package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// acquireVia grants a lease through one given service instance's actor (a
// queue group would pick any instance).
func acquireVia(t *testing.T, ctx context.Context, svc *Service, repo string, c scope.Claim, o lease.Owner) *lease.Lease {
	t.Helper()
	r := &AcquireRequest{Repo: repo, Scope: c, Owner: o, TTL: lease.Duration(time.Minute),
		RequestID: NewRequestID(), CredentialHash: NewCredential().hash()}
	if err := r.normalize(); err != nil {
		t.Fatal(err)
	}
	rep := svc.actor(RepoKey(repo), repo).ask(ctx, &call{op: "acquire", req: r})
	if rep.Error != nil {
		t.Fatalf("acquire %s: %v", c, rep.Error.err())
	}
	return rep.Lease
}

// auditCounts counts a repo's audit events by type and lease id.
func auditCounts(ctx context.Context, nc *nats.Conn, repo string) (map[string]int, error) {
	evs, err := ReadAudit(ctx, nc, repo, 0)
	if err != nil {
		return nil, err
	}
	n := map[string]int{}
	for _, ev := range evs {
		n[ev.Type+" "+ev.LeaseID]++
	}
	return n, nil
}

// wantOnce waits until each lease has exactly one grant event, and fails
// the test if one has none after a while or more than one.
func wantOnce(t *testing.T, ctx context.Context, nc *nats.Conn, repo string, ls ...*lease.Lease) {
	t.Helper()
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		n, err := auditCounts(ctx, nc, repo)
		if err != nil {
			return err
		}
		for _, l := range ls {
			if n[lease.EventGrant+" "+l.LeaseID] == 0 {
				return fmt.Errorf("grant of %s (fence %d) is not in the audit stream", l.LeaseID, l.Fence)
			}
		}
		return nil
	})
	n, err := auditCounts(ctx, nc, repo)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		if got := n[lease.EventGrant+" "+l.LeaseID]; got != 1 {
			t.Errorf("grant of %s is in the audit stream %d times, want once", l.LeaseID, got)
		}
	}
}

// checkChain reads a repo's service audit messages and checks that they
// form one chain: each covers the log records after the previous one's.
func checkChain(t *testing.T, ctx context.Context, nc *nats.Conn, repo string) int {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, AuditStream)
	if err != nil {
		t.Fatal(err)
	}
	var prev uint64
	n := 0
	for seq := uint64(1); ; {
		m, err := st.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(serviceAuditSubject(RepoKey(repo))))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return n
		}
		if err != nil {
			t.Fatal(err)
		}
		var b auditBatch
		if err := json.Unmarshal(m.Data, &b); err != nil {
			t.Fatal(err)
		}
		if b.From != prev || b.LogSeq <= b.From {
			t.Errorf("audit message %d covers log records (%d, %d], after a message up to %d", m.Sequence, b.From, b.LogSeq, prev)
		}
		prev = b.LogSeq
		n++
		seq = m.Sequence + 1
	}
}

// Two service instances on one repo: A writes a grant to the lease log and
// is killed before it writes the grant's audit event; B, which had written
// to the repo before, then grants on top of A's record and writes its own
// events. The per-repo written-up-to mark used to be moved by B past A's
// record, so a restarted instance never wrote A's event. Now B, having
// loaded A's record, writes it in its chain, and a restart writes nothing
// twice.
func TestAuditOfKilledInstance(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const auditRepo = "github.com/acme/audit-killed"
	svcB, err := StartService(ctx, connect(t, b.srv.ClientURL()), ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svcB.Stop)

	w := acquireVia(t, ctx, svcB, auditRepo, claim(t, "w"), owner(1))
	wantOnce(t, ctx, b.nc, auditRepo, w) // B's mark is past w

	b.svc.audit.killed.Store(true) // A writes no audit from here on
	x := acquireVia(t, ctx, b.svc, auditRepo, claim(t, "x"), owner(2))
	y := acquireVia(t, ctx, svcB, auditRepo, claim(t, "y"), owner(3)) // on top of x's record
	b.svc.Stop()
	b.svc = nil
	wantOnce(t, ctx, b.nc, auditRepo, w, x, y)

	// A restarted instance finds nothing left to write, and writes
	// nothing twice.
	svcC, err := StartService(ctx, connect(t, b.srv.ClientURL()), ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svcC.Stop)
	z := acquireVia(t, ctx, svcC, auditRepo, claim(t, "z"), owner(4))
	wantOnce(t, ctx, b.nc, auditRepo, w, x, y, z)
	t.Logf("%d audit messages in the chain", checkChain(t, ctx, b.nc, auditRepo))
}

// The audit message lands but its acknowledgement is lost (a stream leader
// paused after storing it): the writer tries again, and the event must not
// be written twice, however late the retry.
func TestAuditLostAckWritesOnce(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const auditRepo = "github.com/acme/audit-lost-ack"
	key := RepoKey(auditRepo)
	w := b.svc.audit
	w.killed.Store(true)
	x := acquireVia(t, ctx, b.svc, auditRepo, claim(t, "x"), owner(1))

	// Send the very message the writer is about to send, as if its own
	// try had landed unacknowledged. (The actor hands the record to the
	// writer just after it answers: wait for it.)
	var lost auditBatch
	checkFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		w.mu.Lock()
		defer w.mu.Unlock()
		c := w.chains[key]
		if c == nil || len(c.recs) == 0 {
			return errors.New("the writer has not got x's record yet")
		}
		lost = auditBatch{LogSeq: c.tip}
		for _, r := range c.recs {
			lost.Events = append(lost.Events, r.events...)
		}
		return nil
	})
	data, err := lost.encode()
	if err != nil {
		t.Fatal(err)
	}
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: serviceAuditSubject(key), Data: data, Header: nats.Header{writerHeader: {w.writer}}}, jetstream.WithExpectLastSequencePerSubject(0)); err != nil {
		t.Fatal(err)
	}
	w.killed.Store(false) // the writer retries on its own
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		if got := w.covered(key); got < lost.LogSeq {
			return fmt.Errorf("audit chain covers the log up to %d, want %d", got, lost.LogSeq)
		}
		return nil
	})
	y := acquireVia(t, ctx, b.svc, auditRepo, claim(t, "y"), owner(2))
	wantOnce(t, ctx, b.nc, auditRepo, x, y)
	if n := checkChain(t, ctx, b.nc, auditRepo); n != 2 {
		t.Errorf("%d audit messages in the chain, want 2 (the lost-ack one and y's)", n)
	}
}

// The log stream keeps logKeep records of a repo and drops the oldest as
// a new one comes; the service appends nothing that would drop a record
// whose audit events are not yet in the audit stream (the log is their
// only copy): with the audit out of reach, a repo's writes are refused
// before its grant's record would go, and go on once the audit caught up.
func TestLogKeepsUnauditedRecords(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const auditRepo = "github.com/acme/audit-keep"
	b.svc.audit.killed.Store(true) // the audit stream is out of reach
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: auditRepo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	granted := *l
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	renewals := 0
	for ; renewals < 2*logKeep; renewals++ { // each sequential renewal is one commit
		next, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version})
		if err != nil {
			if !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "audit stream is behind") {
				t.Fatalf("renewal %d: %v, want the refusal that the audit is behind", renewals, err)
			}
			break
		}
		l = next
	}
	if renewals >= logKeep || renewals < logKeep-4 {
		t.Fatalf("%d renewals went through with the audit out of reach: want the writes refused just before the log keeps %d records", renewals, logKeep)
	}
	if n, first := logMessages(t, ctx, js, auditRepo); first.Kind != recordDelta || first.Prev != 0 || n > logKeep {
		t.Fatalf("the log dropped the grant's record while its audit event was unwritten: %d messages, the first a %s on %d", n, first.Kind, first.Prev)
	}
	b.svc.audit.killed.Store(false)
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		next, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version})
		if err != nil {
			return err
		}
		l = next
		return nil
	})
	for range logKeep / 2 { // past the grant's record: the log drops it now
		if l, err = b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
			t.Fatal(err)
		}
	}
	if n, first := logMessages(t, ctx, js, auditRepo); n != logKeep || first.Prev == 0 {
		t.Fatalf("%d messages, the first on %d: want the log at its %d, the grant's record gone", n, first.Prev, logKeep)
	}
	wantOnce(t, ctx, b.nc, auditRepo, &granted)
	// A fresh read of what the log keeps (a restart) starts from a snapshot.
	st := newRepoState("")
	if _, err := b.svc.store.load(ctx, RepoKey(auditRepo), st, 0, time.Now, nil); err != nil {
		t.Fatal(err)
	}
	if got := st.leases[l.LeaseID]; got == nil || got.Version != l.Version {
		t.Fatalf("a fresh read has %+v, want the lease at version %d", got, l.Version)
	}
}

// TestSeqWindowKeepsTheLastLogKeep: the actor's window of kept record
// sequences is the last logKeep noted, oldest first, against a slice.
func TestSeqWindowKeepsTheLastLogKeep(t *testing.T) {
	t.Parallel()
	var w seqWindow
	var model []uint64
	for seq := uint64(1); seq <= 3*logKeep+7; seq++ {
		w.note(seq)
		w.note(seq) // a sequence seen again changes nothing
		if model = append(model, seq); len(model) > logKeep {
			model = model[1:]
		}
		oldest, full := w.full()
		if full != (len(model) == logKeep) || full && oldest != model[0] {
			t.Fatalf("after %d: full=%v oldest=%d, want full=%v oldest=%d", seq, full, oldest, len(model) == logKeep, model[0])
		}
	}
}

// TestAuditBacklogTakesOneFlush: a backlog of more messages than a flush
// has attempts (after an outage of the audit stream, or a repo appended to
// as fast as its messages are written) is written by one flush: only
// losing the chain to another writer counts against the attempts, not a
// message written. (Counted alike, a flush of a busy repo gave up after 8
// messages, said the chain was "still moving", and paused the writer.)
func TestAuditBacklogTakesOneFlush(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	js, err := jetstream.New(b.nc)
	if err != nil {
		t.Fatal(err)
	}
	w := newAuditWriter(js, slog.New(slog.DiscardHandler), "backlog-test")
	key := RepoKey("github.com/acme/backlog")
	const records = 20 // each a message of its own: maxAuditEvents events
	for seq := uint64(1); seq <= records; seq++ {
		evs := make([]lease.AuditEvent, maxAuditEvents)
		for i := range evs {
			evs[i] = lease.AuditEvent{Type: lease.EventGrant, Boundary: lease.BoundaryLease, Repo: "github.com/acme/backlog", LeaseID: fmt.Sprintf("lease_%d_%d", seq, i)}
		}
		w.record(key, seq, evs)
	}
	if err := w.flushRepo(ctx, key); err != nil {
		t.Fatalf("one flush of a backlog of %d messages: %v", records, err)
	}
	mark, _, err := w.readMark(ctx, key, 0)
	if err != nil {
		t.Fatal(err)
	}
	if mark != records {
		t.Fatalf("the audit chain covers the log up to %d after the flush, want %d", mark, records)
	}
}
