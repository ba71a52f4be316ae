package leasebus

import (
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestServiceMetrics: the lease service counts what it answers (a grant,
// a conflict, a bad request), its log appends, the requests it has not
// answered yet (an acquire waiting in the queue), and reports active leases
// and queued requests at scrape time, over HTTP in Prometheus's format.
func TestServiceMetrics(t *testing.T) {
	t.Parallel()
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/metrics"
	cred := NewCredential()
	held, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	_, err = b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("overlapping acquire: %v, want a conflict", err)
	}
	if _, err := b.c.Get(ctx, "lease_nope"); err == nil {
		t.Fatal("get of a lease that does not exist succeeded")
	}

	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	scrapeFor := func(wants ...string) {
		t.Helper()
		checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
			resp, err := srv.Client().Get(srv.URL)
			if err != nil {
				return err
			}
			defer resp.Body.Close()
			body, _ := io.ReadAll(resp.Body)
			for _, want := range wants {
				if !strings.Contains(string(body), want) {
					return fmt.Errorf("metrics lack %q:\n%s", want, body)
				}
			}
			return nil
		})
	}
	// An acquire that waits in the queue is in flight until answered.
	waited := make(chan error, 1)
	inner := claim(t, "services/billing/api")
	go func() {
		_, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: inner, Owner: owner(3), TTL: lease.Duration(time.Minute), Wait: lease.Duration(20 * time.Second)}, NewCredential())
		waited <- err
	}()
	scrapeFor(`fenceline_bus_requests_in_flight{op="acquire"} 1`)
	if _, err := b.c.Release(ctx, held.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	if err := <-waited; err != nil {
		t.Fatalf("the queued acquire: %v", err)
	}
	scrapeFor(
		`fenceline_bus_requests_total{op="acquire",result="ok"} 2`,
		`fenceline_bus_requests_total{op="acquire",result="conflict"} 1`,
		`fenceline_bus_appends_total{result="ok"}`,
		"fenceline_bus_active_leases 1",
		"fenceline_bus_queue_depth 0",
		"fenceline_bus_intake_depth 0",
		`fenceline_bus_requests_total{op="get",result="not_found"} 1`,
		`fenceline_bus_request_seconds_count{op="acquire"} 3`,
		`fenceline_bus_requests_in_flight{op="acquire"} 0`,
		`fenceline_bus_requests_in_flight{op="get"} 0`,
		`fenceline_bus_requests_in_flight{op="release"} 0`,
		"fenceline_bus_append_seconds_count",
		"go_goroutines",
		"go_sched_latencies_seconds_bucket", // how long goroutines waited to run: a node short of CPU
	)
}
