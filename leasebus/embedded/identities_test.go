//go:build integration

package embedded

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

const testRepo = "github.com/acme/payments"

// idBus is an embedded bus whose credentials directory enrols holders.
type idBus struct {
	srv     *server.Server
	cfg     leasebus.ServerConfig
	svc     *nats.Conn
	service *leasebus.Service
	ids     *Identities // startIDCluster's, with a service
	// routes[j] carries this node's route connections to node j
	// (startIDCluster's; Partition cuts them).
	routes map[int]*testutil.Bridge
}

// isolateNode cuts node n of a startIDCluster cluster off from the others
// (cut) or heals it.
func isolateNode(nodes []*idBus, n int, cut bool) {
	for i, b := range nodes {
		if i != n {
			b.routes[n].Partition(cut)
			nodes[n].routes[i].Partition(cut)
		}
	}
}

func startIDBus(t *testing.T, holders ...string) *idBus {
	t.Helper()
	return startIDBusWith(t, leasebus.ServiceConfig{}, holders...)
}

// startIDBusWith is startIDBus with the lease service configured as scfg.
func startIDBusWith(t *testing.T, scfg leasebus.ServiceConfig, holders ...string) *idBus {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	if _, err := leasebus.EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	for _, n := range holders {
		if _, _, err := leasebus.EnrollIdentity(dir, n, leasebus.RoleHolder, ""); err != nil {
			t.Fatal(err)
		}
	}
	cfg := leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), CredsDir: dir}
	srv, err := StartServer(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	b := &idBus{srv: srv, cfg: cfg}
	b.svc = b.connectFile(t, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleService)))
	scfg.Names = leasebus.NamesIn(dir)
	svc, err := leasebus.StartService(context.Background(), b.svc, scfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	b.service = svc
	return b
}

