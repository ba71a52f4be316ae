//go:build integration

package leasebus

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// TestSessionReclaim: a lease acquired in a session lives while the
// session keeps alive — past its grace many times over — and is reclaimed
// (audited, with the session named) once the session falls silent; a
// lease acquired with no session is left to its TTL. The next holder's
// fence is higher.
func TestSessionReclaim(t *testing.T) {
	const grace = 2 * time.Second
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m, SessionGrace: grace}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/session"
	h, err := b.c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	loose, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "ledger"), Owner: owner(2), TTL: lease.Duration(5 * time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	// Alive past the grace three times over (counted in keepalives the
	// service answered, each at least keepEvery(grace) apart: beats vouch
	// in between).
	base := requests(m, "keepalive", "ok")
	checkFor(t, 60*time.Second, 50*time.Millisecond, func() error {
		if n := requests(m, "keepalive", "ok") - base; n < int(3*grace/keepEvery(grace)) {
			return fmt.Errorf("%d keepalives so far", n)
		}
		return nil
	})
	if _, err := h.Fence(); err != nil {
		t.Fatalf("a holder whose session keeps alive lost its lease: %v", err)
	}
	held := h.Lease()
	h.Orphan() // its session's only holder: the session falls silent
	stopped := time.Now()
	ended := waitEnded(t, b.c, held.LeaseID, 30*time.Second)
	if ended.Status != lease.StatusReclaimed || !strings.Contains(ended.Reason, "keepalive") {
		t.Errorf("ended as %s (%s), want reclaimed for its silent session", ended.Status, ended.Reason)
	}
	if took := time.Since(stopped); took < grace {
		t.Errorf("reclaimed %s after the session fell silent: before its grace of %s", took, grace)
	}
	checkAudited(t, b, repo, held.LeaseID, lease.EventReclaimed, "session-lost")
	next, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(3), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatalf("scope of the reclaimed lease: %v", err)
	}
	if next.Fence <= held.Fence {
		t.Errorf("next fence %d not above the reclaimed lease's %d", next.Fence, held.Fence)
	}
	if l, err := b.c.Get(ctx, loose.LeaseID); err != nil || !l.Active() {
		t.Errorf("a lease acquired with no session: %v %v, want active until its TTL", l, err)
	}
}

// TestForeignKeepaliveKeepsNothingAlive: another identity that learns a
// session's id and sends its keepalives keeps only its own session of
// that name alive; the lease is reclaimed all the same.
func TestForeignKeepaliveKeepsNothingAlive(t *testing.T) {
	const grace = 2 * time.Second
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{SessionGrace: grace}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/foreign-keepalive"
	hc := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	h, err := hc.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	held := h.Lease()
	h.Orphan()
	// The operator's identity (another key) keeps "that" session alive.
	oc := NewClient(connectAs(t, b.srv.ClientURL(), RoleOperator))
	forge := keepaliveRequest{Session: hc.SessionID(), Leases: []keptLease{{LeaseID: held.LeaseID, Repo: repo, Fence: held.Fence, Version: held.Version}}}
	checkFor(t, 30*time.Second, 100*time.Millisecond, func() error {
		if _, err := oc.request(ctx, "keepalive", forge, 0); err != nil {
			return fmt.Errorf("forged keepalive: %w", err)
		}
		l, err := oc.Get(ctx, held.LeaseID)
		if err != nil {
			return err
		}
		if l.Active() {
			return fmt.Errorf("%s still active", l.LeaseID)
		}
		return nil
	})
}

// TestPartitionedHolderStopsBeforeReclaim: a holder cut off from the bus
// (its connection blackholed, not closed) stops vouching for its lease
// within its silence, long before the service reclaims the lease for the
// silent session; the next holder gets a higher fence, and the cut-off
// holder never vouches again.
func TestPartitionedHolderStopsBeforeReclaim(t *testing.T) {
	const grace = 3 * time.Second
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{SessionGrace: grace}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/partitioned-session"
	bridge := testutil.NewBridge(t, strings.TrimPrefix(b.srv.ClientURL(), "nats://"))
	hc := NewClient(connectAs(t, "nats://"+bridge.Addr(), RoleHolder, nats.PingInterval(time.Hour)))
	h, err := hc.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	held := h.Lease()
	bridge.Partition(true)
	cut := time.Now()
	var stopped time.Duration
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if _, err := h.Fence(); err == nil {
			return errors.New("still vouching")
		}
		stopped = time.Since(cut)
		return nil
	})
	waitEnded(t, b.c, held.LeaseID, 30*time.Second)
	reclaimed := time.Since(cut)
	if stopped > 2*DefaultSilence || reclaimed < grace {
		t.Errorf("holder stopped %s after the cut, lease reclaimed after %s: want ≤ %s and ≥ %s", stopped, reclaimed, 2*DefaultSilence, grace)
	}
	next, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil || next.Fence <= held.Fence {
		t.Fatalf("next holder: %v %v, want a fence above %d", next, err, held.Fence)
	}
	if _, err := h.Fence(); err == nil {
		t.Fatal("the cut-off holder vouches for a reclaimed lease")
	}
}

