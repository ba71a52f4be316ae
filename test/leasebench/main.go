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
	svc, err := leasebus.StartService(ctx, svcConn, leasebus.ServiceConfig{})
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
		r, err := leaseload.Cycles(ctx, cs[:1], leaseload.Load{Phase: "single", Clients: 1, Duration: *d})
		if err != nil {
			return err
		}
		fmt.Println(r)
	}
	if want["disjoint"] {
		r, err := leaseload.Cycles(ctx, cs, leaseload.Load{Phase: "disjoint", Clients: *clients, Duration: *d})
		if err != nil {
			return err
		}
		fmt.Println(r)
	}
	if want["contended"] {
		r, err := leaseload.Cycles(ctx, cs, leaseload.Load{Phase: "contended", Clients: *clients, Duration: *d, Contended: true})
		if err != nil {
			return err
		}
		fmt.Println(r)
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
