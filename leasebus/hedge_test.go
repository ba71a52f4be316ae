package leasebus

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/natstest"
	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// TestAPausedQueueMemberCostsAHedge: an instance whose process is paused
// (SIGSTOP, a stalled VM) keeps its place in the service's queue group
// until its node's routes time out, and NATS hands it a share of every
// request, which it never answers. Here a member that takes the lease
// requests and answers none gets half of them. A client must get every
// answer all the same, each within one try: a lost copy costs a hedge,
// not the try's timeout.
func TestAPausedQueueMemberCostsAHedge(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/hedge", Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}

	paused := connect(t, b.srv.ClientURL())
	var swallowed atomic.Int64
	for _, op := range []string{"get", "revoke"} {
		if _, err := paused.QueueSubscribe(requestSubject(op, "*"), serviceQueue, func(*nats.Msg) { swallowed.Add(1) }); err != nil {
			t.Fatal(err)
		}
	}
	if err := paused.Flush(); err != nil {
		t.Fatal(err)
	}

	// NATS hands each copy to either member at random: a request is lost
	// only when every copy within its try goes to the paused one. With
	// copies 5 ms, then 10, 20, ... apart, a 30 s try sends 13: one
	// request in 8,192 is lost, 0.16 % of runs. (A 50 ms hedge in a 5 s
	// try sent 7, and lost one request in 128: 18 % of runs failed, as one
	// CI run did.) Without the hedge, half the requests are lost.
	c := NewClient(b.nc)
	c.Tries, c.Timeout, c.Hedge = 1, 30*time.Second, 5*time.Millisecond
	const n = 12
	for i := range n {
		got, err := c.Get(ctx, l.LeaseID)
		if err != nil {
			t.Fatalf("get %d of %d, with a paused member in the queue group: %v", i+1, n, err)
		}
		if got.LeaseID != l.LeaseID || !got.Active() {
			t.Fatalf("get %d: %+v, want the active lease %s", i+1, got, l.LeaseID)
		}
	}
	rv, err := c.Revoke(ctx, l.LeaseID, "hedge test")
	if err != nil {
		t.Fatalf("revoke: %v", err)
	}
	if rv.Status != lease.StatusRevoked {
		t.Fatalf("revoke: %s, want revoked", rv.Status)
	}
	// The member took its share: every answer above came despite it.
	if swallowed.Load() == 0 {
		t.Fatalf("the paused member took none of %d requests: the test shows nothing", n+1)
	}
	t.Logf("the paused member swallowed %d copies of %d requests", swallowed.Load(), n+1)
}

// TestHedgedRequestTakesTheFirstAnswer: a request is sent again, on the
// same reply subject, when its first copy goes unanswered, and the first
// answer to any copy ends it; without a hedge the lost copy is the
// request's end.
func TestHedgedRequestTakesTheFirstAnswer(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, "")
	responder := connectNATS(t, srv)
	// The responder drops the first copy of every request and answers
	// each later one.
	seen := map[string]int{}
	sub, err := responder.Subscribe("hedge.echo", func(m *nats.Msg) {
		if seen[m.Reply]++; seen[m.Reply] > 1 {
			_ = m.Respond(m.Data)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := connectNATS(t, srv)
	for _, max := range []int{4, 0} { // a mailbox of its own; the shared overflow
		p := &mailboxes{nc: nc, max: max}
		t.Cleanup(p.close)
		m := nats.NewMsg("hedge.echo")
		m.Data = []byte("x")
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		r, err := p.requestChecked(ctx, m, nil, nil, 20*time.Millisecond)
		cancel()
		if err != nil || string(r.Data) != "x" {
			t.Fatalf("max %d: hedged request: %v %v", max, r, err)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 300*time.Millisecond)
		_, err = p.requestChecked(ctx, m, nil, nil, 0)
		cancel()
		if err == nil {
			t.Fatalf("max %d: a request without a hedge was answered, though its only copy was dropped", max)
		}
	}
}
