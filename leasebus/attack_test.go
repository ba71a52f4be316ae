package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// injectViaConsumer plants data in the shard attempts bucket (storeAt),
// then has a holder-role connection create a push consumer on that bucket
// whose deliver subject is subj: the server itself publishes the record
// there. It returns the consumer create's answer.
func injectViaConsumer(t *testing.T, url, subj string, data []byte) string {
	t.Helper()
	attacker, key := storeAt(t, url, data)
	create, _ := json.Marshal(map[string]any{"stream_name": "KV_FENCELINE_ATTEMPTS", "config": map[string]any{
		"name": key, "deliver_subject": subj, "ack_policy": "none",
		"filter_subject": "$KV.FENCELINE_ATTEMPTS." + key, "deliver_policy": "all",
	}})
	resp, err := attacker.Request(FleetJSAPI+".CONSUMER.CREATE.KV_FENCELINE_ATTEMPTS."+key+".$KV.FENCELINE_ATTEMPTS."+key, create, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// Wait until the consumer has handed the record on (or 2 s).
	deadline := time.Now().Add(2 * time.Second)
	for time.Now().Before(deadline) {
		info, err := attacker.Request(FleetJSAPI+".CONSUMER.INFO.KV_FENCELINE_ATTEMPTS."+key, nil, 2*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		var ci struct {
			Delivered struct {
				Consumer uint64 `json:"consumer_seq"`
			} `json:"delivered"`
		}
		_ = json.Unmarshal(info.Data, &ci)
		if ci.Delivered.Consumer > 0 {
			t.Logf("the server delivered the record onto %s", subj)
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	return string(resp.Data)
}

// A holder has the server deliver a forged lease log record (a snapshot
// without the victim's lease) onto the repo's log subject: the log stream
// stores it like any other message on its subjects, and the service, on
// its next reload, would take it as its own. The log must hold only what
// the service wrote.
func TestHolderCannotWriteLeaseLogThroughJetStream(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	before, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	forged, _ := json.Marshal(logRecord{Kind: recordSnapshot, Repo: repo, Fence: 0})
	resp := injectViaConsumer(t, url, logSubjectFor(RepoKey(repo)), forged)
	t.Logf("consumer create: %s", resp)
	// Let the delivery happen (or not): a later service append on the
	// repo is the witness.
	l2, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	after, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for seq := before.State.LastSeq + 1; seq <= after.State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if m.Header.Get(writerHeader) == "" {
			t.Errorf("the lease log stored a record no service wrote at %d: %s", seq, m.Data)
		}
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || !got.Active() {
		t.Fatalf("after a forged log snapshot: victim %+v %v, want active", got, err)
	}
	if l2.Fence <= l.Fence {
		t.Fatalf("the next grant got fence %d after %d: fences rewound", l2.Fence, l.Fence)
	}
	_ = nats.ErrTimeout
}

// storeAt plants data in the shard attempts bucket and returns a
// holder-role connection (the attacker, which may read the bucket and make
// consumers on it) and the record's key. The lease service alone writes
// the bucket (TestShardRecordsOnlyTheServiceWrites: a holder has it store
// attempt records it checked, of up to 64 KiB), so data is planted with a
// service connection: whatever a stored message holds, having the server
// hand it on to another subject must not make it believed.
func storeAt(t *testing.T, url string, data []byte) (*nats.Conn, string) {
	t.Helper()
	ctx := ctxT(t)
	attacker := connectAs(t, url, RoleHolder)
	ajs, err := JetStream(context.Background(), connectAs(t, url, RoleService))
	if err != nil {
		t.Fatal(err)
	}
	key := fmt.Sprintf("inject%d", time.Now().UnixNano())
	m := nats.NewMsg("$KV.FENCELINE_ATTEMPTS." + key)
	m.Header.Set(writerHeader, "forged") // as if a service wrote it
	m.Data = data
	if _, err := ajs.PublishMsg(ctx, m); err != nil {
		t.Fatalf("plant an attempt record: %v", err)
	}
	return attacker, key
}

// foreignLogRecords returns how many messages after seq the lease log
// holds that no service wrote, and fails the test if the service would
// take one of them for its own.
func foreignLogRecords(t *testing.T, b *bus, after uint64) int {
	t.Helper()
	ctx := ctxT(t)
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for seq := after + 1; seq <= info.State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if m.Header.Get(writerHeader) == b.svc.store.writer {
			continue
		}
		n++
		t.Logf("the lease log stored a message no service wrote, at %d on %s: %s (headers %v)", seq, m.Subject, m.Data, m.Header)
		// (A pull request's delivery is stored under the record's own
		// subject, which the log never reads.)
		if strings.HasPrefix(m.Subject, logSubject+".") && serviceWrote(m.Header) {
			t.Errorf("the service would take the foreign message at %d for its own", seq)
		}
	}
	return n
}

func logLastSeq(t *testing.T, b *bus) uint64 {
	t.Helper()
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctxT(t), LogStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

// A holder names the repo's lease log subject as the reply subject of a
// JetStream API request it may make: the server sends its answer there,
// and the log stream stores whatever is published on its subjects. A
// JetStream API answer so stored damages the log (the service refuses
// the repo); a direct get's answer carries the holder's own bytes (a
// forged snapshot, here even with the service's writer header). The
// server stores them (nothing keeps it from it), but the service reads
// only what a service wrote: the victim's lease stays, the repo is served
// and fences keep rising.
func TestHolderCannotWriteLeaseLogThroughReplies(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"apianswer", "directget", "msgget", "pullnext", "servicereply"} {
		t.Run(how, func(t *testing.T) {
			b := startBus(t)
			ctx := ctxT(t)
			url := b.srv.ClientURL()
			l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
			if err != nil {
				t.Fatal(err)
			}
			before := logLastSeq(t, b)
			forged, _ := json.Marshal(logRecord{Kind: recordSnapshot, Repo: repo, Fence: 0})
			attacker, key := storeAt(t, url, forged)
			logSubj := logSubjectFor(RepoKey(repo))
			switch how {
			case "apianswer":
				err = attacker.PublishRequest(FleetJSAPI+".STREAM.INFO.KV_FENCELINE_ATTEMPTS", logSubj, nil) // a JetStream API answer
			case "directget":
				req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
				err = attacker.PublishRequest(FleetJSAPI+".DIRECT.GET.KV_FENCELINE_ATTEMPTS", logSubj, req)
			case "msgget":
				req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
				err = attacker.PublishRequest(FleetJSAPI+".STREAM.MSG.GET.KV_FENCELINE_ATTEMPTS", logSubj, req)
			case "servicereply":
				// The lease service's own answer (it may publish on every
				// fenceline subject).
				req, _ := json.Marshal(getRequest{LeaseID: l.LeaseID, Repo: repo})
				err = attacker.PublishRequest(requestSubject("get", IdentityOf(attacker)), logSubj, req)
			case "pullnext":
				create, _ := json.Marshal(map[string]any{"stream_name": "KV_FENCELINE_ATTEMPTS", "config": map[string]any{
					"name": key, "ack_policy": "none", "filter_subject": "$KV.FENCELINE_ATTEMPTS." + key, "deliver_policy": "last",
				}})
				var resp *nats.Msg
				resp, err = attacker.Request(FleetJSAPI+".CONSUMER.CREATE.KV_FENCELINE_ATTEMPTS."+key+".$KV.FENCELINE_ATTEMPTS."+key, create, 5*time.Second)
				if err == nil {
					t.Logf("pull consumer: %s", resp.Data)
					err = attacker.PublishRequest(FleetJSAPI+".CONSUMER.MSG.NEXT.KV_FENCELINE_ATTEMPTS."+key, logSubj, []byte(`{"batch":1}`))
				}
			}
			if err != nil {
				t.Fatal(err)
			}
			if err := attacker.Flush(); err != nil {
				t.Fatal(err)
			}
			// A later grant on the repo makes the service append (and, on a
			// foreign record, reload).
			l2, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
			if err != nil {
				t.Errorf("a grant after the attack: %v", err)
			}
			foreignLogRecords(t, b, before)
			got, err := b.c.Get(ctx, l.LeaseID)
			if err != nil || !got.Active() {
				t.Errorf("after the attack: victim %+v %v, want active", got, err)
			}
			if l2 != nil && l2.Fence <= l.Fence {
				t.Errorf("the next grant got fence %d after %d: fences rewound", l2.Fence, l.Fence)
			}
		})
	}
}

// The audit chain, attacked the same way: a holder has the server's direct
// get answer carry a forged chain message (a written-up-to mark far
// ahead, and a made-up revoke) onto the repo's service audit subject.
// Believed, the mark would drop the events of every later grant (and let
// the snapshot purge the log copy), and the forged revoke would read as
// the service's. The service's chain ignores it: every grant after the
// attack is in the audit once, and no reader sees the forged event.
func TestHolderCannotForgeTheAuditChain(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	l1, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	wantOnce(t, ctx, b.nc, repo, l1)
	forged, _ := json.Marshal(auditBatch{From: 0, LogSeq: 1 << 40, Events: []lease.AuditEvent{{
		Type: lease.EventRevoked, Repo: repo, LeaseID: "lease_forged", Boundary: lease.BoundaryLease, Reason: "forged", Time: time.Now().UTC(),
	}}})
	_, key := storeAt(t, url, forged)
	// The bus refuses the request: the audit's subjects are under "$JS.",
	// which no client may name as a reply.
	refused := make(chan error, 1)
	attacker := connectAs(t, url, RoleHolder, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		select {
		case refused <- err:
		default:
		}
	}))
	req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
	if err := attacker.PublishRequest(FleetJSAPI+".DIRECT.GET.KV_FENCELINE_ATTEMPTS", serviceAuditSubject(RepoKey(repo)), req); err != nil {
		t.Fatal(err)
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-refused:
		if !strings.Contains(err.Error(), "Permissions Violation for Publish with Reply") {
			t.Fatalf("the bus answered the attack with %v, want a refused reply subject", err)
		}
	case <-ctx.Done():
		t.Fatal("the bus did not refuse a request whose reply is the audit chain's subject")
	}
	var later []*lease.Lease
	for i := range 3 {
		l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("b%d", i)), Owner: owner(2 + i), TTL: lease.Duration(time.Minute)}, NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		later = append(later, l)
	}
	wantOnce(t, ctx, b.nc, repo, append(later, l1)...)
	evs, err := ReadAudit(ctx, connectAs(t, url, RoleViewer), repo, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if ev.LeaseID == "lease_forged" {
			t.Errorf("the audit reads a forged event as the service's: %+v", ev)
		}
	}
}

