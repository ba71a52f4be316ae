// Command sidecarbench measures the fenceline sidecar as pods run it: the
// real binary as a child process (with a Postgres fence in front of a real
// Postgres from internal/pgtest, the lease bus in this process), reporting
//
//   - start to ready: from starting the process to its /readyz answering 200
//     (admin server up, lease acquired, fences listening), median and max;
//   - resident memory idle (VmRSS, and VmHWM since start);
//   - resident memory with 100 concurrent Postgres connections through the
//     fence, each running queries (VmRSS at the peak, VmHWM).
//
// Floors (issue 7): idle <= 40 MB, 100 connections <= 120 MB, ready <= 300 ms.
//
//	go build -o /tmp/fenceline ./cmd/fenceline && go run ./test/sidecarbench -fenceline /tmp/fenceline
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
)

func main() {
	bin := flag.String("fenceline", "fenceline", "the fenceline binary (the sidecar runs as its own process)")
	runs := flag.Int("runs", 5, "start-to-ready runs")
	conns := flag.Int("conns", 100, "concurrent Postgres connections through the fence")
	verbose := flag.Bool("v", false, "show the sidecars' logs")
	flag.Parse()
	if err := run(*bin, *runs, *conns, *verbose); err != nil {
		fmt.Fprintln(os.Stderr, "sidecarbench:", err)
		os.Exit(1)
	}
}

func run(bin string, runs, conns int, verbose bool) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	dir, err := os.MkdirTemp("", "sidecarbench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	pg, err := pgtest.Start(ctx)
	if err != nil {
		return fmt.Errorf("postgres: %w", err)
	}
	defer pg.Stop()
	srv, err := embedded.StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: filepath.Join(dir, "bus")})
	if err != nil {
		return err
	}
	defer srv.Shutdown()
	creds := leasebus.CredsDirOf(filepath.Join(dir, "bus"))
	svcOpts, err := leasebus.RoleOptions(creds, leasebus.RoleService)
	if err != nil {
		return err
	}
	nc, err := nats.Connect(srv.ClientURL(), svcOpts...)
	if err != nil {
		return err
	}
	defer nc.Close()
	svc, err := leasebus.StartService(ctx, nc, leasebus.ServiceConfig{})
	if err != nil {
		return err
	}
	defer svc.Stop()

	b := &bench{bin: bin, bus: srv.ClientURL(), creds: creds, pg: pg, dir: dir, verbose: verbose}
	var ready []time.Duration
	for range runs {
		sc, err := b.start(ctx)
		if err != nil {
			return err
		}
		ready = append(ready, sc.ready)
		if err := sc.stop(); err != nil {
			return err
		}
	}
	slices.Sort(ready)
	fmt.Printf("start to ready (/readyz 200): median %s, max %s over %d runs (floor <= 300 ms)\n",
		ready[len(ready)/2].Round(time.Millisecond), ready[len(ready)-1].Round(time.Millisecond), runs)

	sc, err := b.start(ctx)
	if err != nil {
		return err
	}
	defer sc.stop()
	// Idle: let the runtime settle, as a pod's sidecar sits between pushes.
	time.Sleep(2 * time.Second)
	rss, hwm := sc.mem()
	fmt.Printf("idle: VmRSS %.1f MB, VmHWM %.1f MB (floor <= 40 MB)\n", mb(rss), mb(hwm))

	peak, err := b.connections(ctx, sc, conns)
	if err != nil {
		return err
	}
	rss, hwm = sc.mem()
	fmt.Printf("%d concurrent Postgres connections through the fence: VmRSS %.1f MB at the peak, VmHWM %.1f MB (floor <= 120 MB); after closing: VmRSS %.1f MB\n",
		conns, mb(peak), mb(hwm), mb(rss))
	return nil
}

func mb(n int64) float64 { return float64(n) / (1 << 20) }

type bench struct {
	bin, bus string
	creds    string // the bus's credentials directory (the sidecars' --creds)
	pg       *pgtest.Server
	dir      string
	seq      int
	verbose  bool
}

