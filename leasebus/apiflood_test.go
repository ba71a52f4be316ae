package leasebus

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

// TestJetStreamAPIFloodKeepsThePrimary: any fleet identity may ask the
// JetStream API for what it reads (a stream's records, its info, its own
// consumers), and every server takes those requests on two queues, each
// dropped whole past 10,000, info requests worked only while no other
// waits. Holders flood both. The primary must keep its claim and serve:
// its check that its fleet connection reaches its claim connection
// (hearsFleet) once asked for the claim's stream's info on the info
// queue, and under such a flood the primary let a 2 s term run out
// within 3 s (and an instance whose check failed could not take the
// claim either).
func TestJetStreamAPIFloodKeepsThePrimary(t *testing.T) {
	t.Parallel()
	const term = 2 * time.Second // renewed every 500 ms, each given the rest of the term
	b := electedAlone(t, term)
	began := termsBegun(b.svc)

	// The repo's log is read before the flood: the service's own reads
	// of a log wait in the same queue (a repo first asked for during a
	// flood is served seconds late).
	c := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	if _, err := c.Acquire(ctxT(t), AcquireRequest{Repo: repo, Scope: claim(t, "before"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	asker := connectAs(t, b.srv.ClientURL(), RoleHolder)
	info := FleetJSAPI + ".STREAM.INFO." + PolicyStream
	if _, err := asker.Request(info, nil, 5*time.Second); err != nil {
		t.Fatalf("a holder cannot ask for the policy stream's info before the flood: %v", err)
	}
	// Two holders flood: one creates consumers (the API's main queue, which
	// the servers work before any info request), the other asks for a
	// stream's info (the info queue, which fills while it waits and is
	// dropped whole at 10,000, with whatever else waited in it).
	ctx, stop := context.WithCancel(context.Background())
	floods := []struct{ subject, req string }{
		{FleetJSAPI + ".CONSUMER.CREATE." + PolicyStream, `{"stream_name":"` + PolicyStream + `","config":{"ack_policy":"none","deliver_policy":"all","mem_storage":true,"num_replicas":1,"inactive_threshold":1000000000}}`},
		{info, ""},
	}
	done := make(chan error, len(floods))
	for _, f := range floods {
		flooder := connectAs(t, b.srv.ClientURL(), RoleHolder)
		go func() {
			reply := flooder.NewRespInbox() // nobody listens: the answers are dropped
			for ctx.Err() == nil {
				for range 1000 { // blocks once the socket is full: nothing piles up here
					if err := flooder.PublishRequest(f.subject, reply, []byte(f.req)); err != nil {
						done <- err
						return
					}
				}
			}
			done <- nil
		}()
	}
	t.Cleanup(func() {
		stop()
		for range floods {
			if err := <-done; err != nil && !errors.Is(err, nats.ErrConnectionClosed) {
				t.Errorf("the flood: %v", err)
			}
		}
	})
	// The flood holds the API up: an info request goes unanswered.
	checkFor(t, 20*time.Second, 0, func() error {
		if _, err := asker.Request(info, nil, 300*time.Millisecond); err == nil {
			return errors.New("the policy stream's info is still answered within 300 ms: the flood is not heavy enough yet")
		}
		return nil
	})
	flooded := time.Now()

	// For four terms the primary keeps its claim, in the same term, and
	// answers a holder.
	for i := 0; time.Since(flooded) < 4*term; i++ {
		actx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := c.Acquire(actx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("flood/%d", i)), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
		cancel()
		if !b.svc.Primary() || termsBegun(b.svc) != began {
			t.Fatalf("the primary let its term go %s into a JetStream API flood (terms begun: %d, then %d)", time.Since(flooded).Round(time.Millisecond), began, termsBegun(b.svc))
		}
		if err != nil {
			t.Fatalf("a holder is not served %s into a JetStream API flood: %v", time.Since(flooded).Round(time.Millisecond), err)
		}
		time.Sleep(50 * time.Millisecond) // paces the acquires; nothing waited for
	}
}