func (b *idBus) connectFile(t *testing.T, path string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	c, err := leasebus.LoadCreds(path)
	if err != nil {
		t.Fatal(err)
	}
	copts, err := c.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(b.srv.ClientURL(), append(copts, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

func (b *idBus) holderFile(name string) string {
	return filepath.Join(leasebus.HoldersDir(b.cfg.CredsDir), name+".nk")
}

// violations collects the permission violations the server reports to a
// connection.
type violations struct {
	mu   sync.Mutex
	errs []error
}

func (v *violations) handler(_ *nats.Conn, _ *nats.Subscription, err error) {
	v.mu.Lock()
	defer v.mu.Unlock()
	v.errs = append(v.errs, err)
}

func (v *violations) wait(t *testing.T, what string) {
	t.Helper()
	testutil.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		v.mu.Lock()
		defer v.mu.Unlock()
		for _, err := range v.errs {
			if errors.Is(err, nats.ErrPermissionViolation) {
				return nil
			}
		}
		return fmt.Errorf("no permission violation for %s yet (%v)", what, v.errs)
	})
}

func claimOf(t *testing.T, p string) scope.Claim {
	t.Helper()
	c, err := scope.New([]string{p}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func ctxOf(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// TestHolderHearsOnlyItsOwnAnswers: two runners, each with its own
// enrolled identity. A cannot subscribe to B's inbox (NATS refuses it: a
// permission violation), so it neither sees B's answers nor learns their
// subjects, and it cannot publish into B's inbox either; B's requests are
// answered as usual. (With the one shared holder.nk of before, A's
// subscription was B's own and was allowed.)
func TestHolderHearsOnlyItsOwnAnswers(t *testing.T) {
	b := startIDBus(t, "runner-a", "runner-b")
	ctx := ctxOf(t)
	var va violations
	a := b.connectFile(t, b.holderFile("runner-a"), nats.ErrorHandler(va.handler))
	bc := b.connectFile(t, b.holderFile("runner-b"))
	if leasebus.IdentityOf(a) == leasebus.IdentityOf(bc) {
		t.Fatal("two enrolled runners share one identity")
	}
	var seen atomic.Int32
	if _, err := a.Subscribe("_INBOX."+leasebus.IdentityOf(bc)+".>", func(*nats.Msg) { seen.Add(1) }); err != nil {
		t.Fatal(err)
	}
	va.wait(t, "subscribing to another identity's inbox")

	var vp violations
	a2 := b.connectFile(t, b.holderFile("runner-a"), nats.ErrorHandler(vp.handler))
	if err := a2.Publish("_INBOX."+leasebus.IdentityOf(bc)+".forged", []byte(`{"lease":{}}`)); err != nil {
		t.Fatal(err)
	}
	vp.wait(t, "publishing into another identity's inbox")

	cred := leasebus.NewCredential()
	victim := leasebus.NewClient(bc)
	l, err := victim.Acquire(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: claimOf(t, "services/billing"), Owner: lease.Owner{TaskID: "t", AgentID: "b", AttemptID: "att_b"}, TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := victim.Renew(ctx, leasebus.RenewRequest{LeaseID: l.LeaseID, Repo: testRepo, Credential: cred, Version: l.Version}); err != nil {
		t.Fatal(err)
	}
	if err := a.Flush(); err != nil {
		t.Fatal(err)
	}
	if n := seen.Load(); n != 0 {
		t.Fatalf("runner A heard %d of runner B's answers", n)
	}
}

// TestRevokeOneIdentity: the operator revokes runner A's identity (bus
// revoke-identity: its record removed, the server's users reloaded
// without a restart). NATS closes A's connection at once and refuses it
// on every reconnect; runner B, connected all along, keeps renewing.
func TestRevokeOneIdentity(t *testing.T) {
	b := startIDBus(t, "runner-a", "runner-b")
	ctx := ctxOf(t)
	fast := []nats.Option{nats.MaxReconnects(-1), nats.ReconnectWait(20 * time.Millisecond)}
	a := b.connectFile(t, b.holderFile("runner-a"), fast...)
	bc := b.connectFile(t, b.holderFile("runner-b"), fast...)

	hold := func(nc *nats.Conn, path string, renewals *atomic.Int32, failures *atomic.Int32) *leasebus.Holder {
		h, err := leasebus.NewClient(nc).AcquireAndHold(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: claimOf(t, path),
			Owner: lease.Owner{TaskID: "t", AgentID: path, AttemptID: "att_" + path}, TTL: lease.Duration(1500 * time.Millisecond)},
			leasebus.NewCredential(), leasebus.HoldOptions{OnRenew: func(_ time.Duration, err error) {
				if err != nil {
					failures.Add(1)
				} else {
					renewals.Add(1)
				}
			}})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.Orphan)
		return h
	}
	var aRenewed, aFailed, bRenewed, bFailed atomic.Int32
	hold(a, "a", &aRenewed, &aFailed)
	hb := hold(bc, "b", &bRenewed, &bFailed)

	// Runner A's machine keeps its copy of the seed.
	kept := filepath.Join(t.TempDir(), "runner-a.nk")
	if data, err := os.ReadFile(b.holderFile("runner-a")); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(kept, data, 0o600); err != nil {
		t.Fatal(err)
	}
	id, ok, err := leasebus.FindIdentity(b.cfg.CredsDir, "runner-a")
	if err != nil || !ok {
		t.Fatalf("runner-a: %v %v", ok, err)
	}
	if err := leasebus.RemoveIdentity(b.cfg.CredsDir, id); err != nil {
		t.Fatal(err)
	}
	if err := ReloadUsers(b.srv, b.cfg); err != nil {
		t.Fatal(err)
	}
	// Closed by the server at the reload (no waiting for a ping).
	testutil.CheckFor(t, time.Second, 5*time.Millisecond, func() error {
		if a.IsConnected() {
			return errors.New("the revoked identity is still connected")
		}
		return nil
	})
	// And refused when it comes back, whatever it tries.
	if _, err := leasebus.Dial(b.srv.ClientURL(), "test", leasebus.BusCreds{Path: kept, Source: "test", Role: leasebus.RoleHolder}); !errors.As(err, new(*leasebus.CredsRefusedError)) {
		t.Fatalf("a new connection of the revoked identity: %v, want it refused", err)
	}
	if a.IsConnected() {
		t.Fatal("the revoked identity reconnected")
	}
	// B was not touched: connected throughout, and renewing on.
	from := bRenewed.Load()
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		if n := bRenewed.Load() - from; n < 3 {
			return fmt.Errorf("runner B renewed %d times since the revoke, want 3", n)
		}
		return nil
	})
	if n := bFailed.Load(); n != 0 {
		t.Fatalf("runner B's renewals failed %d times", n)
	}
	if st, err := hb.State(); st != lease.Held {
		t.Fatalf("runner B's lease: %v %v, want held", st, err)
	}
	if a.IsConnected() {
		t.Fatal("the revoked identity reconnected")
	}
}

// TestEphemeralEnrolment: a run enrols an identity of its own with the
// machine's enroller key. The enroller itself may do nothing else: no
// lease request, no other inbox. Two enrolments are two identities; one
// that leaves is disconnected and removed.
func TestEphemeralEnrolment(t *testing.T) {
	b := startIDBus(t)
	ctx := ctxOf(t)
	ids, err := ServeIdentities(b.service.FleetConn(), b.srv, b.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ids.Stop)
	var ve violations
	enc := b.connectFile(t, filepath.Join(b.cfg.CredsDir, leasebus.CredsFile(leasebus.RoleEnroller)), nats.ErrorHandler(ve.handler))

	one, err := leasebus.EnrollEphemeral(enc, "run-att_1")
	if err != nil {
		t.Fatal(err)
	}
	two, err := leasebus.EnrollEphemeral(enc, "run-att_2")
	if err != nil {
		t.Fatal(err)
	}
	if one.Nkey() == two.Nkey() || one.Name == two.Name {
		t.Fatalf("two enrolments gave %s %s and %s %s", one.Name, one.Nkey(), two.Name, two.Nkey())
	}
	nc1, err := nats.Connect(b.srv.ClientURL(), one.Options()...)
	if err != nil {
		t.Fatalf("connect as the enrolled identity: %v", err)
	}
	defer nc1.Close()
	if _, err := leasebus.NewClient(nc1).Acquire(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: claimOf(t, "x"),
		Owner: lease.Owner{TaskID: "t", AgentID: "a", AttemptID: "att_1"}, TTL: lease.Duration(time.Minute)}, leasebus.NewCredential()); err != nil {
		t.Fatalf("acquire as the enrolled identity: %v", err)
	}

	// The enroller key acts on no lease and hears nobody's answers.
	if _, err := leasebus.NewClient(enc).Acquire(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: claimOf(t, "y"),
		Owner: lease.Owner{TaskID: "t", AgentID: "e", AttemptID: "att_e"}, TTL: lease.Duration(time.Minute)}, leasebus.NewCredential()); !errors.Is(err, leasebus.ErrForbidden) {
		t.Fatalf("acquire with the enroller key: %v, want %v", err, leasebus.ErrForbidden)
	}
	if _, err := enc.Subscribe("_INBOX."+one.Nkey()+".>", func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	ve.wait(t, "the enroller subscribing to a run's inbox")

	// Leaving removes the identity and closes its connection.
	if err := one.Leave(nc1); err != nil {
		t.Fatal(err)
	}
	testutil.CheckFor(t, time.Second, 5*time.Millisecond, func() error {
		if nc1.IsConnected() {
			return errors.New("the identity that left is still connected")
		}
		return nil
	})
	if _, ok, err := leasebus.FindIdentity(b.cfg.CredsDir, one.Nkey()); ok || err != nil {
		t.Fatalf("the identity that left is still enrolled (%v)", err)
	}
	if _, err := nats.Connect(b.srv.ClientURL(), one.Options()...); !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("reconnect of the identity that left: %v, want %v", err, nats.ErrAuthorization)
	}
	// The other one is still there.
	nc2, err := nats.Connect(b.srv.ClientURL(), two.Options()...)
	if err != nil {
		t.Fatalf("the other enrolled identity: %v", err)
	}
	nc2.Close()
}