// A holder may not sweep, but it may make the server (or the lease
// service itself) answer onto the operator's sweep subject: a JetStream
// API request, with the operator's request subject as its reply. The
// answer carries no reply of its own and no JetStream header, and decodes
// as a sweep request. The service takes requests only as their identity
// sends them, with a reply to that identity's own inbox: no sweep runs in
// the operator's name, and the audit says nobody swept.
func TestHolderCannotAskThroughReplies(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	opNC := connectAs(t, url, RoleOperator)
	op, viewer := IdentityOf(opNC), IdentityOf(connectAs(t, url, RoleViewer))
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	attacker := connectAs(t, url, RoleHolder)
	for _, subj := range []string{requestSubject("sweep", op), requestSubject("list", viewer)} {
		// A JetStream API answer, and the lease service's own answer.
		if err := attacker.PublishRequest(FleetJSAPI+".STREAM.INFO.KV_FENCELINE_ATTEMPTS", subj, nil); err != nil {
			t.Fatal(err)
		}
		req, _ := json.Marshal(getRequest{LeaseID: l.LeaseID, Repo: repo})
		if err := attacker.PublishRequest(requestSubject("get", IdentityOf(attacker)), subj, req); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	// The operator's own list, after: once it is audited, the forged
	// ones (sent first) had their chance.
	if _, err := NewClient(opNC).List(ctx, repo, false); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventList && ev.RequestedBy == b.svc.name(op) {
				return nil
			}
		}
		return errors.New("the operator's list is not audited yet")
	})
	evs, err := ReadAudit(ctx, b.nc, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if ev.Type == lease.EventSweep || (ev.Type == lease.EventList && ev.RequestedBy != b.svc.name(op)) {
			t.Errorf("the service acted on an answer as a request: %s by %q (%s)", ev.Type, ev.RequestedBy, ev.Message)
		}
	}
	// It ignored them, and said so in the audit, in no one's name (the
	// identities whose subjects were abused did not send them).
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, "", 0)
		if err != nil {
			return err
		}
		forged := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == ReasonBusForged {
				if ev.RequestedBy != "" || !strings.Contains(ev.Message, "not that identity's inbox") {
					t.Fatalf("the forged request's audit event: %+v", ev)
				}
				forged++
			}
		}
		if forged < 4 {
			return fmt.Errorf("%d forged requests audited, want 4", forged)
		}
		return nil
	})
}

