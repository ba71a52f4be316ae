//go:build integration

package leasebus

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestClusterStatusThroughAPartition: the primary's node cut off from the
// other two. An operator on the majority side, whose lease requests wait
// for the takeover, hears from both instances there (not from the cut-off
// one) and learns who the primary was and that it is not heard, then,
// once a standby took over, who serves and who leads the lease log.
func TestClusterStatusThroughAPartition(t *testing.T) {
	t.Parallel()
	cl := startClusterOf(t, true)
	ctx := ctxFor(t, 3*time.Minute)
	svcs := make([]*Service, len(cl.srvs))
	for i := range svcs {
		svcs[i], _ = startClusterServiceWith(ctx, t, connect(t, cl.urls[i]), ServiceConfig{Primary: true})
	}
	p := primaryOf(t, svcs, 60*time.Second)
	gone := svcs[p].store.writer
	var majority []string
	for i, u := range cl.urls {
		if i != p {
			majority = append(majority, u)
		}
	}
	viewer := NewClient(connectAs(t, strings.Join(majority, ","), RoleViewer))
	statusOf(ctx, t, viewer, 3)

	cl.isolate(t, p, true)
	cut := time.Now()
	// Until a standby takes over (the term plus the gap after the last
	// renewal), the answers say the primary's claim is unrenewed; a
	// loaded machine may ask only after it did.
	sts := statusOf(ctx, t, viewer, 2)
	why := Explain(sts)
	t.Logf("%s after the cut: %s", time.Since(cut).Round(time.Millisecond), why)
	if !strings.Contains(why, "instance "+gone+" did not answer from here") &&
		!strings.Contains(why, "the primary "+gone+" has not renewed its claim for ") {
		t.Errorf("Explain after the primary's node was cut off names no silence of %s: %q", gone, why)
	}
	for _, st := range sts {
		if st.Instance == gone {
			t.Errorf("the cut-off instance %s answered from the majority's side", gone)
		}
	}
	checkFor(t, 60*time.Second, 100*time.Millisecond, func() error {
		sts = statusOf(ctx, t, viewer, 2)
		why = Explain(sts)
		if !strings.Contains(why, " is the primary and serves") || !strings.Contains(why, "the lease log ("+LogStream+") is led by ") {
			return fmt.Errorf("no takeover yet: %s", why)
		}
		return nil
	})
	t.Logf("%s after the cut: %s", time.Since(cut).Round(time.Millisecond), why)
	if strings.Contains(why, "instance "+gone+" is the primary") {
		t.Errorf("the cut-off instance serves, say the majority's instances: %s", why)
	}
	cl.isolate(t, p, false)
}

// TestClusterDropsACutOffNodesRoutes: the other nodes give up a cut-off
// node's routes within seconds (route pings every 2 s, three unanswered),
// not the 20-30 s of the client ping interval: until then its lease
// service instance stays in the queue group and the requests handed to it
// vanish.
func TestClusterDropsACutOffNodesRoutes(t *testing.T) {
	t.Parallel()
	cl := startClusterOf(t, true)
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		for i, s := range cl.srvs {
			if n := s.NumRemotes(); n != 2 {
				return fmt.Errorf("node %d has %d remotes, want 2", i, n)
			}
		}
		return nil
	})
	cl.isolate(t, 2, true)
	cut := time.Now()
	checkFor(t, 18*time.Second, 50*time.Millisecond, func() error {
		for i, s := range cl.srvs[:2] {
			if n := s.NumRemotes(); n != 1 {
				return fmt.Errorf("node %d still has %d remotes %s after node 2 was cut off", i, n, time.Since(cut).Round(time.Millisecond))
			}
		}
		return nil
	})
	t.Logf("nodes 0 and 1 dropped node 2's routes %s after the cut", time.Since(cut).Round(time.Millisecond))
	// And the cut holds: no node dials a route around the bridges to the
	// address it learnt of node 2 (ServerConfig.ClusterAdvertise: before,
	// the routes came back straight to node 2's real address within
	// seconds and healed the partition).
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); {
		for i, s := range cl.srvs[:2] {
			if n := s.NumRemotes(); n != 1 {
				t.Fatalf("node %d has %d remotes %s after node 2 was cut off: a route went around the bridges", i, n, time.Since(cut).Round(time.Millisecond))
			}
		}
		time.Sleep(50 * time.Millisecond) // sampling a state that must not change, not waiting for one
	}
	cl.isolate(t, 2, false)
	checkFor(t, 30*time.Second, 50*time.Millisecond, func() error {
		if n := cl.srvs[2].NumRemotes(); n != 2 {
			return fmt.Errorf("node 2 has %d remotes after the heal, want 2", n)
		}
		return nil
	})
}
