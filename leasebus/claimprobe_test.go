package leasebus

import (
	"context"
	"errors"
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
// connection for an answer (hearsFleet) refuses that question, and the
// answer's subscription; one whose servers were reloaded one by one may
// refuse the question alone (the fleet connection's server still on the
// older configuration). The service must not take either for a fleet
// connection cut off — no instance would ever take or renew the claim,
// and nobody would be served — but tell the refusal at once, keep its
// term, say to configure the bus again, and serve; once the servers are
// reloaded with the new configuration, it checks again without a restart.
//
// Not parallel: it shortens fleetReprobe, which the parallel tests (run
// after the sequential ones) read.
func TestReachRefusedByAnOlderConfig(t *testing.T) {
	// inFleet: the line is in the fleet account's block.
	for _, tc := range []struct {
		name string
		cut  func(line string, inFleet bool) bool
		want int // lines cut
	}{
		{"older configuration", func(line string, _ bool) bool { return strings.Contains(line, reachPrefix+".") }, 4},
		{"the fleet's question alone", func(line string, inFleet bool) bool { return inFleet && strings.Contains(line, reachPrefix+".") }, 2},
	} {
		t.Run(tc.name, func(t *testing.T) { reachRefused(t, tc.cut, tc.want) })
	}
}

func reachRefused(t *testing.T, cut func(line string, inFleet bool) bool, want int) {
	reprobe := fleetReprobe
	t.Cleanup(func() { fleetReprobe = reprobe }) // after the service's Stop, registered later
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
	var kept []string
	inFleet := false
	for _, line := range strings.Split(conf, "\n") {
		inFleet = inFleet || strings.HasPrefix(line, "  "+FleetAccount+" {")
		if !cut(line, inFleet) {
			kept = append(kept, line)
		}
	}
	if n := strings.Count(conf, "\n") + 1 - len(kept); n != want {
		t.Fatalf("cut %d lines naming %s, want %d:\n%s", n, reachPrefix, want, conf)
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
	began := termsBegun(svc)
	const again = "print the bus's configuration again with `fenceline bus creds`"
	if !strings.Contains(log.String(), again) {
		t.Fatalf("the service did not say %q:\n%s", again, log.String())
	}
	if svc.fleetUnprobedAt.Load() == 0 {
		t.Fatal("the service does not hold the check off")
	}
	// Asked again (every 200 ms here) and refused again, the refusal
	// costs no renewal: told at once, not when the term runs out.
	for end := time.Now().Add(5 * testTerm); time.Now().Before(end); {
		if !svc.Primary() || termsBegun(svc) != began {
			t.Fatalf("the primary let its term go while the bus refused its check:\n%s", log.String())
		}
		time.Sleep(20 * time.Millisecond) // sampling a state that must not change, not waiting for one
	}

	srv.Reload(t, conf)
	const back = "reach its claim connection again"
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(log.String(), back) || svc.fleetUnprobedAt.Load() != 0 {
			return fmt.Errorf("the service has not checked again since the reload (it says %q once it has):\n%s", back, log.String())
		}
		return nil
	})
	if !svc.Primary() || termsBegun(svc) != began {
		t.Fatalf("the primary lost its term by the reload:\n%s", log.String())
	}
	if err := svc.hearsFleet(ctx); err != nil {
		t.Fatalf("the fleet connection does not reach the claim connection on the reloaded bus: %v", err)
	}
}

// TestReachAnswersNoJetStreamDelivery: a holder has JetStream push a
// stream's records onto the subject where the claim connection answers
// its fleet connection (the writer stamp in it is no secret: the status
// request names the primary). Those deliveries get no answer: answering
// published onto the consumer's acknowledgement subject, which kept the
// attacker's consumer flowing and set the claim connection's last error
// (that the check reads to tell a refusal) to a permission violation.
func TestReachAnswersNoJetStreamDelivery(t *testing.T) {
	t.Parallel()
	b := electedAlone(t, testTerm)
	nc := b.svc.nc
	sub := reachSub(b.svc)
	if sub == nil {
		t.Fatal("the claim connection does not answer the fleet connection")
	}
	before, _ := sub.Delivered()
	lastErr := nc.LastError()
	injectViaConsumer(t, b.srv.ClientURL(), reachSubject(b.svc.store.writer), []byte("hello"))
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if n, _ := sub.Delivered(); n <= before {
			return errors.New("the delivery has not reached the claim connection's subscription")
		}
		return nil
	})
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if le := nc.LastError(); le != lastErr {
		t.Fatalf("the claim connection answered a JetStream delivery: %v", le)
	}
	if err := b.svc.hearsFleet(ctxT(t)); err != nil {
		t.Fatalf("the check fails after the delivery: %v", err)
	}
}

// TestReachSubscriptionLostIsMadeAgain: the claim connection's answer is
// gone (a server it reconnected to refused it again, or it was dropped):
// the fleet connection's question finds no responders, and the check
// makes the subscription again and asks once more rather than fail every
// claim write from then on.
func TestReachSubscriptionLostIsMadeAgain(t *testing.T) {
	t.Parallel()
	b := electedAlone(t, testTerm)
	lost := reachSub(b.svc)
	if err := lost.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	if err := b.svc.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	if err := b.svc.askReach(ctxT(t)); !errors.Is(err, nats.ErrNoResponders) {
		t.Fatalf("asked with the answer's subscription gone: %v, want no responders", err)
	}
	if err := b.svc.hearsFleet(ctxT(t)); err != nil {
		t.Fatalf("the check fails once the answer's subscription is gone: %v", err)
	}
	if err := b.svc.askReach(ctxT(t)); err != nil {
		t.Fatalf("the subscription was not made again: %v", err)
	}
}
