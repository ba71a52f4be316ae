package embedded

import (
	"context"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/natstest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// TestClaimProbeRefusedByAnOlderConfig: a nats-server configured by a
// `bus creds` from before the lease service's fleet connection probed the
// claim (hearsFleet) refuses it that probe. The service must not take it
// for a fleet connection cut off — no instance would ever take or renew
// the claim, and nobody would be served — but say to configure the bus
// again, and serve.
func TestClaimProbeRefusedByAnOlderConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := leasebus.EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	users, err := leasebus.ServerUsers(dir)
	if err != nil {
		t.Fatal(err)
	}
	conf, err := leasebus.AuthConfig(users)
	if err != nil {
		t.Fatal(err)
	}
	// The lines that grant, export and import the probe, and no other.
	probe := "STREAM.INFO." + leasebus.PrimaryStream
	var kept []string
	for _, line := range strings.Split(conf, "\n") {
		if !strings.Contains(line, probe) {
			kept = append(kept, line)
		}
	}
	if cut := strings.Count(conf, "\n") + 1 - len(kept); cut != 3 {
		t.Fatalf("the config names %s on %d lines, want 3 (the fleet connection's grant, the export, the import):\n%s", probe, cut, conf)
	}
	srv := natstest.Start(t, strings.Join(kept, "\n"))
	connect := func(role leasebus.Role) *nats.Conn {
		o, err := leasebus.RoleOptions(dir, role)
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
	svc, err := leasebus.StartService(ctx, connect(leasebus.RoleService), leasebus.ServiceConfig{Primary: true, Logger: slog.New(slog.NewTextHandler(&log, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	if svc.FleetConn() == nil {
		t.Fatal("the service has no fleet connection")
	}
	c := leasebus.NewClient(connect(leasebus.RoleHolder))
	claim, err := scope.New([]string{"probe"}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	// Served: the instance took the claim.
	if _, err := c.Acquire(ctx, leasebus.AcquireRequest{Repo: "github.com/acme/probe", Scope: claim, Owner: lease.Owner{TaskID: "t", AgentID: "a", AttemptID: "1"}, TTL: lease.Duration(time.Minute)}, leasebus.NewCredential()); err != nil {
		t.Fatalf("a service on an older configuration serves nobody: %v\n%s", err, log.String())
	}
	if !svc.Primary() {
		t.Fatal("the instance that served is not the primary")
	}
	const again = "print the bus's configuration again with `fenceline bus creds`"
	if !strings.Contains(log.String(), again) {
		t.Fatalf("the service did not say %q:\n%s", again, log.String())
	}
}