// startIDCluster starts a 3-node embedded cluster whose nodes share one
// credentials directory (returned), each answering identity requests, its
// routes through bridges (isolateNode);
// with service set, each also runs a lease service (service gives its
// config) that audits and collects identities.
func startIDCluster(t *testing.T, service *leasebus.ServiceConfig) ([]*idBus, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	if _, err := leasebus.EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"runner-a", "runner-b"} {
		if _, _, err := leasebus.EnrollIdentity(dir, n, leasebus.RoleHolder, ""); err != nil {
			t.Fatal(err)
		}
	}
	addrs := make([]string, 6) // below the ephemeral range: no dial takes one before its node listens
	for i, port := range testutil.FreePorts(t, len(addrs)) {
		addrs[i] = fmt.Sprintf("127.0.0.1:%d", port)
	}
	nodes := make([]*idBus, 3)
	for i := range 3 {
		var peers []string
		routes := map[int]*testutil.Bridge{}
		for j := range 3 {
			if j != i {
				routes[j] = testutil.NewBridge(t, addrs[3+j])
				peers = append(peers, "nats://"+routes[j].Addr())
			}
		}
		cfg := leasebus.ServerConfig{Listen: addrs[i], StoreDir: t.TempDir(), CredsDir: dir, Name: fmt.Sprintf("fenceline-%d", i),
			ClusterName: "fenceline-ids", ClusterListen: addrs[3+i], Routes: peers}
		srv, err := StartServer(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
		nodes[i] = &idBus{srv: srv, cfg: cfg, routes: routes}
	}
	for _, n := range nodes {
		n.svc = n.connectFile(t, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleService)))
		fleet, err := leasebus.ConnectFleet(n.svc)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(fleet.Close)
		ids, err := ServeIdentities(fleet, n.srv, n.cfg, nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(ids.Stop)
		if service != nil {
			n.ids = ids
		}
	}
	testutil.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		for i, n := range nodes {
			if r := n.srv.NumRoutes(); r < 2 {
				return fmt.Errorf("node %d has %d routes", i, r)
			}
		}
		return nil
	})
	if service != nil {
		for _, n := range nodes {
			scfg := *service
			scfg.Replicas, scfg.Names = 3, leasebus.NamesIn(dir)
			var svc *leasebus.Service
			testutil.CheckFor(t, 30*time.Second, 100*time.Millisecond, func() error {
				var err error
				svc, err = leasebus.StartService(context.Background(), n.svc, scfg)
				return err
			})
			t.Cleanup(svc.Stop)
			n.service = svc
			n.ids.Audit(svc)
			n.ids.Collect(svc, CollectAfter(scfg.SessionGrace))
		}
	}
	return nodes, dir
}

