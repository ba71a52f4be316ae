//go:build integration && partitioncollect

package embedded

// Out of CI (build tag partitioncollect), because the harness's partition
// leaks: run under load (three processes of this test at once, -race),
// 3 of 9 runs failed, on this stop's head and on the base before it alike,
// and every failure was node 2 — the node cut off — collecting the run's
// identity: its audit event, which needs the stream's majority, was
// committed, so node 2 still reached the others. The likely way past the
// bridges, not yet shown: they carry the routes each node solicits, but
// the nodes gossip their real cluster addresses, and a node that hears of
// a peer before its own bridged route is up connects to it directly
// (nats-server's implicit routes). Until the harness makes every route go
// through a bridge (and checks that it does), a failure here says nothing
// about the product:
//
//	go test -race -tags 'integration partitioncollect' -run TestPartitionedNodeCollectsNoLiveIdentity ./leasebus/embedded
//
// Before keepalives were sent again after a quarter of their time (not
// after all of it), this failed about one run in three: the server kept
// counting the cut-off instance's route up and gave it a third of the
// run's keepalives, two lost in a row left the run unheard for 7–8 s on
// the majority's side, and both instances there collected it
// (Client.keepalive).

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/leasebus"
)

// TestPartitionedNodeCollectsNoLiveIdentity (issue 28): a node cut off
// from the other two stops hearing the sessions kept alive through them,
// and after a grace stops counting the instances there, so to its lease
// service a live run connected elsewhere looks killed. It must not
// collect that run's identity (the nodes share their credentials, so a
// removal there would lock the run out everywhere): a collection is
// confirmed by its audit event, which a node without the majority cannot
// commit. After the partition heals the run is still enrolled and
// connected.
func TestPartitionedNodeCollectsNoLiveIdentity(t *testing.T) {
	const grace = 2 * time.Second
	nodes, dir := startIDCluster(t, &leasebus.ServiceConfig{SessionGrace: grace})
	after := CollectAfter(grace)
	run, nc, stop := liveRun(t, nodes, dir, "run-att_partitioned", 0)
	t.Cleanup(stop)

	isolateNode(nodes, 2, true)
	// Long enough for node 2 to forget its peers (a grace), find the run
	// idle for the collection's wait, and try more than once.
	deadline := time.Now().Add(2*after + 3*grace)
	for time.Now().Before(deadline) {
		if _, ok, err := leasebus.FindIdentity(dir, run.Nkey()); err != nil || !ok {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			evs, _ := leasebus.ReadAudit(ctx, nodes[0].svc, "", 0)
			for _, ev := range evs {
				if ev.Type == leasebus.EventIdentityRevoked {
					t.Logf("audit: %s by %s: %s", ev.Time.Format(time.RFC3339Nano), ev.RequestedBy, ev.Message)
				}
			}
			t.Fatalf("a live run's identity was collected during a partition (enrolled %v, %v)", ok, err)
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		}
	}
	isolateNode(nodes, 2, false)
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		if r := nodes[2].srv.NumRoutes(); r < 2 {
			return fmt.Errorf("node 2 has %d routes after the heal", r)
		}
		return nil
	})
	if _, ok, err := leasebus.FindIdentity(dir, run.Nkey()); err != nil || !ok {
		t.Fatalf("the live run's identity is gone after the partition (enrolled %v, %v)", ok, err)
	}
	if !nc.IsConnected() {
		t.Fatal("the live run was disconnected")
	}
}
