//go:build integration

package leasebus

// The lease bus on a 3-node JetStream cluster (R3 streams), with the node
// leading the lease log shut down in the middle of concurrent acquire /
// renew / release traffic. The lease service is an ordinary client of the
// cluster and survives the node. Operations may fail with ErrUnavailable
// during the failover (clients retry them with the same request id) but
// grants resume within a bounded time, and throughout:
//
//   - the lease log (read back in commit order) never grants over an
//     active lease, and fences strictly increase and are never reissued;
//   - every List answer is pairwise disjoint;
//   - no fence is ever seen on two lease ids (results, Watch, log);
//   - every grant a client was told about is in the log with its fence.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

type testCluster struct {
	srvs []*server.Server
	urls []string
	// routes[i][j] relays node i's route to node j (bridged clusters
	// only), so that a node can be cut off (isolate).
	routes [][]*testutil.Bridge
}

func startCluster(t *testing.T) *testCluster { return startClusterOf(t, false) }

// startClusterOf starts three nodes; bridged, their routes go through
// relays that isolate can cut.
func startClusterOf(t *testing.T, bridged bool) *testCluster {
	t.Helper()
	ports := testutil.FreePorts(t, 6)
	c := &testCluster{srvs: make([]*server.Server, 3), routes: make([][]*testutil.Bridge, 3)}
	var routes []string
	for i := range 3 {
		c.urls = append(c.urls, fmt.Sprintf("nats://127.0.0.1:%d", ports[i]))
		routes = append(routes, fmt.Sprintf("nats://127.0.0.1:%d", ports[3+i]))
	}
	for i := range 3 {
		c.routes[i] = make([]*testutil.Bridge, 3)
		var peers []string
		for j, r := range routes {
			switch {
			case j == i:
			case bridged:
				c.routes[i][j] = testutil.NewBridge(t, fmt.Sprintf("127.0.0.1:%d", ports[3+j]))
				peers = append(peers, "nats://"+c.routes[i][j].Addr())
			default:
				peers = append(peers, r)
			}
		}
		cfg := ServerConfig{
			Listen: fmt.Sprintf("127.0.0.1:%d", ports[i]), StoreDir: t.TempDir(), Name: fmt.Sprintf("fenceline-%d", i),
			ClusterName: "fenceline-test", ClusterListen: fmt.Sprintf("127.0.0.1:%d", ports[3+i]), Routes: peers,
		}
		if bridged {
			cfg.ClusterAdvertise = testutil.DeadAddr
		}
		s, err := EmbeddedStartServer(serverConfig(t, cfg))
		if err != nil {
			t.Fatal(err)
		}
		c.srvs[i] = s
		t.Cleanup(func() { s.Shutdown(); s.WaitForShutdown() })
	}
	return c
}

// isolate cuts node k off from the others (cut) or heals it: a partition,
// not a shutdown, so its stream leaderships end by election, as when a
// node dies, not by handing them over.
func (c *testCluster) isolate(t *testing.T, k int, cut bool) {
	t.Helper()
	for i := range c.srvs {
		if i != k {
			if c.routes[i][k] == nil {
				t.Fatal("isolate: the cluster's routes are not bridged")
			}
			c.routes[i][k].Partition(cut)
			c.routes[k][i].Partition(cut)
		}
	}
}

func (c *testCluster) connect(t *testing.T) *nats.Conn {
	t.Helper()
	return connect(t, strings.Join(c.urls, ","))
}

// streamLeader returns the index of the server leading stream, or -1.
func (c *testCluster) streamLeader(stream string) int {
	for i, s := range c.srvs {
		if s != nil && s.Running() && s.JetStreamIsStreamLeader(ServiceAccount, stream) {
			return i
		}
	}
	return -1
}

// startClusterService starts a lease service (replicas 3) on nc, a
// connection to a new cluster, once its JetStream answers; the service
// itself waits while the cluster elects its leaders.
func startClusterService(ctx context.Context, t *testing.T, nc *nats.Conn) (*Service, jetstream.JetStream) {
	t.Helper()
	return startClusterServiceWith(ctx, t, nc, ServiceConfig{})
}