// TestIdentitiesOnACluster: on a 3-node embedded cluster whose nodes share
// one credentials directory, each node answers identity requests and
// reloads its own users. A run's identity enrolled through one node is
// admitted by every node; an identity the operator revokes is closed on
// the node it is connected to and refused by every node, while another
// identity's connection, on a third node, is not touched; and no node
// lets one identity subscribe to another's inbox.
func TestIdentitiesOnACluster(t *testing.T) {
	nodes, dir := startIDCluster(t, nil)
	// An ephemeral identity enrolled through node 0 is admitted by all.
	enc := nodes[0].connectFile(t, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleEnroller)))
	var run *leasebus.EphemeralIdentity
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		var err error
		run, err = leasebus.EnrollEphemeral(enc, "run-att_cluster")
		return err
	})
	for i, n := range nodes {
		testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
			nc, err := nats.Connect(n.srv.ClientURL(), run.Options()...)
			if err != nil {
				return fmt.Errorf("node %d: %w", i, err)
			}
			nc.Close()
			return nil
		})
	}

	// A on node 1, B on node 2.
	var va violations
	a := nodes[1].connectFile(t, nodes[1].holderFile("runner-a"), nats.ErrorHandler(va.handler), nats.MaxReconnects(-1), nats.ReconnectWait(20*time.Millisecond))
	bc := nodes[2].connectFile(t, nodes[2].holderFile("runner-b"))
	if _, err := a.Subscribe("_INBOX."+leasebus.IdentityOf(bc)+".>", func(*nats.Msg) {}); err != nil {
		t.Fatal(err)
	}
	va.wait(t, "subscribing to another identity's inbox on a cluster")

	kept := filepath.Join(t.TempDir(), "runner-a.nk")
	if data, err := os.ReadFile(nodes[1].holderFile("runner-a")); err != nil {
		t.Fatal(err)
	} else if err := os.WriteFile(kept, data, 0o600); err != nil {
		t.Fatal(err)
	}
	id, _, err := leasebus.FindIdentity(dir, "runner-a")
	if err != nil {
		t.Fatal(err)
	}
	if err := leasebus.RemoveIdentity(dir, id); err != nil {
		t.Fatal(err)
	}
	// What `bus revoke-identity` does: an operator asks; every node reloads.
	op := nodes[0].connectFile(t, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleOperator)))
	if err := leasebus.ReloadIdentities(op); err != nil {
		t.Fatal(err)
	}
	testutil.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if a.IsConnected() {
			return errors.New("the revoked identity is still connected to node 1")
		}
		for i, n := range nodes {
			if _, err := leasebus.Dial(n.srv.ClientURL(), "test", leasebus.BusCreds{Path: kept, Source: "test", Role: leasebus.RoleHolder}); !errors.As(err, new(*leasebus.CredsRefusedError)) {
				return fmt.Errorf("node %d: a connection of the revoked identity: %v, want it refused", i, err)
			}
		}
		return nil
	})
	if !bc.IsConnected() {
		t.Fatal("runner B, on node 2, lost its connection to another identity's revoke")
	}
	if err := bc.Flush(); err != nil {
		t.Fatalf("runner B: %v", err)
	}
}

