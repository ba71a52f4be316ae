// Command leasebench measures fenceline's lease bus on the embedded single
// node (JetStream file store, SyncAlways): acquire+release cycles per second
// and latencies for 1 client, N clients on disjoint scopes of one repo, N
// clients contending for one scope, and acquire latency with 10 vs 1,000
// active leases. It prints RESULT lines like the anchor benchmarks in
// ../shared/anchor-bench, so scripts/bench-leases.sh can put them side by
// side. Every phase is bounded by -d and the process stops by itself.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"runtime"
	"runtime/pprof"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
	"github.com/fenceline/fenceline/test/leaseload"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "leasebench:", err)
		os.Exit(1)
	}
}

func run() error {
	d := flag.Duration("d", 10*time.Second, "duration of each cycling phase")
	clients := flag.Int("c", 32, "clients in the disjoint and contended phases")
	dir := flag.String("dir", "", "parent directory for the JetStream store (default: OS temp dir)")
	phases := flag.String("phases", "single,disjoint,contended,active", "phases to run, comma-separated")
	probes := flag.Int("probes", 300, "acquire+release probes in the active phase")
	cpuProfile := flag.String("cpuprofile", "", "write a CPU profile of the whole process (server, service and clients) over the phases to this file")
	flag.Parse()

	store, err := os.MkdirTemp(*dir, "leasebench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(store)
	srv, err := embedded.StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: store})
	if err != nil {
		return err
	}
	defer func() { srv.Shutdown(); srv.WaitForShutdown() }()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()

	creds := leasebus.CredsDirOf(store)
	svcOpts, err := leasebus.RoleOptions(creds, leasebus.RoleService)
	if err != nil {
		return err
	}
	holderOpts, err := leasebus.RoleOptions(creds, leasebus.RoleHolder)
	if err != nil {
		return err
	}
	svcConn, err := nats.Connect("", append(svcOpts, nats.InProcessServer(srv))...) // as in `fenceline bus serve`
	if err != nil {
		return err
	}
	defer svcConn.Close()
	metrics := leasebus.NewServiceMetrics()
	svc, err := leasebus.StartService(ctx, svcConn, leasebus.ServiceConfig{Metrics: metrics})
	if err != nil {
		return err
	}
	defer svc.Stop()

	// One connection per client, as each agent's sidecar has its own.
	cs := make([]*leasebus.Client, *clients)
	for i := range cs {
		nc, err := nats.Connect(srv.ClientURL(), holderOpts...) // a holder, as each agent's sidecar
		if err != nil {
			return err
		}
		defer nc.Close()
		cs[i] = leasebus.NewClient(nc)
	}
	if *cpuProfile != "" {
		f, err := os.Create(*cpuProfile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	fmt.Printf("go=%s GOMAXPROCS=%d NumCPU=%d syncAlways=true phase=%s\n", runtime.Version(), runtime.GOMAXPROCS(0), runtime.NumCPU(), *d)

	want := map[string]bool{}
	for _, p := range strings.Split(*phases, ",") {
		want[strings.TrimSpace(p)] = true
	}
	if want["single"] {
		before := appendStats(metrics)
		r, err := leaseload.Cycles(ctx, cs[:1], leaseload.Load{Phase: "single", Clients: 1, Duration: *d})
		if err != nil {
			return err
		}
		fmt.Println(r)
		fmt.Println(appendStats(metrics).since(before, "single", r.Cycles))
	}
	if want["disjoint"] {
		before := appendStats(metrics)
		r, err := leaseload.Cycles(ctx, cs, leaseload.Load{Phase: "disjoint", Clients: *clients, Duration: *d})
		if err != nil {
			return err
		}
		fmt.Println(r)
		fmt.Println(appendStats(metrics).since(before, "disjoint", r.Cycles))
	}
	if want["contended"] {
		before := appendStats(metrics)
		r, err := leaseload.Cycles(ctx, cs, leaseload.Load{Phase: "contended", Clients: *clients, Duration: *d, Contended: true})
		if err != nil {
			return err
		}
		fmt.Println(r)
		fmt.Println(appendStats(metrics).since(before, "contended", r.Cycles))
		if min := minInt(r.PerCli); min == 0 {
			return fmt.Errorf("contended: a client made no progress (per-client cycles %v)", r.PerCli)
		}
	}
	if want["active"] {
		var p50 [2]time.Duration
		for i, n := range []int{10, 1000} {
			r, err := leaseload.AcquireWithActive(ctx, cs[0], n, *probes)
			if err != nil {
				return err
			}
			fmt.Println(r)
			p50[i] = leaseload.Pct(r.Acquire, .5)
		}
		fmt.Printf("RATIO acquire_p50_active1000_over_active10=%.2f (floor: <= 2.00)\n", float64(p50[1])/float64(p50[0]))
	}
	return nil
}

func minInt(xs []int) int {
	m := int(^uint(0) >> 1)
	for _, x := range xs {
		m = min(m, x)
	}
	return m
}

// appends is what the service's metrics say of its lease-log appends so far.
type appends struct {
	ok, cas float64 // appends that took, and compare-and-swap conflicts
	took    float64 // seconds the ok ones waited for the store's acknowledgement
}

func appendStats(m *leasebus.ServiceMetrics) appends {
	var a appends
	families, err := m.Registry().Gather()
	if err != nil {
		return a
	}
	for _, f := range families {
		for _, mt := range f.GetMetric() {
			switch f.GetName() {
			case "fenceline_bus_appends_total":
				for _, l := range mt.GetLabel() {
					switch {
					case l.GetName() == "result" && l.GetValue() == "ok":
						a.ok += mt.GetCounter().GetValue()
					case l.GetName() == "result" && l.GetValue() == "cas":
						a.cas += mt.GetCounter().GetValue()
					}
				}
			case "fenceline_bus_append_seconds":
				a.took += mt.GetHistogram().GetSampleSum()
			}
		}
	}
	return a
}

// since prints, for a phase of cycles acquire+release cycles, the appends
// made since b: how many requests one append carried, and how long an
// append waited for its fsync'd acknowledgement.
func (a appends) since(b appends, phase string, cycles int) string {
	n := a.ok - b.ok
	if n == 0 {
		return fmt.Sprintf("STATS phase=%s appends=0", phase)
	}
	return fmt.Sprintf("STATS phase=%s appends=%.0f cas_conflicts=%.0f requests_per_append=%.2f append_mean_ms=%.3f",
		phase, n, a.cas-b.cas, 2*float64(cycles)/n, 1000*(a.took-b.took)/n)
}
