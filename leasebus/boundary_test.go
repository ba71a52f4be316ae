package leasebus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// A runner's credentials once let it write the audit stream itself: a
// 7 MiB event, an event in another writer's name (a forged writer
// header), for any repo, as fast as the store took them — enough to fill
// the store or evict every grant and revoke record. Now the bus refuses a
// holder's own writes to the audit stream, and what it sends through the
// service is clipped, named after its sender, and rate-limited per
// identity.
// flood records n events (ev(i)) one by one and counts those written and
// those the service refused over a rate limit, and how long it took.
func flood(ctx context.Context, t *testing.T, aud *Auditor, n int, ev func(int) AuditEvent) (written, limited int, took time.Duration) {
	t.Helper()
	start := time.Now()
	for i := range n {
		err := aud.Record(ctx, ev(i))
		switch {
		case err == nil:
			written++
		case errors.Is(err, ErrUnavailable) && strings.Contains(err.Error(), "faster than"):
			limited++
		default:
			t.Fatal(err)
		}
	}
	return written, limited, time.Since(start)
}

func TestBoundaryEventsAreBounded(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	holderNC := connectAs(t, url, RoleHolder)
	holder := IdentityOf(holderNC)

	// Straight into the stream: refused by the bus.
	js, err := JetStream(context.Background(), holderNC)
	if err != nil {
		t.Fatal(err)
	}
	big := strings.Repeat("x", 7<<20)
	m := nats.NewMsg(eventsSubjectFor(repo, BoundaryGit, "forged"))
	m.Header.Set(writerHeader, "forged")
	m.Data = []byte(`{"events":[{"type":"denied","boundary":"git","repo":"` + repo + `","message":"` + big[:1<<20] + `"}]}`)
	pctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = js.PublishMsg(pctx, m)
	cancel()
	if err == nil {
		t.Fatal("a holder wrote the audit stream itself")
	}

	// Through the service: a 7 MiB request is refused undecoded.
	aud, err := NewAuditor(holderNC)
	if err != nil {
		t.Fatal(err)
	}
	r, err := aud.c.request(ctx, "audit", &AuditEvent{Type: EventDenied, Boundary: BoundaryGit, Repo: repo, Message: big}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Error.err(); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("a 7 MiB event: %v, want refused as too large", err)
	}
	// Neither the lease's own boundary nor the bus's.
	for _, boundary := range []string{BoundaryLease, BoundaryBus, "nonsense"} {
		r, err := aud.c.request(ctx, "audit", &AuditEvent{Type: EventGrant, Boundary: boundary, Repo: repo, Message: "forged grant"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Error.err(); !errors.Is(err, ErrInvalid) {
			t.Fatalf("an event of boundary %q: %v, want refused", boundary, err)
		}
	}
	// A long message is kept as an excerpt, and the event names who sent
	// it, whatever it says.
	if err := aud.Record(ctx, AuditEvent{Type: EventDenied, Boundary: BoundaryNet, Repo: repo, RequestedBy: "operator",
		Reason: "not-allowed", Message: "CONNECT https://exfil.example/" + strings.Repeat("a", 900<<10)}); err != nil {
		t.Fatal(err)
	}
	evs, err := ReadAudit(ctx, b.nc, repo, 0)
	if err != nil {
		t.Fatal(err)
	}
	var got *AuditEvent
	for i := range evs {
		if evs[i].Boundary == BoundaryNet {
			got = &evs[i]
		}
	}
	switch {
	case got == nil:
		t.Fatal("the clipped event is not in the audit")
	case len(got.Message) > maxEventMessage+64 || !strings.Contains(got.Message, "bytes cut"):
		t.Fatalf("the event keeps %d bytes of the message: %.80q…", len(got.Message), got.Message)
	case got.RequestedBy != holder:
		t.Fatalf("the event names %q as its writer, want the identity that sent it (%s)", got.RequestedBy, holder)
	}
}

// One identity writing boundary events as fast as it can gets its burst and
// its rate, the rest is counted in one event a second; another identity's
// events still land.
func TestBoundaryEventsRateLimitedPerIdentity(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	flooder, err := NewAuditor(connectAs(t, url, RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	written, limited, took := flood(ctx, t, flooder, 3*boundaryBurst, func(i int) AuditEvent {
		return AuditEvent{Type: EventDenied, Boundary: BoundaryFile, Repo: repo, Message: fmt.Sprintf("flood %d", i)}
	})
	if most := boundaryBurst + int(took.Seconds()*boundaryRate) + 1; written > most || limited == 0 {
		t.Fatalf("%d events written one by one in %s (at most %d), %d refused over the rate", written, took.Round(time.Millisecond), most, limited)
	}
	other, err := NewAuditor(connectAs(t, url, RoleOperator))
	if err != nil {
		t.Fatal(err)
	}
	if err := other.Record(ctx, AuditEvent{Type: EventDenied, Boundary: BoundaryGit, Repo: repo, Message: "another runner's refusal"}); err != nil {
		t.Fatalf("another identity's event, during the flood: %v", err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Reason == ReasonRateLimited && strings.Contains(ev.Message, "boundary events more than") {
				return nil
			}
		}
		return errors.New("no event counts the dropped ones yet")
	})
}

// The shard store's buckets are the lease service's: an operator can no
// longer create a stream (whose subjects it would choose: the renewals',
// say), a Nats-Rollup: all no longer wipes a bucket, and a record of
// megabytes is refused; a holder no longer writes the buckets at all.
func TestShardBucketsAreTheServices(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	op, err := JetStream(context.Background(), connectAs(t, url, RoleOperator))
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	_, err = op.CreateStream(cctx, jetstream.StreamConfig{Name: shardPoolStream + "X", Subjects: []string{apiPrefix + ".renew.>"}})
	cancel()
	if err == nil {
		t.Fatal("an operator created a stream over the renewals' subjects")
	}

	holder, err := JetStream(context.Background(), connectAs(t, url, RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	hkv, err := holder.KeyValue(ctx, "FENCELINE_SHARDS")
	if err != nil {
		t.Fatalf("the service made no shard pool bucket: %v", err)
	}
	hctx, hcancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = hkv.Put(hctx, "pool-h", []byte(`{"repo":"h"}`))
	hcancel()
	if err == nil {
		t.Error("a holder wrote the shard pool bucket")
	}
	// Even the service's own connection: no rollup, no record of megabytes.
	svc, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := svc.KeyValue(ctx, "FENCELINE_SHARDS")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "pool-a", []byte(`{"repo":"a"}`)); err != nil {
		t.Fatal(err)
	}
	wipe := nats.NewMsg("$KV.FENCELINE_SHARDS.pool-b")
	wipe.Header.Set("Nats-Rollup", "all")
	wipe.Data = []byte(`{}`)
	if _, err := svc.PublishMsg(ctx, wipe); err == nil {
		t.Error("a Nats-Rollup: all was stored")
	}
	if e, err := kv.Get(ctx, "pool-a"); err != nil || string(e.Value()) != `{"repo":"a"}` {
		t.Fatalf("after a rollup, pool-a: %v %v", e, err)
	}
	if _, err := kv.Put(ctx, "pool-c", make([]byte, 7<<20)); err == nil {
		t.Error("a 7 MiB shard record was stored")
	}
}