// TestHeldByAKilledProcess is the child of TestKilledRunnerScopeReclaimed
// (it does nothing run as a test).
func TestHeldByAKilledProcess(t *testing.T) {
	url := os.Getenv(envHoldURL)
	if url == "" {
		return // not the child
	}
	creds, err := LoadCreds(os.Getenv(envHoldCreds))
	if err != nil {
		t.Fatal(err)
	}
	opts, err := creds.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(url, append(opts, HolderConnOptions()...)...)
	if err != nil {
		t.Fatal(err)
	}
	h, err := NewClient(nc).AcquireAndHold(context.Background(), AcquireRequest{Repo: os.Getenv(envHoldRepo), Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l := h.Lease()
	fmt.Printf("HELD %s %d\n", l.LeaseID, l.Fence)
	select {} // until killed
}

func TestKilledRunnerScopeReclaimed(t *testing.T) {
	b := startBus(t) // the default grace
	ctx := ctxT(t)
	const repo = "github.com/acme/killed-runner"
	cmd := exec.Command(os.Args[0], "-test.run=^TestHeldByAKilledProcess$", "-test.count=1")
	cmd.Env = append(os.Environ(), envHoldURL+"="+b.srv.ClientURL(), envHoldCreds+"="+filepath.Join(testCredsDir(t), CredsFile(RoleHolder)), envHoldRepo+"="+repo)
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	waited := false
	defer func() {
		if !waited {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
		}
	}()
	lines := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "HELD ") {
				lines <- sc.Text()
				break
			}
		}
		close(lines)
		_, _ = bufio.NewReader(out).WriteTo(discard{})
	}()
	var line string
	select {
	case line = <-lines:
	case <-time.After(30 * time.Second):
		t.Fatal("the child holder did not report its lease within 30 s")
	}
	f := strings.Fields(line)
	if len(f) != 3 {
		t.Fatalf("child said %q", line)
	}
	id := f[1]
	fence, _ := strconv.ParseUint(f[2], 10, 64)
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	killed := time.Now()
	_ = cmd.Wait()
	waited = true

	next, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(60 * time.Second)}, NewCredential())
	if err != nil {
		t.Fatalf("scope of the killed runner's lease: %v", err)
	}
	took := time.Since(killed)
	t.Logf("scope back %s after the kill (ttl 5m, grace %s)", took.Round(time.Millisecond), DefaultSessionGrace)
	if took > 15*time.Second {
		t.Errorf("scope back %s after the kill: want ≤ 15 s", took)
	}
	if next.Fence <= fence {
		t.Errorf("next fence %d not above the killed runner's %d", next.Fence, fence)
	}
	l, err := b.c.Get(ctx, id)
	if err != nil || l.Status != lease.StatusReclaimed {
		t.Fatalf("killed runner's lease: %v %v, want reclaimed", l, err)
	}
	checkAudited(t, b, repo, id, lease.EventReclaimed, "session-lost")
}

// TestSessionsOnACluster: with a lease service instance on each of three
// nodes, a session's keepalives reach one instance or another, and each
// tells the others what it heard: no instance reclaims a live session's
// lease, and once the session falls silent the lease is reclaimed once
// (one reclaim in the audit, however many instances saw it due).
func TestSessionsOnACluster(t *testing.T) {
	const grace = 2 * time.Second
	cl := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	ms := make([]*ServiceMetrics, 3)
	for i := range 3 {
		ms[i] = NewServiceMetrics()
		startClusterServiceWith(ctx, t, connect(t, cl.urls[i]), ServiceConfig{SessionGrace: grace, Metrics: ms[i]})
	}
	keepalives := func() (total, least int) {
		least = -1
		for _, m := range ms {
			n := requests(m, "keepalive", "ok")
			total += n
			if least < 0 || n < least {
				least = n
			}
		}
		return total, least
	}
	const repo = "github.com/acme/cluster-session"
	hc := NewClient(connectAs(t, cl.urls[0], RoleHolder))
	h, err := hc.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	held := h.Lease()
	c := NewClient(connectAs(t, cl.urls[1], RoleOperator))
	base, _ := keepalives()
	checkFor(t, 2*time.Minute, 50*time.Millisecond, func() error {
		// However they spread (one instance may hear none: the others'
		// digests tell it), each instance's grace passed twice over.
		if total, least := keepalives(); total-base < int(4*grace/keepEvery(grace)) {
			return fmt.Errorf("%d keepalives so far, the fewest through one instance %d", total-base, least)
		}
		return nil
	})
	if l, err := c.Get(ctx, held.LeaseID); err != nil || !l.Active() {
		t.Fatalf("a live session's lease on the cluster: %v %v, want active", l, err)
	}
	if _, err := h.Fence(); err != nil {
		t.Fatalf("holder: %v", err)
	}
	h.Orphan()
	if l := waitEnded(t, c, held.LeaseID, time.Minute); l.Status != lease.StatusReclaimed {
		t.Fatalf("%s ended as %s (%s), want reclaimed", l.LeaseID, l.Status, l.Reason)
	}
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, c.Conn(), repo, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.LeaseID == held.LeaseID && ev.Type == lease.EventReclaimed {
				n++
			}
		}
		if n != 1 {
			return fmt.Errorf("%d reclaims of %s in the audit, want 1", n, held.LeaseID)
		}
		return nil
	})
}

// TestSessionReclaimAfterServiceRestart: a lease service that starts
// after a holder's process died (a restart, a failover) still reclaims
// the lease for its silent session, its grace counted from its own start.
func TestSessionReclaimAfterServiceRestart(t *testing.T) {
	const grace = 2 * time.Second
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{SessionGrace: grace}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/session-restart"
	hc := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	h, err := hc.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "billing"), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	held := h.Lease()
	b.svc.Stop()
	h.Orphan() // the process is gone while no service runs
	b.svc, err = StartService(context.Background(), b.nc, b.cfg)
	if err != nil {
		t.Fatal(err)
	}
	// Watched through the audit stream alone: a request about the lease
	// would have the service read its repo's log (and index it afresh).
	checkAudited(t, b, repo, held.LeaseID, lease.EventReclaimed, "session-lost")
	if l, err := b.c.Get(ctx, held.LeaseID); err != nil || l.Status != lease.StatusReclaimed {
		t.Fatalf("%s: %v %v, want reclaimed", held.LeaseID, l, err)
	}
}
