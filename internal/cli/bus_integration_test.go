//go:build integration

package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestBusServeCluster runs three "bus serve" nodes of one cluster (the
// streams get 3 replicas) and uses them as one bus.
func TestBusServeCluster(t *testing.T) {
	isolate(t)
	setCfg(t, func(c *config) { c.Creds = t.TempDir() }) // one credentials directory for every node
	// Below the ephemeral range (StablePorts): a port from it, free when
	// picked, was taken by an outgoing connection before its node listened
	// (the route dials of the nodes already up), and the nodes never met.
	var clusterAddrs []string
	for _, port := range testutil.FreePorts(t, 3) {
		clusterAddrs = append(clusterAddrs, fmt.Sprintf("127.0.0.1:%d", port))
	}
	routes := "nats://" + strings.Join(clusterAddrs, ",nats://")
	nodes := make([]*served, 3)
	errs := make([]error, 3)
	var wg sync.WaitGroup // the nodes start together: each waits for a quorum
	for i := range nodes {
		wg.Go(func() {
			nodes[i], errs[i] = startServe(t, "--listen", "127.0.0.1:0", "--store", t.TempDir(),
				"--name", fmt.Sprintf("n%d", i), "--cluster-name", "fl", "--cluster-listen", clusterAddrs[i], "--routes", routes)
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		mustContain(t, "node stdout", n.out.String(), "(replicas 3)")
	}
	// Each node runs a lease service in one queue group; they elect a
	// primary, which serves every lease request, and the standbys forward
	// what they take to it. Grants and conflicts are right whichever node
	// a client asks.
	// The first acquire may come before the instances have elected a
	// primary (on a loaded machine, later than the second an election
	// takes): the bus then answers "try again", and so does this test.
	var a acquired
	checkFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		r := fl(t, "--nats", nodes[0].url, "lease", "acquire", "--repo", testRepo, "--json", "--scope", "services/billing")
		if r.code != ExitOK && strings.Contains(r.stderr, "try again") {
			return fmt.Errorf("first acquire: %s", r.stderr)
		}
		r.want(t, ExitOK)
		if err := json.Unmarshal([]byte(r.stdout), &a); err != nil {
			t.Fatalf("decode acquire --json: %v\n%s", err, r.stdout)
		}
		return nil
	})
	for _, n := range nodes[1:] {
		r := fl(t, "--nats", n.url, "lease", "acquire", "--repo", testRepo, "--scope", "services/billing/api").want(t, ExitConflict)
		mustContain(t, "stderr", r.stderr, a.LeaseID)
		r = fl(t, "--nats", n.url, "lease", "acquire", "--repo", testRepo, "--whole-repo").want(t, ExitConflict)
		mustContain(t, "stderr", r.stderr, a.LeaseID)
	}
	last := a.Fence
	for i, n := range nodes {
		b := acquireJSON(t, n.url, "--scope", fmt.Sprintf("libs/l%d", i))
		if b.Fence <= last {
			t.Errorf("node %d granted fence %d after %d: not increasing", i, b.Fence, last)
		}
		last = b.Fence
	}
	// Every node's instance answers a status request: one is the
	// primary, and the lease log has a leader every replica follows.
	checkFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		r := fl(t, "--nats", nodes[2].url, "bus", "status")
		if r.code != ExitOK {
			return fmt.Errorf("bus status: exit %d: %s", r.code, r.stderr)
		}
		n := 0
		for _, line := range strings.Split(r.stdout, "\n") {
			if strings.HasPrefix(line, "instance ") {
				n++
			}
		}
		if n != 3 {
			return fmt.Errorf("bus status lists %d instances, want 3:\n%s", n, r.stdout)
		}
		if strings.Count(r.stdout, ": primary\n") != 1 || strings.Count(r.stdout, ": standby; primary ") != 2 {
			return fmt.Errorf("bus status does not list one primary and two standbys:\n%s", r.stdout)
		}
		if !strings.Contains(r.stdout, "\nnow: instance ") || !strings.Contains(r.stdout, " is the primary and serves (on server n") ||
			!strings.Contains(r.stdout, "the lease log (FENCELINE_LOG) is led by n") || strings.Contains(r.stdout, "which does not hear") {
			return fmt.Errorf("bus status does not say a primary serves and a whole cluster holds the log:\n%s", r.stdout)
		}
		return nil
	})
	// Two nodes gone: the cluster has no quorum, so no revoke can be
	// written. The operator's revoke says, within 2 s, what it waits for,
	// and ends (refused or not) instead of hanging: the lease log cannot
	// be written, or (the primary was on a node that stopped) no primary
	// can be elected.
	for i, n := range nodes[1:] {
		if code := n.stop(); code != ExitOK {
			t.Errorf("node %d exited %d", i+1, code)
		}
	}
	start := time.Now()
	r := fl(t, "--nats", nodes[0].url, "lease", "revoke", a.LeaseID, "--reason", "cluster fault drill")
	took := time.Since(start)
	switch {
	case r.code == ExitOK:
		t.Errorf("a revoke without a quorum succeeded after %s:\n%s", took, r.stderr)
	case took <= revokePatience && !strings.Contains(r.stderr, "lease log") && !strings.Contains(r.stderr, "primary"):
		t.Errorf("a revoke refused after %s does not say why:\n%s", took, r.stderr)
	case took > revokePatience && (!strings.Contains(r.stderr, "no answer to the revoke of "+a.LeaseID+" after 2s: ") || !strings.Contains(r.stderr, "instance")):
		t.Errorf("a revoke that took %s did not say what it waited for:\n%s", took, r.stderr)
	}
	if took > 30*time.Second {
		t.Errorf("revoke without a quorum took %s", took)
	}
	t.Logf("revoke without a quorum: exit %d after %s\n%s", r.code, took.Round(time.Millisecond), r.stderr)
	if code := nodes[0].stop(); code != ExitOK {
		t.Errorf("node 0 exited %d", code)
	}
}
