package leasebus

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/natstest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// TestReachRefusedByAnOlderConfig: a nats-server configured by a `bus
// creds` from before the lease service's fleet connection asked its claim
// connection for an answer (hearsFleet) refuses it that request. The
// service must not take it for a fleet connection cut off — no instance
// would ever take or renew the claim, and nobody would be served — but
// say to configure the bus again, and serve; once the servers are
// reloaded with the new configuration, it checks again without a restart.
//
// Not parallel: it shortens fleetReprobe, which the parallel tests (run
// after the sequential ones) read.
func TestReachRefusedByAnOlderConfig(t *testing.T) {
	defer func(d time.Duration) { fleetReprobe = d }(fleetReprobe)
	fleetReprobe = 200 * time.Millisecond
	dir := t.TempDir()
	if _, err := EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	users, err := ServerUsers(dir)
	if err != nil {
		t.Fatal(err)
	}
	conf, err := AuthConfig(users)
	if err != nil {
		t.Fatal(err)
	}
	// The lines that grant, export and import the check's subject, and no
	// other.
	var kept []string
	for _, line := range strings.Split(conf, "\n") {
		if !strings.Contains(line, reachPrefix+".") {
			kept = append(kept, line)
		}
	}
	if cut := strings.Count(conf, "\n") + 1 - len(kept); cut != 4 {
		t.Fatalf("the config names %s on %d lines, want 4 (the claim connection's and the fleet connection's grants, the export, the import):\n%s", reachPrefix, cut, conf)
	}
	srv := natstest.Start(t, strings.Join(kept, "\n"))
	connect := func(role Role) *nats.Conn {
		o, err := RoleOptions(dir, role)
		if err != nil {
			t.Fatal(err)
		}
		nc, err := nats.Connect(srv.ClientURL(), o...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(nc.Close)
		return nc
	}
	var log testutil.SyncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	svc, err := StartService(ctx, connect(RoleService), ServiceConfig{Primary: true, PrimaryTerm: testTerm, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	if svc.FleetConn() == nil || svc.FleetConn() == svc.nc {
		t.Fatal("the service has no fleet connection of its own")
	}
	c := NewClient(connect(RoleHolder))
	// Served: the instance took the claim.
	if _, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "probe"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatalf("a service on an older configuration serves nobody: %v\n%s", err, log.String())
	}
	if !svc.Primary() {
		t.Fatal("the instance that served is not the primary")
	}
	const again = "print the bus's configuration again with `fenceline bus creds`"
	if !strings.Contains(log.String(), again) {
		t.Fatalf("the service did not say %q:\n%s", again, log.String())
	}
	if svc.fleetUnprobedAt.Load() == 0 {
		t.Fatal("the service does not hold the check off")
	}

	srv.Reload(t, conf)
	const back = "reach its claim connection again"
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(log.String(), back) || svc.fleetUnprobedAt.Load() != 0 {
			return fmt.Errorf("the service has not checked again since the reload (it says %q once it has):\n%s", back, log.String())
		}
		return nil
	})
	if !svc.Primary() {
		t.Fatalf("the primary lost its term once its check was back:\n%s", log.String())
	}
	if err := svc.hearsFleet(ctx); err != nil {
		t.Fatalf("the fleet connection does not reach the claim connection on the reloaded bus: %v", err)
	}
}
