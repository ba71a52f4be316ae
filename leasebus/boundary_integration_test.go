//go:build integration

package leasebus

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

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
	m := nats.NewMsg(eventsSubjectFor(repo, lease.BoundaryGit, "forged"))
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
	r, err := aud.c.request(ctx, "audit", &lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryGit, Repo: repo, Message: big}, 0)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Error.err(); !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "at most") {
		t.Fatalf("a 7 MiB event: %v, want refused as too large", err)
	}
	// Neither the lease's own boundary nor the bus's.
	for _, boundary := range []string{lease.BoundaryLease, lease.BoundaryBus, "nonsense"} {
		r, err := aud.c.request(ctx, "audit", &lease.AuditEvent{Type: lease.EventGrant, Boundary: boundary, Repo: repo, Message: "forged grant"}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Error.err(); !errors.Is(err, lease.ErrInvalid) {
			t.Fatalf("an event of boundary %q: %v, want refused", boundary, err)
		}
	}
	// A long message is kept as an excerpt, and the event names who sent
	// it, whatever it says.
	if err := aud.Record(ctx, lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryNet, Repo: repo, RequestedBy: "operator",
		Reason: "not-allowed", Message: "CONNECT https://exfil.example/" + strings.Repeat("a", 900<<10)}); err != nil {
		t.Fatal(err)
	}
	evs, err := ReadAudit(ctx, b.nc, repo, 0)
	if err != nil {
		t.Fatal(err)
	}
	var got *lease.AuditEvent
	for i := range evs {
		if evs[i].Boundary == lease.BoundaryNet {
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