// TestIdentityChangesAudited (issue 28): enrolling and revoking an
// identity are audit events naming who asked and which identity, and an
// identity enrolled after the service started is named by its name, not
// its key, in later events.
func TestIdentityChangesAudited(t *testing.T) {
	b := startIDBus(t)
	ctx := ctxOf(t)
	ids, err := ServeIdentities(b.service.FleetConn(), b.srv, b.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ids.Stop)
	ids.Audit(b.service)
	enc := b.connectFile(t, filepath.Join(b.cfg.CredsDir, leasebus.CredsFile(leasebus.RoleEnroller)))
	run, err := leasebus.EnrollEphemeral(enc, "run-att_audit")
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(b.srv.ClientURL(), run.Options()...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if _, err := leasebus.NewClient(nc).List(ctx, testRepo, false); err != nil {
		t.Fatal(err)
	}
	// The operator's: bus enroll, then bus revoke-identity (files, then a reload).
	opNC := b.connectFile(t, filepath.Join(b.cfg.CredsDir, leasebus.CredsFile(leasebus.RoleOperator)))
	pod, _, err := leasebus.EnrollIdentity(b.cfg.CredsDir, "pod-billing", leasebus.RoleHolder, filepath.Join(t.TempDir(), "pod.nk"))
	if err != nil {
		t.Fatal(err)
	}
	if err := leasebus.ReloadIdentities(opNC); err != nil {
		t.Fatal(err)
	}
	if err := leasebus.RemoveIdentity(b.cfg.CredsDir, pod); err != nil {
		t.Fatal(err)
	}
	if err := leasebus.ReloadIdentities(opNC); err != nil {
		t.Fatal(err)
	}
	want := []string{
		leasebus.EventIdentityEnrolled + " " + run.Name + " (" + run.Nkey() + ") by enroller",
		leasebus.EventIdentityEnrolled + " pod-billing (" + pod.Nkey + ") by operator",
		leasebus.EventIdentityRevoked + " pod-billing (" + pod.Nkey + ") by operator",
	}
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.svc, "", 0)
		if err != nil {
			return err
		}
		var got []string
		for _, ev := range evs {
			if ev.Boundary == lease.BoundaryBus && (ev.Type == leasebus.EventIdentityEnrolled || ev.Type == leasebus.EventIdentityRevoked) {
				name, _, _ := strings.Cut(ev.Message, ":")
				got = append(got, ev.Type+" "+name+" by "+ev.RequestedBy)
			}
		}
		for _, w := range want {
			if !slices.Contains(got, w) {
				return fmt.Errorf("no %q among %q", w, got)
			}
		}
		return nil
	})
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.svc, testRepo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventList && ev.RequestedBy == run.Name {
				return nil
			}
		}
		return fmt.Errorf("no list event by %s in %+v", run.Name, evs)
	})
}