// The same answers aimed at the subjects of Anonymous, the identity of
// every connection on a bus without credentials. On a bus with identities
// no connection is Anonymous, and none may publish on its subjects, but
// answers can be sent there as above, with no reply: the service took
// them as Anonymous's requests (which need no inbox reply), unaudited,
// in a turn of the intake exempt from the per-identity bounds. Now they
// are refused and audited as any other answer sent onto a request subject.
func TestNoOneAsksAsAnonymousOnABusWithIdentities(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	attacker := connectAs(t, url, RoleHolder)
	// JetStream's answers: no reply, a body of JetStream's. (The service
	// answers nobody but the asker's own inbox: TestHolderCannotAskThroughReplies.)
	ops := []string{"sweep", "revoke", "get", "acquire", "keepalive"}
	for _, op := range ops {
		if err := attacker.PublishRequest(FleetJSAPI+".STREAM.INFO.KV_FENCELINE_ATTEMPTS", requestSubject(op, Anonymous), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	want := len(ops)
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, "", 0)
		if err != nil {
			return err
		}
		forged := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == ReasonBusForged {
				if ev.RequestedBy != "" || !strings.Contains(ev.Message, "no one asks as "+Anonymous) {
					t.Fatalf("the forged request's audit event: %+v", ev)
				}
				forged++
			}
		}
		if forged < want {
			return fmt.Errorf("%d answers sent onto the anonymous subjects audited as forged, want %d", forged, want)
		}
		return nil
	})
	evs, err := ReadAudit(ctx, b.nc, "", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if ev.RequestedBy == b.svc.name(Anonymous) || ev.RequestedBy == Anonymous {
			t.Errorf("the service acted on an answer as Anonymous's request: %s (%s)", ev.Type, ev.Message)
		}
	}
	if got, err := b.c.Get(ctx, l.LeaseID); err != nil || !got.Active() {
		t.Fatalf("the lease after the answers: %+v, %v: want it held", got, err)
	}
}

