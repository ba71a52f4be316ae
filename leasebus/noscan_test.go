package leasebus

// No request scans every repo: a lease id names its repo, so a get,
// release, renew or revoke by id on an instance that has not seen the
// lease reads that repo's log alone; a scrape of the metrics reads no log;
// a service starts serving before it has read every repo's log, and loads
// them in the background (where leases nobody asks about still expire).

import (
	"context"
	"fmt"
	"net/http/httptest"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// manyRepos grants one lease in each of n repos (github.com/many/rN)
// through b's service, a few at a time.
func manyRepos(t testing.TB, b *bus, n int, ttl time.Duration) []ackedLease {
	t.Helper()
	reqs := make([]AcquireRequest, n)
	for i := range reqs {
		reqs[i] = AcquireRequest{Repo: manyRepo(i), Scope: claim(t, "a"), Owner: owner(i), TTL: lease.Duration(ttl)}
	}
	return acquireMany(t, b, reqs)
}

// acquireMany grants reqs through b's service, 16 at a time.
func acquireMany(t testing.TB, b *bus, reqs []AcquireRequest) []ackedLease {
	t.Helper()
	ctx := ctxT(t)
	out := make([]ackedLease, len(reqs))
	var wg sync.WaitGroup
	errs := make(chan error, len(reqs))
	next := make(chan int)
	for range 16 {
		wg.Go(func() {
			for i := range next {
				cred := NewCredential()
				l, err := b.c.Acquire(ctx, reqs[i], cred)
				if err != nil {
					errs <- fmt.Errorf("acquire in %s: %w", reqs[i].Repo, err)
					continue
				}
				out[i] = ackedLease{l: l, cred: cred}
			}
		})
	}
	for i := range reqs {
		next <- i
	}
	close(next)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return out
}

func manyRepo(i int) string { return fmt.Sprintf("github.com/many/r%d", i) }

// metric sums the values of the metric family name that m gathers now
// (counters and gauges, every label).
func metric(t *testing.T, m *ServiceMetrics, name string) float64 {
	t.Helper()
	fams, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
		for _, x := range f.GetMetric() {
			sum += x.GetCounter().GetValue() + x.GetGauge().GetValue()
		}
	}
	return sum
}

// logReads is how many reads of the lease log m counted, of every kind
// (reading the counter itself reads no log).
func logReads(t *testing.T, m *ServiceMetrics) int {
	t.Helper()
	fams, err := m.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	n := 0.0
	for _, f := range fams {
		if f.GetName() == "fenceline_bus_log_reads_total" {
			for _, x := range f.GetMetric() {
				n += x.GetCounter().GetValue()
			}
		}
	}
	return int(n)
}

func actorCount(s *Service) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.actors)
}

// startHeld starts another lease service on b's connection with fresh
// metrics, its background load of every repo held until release is
// called; b stops it at cleanup.
func startHeld(t *testing.T, b *bus) (svc *Service, m *ServiceMetrics, release func()) {
	t.Helper()
	m = NewServiceMetrics()
	hold := make(chan struct{})
	var once sync.Once
	release = func() { once.Do(func() { close(hold) }) }
	t.Cleanup(release)
	svc, err := StartService(ctxT(t), b.nc, ServiceConfig{Metrics: m, holdLoads: hold})
	if err != nil {
		t.Fatal(err)
	}
	b.svc = svc
	return svc, m, release
}

// writeOldLease writes a lease with an id of the old form (no repo key)
// into repo's log as a service before ids named their repo would have.
func writeOldLease(t *testing.T, ctx context.Context, nc *nats.Conn, repo string, cred Credential) *lease.Lease {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC().Round(time.Millisecond)
	e := &entry{Lease: lease.Lease{LeaseID: newID("lease_", now), Repo: repo, Scope: claim(t, "old"), WorkspaceID: lease.DefaultWorkspace,
		WorkspaceMode: lease.WorkspaceShared, Owner: owner(1), Status: lease.StatusActive, Version: 1, Fence: 1,
		AcquiredAt: now, RenewedAt: now, ExpiresAt: now.Add(time.Minute), TTL: lease.Duration(time.Minute)},
		SecretHash: cred.hash(), RequestID: NewRequestID()}
	if _, ok := LeaseRepoKey(e.LeaseID); ok {
		t.Fatalf("old-form id %s names a repo", e.LeaseID)
	}
	data, err := (&logRecord{Kind: recordDelta, Repo: repo, Fence: 1, Leases: []*entry{e}}).encode()
	if err != nil {
		t.Fatal(err)
	}
	msg := nats.NewMsg(logSubjectFor(RepoKey(repo)))
	msg.Header.Set(writerHeader, "an-older-service")
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, "0")
	msg.Data = data
	if _, err := js.PublishMsg(ctx, msg); err != nil {
		t.Fatal(err)
	}
	return &e.Lease
}