// TestKilledRunsIdentityCollected (issue 28): a run killed before it could
// leave leaves its ephemeral identity enrolled. The bus collects it once
// none of its sessions has been heard for CollectAfter(grace) and it has
// no connection and no active lease (its lease is reclaimed first, when
// its session's grace runs out), and audits that; a run that is still
// connected, or keeps its session heard while it holds nothing (waiting
// for a lease), keeps its identity.
func TestKilledRunsIdentityCollected(t *testing.T) {
	const grace = 2 * time.Second
	b := startIDBusWith(t, leasebus.ServiceConfig{SessionGrace: grace})
	ctx := ctxOf(t)
	ids, err := ServeIdentities(b.service.FleetConn(), b.srv, b.cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ids.Stop)
	ids.Audit(b.service)
	after := CollectAfter(grace)
	ids.Collect(b.service, after)
	enc := b.connectFile(t, filepath.Join(b.cfg.CredsDir, leasebus.CredsFile(leasebus.RoleEnroller)))
	enrol := func(name string) (*leasebus.EphemeralIdentity, *nats.Conn) {
		t.Helper()
		id, err := leasebus.EnrollEphemeral(enc, name)
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(b.srv.ClientURL(), id.Options()...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return id, nc
	}
	killed, knc := enrol("run-killed")
	idle, inc := enrol("run-idle")
	waiting, wnc := enrol("run-waiting")
	stop := leasebus.NewClient(wnc).KeepIdentity()
	t.Cleanup(stop)

	h, err := leasebus.NewClient(knc).AcquireAndHold(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: claimOf(t, "x"),
		Owner: lease.Owner{TaskID: "t", AgentID: "killed", AttemptID: "att_k"}, TTL: lease.Duration(time.Hour)}, leasebus.NewCredential(), leasebus.HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	leaseID := h.Lease().LeaseID
	// Killed: its connection drops, it never leaves. (The holder stays
	// unstopped, as in a process that died.)
	knc.Close()
	enrolled := func(id *leasebus.EphemeralIdentity) bool {
		_, ok, err := leasebus.FindIdentity(b.cfg.CredsDir, id.Nkey())
		if err != nil {
			t.Fatal(err)
		}
		return ok
	}
	viewer := leasebus.NewClient(b.connectFile(t, filepath.Join(b.cfg.CredsDir, leasebus.CredsFile(leasebus.RoleViewer))))
	testutil.CheckFor(t, after+5*grace, 100*time.Millisecond, func() error {
		if enrolled(killed) {
			return errors.New("the killed run's identity is still enrolled")
		}
		return nil
	})
	// Its lease was reclaimed before: the identity went with nothing held.
	l, err := viewer.Get(ctx, leaseID)
	if err != nil || l.Status != lease.StatusReclaimed {
		t.Fatalf("the killed run's lease: %+v %v, want reclaimed", l, err)
	}
	// The server reads the identities again right after the file went.
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		nc, err := nats.Connect(b.srv.ClientURL(), killed.Options()...)
		if err == nil {
			nc.Close()
		}
		if !errors.Is(err, nats.ErrAuthorization) {
			return fmt.Errorf("a connection as the collected identity: %v, want %v", err, nats.ErrAuthorization)
		}
		return nil
	})
	// The live ones stay, connected.
	for _, c := range []struct {
		id *leasebus.EphemeralIdentity
		nc *nats.Conn
	}{{idle, inc}, {waiting, wnc}} {
		if !enrolled(c.id) || !c.nc.IsConnected() {
			t.Fatalf("%s: enrolled %v, connected %v: a live run lost its identity", c.id.Name, enrolled(c.id), c.nc.IsConnected())
		}
	}
	// The collection is audited, as the bus's own act.
	testutil.CheckFor(t, 5*time.Second, 50*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.svc, "", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == leasebus.EventIdentityRevoked && strings.Contains(ev.Message, killed.Nkey()) && strings.Contains(ev.Message, "collected") {
				return nil
			}
		}
		return fmt.Errorf("no audit event of %s collected among %d", killed.Name, len(evs))
	})
}

