//go:build integration

package leasebus

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestClusterPrimaryTakesItsLapsedClaimBack: the node leading the claim's
// stream is cut off from the others while neither instance runs on it. The primary cannot renew
// its claim until the stream has elected another leader (seconds, longer
// than a term), so its term runs out; once the claim can be written
// again, the last record is still its own, and it takes the claim back at
// once instead of leaving it to the standby, which would have had to load
// every repo's log before serving (at 10,000 leases on this machine
// longer than the holders' TTL). The standby never begins a term — unless
// the lapsed primary cannot read the claim itself by then — and the lease
// granted before is served on.
func TestClusterPrimaryTakesItsLapsedClaimBack(t *testing.T) {
	t.Parallel()
	cl := startClusterOf(t, true)
	ctx := ctxFor(t, 3*time.Minute) // its waits add up to more than ctxT's 30 s on a loaded machine
	k := ledStreams(ctx, t, cl, PrimaryStream)
	var svcs []*Service
	for i := range cl.srvs {
		if i == k {
			continue
		}
		svc, _ := startClusterServiceWith(ctx, t, connect(t, cl.urls[i]), ServiceConfig{Primary: true, PrimaryTerm: testTerm})
		svcs = append(svcs, svc)
	}
	p := primaryOf(t, svcs, 30*time.Second)
	c := NewClient(connect(t, cl.urls[(k+1)%3]))
	l, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "kept"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}

	cl.isolate(t, k, true)
	killed := time.Now()
	checkFor(t, 30*time.Second, 5*time.Millisecond, func() error {
		if svcs[p].Primary() {
			return errors.New("the primary's term has not run out yet")
		}
		return nil
	})
	lapsed := time.Since(killed)
	// The lapsed primary comes first, unless it cannot read the claim
	// itself when the standby, reading it again for primaryGap, takes
	// over: its own node's JetStream still unavailable (503 for 17 s
	// longer than the standby's node's in one run under load). It could
	// not serve then either; the standby's takeover is the design's.
	var cutOff error
	checkFor(t, 60*time.Second, 10*time.Millisecond, func() error {
		if svcs[p].Primary() {
			return nil
		}
		if svcs[1-p].Primary() {
			lp := svcs[p].prim
			lp.mu.Lock()
			readErr, backAt := lp.readErr, lp.backAt
			lp.mu.Unlock()
			if readErr == nil && time.Since(backAt) > primaryGap/2 {
				t.Fatalf("the standby took over %s after the cut while the lapsed primary could read the claim (since %s ago): the lapsed primary did not come first",
					time.Since(killed).Round(time.Millisecond), time.Since(backAt).Round(time.Millisecond))
			}
			cutOff = cmp.Or(readErr, errors.New("its reads came back as the standby took over"))
			return nil
		}
		return fmt.Errorf("instance %d (the primary before) is not primary again yet", p)
	})
	if cutOff != nil {
		t.Logf("the claim's stream leader was cut off; the primary's term ran out %s later, and the standby took over %s after the cut while the lapsed primary could not read the claim (%v)",
			lapsed.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond), cutOff)
	} else {
		t.Logf("the claim's stream leader was cut off; the primary's term ran out %s later and it took the claim back %s after the cut",
			lapsed.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond))
		if n := svcs[1-p].prim.number; n != 0 {
			t.Fatalf("the standby began %d terms: the lapsed primary did not come first", n)
		}
	}
	// The log stream may still be electing a leader of its own (its
	// leader may have been the node cut off): the bus says so, and the
	// lease is there once it serves.
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		got, err := c.Get(ctx, l.LeaseID)
		if errors.Is(err, lease.ErrUnavailable) {
			return err
		}
		if err != nil || !got.Active() || got.Fence != l.Fence {
			t.Fatalf("after the claim came back: %+v %v, want the lease granted before", got, err)
		}
		return nil
	})
	if _, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "after"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(20 * time.Second)}, NewCredential()); err != nil {
		t.Fatalf("acquire after the claim came back: %v", err)
	}
}

// TestClusterPrimaryLeadsNoStreamItWaitsOn: the primary keeps the lease
// log's stream and the claim's led from nodes other than its own, so that
// its node's death costs a takeover or a stream's election, not one after
// the other. The first instance starts on the node that leads the log
// stream (and becomes the primary there); within its first check the log
// stream, and the claim's if it led that too, are led from another node
// than the primary's, and the lease granted before is served on.
func TestClusterPrimaryLeadsNoStreamItWaitsOn(t *testing.T) {
	t.Parallel()
	cl := startClusterOf(t, false)
	ctx := ctxFor(t, 3*time.Minute) // its waits add up to more than ctxT's 30 s on a loaded machine
	k := ledStreams(ctx, t, cl, LogStream)
	first, _ := startClusterServiceWith(ctx, t, connect(t, cl.urls[k]), ServiceConfig{Primary: true, PrimaryTerm: testTerm})
	primaryOf(t, []*Service{first}, 30*time.Second)
	c := NewClient(connect(t, cl.urls[(k+1)%3]))
	l, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "kept"), Owner: owner(1), TTL: lease.Duration(time.Minute), Wait: lease.Duration(20 * time.Second)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	svcs := make([]*Service, len(cl.srvs))
	svcs[k] = first
	for i := range cl.srvs {
		if i != k {
			svcs[i], _ = startClusterServiceWith(ctx, t, connect(t, cl.urls[i]), ServiceConfig{Primary: true, PrimaryTerm: testTerm})
		}
	}
	// Whichever instance is the primary by then (a loaded machine may
	// move a 600 ms term), neither stream is led from its node.
	checkFor(t, apartAfter+30*time.Second, 50*time.Millisecond, func() error {
		p := -1
		for i, s := range svcs {
			if s.Primary() {
				p = i
			}
		}
		if p < 0 {
			return errors.New("no primary")
		}
		for _, st := range apartStreams {
			if cl.streamLeader(st) == p {
				return fmt.Errorf("stream %s is led from the primary's node %d", st, p)
			}
		}
		return nil
	})
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		got, err := c.Get(ctx, l.LeaseID)
		if errors.Is(err, lease.ErrUnavailable) {
			return err
		}
		if err != nil || !got.Active() || got.Fence != l.Fence {
			t.Fatalf("after the streams moved: %+v %v, want the lease granted before", got, err)
		}
		return nil
	})
}

// ledStreams makes the bus's streams on cl (before any service starts, so
// that a test sees where they lead) and returns the index of the node
// leading stream, once it has a leader.
func ledStreams(ctx context.Context, t *testing.T, cl *testCluster, stream string) int {
	t.Helper()
	js, err := JetStream(context.Background(), cl.connect(t))
	if err != nil {
		t.Fatal(err)
	}
	checkFor(t, 60*time.Second, 100*time.Millisecond, func() error {
		ectx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return ensureStreams(ectx, js, 3)
	})
	k := -1
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if k = cl.streamLeader(stream); k < 0 {
			return fmt.Errorf("stream %s has no leader yet", stream)
		}
		return nil
	})
	return k
}