type sidecar struct {
	cmd    *exec.Cmd
	pgAddr string
	ready  time.Duration
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

// start runs a sidecar and returns once /readyz answers 200.
func (b *bench) start(ctx context.Context) (*sidecar, error) {
	b.seq++
	adminPort, err := freePort()
	if err != nil {
		return nil, err
	}
	pgPort, err := freePort()
	if err != nil {
		return nil, err
	}
	pgAddr := fmt.Sprintf("127.0.0.1:%d", pgPort)
	cmd := exec.Command(b.bin, "--nats", b.bus, "--creds", b.creds, "sidecar", "--repo", fmt.Sprintf("bench/%d", b.seq), "--table", "public.*",
		"--workspace", "exclusive", "--pg-upstream", b.pg.Addr(), "--pg-listen", pgAddr,
		"--admin", fmt.Sprintf("127.0.0.1:%d", adminPort), "--state-dir", filepath.Join(b.dir, fmt.Sprintf("sidecar%d", b.seq)))
	cmd.Env = append(os.Environ(), "XDG_STATE_HOME="+filepath.Join(b.dir, "state"))
	cmd.Stdout = io.Discard
	if b.verbose {
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	}
	started := time.Now()
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start sidecar: %w", err)
	}
	sc := &sidecar{cmd: cmd, pgAddr: pgAddr}
	url := fmt.Sprintf("http://127.0.0.1:%d/readyz", adminPort)
	hc := &http.Client{Timeout: time.Second}
	for {
		resp, err := hc.Get(url)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				sc.ready = time.Since(started)
				return sc, nil
			}
		}
		if time.Since(started) > 20*time.Second || ctx.Err() != nil {
			sc.stop()
			return nil, errors.New("the sidecar was not ready within 20s")
		}
		time.Sleep(time.Millisecond) // polling another process's port
	}
}

// mem is the sidecar's VmRSS and VmHWM in bytes.
func (s *sidecar) mem() (rss, hwm int64) {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", s.cmd.Process.Pid))
	if err != nil {
		return -1, -1
	}
	for l := range strings.Lines(string(data)) {
		for key, dst := range map[string]*int64{"VmRSS:": &rss, "VmHWM:": &hwm} {
			if v, ok := strings.CutPrefix(l, key); ok {
				kb, _ := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
				*dst = kb << 10
			}
		}
	}
	return rss, hwm
}

// stop sends SIGTERM (as the kubelet does) and waits for the exit.
func (s *sidecar) stop() error {
	if s.cmd.ProcessState != nil {
		return nil
	}
	s.cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- s.cmd.Wait() }()
	select {
	case err := <-done:
		return err
	case <-time.After(20 * time.Second):
		s.cmd.Process.Kill()
		<-done
		return errors.New("the sidecar did not stop within 20s of SIGTERM")
	}
}

// connections opens n connections through the fence at once, runs 20
// queries on each, samples the sidecar's VmRSS while all are
// open, and closes them. It returns the peak VmRSS seen.
func (b *bench) connections(ctx context.Context, sc *sidecar, n int) (int64, error) {
	dsn := strings.Replace(b.pg.AdminDSN(""), b.pg.Addr(), sc.pgAddr, 1)
	open := make(chan struct{})
	release := make(chan struct{})
	errs := make(chan error, n)
	var wg sync.WaitGroup
	var opened sync.WaitGroup
	opened.Add(n)
	for range n {
		wg.Go(func() {
			once := sync.OnceFunc(opened.Done)
			defer once()
			<-open
			c, err := pgx.Connect(ctx, dsn)
			if err != nil {
				errs <- err
				return
			}
			defer c.Close(context.Background())
			for i := range 20 {
				var v int
				if err := c.QueryRow(ctx, "SELECT $1::int + 1", i).Scan(&v); err != nil {
					errs <- err
					return
				}
			}
			once()
			<-release
		})
	}
	close(open)
	opened.Wait()
	var peak int64
	for range 10 {
		if rss, _ := sc.mem(); rss > peak {
			peak = rss
		}
		time.Sleep(50 * time.Millisecond)
	}
	close(release)
	wg.Wait()
	close(errs)
	if err := <-errs; err != nil {
		return peak, fmt.Errorf("connection through the fence: %w", err)
	}
	return peak, nil
}
