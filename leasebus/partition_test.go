//go:build integration

package leasebus

// A holder whose NATS server is cut off from the lease service's server
// (issue 28.8). Its own server keeps answering its pings, so a holder that
// took a PONG for the service's word kept writing for a whole renewal
// interval after a revoke it could not hear. The holder's liveness must be
// the service's answer: through a partition it stops within its silence
// bound, and once the partition heals it learns the revoke.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// partitionCluster is three JetStream nodes whose routes all go through
// bridges (routes[i][j] carries node i's connections to node j).
type partitionCluster struct {
	urls   []string
	routes [3][3]*testutil.Bridge
	srvs   []*server.Server
}

func startPartitionCluster(t *testing.T) *partitionCluster {
	t.Helper()
	ports := testutil.FreePorts(t, 6)
	c := &partitionCluster{}
	for i := range 3 {
		c.urls = append(c.urls, fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
		for j := range 3 {
			if i != j {
				c.routes[i][j] = testutil.NewBridge(t, fmt.Sprintf("127.0.0.1:%d", ports[3+j]))
			}
		}
	}
	for i := range 3 {
		var peers []string
		for j := range 3 {
			if i != j {
				peers = append(peers, "nats://"+c.routes[i][j].Addr())
			}
		}
		s, err := EmbeddedStartServer(serverConfig(t, ServerConfig{
			Listen: fmt.Sprintf("127.0.0.1:%d", ports[i]), StoreDir: t.TempDir(), Name: fmt.Sprintf("fenceline-%d", i),
			ClusterName: "fenceline-partition", ClusterListen: fmt.Sprintf("127.0.0.1:%d", ports[3+i]), Routes: peers,
			ClusterAdvertise: testutil.DeadAddr,
		}))
		if err != nil {
			t.Fatal(err)
		}
		c.srvs = append(c.srvs, s)
		t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	}
	return c
}

// isolate cuts node n off from the other two (cut) or heals it.
func (c *partitionCluster) isolate(n int, cut bool) {
	for i := range 3 {
		if i != n {
			c.routes[i][n].Partition(cut)
			c.routes[n][i].Partition(cut)
		}
	}
}

func TestRevokeReachesHolderThroughPartition(t *testing.T) {
	t.Parallel() // elections and a partition: runs beside the others (own servers)
	cl := startPartitionCluster(t)
	ctx := ctxT(t)

	// The service and the operator on node 0; the holder on node 2 only.
	startClusterService(ctx, t, connect(t, cl.urls[0]))
	op := NewClient(connectAs(t, strings.Join(cl.urls[:2], ","), RoleOperator))
	hc := NewClient(connectAs(t, cl.urls[2], RoleHolder))

	// A long TTL: its renewal interval (20 s) is far beyond the bound, so
	// only the heartbeat can stop the holder in time.
	const repo = "github.com/acme/partition"
	var h *Holder
	checkFor(t, 30*time.Second, 200*time.Millisecond, func() error {
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		var err error
		h, err = hc.AcquireAndHold(actx, AcquireRequest{Repo: repo, Scope: claim(t, "src"), Owner: owner(1), TTL: lease.Duration(60 * time.Second)},
			NewCredential(), HoldOptions{})
		return err
	})
	t.Cleanup(h.Orphan)
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error { _, err := h.Fence(); return err })
	id := h.Lease().LeaseID

	cl.isolate(2, true)
	cutAt := time.Now()
	t.Logf("node 2 (the holder's) cut off from nodes 0 and 1")
	// The operator revokes on the majority side; the log's leader may have
	// been node 2, so the first tries may wait for an election.
	checkFor(t, 60*time.Second, 200*time.Millisecond, func() error {
		rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err := op.Revoke(rctx, id, "partition test")
		return err
	})
	revokedAt := time.Now()
	t.Logf("revoked %s %s after the cut", id, revokedAt.Sub(cutAt).Round(time.Millisecond))

	// The bound: writes stop within a second of the revoke. (The holder
	// may have stopped already: it hears nothing from the service since
	// the cut.)
	deadline := revokedAt.Add(time.Second)
	for {
		_, err := h.Fence()
		if err != nil {
			if !errors.Is(err, lease.ErrLeaseUnknown) && !errors.Is(err, lease.ErrLeaseLost) {
				t.Fatalf("fence after the revoke: %v (want unknown or lost)", err)
			}
			t.Logf("the holder stopped %s after the cut: %v", time.Since(cutAt).Round(time.Millisecond), err)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the holder on the cut-off node still vouches for %s %s after the revoke (%s after the cut): its own server's answers are not the service's",
				id, time.Since(revokedAt).Round(time.Millisecond), time.Since(cutAt).Round(time.Millisecond))
		}
		time.Sleep(10 * time.Millisecond) // polling a clock-bound answer, not waiting for state
	}

	// Healed, the holder learns the revoke from the service.
	cl.isolate(2, false)
	checkFor(t, 60*time.Second, 50*time.Millisecond, func() error {
		if st, err := h.State(); st != lease.Lost {
			return fmt.Errorf("holder %s, want lost after the partition healed: %v", st, err)
		}
		return nil
	})
	if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
		t.Fatalf("fence after the heal: %v, want lost", err)
	}
}
