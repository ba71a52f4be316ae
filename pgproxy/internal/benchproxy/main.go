// Command benchproxy runs a pgproxy in front of a Postgres server with a
// fixed, always-live lease, for scripts/bench-pg.sh and scripts/pgx-suite.sh. With -install it first
// installs the storage-side fence on the claimed tables.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"runtime"
	"runtime/pprof"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "benchproxy:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:6433", "listen address")
	upstream := flag.String("upstream", "127.0.0.1:5432", "Postgres host:port, or the path of its Unix socket")
	tables := flag.String("tables", "public.*", "comma-separated table claims")
	install := flag.String("install", "", "admin DSN: install the fence on the claimed tables first")
	trigger := flag.String("trigger", "auto", "with -install: the trigger, auto, c or plpgsql")
	clib := flag.String("c-library", "", "with -install: the C trigger's shared library (default "+pgproxy.CTriggerLibrary+")")
	wholeRepo := flag.Bool("whole-repo", false, "the lease claims the whole repository besides its tables")
	allowOpaque := flag.Bool("allow-opaque", false, "allow writes whose tables cannot be named (DO, CALL, CREATE FUNCTION...), as --pg-allow-opaque")
	cpuprofile := flag.String("cpuprofile", "", "write a CPU profile of the whole run to this file (stopped on SIGINT/SIGTERM)")
	memprofile := flag.String("memprofile", "", "write a heap profile of every allocation over the whole run to this file at exit (slows the proxy)")
	flag.Parse()
	if *memprofile != "" {
		runtime.MemProfileRate = 1 // every allocation, to count them (slows the proxy)
		defer func() {
			if err := writeHeapProfile(*memprofile); err != nil {
				fmt.Fprintln(os.Stderr, err)
			}
		}()
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("cpu profile: %w", err)
		}
		defer pprof.StopCPUProfile()
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	claims := strings.Split(*tables, ",")
	var secret []byte
	if *install != "" {
		trig, err := pgproxy.ParseTrigger(*trigger)
		if err != nil {
			return err
		}
		conn, err := pgx.Connect(ctx, *install)
		if err != nil {
			return err
		}
		in, err := pgproxy.Install(ctx, conn, claims, pgproxy.InstallOptions{Trigger: trig, CLibrary: *clib})
		conn.Close(ctx)
		if err != nil {
			return err
		}
		secret = in.Secret
		fmt.Printf("trigger %s %s\n", in.Trigger, in.CLibrary)
		if in.NoC != nil {
			fmt.Printf("not the C trigger: %v\n", in.NoC)
		}
	}
	claim, err := scope.New(nil, *wholeRepo, claims)
	if err != nil {
		return err
	}
	// Play the lease service: the proxy holds only the lease's grant key.
	rec := lease.Lease{LeaseID: "lease_bench", Fence: 1, Scope: claim, Status: lease.StatusActive}
	if secret != nil {
		if rec.Grants, err = lease.GrantKeysFor(&rec, nil, secret); err != nil {
			return err
		}
	}
	p, err := pgproxy.Listen(ctx, pgproxy.Config{
		Listen: *listen, Upstream: *upstream, AllowOpaque: *allowOpaque,
		Lease:  leasebus.Frozen{Record: rec},
		Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
	})
	if err != nil {
		return err
	}
	fmt.Println("listening", p.Addr())
	<-ctx.Done()
	return p.Close()
}

// writeHeapProfile writes the heap profile, whose alloc_* samples count
// every allocation since the start (go tool pprof -sample_index=alloc_objects).
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("heap profile: %w", err)
	}
	defer f.Close()
	if err := pprof.Lookup("heap").WriteTo(f, 0); err != nil {
		return fmt.Errorf("heap profile: %w", err)
	}
	return nil
}