// The same answers aimed at the change subjects a watcher (the run UI)
// hears: a JetStream API answer and the lease service's own answer to a get, sent
// onto a lease's change subject. Neither is a record of that lease: the
// watcher sees only the real grant that follows.
func TestWatcherIgnoresAnswersOnChangeSubjects(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var seen []string
	stop, err := NewClient(connectAs(t, url, RoleViewer)).Watch(repo, func(got *lease.Lease) {
		mu.Lock()
		seen = append(seen, got.LeaseID)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	attacker := connectAs(t, url, RoleHolder)
	subj := ChangedSubject(repo, l.LeaseID)
	if err := attacker.PublishRequest(FleetJSAPI+".STREAM.INFO.KV_FENCELINE_ATTEMPTS", subj, nil); err != nil {
		t.Fatal(err)
	}
	req, _ := json.Marshal(getRequest{LeaseID: l.LeaseID, Repo: repo})
	if err := attacker.PublishRequest(requestSubject("get", IdentityOf(attacker)), subj, req); err != nil {
		t.Fatal(err)
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	l2, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "b"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if !slices.Contains(seen, l2.LeaseID) {
			return errors.New("the grant of " + l2.LeaseID + " not seen yet")
		}
		return nil
	})
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(seen, []string{l2.LeaseID}) {
		t.Errorf("the watcher saw records %q, want only the real grant %s", seen, l2.LeaseID)
	}
}

// Answers sent onto the instances' own subjects: each on an append
// announcement of a made-up repo would start an actor (a goroutine) for
// it, without end. The service takes announcements only from instances.
func TestHolderCannotStartActorsThroughReplies(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	hasActor := func(key string) bool {
		b.svc.mu.Lock()
		defer b.svc.mu.Unlock()
		_, ok := b.svc.actors[key]
		return ok
	}
	b.svc.followOthers() // as when another instance is on the bus
	if err := b.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	attacker := connectAs(t, url, RoleHolder)
	for i := range 20 {
		if err := attacker.PublishRequest(FleetJSAPI+".STREAM.INFO.KV_FENCELINE_ATTEMPTS", fmt.Sprintf("%s.junk%d", appendedPrefix, i), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	// Then a real announcement by another instance: once its repo has an
	// actor, the answers (handled in order before it) had their chance.
	witness := nats.NewMsg(appendedPrefix + ".witness")
	witness.Header.Set(writerHeader, "another-instance")
	witness.Data = []byte("1")
	if err := connect(t, url).PublishMsg(witness); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if !hasActor("witness") {
			return errors.New("the real announcement was not handled yet")
		}
		return nil
	})
	for i := range 20 {
		if hasActor(fmt.Sprintf("junk%d", i)) {
			t.Fatalf("an answer on the append announcement of made-up repo junk%d started an actor", i)
		}
	}
}

// A holder has the server deliver a record the service stored (so it
// carries a service's writer stamp) onto the subject on which instances
// share the sessions they heard: the push consumer's creator names its
// delivery subject unchecked, and the service subscribes there. Taken for
// another instance's digest, it would make a made-up instance a peer
// (while it is not heard, no instance reclaims a dead runner's lease) and
// its lines sessions heard (kept alive). The service takes no JetStream
// delivery on the subjects between instances (fromInstance).
func TestHolderCannotShareSessionsThroughJetStream(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	// The delivery happens: a subscriber of the test's own sees it.
	delivered := make(chan struct{}, 1)
	sub, err := b.nc.Subscribe(sessionsSubject, func(m *nats.Msg) {
		if m.Header.Get(writerHeader) == "forged" {
			select {
			case delivered <- struct{}{}:
			default:
			}
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := b.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	resp := injectViaConsumer(t, b.srv.ClientURL(), sessionsSubject, []byte("holder.session-of-a-dead-runner\n"))
	select {
	case <-delivered:
	case <-time.After(10 * time.Second):
		t.Fatalf("the holder's push consumer delivered nothing onto %s (%s): the attack never ran", sessionsSubject, resp)
	}
	// Then a real digest of another instance: once the service has learned
	// it, the delivery (handled in order before it) had its chance.
	witness := nats.NewMsg(sessionsSubject)
	witness.Header.Set(writerHeader, "another-instance")
	if err := b.nc.PublishMsg(witness); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		b.svc.live.mu.Lock()
		defer b.svc.live.mu.Unlock()
		if _, ok := b.svc.live.peers["another-instance"]; !ok {
			return errors.New("the real digest was not learned yet")
		}
		return nil
	})
	b.svc.live.mu.Lock()
	_, peer := b.svc.live.peers["forged"]
	_, seen := b.svc.live.seen["holder.session-of-a-dead-runner"]
	b.svc.live.mu.Unlock()
	if peer || seen {
		t.Fatalf("a JetStream delivery on %s was taken as an instance's digest: peer %v, session heard %v", sessionsSubject, peer, seen)
	}
}

// TestRequestIDsAreEachIdentitysOwn: an acquire's request id makes its
// retry (after a lost reply, or a "try again") return the lease it was
// granted. Another runner can learn that id (a conflict names the queued
// request it waits behind) and, before, could take it over: a lease of
// its own under the same id, released at once, made the service forget
// the victim's, whose retry then conflicted with its own lease and held
// its scope for nothing until the lease's TTL ran out.
func TestRequestIDsAreEachIdentitysOwn(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	req := AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute), RequestID: NewRequestID()}
	cred := NewCredential()
	l, err := victim.Acquire(ctx, req, cred)
	if err != nil {
		t.Fatal(err)
	}
	acred := NewCredential()
	al, err := attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "elsewhere"), Owner: owner(2), TTL: lease.Duration(time.Minute), RequestID: req.RequestID}, acred)
	if err != nil {
		t.Fatal(err)
	}
	if al.LeaseID == l.LeaseID {
		t.Fatalf("the attacker's acquire with the victim's request id was answered the victim's lease %s", l.LeaseID)
	}
	if _, err := attacker.Release(ctx, al.LeaseID, acred); err != nil {
		t.Fatal(err)
	}
	again, err := victim.Acquire(ctx, req, cred)
	if err != nil {
		t.Fatalf("the victim's retry of its acquire: %v, want its lease %s", err, l.LeaseID)
	}
	if again.LeaseID != l.LeaseID {
		t.Fatalf("the victim's retry was granted %s, want its lease %s again", again.LeaseID, l.LeaseID)
	}
}
