//go:build integration

package busserve

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestStaggeredClusterStart (issue 34): three nodes of a cluster started
// seconds apart, each with its lease service, as a platform team's
// machines come up: the first ones wait for the cluster to form (saying
// so in their logs) instead of failing, and once the last one is up every
// node grants leases, with fences rising across nodes.
func TestStaggeredClusterStart(t *testing.T) {
	creds := bustest.CredsDir(t)
	addrs := make([]string, 6) // below the ephemeral range: no dial takes one before its node listens
	for i, port := range testutil.FreePorts(t, len(addrs)) {
		addrs[i] = fmt.Sprintf("127.0.0.1:%d", port)
	}
	logs := &logBuffer{}
	log := slog.New(slog.NewJSONHandler(logs, nil))
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("the nodes' and services' logs:\n%s", logs)
		}
	})
	type started struct {
		i   int
		n   *Node
		s   *Service
		err error
	}
	done := make(chan started, 3)
	for i, delay := range []time.Duration{0, 2 * time.Second, 5 * time.Second} {
		go func() {
			select {
			case <-time.After(delay): // the stagger is the scenario, not a wait for state
			case <-t.Context().Done():
				done <- started{i: i, err: t.Context().Err()}
				return
			}
			var routes []string
			for j := range 3 {
				if j != i {
					routes = append(routes, "nats://"+addrs[3+j])
				}
			}
			n, err := StartNode(t.Context(), leasebus.ServerConfig{Listen: addrs[i], StoreDir: t.TempDir(), CredsDir: creds,
				Name: fmt.Sprintf("stagger-%d", i), ClusterName: "stagger", ClusterListen: addrs[3+i], Routes: routes}, log)
			if err != nil {
				done <- started{i: i, err: err}
				return
			}
			s, err := StartService(t.Context(), ServiceConfig{Node: n, Logger: log})
			done <- started{i: i, n: n, s: s, err: err}
		}()
	}
	nodes := make([]*Node, 3)
	for range 3 {
		var st started
		select {
		case st = <-done:
		case <-time.After(2 * time.Minute):
			t.Fatalf("the staggered cluster did not come up within 2 minutes\n%s", logs)
		}
		if st.err != nil {
			t.Fatalf("node %d: %v\n%s", st.i, st.err, logs)
		}
		t.Cleanup(st.n.Stop)
		t.Cleanup(st.s.Stop)
		if st.s.Replicas != 3 {
			t.Errorf("node %d's service keeps %d replicas, want 3", st.i, st.s.Replicas)
		}
		nodes[st.i] = st.n
	}
	var last uint64
	for _, i := range []int{2, 0, 1} {
		c := leasebus.NewClient(bustest.ConnectRole(t, nodes[i].URL(), leasebus.RoleHolder))
		cred := leasebus.NewCredential()
		ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
		l, err := c.Acquire(ctx, leasebus.AcquireRequest{Repo: "github.com/acme/billing", Scope: bustest.Claim(t, "services/billing"),
			Owner: lease.Owner{TaskID: "task", AgentID: fmt.Sprint("agent-", i), AttemptID: lease.NewAttemptID()},
			TTL:   lease.Duration(time.Minute), Wait: lease.Duration(10 * time.Second)}, cred)
		if err != nil {
			cancel()
			t.Fatalf("acquire through node %d: %v", i, err)
		}
		if l.Fence <= last {
			t.Errorf("the lease through node %d got fence %d after %d", i, l.Fence, last)
		}
		last = l.Fence
		if _, err := c.Release(ctx, l.LeaseID, cred); err != nil {
			t.Errorf("release through node %d: %v", i, err)
		}
		cancel()
	}
	if !strings.Contains(logs.String(), "waiting for the cluster to form") && !strings.Contains(logs.String(), "waiting for JetStream: a new cluster") {
		t.Errorf("no node said what it waited for:\n%.3000s", logs)
	}
}
