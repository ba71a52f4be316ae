// Package leaseload drives acquire+release cycles against a lease bus and
// reports throughput and latency. The benchmarks in test/ and the
// leasebench command share it, so `go test -bench` and the side-by-side
// script measure the same thing.
package leaseload

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// Repo is the repository identity every load uses.
const Repo = "github.com/acme/bench"

// Result is what one load phase measured.
type Result struct {
	Phase   string
	Clients int
	Cycles  int           // acquire+release pairs completed
	Elapsed time.Duration // wall time of the phase
	Acquire []time.Duration
	Release []time.Duration
	Handoff []time.Duration // contended: release by one holder -> grant to the next
	PerCli  []int           // cycles per client
}

// CyclesPerSec is completed acquire+release pairs per second.
func (r *Result) CyclesPerSec() float64 { return float64(r.Cycles) / r.Elapsed.Seconds() }

// Pct returns the p-quantile (0..1) of ds.
func Pct(ds []time.Duration, p float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[int(float64(len(s)-1)*p)]
}

// String renders the result as one RESULT line, like the anchor benches.
func (r *Result) String() string {
	line := fmt.Sprintf("RESULT system=fenceline phase=%s clients=%d cycles=%d elapsed=%.2fs cycles_per_s=%.1f acquire_p50=%v acquire_p99=%v release_p50=%v",
		r.Phase, r.Clients, r.Cycles, r.Elapsed.Seconds(), r.CyclesPerSec(),
		Pct(r.Acquire, .5).Round(time.Microsecond), Pct(r.Acquire, .99).Round(time.Microsecond), Pct(r.Release, .5).Round(time.Microsecond))
	if len(r.Handoff) > 0 {
		line += fmt.Sprintf(" handoff_p50=%v handoff_p99=%v", Pct(r.Handoff, .5).Round(time.Microsecond), Pct(r.Handoff, .99).Round(time.Microsecond))
	}
	if len(r.PerCli) > 0 {
		line += fmt.Sprintf(" min_per_client=%d max_per_client=%d", slices.Min(r.PerCli), slices.Max(r.PerCli))
	}
	return line
}

// Load describes one cycling phase.
type Load struct {
	Phase   string
	Clients int
	// Duration bounds the phase; MaxCycles (if > 0) stops it earlier,
	// once that many cycles have started.
	Duration  time.Duration
	MaxCycles int64
	// Contended: every client asks for the same path (and waits for it);
	// otherwise each client has its own disjoint path in the one repo.
	Contended bool
}

// Cycles runs l.Clients goroutines, each looping acquire -> release;
// goroutine i uses cs[i%len(cs)].
func Cycles(ctx context.Context, cs []*leasebus.Client, l Load) (*Result, error) {
	clients, d, contended := l.Clients, l.Duration, l.Contended
	var started atomic.Int64
	res := &Result{Phase: l.Phase, Clients: clients, PerCli: make([]int, clients)}
	var mu sync.Mutex // guards res and the two lists below
	// contended: every grant and every release start, to pair each release
	// with the grant that followed it (grants are serialized on one scope).
	var grants, releases []time.Time
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(d)
	errc := make(chan error, clients)
	for i := range clients {
		path := fmt.Sprintf("svc/client-%03d", i)
		if contended {
			path = "svc/shared"
		}
		cl, err := scope.New([]string{path}, false, nil)
		if err != nil {
			return nil, err
		}
		c := cs[i%len(cs)]
		wg.Go(func() {
			cred := leasebus.NewCredential()
			var acq, rel []time.Duration
			var myGrants, myReleases []time.Time
			n := 0
			for time.Now().Before(deadline) && (l.MaxCycles <= 0 || started.Add(1) <= l.MaxCycles) {
				req := leasebus.AcquireRequest{Repo: Repo, Scope: cl,
					Owner: lease.Owner{TaskID: "bench", AgentID: fmt.Sprintf("client-%d", i)},
					TTL:   lease.Duration(30 * time.Second)}
				if contended {
					req.Wait = lease.Duration(time.Until(deadline) + time.Second)
				}
				t0 := time.Now()
				l, err := c.Acquire(ctx, req, cred)
				if err != nil {
					var ce *lease.ConflictError
					if errors.As(err, &ce) && ce.Waited {
						break // the phase ended while we queued
					}
					errc <- fmt.Errorf("client %d acquire: %w", i, err)
					return
				}
				got := time.Now()
				acq = append(acq, got.Sub(t0))
				t1 := time.Now()
				myGrants, myReleases = append(myGrants, got), append(myReleases, t1)
				if _, err := c.Release(ctx, l.LeaseID, cred); err != nil {
					errc <- fmt.Errorf("client %d release: %w", i, err)
					return
				}
				rel = append(rel, time.Since(t1))
				n++
			}
			mu.Lock()
			res.Acquire = append(res.Acquire, acq...)
			res.Release = append(res.Release, rel...)
			grants, releases = append(grants, myGrants...), append(releases, myReleases...)
			res.PerCli[i] = n
			res.Cycles += n
			mu.Unlock()
		})
	}
	wg.Wait()
	res.Elapsed = time.Since(start)
	if contended {
		slices.SortFunc(grants, time.Time.Compare)
		slices.SortFunc(releases, time.Time.Compare)
		for i := 0; i+1 < len(grants) && i < len(releases); i++ {
			if h := grants[i+1].Sub(releases[i]); h > 0 {
				res.Handoff = append(res.Handoff, h)
			}
		}
	}
	close(errc)
	for err := range errc {
		return res, err
	}
	return res, nil
}

// AcquireWithActive holds background leases on disjoint paths in one repo,
// then measures acquire latency of n more acquire+release cycles.
func AcquireWithActive(ctx context.Context, c *leasebus.Client, background, n int) (*Result, error) {
	cred := leasebus.NewCredential()
	var held []string
	for i := range background {
		cl, _ := scope.New([]string{fmt.Sprintf("bg/%05d", i)}, false, nil)
		l, err := c.Acquire(ctx, leasebus.AcquireRequest{Repo: Repo, Scope: cl, Owner: lease.Owner{TaskID: "bench-bg"}, TTL: lease.Duration(10 * time.Minute)}, cred)
		if err != nil {
			return nil, fmt.Errorf("background lease %d: %w", i, err)
		}
		held = append(held, l.LeaseID)
	}
	defer func() {
		for _, id := range held {
			_, _ = c.Release(context.WithoutCancel(ctx), id, cred)
		}
	}()
	res := &Result{Phase: fmt.Sprintf("active-%d", background), Clients: 1}
	cl, _ := scope.New([]string{"probe"}, false, nil)
	start := time.Now()
	for range n {
		t0 := time.Now()
		l, err := c.Acquire(ctx, leasebus.AcquireRequest{Repo: Repo, Scope: cl, Owner: lease.Owner{TaskID: "bench-probe"}, TTL: lease.Duration(time.Minute)}, cred)
		if err != nil {
			return nil, err
		}
		res.Acquire = append(res.Acquire, time.Since(t0))
		t1 := time.Now()
		if _, err := c.Release(ctx, l.LeaseID, cred); err != nil {
			return nil, err
		}
		res.Release = append(res.Release, time.Since(t1))
		res.Cycles++
	}
	res.Elapsed = time.Since(start)
	return res, nil
}