// BenchmarkRestartFirstAnswer: a lease service starting on a bus of 1,000
// repos (a lease in each) until it has answered a get by id of one of
// them — what a restarted node costs before it serves. (Uses only what
// services before ids named their repo had, to compare.)
func BenchmarkRestartFirstAnswer(b *testing.B) {
	bb := startBus(b)
	const n = 1000
	leases := manyRepos(b, bb, n, time.Hour)
	bb.svc.Stop()
	bb.svc = nil
	ctx := ctxT(b)
	i := 0
	for b.Loop() {
		svc, err := StartService(ctx, bb.nc, ServiceConfig{})
		if err != nil {
			b.Fatal(err)
		}
		l := leases[i%n].l
		if got, err := bb.c.Get(ctx, l.LeaseID); err != nil || got.Fence != l.Fence {
			b.Fatalf("get %s: %+v %v", l.LeaseID, got, err)
		}
		svc.Stop()
		i++
	}
}

// BenchmarkMetricsScrape: one scrape of the lease service's metrics with
// 1,000 repos served (a lease in each).
func BenchmarkMetricsScrape(b *testing.B) {
	m := NewServiceMetrics()
	bb := &bus{t: b, dir: b.TempDir(), cfg: ServiceConfig{Metrics: m}}
	bb.start("127.0.0.1:0")
	b.Cleanup(bb.stop)
	const n = 1000
	manyRepos(b, bb, n, time.Hour)
	want := fmt.Sprintf("fenceline_bus_active_leases %d\n", n)
	for b.Loop() {
		rec := httptest.NewRecorder()
		m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		if !strings.Contains(rec.Body.String(), want) {
			b.Fatalf("scrape lacks %q", want)
		}
	}
}

// BenchmarkMemoryPerRepo: what one more repo served costs the process
// (the embedded NATS server's share included), with one lease in each of
// 2,000 repos: heap and goroutine stacks in use after a collection, and
// goroutines. Run with -benchtime 1x: each iteration starts a bus.
func BenchmarkMemoryPerRepo(b *testing.B) {
	const n = 2000
	for b.Loop() {
		bb := startBus(b)
		warmUp(b, bb, 16)
		h0, s0, g0 := inUse()
		manyRepos(b, bb, n, time.Hour)
		h1, s1, g1 := inUse()
		b.ReportMetric(float64(h1-h0)/n, "heap-B/repo")
		b.ReportMetric(float64(s1-s0)/n, "stack-B/repo")
		b.ReportMetric(float64(g1-g0)/n, "goroutines/repo")
	}
}

// BenchmarkMemoryPerLease: what one more active lease costs the process,
// with 5,000 leases over 10 repos (each repo served, with a lease, before
// the count starts): heap in use after a collection. etcd's is about 330
// bytes a lease at 10 million leases (issue 34's anchor). Run with
// -benchtime 1x.
func BenchmarkMemoryPerLease(b *testing.B) {
	const repos, n = 10, 5000
	for b.Loop() {
		bb := startBus(b)
		warmUp(b, bb, repos)
		h0, _, _ := inUse()
		reqs := make([]AcquireRequest, n)
		for i := range reqs {
			reqs[i] = AcquireRequest{Repo: fmt.Sprintf("github.com/warm/r%d", i%repos), Scope: claim(b, fmt.Sprintf("p%d", i)),
				Owner: owner(i), TTL: lease.Duration(time.Hour)}
		}
		acquireMany(b, bb, reqs)
		h1, _, _ := inUse()
		b.ReportMetric(float64(h1-h0)/n, "heap-B/lease")
	}
}

// warmUp takes a lease in each of n repos (github.com/warm/rI; 16 at
// least, as many at once as acquireMany asks), so that what a service
// makes once (its reply mailboxes, the client's) and, for those repos,
// what a repo costs are not counted with what a measurement adds.
func warmUp(b *testing.B, bb *bus, n int) {
	reqs := make([]AcquireRequest, max(n, 16))
	for i := range reqs {
		reqs[i] = AcquireRequest{Repo: fmt.Sprintf("github.com/warm/r%d", i), Scope: claim(b, "warm"), Owner: owner(i), TTL: lease.Duration(time.Hour)}
	}
	acquireMany(b, bb, reqs)
}

// inUse is the process's heap and goroutine stacks in use after a
// collection, and its goroutines.
func inUse() (heap, stack uint64, goroutines int) {
	var m runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&m)
	return m.HeapInuse, m.StackInuse, runtime.NumGoroutine()
}
