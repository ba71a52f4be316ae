package leasebus

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// TestPrimaryWhoseFleetGoesSilentStepsDown: the lease service takes the
// fleet's requests and answers them on one connection (the fleet
// account's) and renews its claim on another (the service account's), and
// the two may have dialled different servers. The primary's fleet
// connection goes silent (its server froze, as a SIGSTOP of a cluster
// node leaves it) while its claim's connection works: it must let its term
// run out, so that the standby takes over and answers, rather than renew
// its claim and answer nobody — every request the standby forwards to it
// lost — until the server drops the stale connection, half a minute later.
func TestPrimaryWhoseFleetGoesSilentStepsDown(t *testing.T) {
	t.Parallel()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Primary: true, PrimaryTerm: testTerm}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	u, err := url.Parse(b.srv.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	// X's connections go through a bridge: the first it accepts is the
	// claim's, the second the fleet's.
	br := testutil.NewBridge(t, u.Host)
	cfg := ServiceConfig{Primary: true, PrimaryTerm: testTerm}
	x, err := StartService(ctxT(t), connect(t, "nats://"+br.Addr()), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(x.Stop)
	b.svc.Stop() // hands the claim over to x
	b.svc = nil
	primaryOf(t, []*Service{x}, 10*time.Second)
	y, err := StartService(ctxT(t), connect(t, b.srv.ClientURL()), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(y.Stop)
	if p := primaryOf(t, []*Service{x, y}, 10*time.Second); p != 0 {
		t.Fatal("the instance behind the bridge is no longer the primary once the standby started")
	}
	ctx := ctxT(t)
	c := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	l, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "fleet"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}

	br.PartitionConn(1)
	cut := time.Now()
	if err := x.FleetConn().FlushTimeout(300 * time.Millisecond); err == nil {
		t.Fatal("the primary's fleet connection still answers its pings: the bridge cut another connection")
	}
	if err := x.nc.FlushTimeout(5 * time.Second); err != nil {
		t.Fatalf("the primary's claim connection is cut too: %v", err)
	}
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if x.Primary() {
			return errors.New("the primary whose fleet connection is silent still serves")
		}
		if !y.Primary() {
			return errors.New("the standby has not taken over")
		}
		return nil
	})
	// Done by its own check, not by the server giving up the connection.
	if n := x.FleetConn().Stats().Reconnects; n != 0 {
		t.Fatalf("the silent fleet connection reconnected (%d) before the primary stepped down, %s after the cut: the test proves nothing", n, time.Since(cut))
	}
	t.Logf("the standby serves %s after the primary's fleet connection went silent", time.Since(cut).Round(time.Millisecond))
	checkFor(t, 10*time.Second, 0, func() error {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		got, err := c.Get(rctx, l.LeaseID)
		if err != nil {
			return err
		}
		if !got.Active() || got.Fence != l.Fence {
			return fmt.Errorf("the new primary has %+v: want the lease granted before", got)
		}
		return nil
	})
}