// TestIdentityCollectionOnACluster (issue 28): on a 3-node cluster whose
// nodes share their credentials, a run connected to one node, holding
// nothing, is connected to none of the others: only its keepalives,
// answered by any instance and shared in their digests, keep the other
// nodes from collecting its identity. Once the run is killed, its identity
// is collected.
func TestIdentityCollectionOnACluster(t *testing.T) {
	const grace = 2 * time.Second
	nodes, dir := startIDCluster(t, &leasebus.ServiceConfig{SessionGrace: grace})
	after := CollectAfter(grace)
	run, nc, stop := liveRun(t, nodes, dir, "run-att_waiting", 2)
	// Twice the time after which a silent identity goes, and a beat.
	deadline := time.Now().Add(2*after + grace)
	for time.Now().Before(deadline) {
		if _, ok, err := leasebus.FindIdentity(dir, run.Nkey()); err != nil || !ok {
			t.Fatalf("a live run's identity was collected (enrolled %v, %v)", ok, err)
		}
		if !nc.IsConnected() {
			t.Fatal("a live run was disconnected")
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		}
	}
	stop()
	nc.Close()
	testutil.CheckFor(t, after+5*grace, 100*time.Millisecond, func() error {
		if _, ok, err := leasebus.FindIdentity(dir, run.Nkey()); ok || err != nil {
			return fmt.Errorf("the killed run's identity is still enrolled (%v)", err)
		}
		return nil
	})
}

// liveRun enrols an ephemeral identity name through node 0 of a
// startIDCluster cluster, connects it to node n and keeps its session
// heard (stop ends that).
func liveRun(t *testing.T, nodes []*idBus, dir, name string, n int) (*leasebus.EphemeralIdentity, *nats.Conn, func()) {
	t.Helper()
	enc := nodes[0].connectFile(t, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleEnroller)))
	var run *leasebus.EphemeralIdentity
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		var err error
		run, err = leasebus.EnrollEphemeral(enc, name)
		return err
	})
	var nc *nats.Conn
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		var err error
		nc, err = nats.Connect(nodes[n].srv.ClientURL(), run.Options()...)
		return err
	})
	t.Cleanup(nc.Close)
	return run, nc, leasebus.NewClient(nc).KeepIdentity()
}