// startClusterServiceWith is startClusterService with cfg (its Replicas
// set to 3).
func startClusterServiceWith(ctx context.Context, t *testing.T, nc *nats.Conn, cfg ServiceConfig) (*Service, jetstream.JetStream) {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	checkFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		actx, cancel := context.WithTimeout(ctx, 2*time.Second)
		defer cancel()
		_, err := js.AccountInfo(actx)
		return err
	})
	sctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	cfg.Replicas = 3
	svc, err := StartService(sctx, nc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	return svc, js
}

func TestClusterLeaderFailover(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	cl := startCluster(t)
	seed := testSeed(t)
	ctx := ctxT(t)

	_, js := startClusterService(ctx, t, cl.connect(t))
	st, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	if r := st.CachedInfo().Config.Replicas; r != 3 {
		t.Fatalf("lease log has %d replicas, want 3", r)
	}

	const clusterRepo = "github.com/acme/cluster"
	claims := propClaims(t)
	logChk := newCommitChecker(3)
	follower := followLogPolling(t, cl.connect(t), logChk, clusterRepo)
	watchChk := newCommitChecker(3) // best effort: a watch may miss records while a node dies
	var fmu sync.Mutex
	fences := map[uint64]string{} // fence -> lease id, from every source
	results := map[string]*lease.Lease{}
	var fenceErrs []string
	sawFence := func(src string, l *lease.Lease) {
		fmu.Lock()
		defer fmu.Unlock()
		if id, ok := fences[l.Fence]; ok && id != l.LeaseID {
			fenceErrs = append(fenceErrs, fmt.Sprintf("%s: fence %d on %s and %s", src, l.Fence, id, l.LeaseID))
		}
		fences[l.Fence] = l.LeaseID
	}
	watchChecker(t, NewClient(connectAs(t, strings.Join(cl.urls, ","), RoleViewer)), clusterRepo, watchChk, func(l *lease.Lease, _ time.Time) { sawFence("watch", l) })

	var (
		stop        atomic.Bool
		killedAt    atomic.Int64 // unix nanos, 0 before the kill
		resumedAt   atomic.Int64 // first grant acknowledged after the kill
		mu          sync.Mutex
		stats       = map[string]int{}
		listChecks  atomic.Int64
		unavailable atomic.Int64
	)
	count := func(k string) { mu.Lock(); stats[k]++; mu.Unlock() }
	newClient := func() *Client {
		c := NewClient(cl.connect(t))
		c.Timeout, c.Tries = 2*time.Second, 1
		return c
	}
	// retry runs op until it is not ErrUnavailable, for at most 30 s.
	retry := func(what string, op func() error) error {
		deadline := time.Now().Add(30 * time.Second)
		for {
			err := op()
			if !errors.Is(err, lease.ErrUnavailable) || time.Now().After(deadline) {
				return err
			}
			unavailable.Add(1)
			time.Sleep(50 * time.Millisecond) // spacing retries
		}
	}

	const workers = 4
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(seed, uint64(w)))
			c := newClient()
			for op := 0; op < 5000 && !stop.Load(); op++ {
				req := claims[rng.IntN(len(claims))]
				req.Repo, req.Owner, req.TTL = clusterRepo, owner(w), lease.Duration(20*time.Second)
				req.RequestID = NewRequestID() // retries of this acquire are the same request
				cred := NewCredential()
				var l *lease.Lease
				started := time.Now().UnixNano()
				err := retry("acquire", func() (err error) {
					l, err = c.Acquire(ctx, req, cred)
					return err
				})
				switch {
				case errors.Is(err, lease.ErrConflict):
					count("conflict")
					continue
				case err != nil:
					t.Errorf("acquire: %v", err)
					return
				}
				count("grant")
				sawFence("result", l)
				mu.Lock()
				results[l.LeaseID] = l
				mu.Unlock()
				if k := killedAt.Load(); k != 0 && started > k {
					resumedAt.CompareAndSwap(0, time.Now().UnixNano())
				}
				time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond) // holding it a little
				if rng.IntN(2) == 0 {
					err := retry("renew", func() error {
						r, err := c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version, RenewID: "renew-" + l.LeaseID})
						if err == nil {
							l = r
						}
						return err
					})
					if err != nil && !errors.Is(err, lease.ErrLeaseLost) {
						t.Errorf("renew: %v", err)
						return
					}
					count("renew")
				}
				if err := retry("release", func() error {
					_, err := c.Release(ctx, l.LeaseID, cred)
					return err
				}); err != nil {
					t.Errorf("release %s: %v", l.LeaseID, err)
					return
				}
				count("release")
			}
		})
	}
	// A List checker: every answer must be pairwise disjoint.
	wg.Go(func() {
		c := newClient()
		for !stop.Load() {
			ls, err := c.List(ctx, clusterRepo, false)
			if err == nil {
				if err := checkActiveSet(ls, 3); err != nil {
					t.Errorf("list: %v", err)
				}
				listChecks.Add(1)
			} else if !errors.Is(err, lease.ErrUnavailable) {
				t.Errorf("list: %v", err)
			}
			time.Sleep(10 * time.Millisecond) // spacing the probes
		}
	})

	// Let traffic run, then shut down the log's leader.
	checkFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if stats["grant"] < 30 {
			return fmt.Errorf("%d grants so far", stats["grant"])
		}
		return nil
	})
	var victim int
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		if victim = cl.streamLeader(LogStream); victim < 0 {
			return errors.New("no leader for the lease log")
		}
		return nil
	})
	mu.Lock()
	before := stats["grant"]
	mu.Unlock()
	t.Logf("shutting down %s, leader of %s, after %d grants", cl.srvs[victim].Name(), LogStream, before)
	killedAt.Store(time.Now().UnixNano())
	cl.srvs[victim].Shutdown()
	cl.srvs[victim].WaitForShutdown()

	checkFor(t, 25*time.Second, 20*time.Millisecond, func() error {
		if resumedAt.Load() == 0 {
			return errors.New("no grant since the leader went down")
		}
		return nil
	})
	failover := time.Duration(resumedAt.Load() - killedAt.Load())
	checkFor(t, 15*time.Second, 20*time.Millisecond, func() error {
		if l := cl.streamLeader(LogStream); l < 0 || l == victim {
			return fmt.Errorf("lease log leader after the failover: %d", l)
		}
		return nil
	})
	// More traffic on the new leader, then stop.
	checkFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		if stats["grant"] < before+80 {
			return fmt.Errorf("%d grants since the failover", stats["grant"]-before)
		}
		return nil
	})
	stop.Store(true)
	wg.Wait()
	if t.Failed() {
		t.FailNow()
	}
	t.Logf("grants resumed %s after the leader went down; %d unavailable answers retried; %d list checks; outcomes %v",
		failover.Round(time.Millisecond), unavailable.Load(), listChecks.Load(), stats)
	if failover > 20*time.Second {
		t.Errorf("grants resumed only %s after the leader went down", failover)
	}

	follower.waitCaughtUp(t, clusterRepo, 20*time.Second)
	if err := logChk.err(); err != nil {
		t.Fatalf("lease log violates the invariants:\n%v", err)
	}
	t.Logf("log follower: %s; watch saw %d grants (best effort)", follower.stats(), watchChk.grantCount())
	if err := watchChk.err(); err != nil {
		t.Logf("watch stream (best effort, it may miss records across a node failure):\n%v", err)
	}
	fmu.Lock()
	defer fmu.Unlock()
	if len(fenceErrs) > 0 {
		t.Fatalf("fences reissued:\n%s", strings.Join(fenceErrs, "\n"))
	}
	mu.Lock()
	defer mu.Unlock()
	// Acknowledged means committed: every grant a client got is in the log
	// (as a record, or in a snapshot when the follower read past a purge).
	for id, l := range results {
		g, ok := logChk.granted(id)
		if !ok {
			t.Errorf("acknowledged grant %s (fence %d) is not in the lease log", id, l.Fence)
		} else if g.Fence != l.Fence {
			t.Errorf("grant %s: client got fence %d, log has %d", id, l.Fence, g.Fence)
		}
	}
	// Every fence any source saw is in the log's order.
	for f, id := range fences {
		if g, ok := logChk.granted(id); ok && g.Fence != f {
			t.Errorf("lease %s seen with fence %d, log has %d", id, f, g.Fence)
		}
	}
}
