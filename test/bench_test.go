// Package test holds fenceline's end-to-end benchmarks; they drive a real
// embedded NATS JetStream server (file store, SyncAlways) and the real
// lease service through the real client.
package test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/test/leaseload"
)

func startBench(b *testing.B, clients int) []*leasebus.Client {
	b.Helper()
	srv := bustest.StartServer(b, leasebus.ServerConfig{})
	conn := func() *nats.Conn { return bustest.ConnectRole(b, srv.ClientURL(), leasebus.RoleHolder) }
	// The service talks to its server in-process, as in `fenceline bus serve`.
	svcConn, err := nats.Connect("", bustest.Options(b, leasebus.RoleService, nats.InProcessServer(srv))...)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(svcConn.Close)
	svc, err := leasebus.StartService(context.Background(), svcConn, leasebus.ServiceConfig{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(svc.Stop)
	cs := make([]*leasebus.Client, clients)
	for i := range cs {
		cs[i] = leasebus.NewClient(conn())
	}
	return cs
}

func report(b *testing.B, r *leaseload.Result) {
	b.ReportMetric(r.CyclesPerSec(), "cycles/s")
	b.ReportMetric(float64(leaseload.Pct(r.Acquire, .5).Microseconds()), "acquire-p50-µs")
	b.ReportMetric(float64(leaseload.Pct(r.Acquire, .99).Microseconds()), "acquire-p99-µs")
	if len(r.Handoff) > 0 {
		b.ReportMetric(float64(leaseload.Pct(r.Handoff, .5).Microseconds()), "handoff-p50-µs")
	}
}

// BenchmarkLeaseCycles measures acquire+release cycles on the embedded
// single node with SyncAlways: one client; 32 clients on disjoint scopes of
// one repo; 32 clients contending for one scope (every client must progress).
func BenchmarkLeaseCycles(b *testing.B) {
	for _, bc := range []struct {
		name      string
		clients   int
		contended bool
	}{
		{"single", 1, false},
		{"disjoint-32", 32, false},
		{"contended-32", 32, true},
	} {
		b.Run(bc.name, func(b *testing.B) {
			cs := startBench(b, bc.clients)
			ctx := context.Background()
			b.ResetTimer()
			r, err := leaseload.Cycles(ctx, cs, leaseload.Load{Phase: bc.name, Clients: bc.clients,
				Duration: time.Minute, MaxCycles: int64(b.N), Contended: bc.contended})
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			report(b, r)
			if bc.contended && b.N >= 10*bc.clients {
				for i, n := range r.PerCli {
					if n == 0 {
						b.Fatalf("client %d made no progress in %d cycles (livelock or starvation)", i, r.Cycles)
					}
				}
			}
		})
	}
}

// BenchmarkAcquireWithActive measures acquire latency with 10 and with 1,000
// active leases in the same repo (the floor: p50 at 1,000 ≤ 2× p50 at 10).
func BenchmarkAcquireWithActive(b *testing.B) {
	for _, n := range []int{10, 1000} {
		b.Run(fmt.Sprintf("active-%d", n), func(b *testing.B) {
			cs := startBench(b, 1)
			ctx := context.Background()
			b.ResetTimer()
			r, err := leaseload.AcquireWithActive(ctx, cs[0], n, b.N)
			if err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			report(b, r)
		})
	}
}
