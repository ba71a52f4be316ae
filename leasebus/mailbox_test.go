package leasebus

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/natstest"
)

// TestMailboxesBeyondMaxMakeNoSubscriptions: requests beyond the pool's
// max share one overflow subscription, so a burst of requests changes no
// subscription after the first (each change is propagated to every server
// of a cluster and clears each server's subject cache), and every request
// still gets the answer to itself.
func TestMailboxesBeyondMaxMakeNoSubscriptions(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, "")
	responder := connectNATS(t, srv)
	// The responder answers once the whole burst is in (every request
	// waiting at once), each first with a reply the request does not
	// accept.
	const burstSize = 32
	var held []*nats.Msg
	echo, err := responder.Subscribe("mailbox.echo", func(m *nats.Msg) {
		if held = append(held, m); len(held) < burstSize {
			return
		}
		for _, m := range held {
			_ = m.Respond([]byte("not-" + string(m.Data)))
			_ = m.Respond(m.Data)
		}
		held = nil
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = echo.Unsubscribe() })
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := connectNATS(t, srv)
	p := &mailboxes{nc: nc, max: 2}
	t.Cleanup(p.close)
	burst := func() {
		t.Helper()
		var wg sync.WaitGroup
		errs := make(chan error, burstSize)
		for i := range burstSize {
			wg.Go(func() {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				want := fmt.Sprint(i)
				m := nats.NewMsg("mailbox.echo")
				m.Data = []byte(want)
				r, err := p.requestChecked(ctx, m, nil, func(r *nats.Msg) bool { return string(r.Data)[:1] != "n" }, 0)
				switch {
				case err != nil:
					errs <- fmt.Errorf("request %d: %w", i, err)
				case string(r.Data) != want:
					errs <- fmt.Errorf("request %d got the answer %q", i, r.Data)
				}
			})
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
	}
	changes := func() uint64 {
		t.Helper()
		if err := nc.Flush(); err != nil {
			t.Fatal(err)
		}
		sz, err := srv.Subsz(&server.SubszOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return sz.NumInserts + sz.NumRemoves
	}
	burst()
	if subs := nc.NumSubscriptions(); subs > p.max+1 {
		t.Fatalf("%d subscriptions after a burst of %d requests: want at most max (%d) plus one overflow", subs, burstSize, p.max)
	}
	before := changes()
	burst()
	if n := changes() - before; n != 0 {
		t.Fatalf("a second burst of %d requests made or dropped %d subscriptions: requests beyond max must share one", burstSize, n)
	}
	p.mu.Lock()
	waiting := len(p.over.waiting)
	p.mu.Unlock()
	if waiting != 0 {
		t.Fatalf("%d overflow waiters left after every request returned", waiting)
	}
}

// connectNATS connects to srv, closed at the test's end.
func connectNATS(t *testing.T, srv *natstest.Server) *nats.Conn {
	t.Helper()
	nc, err := nats.Connect(srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestMailboxesAreSmall: a mailbox waits for one reply at a time, so it
// holds a few messages, not a synchronous subscription's 65,536 (512 KB
// of pointers, allocated whole: 30 MB of a service's heap at 10,000
// leases, and up to 8 MB a client).
func TestMailboxesAreSmall(t *testing.T) {
	srv := natstest.Start(t, "")
	nc := connectNATS(t, srv)
	const n = 16
	p := &mailboxes{nc: nc, max: n}
	t.Cleanup(p.close)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	boxes := make([]*mailbox, n)
	for i := range boxes {
		if boxes[i] = p.get(); boxes[i] == nil {
			t.Fatalf("mailbox %d not made", i)
		}
	}
	runtime.ReadMemStats(&after)
	for _, mb := range boxes {
		p.put(mb)
	}
	per := (after.TotalAlloc - before.TotalAlloc) / n
	if per > 16<<10 {
		t.Errorf("a mailbox allocates %d bytes: want a few kilobytes at most", per)
	}
	t.Logf("a mailbox allocates %d bytes", per)
}

// TestMailboxRequestEndsWhenItsConnectionCloses: a request waiting for a
// reply ends with nats.ErrConnectionClosed when its connection closes, as
// nats.go's own requests do, not at its context's end.
func TestMailboxRequestEndsWhenItsConnectionCloses(t *testing.T) {
	srv := natstest.Start(t, "")
	nc := connectNATS(t, srv)
	heard := make(chan struct{}, 1)
	if _, err := nc.Subscribe("mailbox.silent", func(*nats.Msg) { heard <- struct{}{} }); err != nil { // takes requests, answers none
		t.Fatal(err)
	}
	p := &mailboxes{nc: nc, max: 1}
	done := make(chan error, 1)
	go func() {
		_, err := p.request(context.Background(), nats.NewMsg("mailbox.silent"))
		done <- err
	}()
	select {
	case <-heard:
	case <-time.After(10 * time.Second):
		t.Fatal("the request was not sent")
	}
	nc.Close()
	select {
	case err := <-done:
		if !errors.Is(err, nats.ErrConnectionClosed) {
			t.Fatalf("the request ended with %v, want %v", err, nats.ErrConnectionClosed)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request still waits 10 s after its connection closed")
	}
}

// TestMailboxesSubscribeUpFront: a pool's mailboxes are subscribed when
// the pool is made, and its requests make no subscription after: on a
// cluster a new subscription's interest reaches the other servers in a
// race with the first answers to it (see newMailboxes).
func TestMailboxesSubscribeUpFront(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, "")
	responder := connectNATS(t, srv)
	echo, err := responder.Subscribe("mailbox.echo", func(m *nats.Msg) { _ = m.Respond(m.Data) })
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = echo.Unsubscribe() })
	if err := responder.Flush(); err != nil {
		t.Fatal(err)
	}
	nc := connectNATS(t, srv)
	const max = 4
	p := newMailboxes(nc, max)
	t.Cleanup(p.close)
	if n := nc.NumSubscriptions(); n != max+1 {
		t.Fatalf("%d subscriptions once the pool is made: want all %d mailboxes and the overflow", n, max)
	}
	var wg sync.WaitGroup
	for i := range 2 * max {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			m := nats.NewMsg("mailbox.echo")
			m.Data = []byte(fmt.Sprint(i))
			if r, err := p.request(ctx, m); err != nil || string(r.Data) != fmt.Sprint(i) {
				t.Errorf("request %d: %v", i, err)
			}
		})
	}
	wg.Wait()
	if n := nc.NumSubscriptions(); n != max+1 {
		t.Fatalf("%d subscriptions after %d requests at once: want the %d made up front", n, 2*max, max+1)
	}
}
