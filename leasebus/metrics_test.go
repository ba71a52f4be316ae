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
// a conflict, a bad request), its log appends, and reports active leases
// and queued requests at scrape time, over HTTP in Prometheus's format.
func TestServiceMetrics(t *testing.T) {
	t.Parallel()
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const repo = "github.com/acme/metrics"
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	_, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("overlapping acquire: %v, want a conflict", err)
	}
	if _, err := b.c.Get(ctx, "lease_nope"); err == nil {
		t.Fatal("get of a lease that does not exist succeeded")
	}

	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		resp, err := srv.Client().Get(srv.URL)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		for _, want := range []string{
			`fenceline_bus_requests_total{op="acquire",result="ok"} 1`,
			`fenceline_bus_requests_total{op="acquire",result="conflict"} 1`,
			`fenceline_bus_appends_total{result="ok"}`,
			"fenceline_bus_active_leases 1",
			"fenceline_bus_queue_depth 0",
			`fenceline_bus_requests_total{op="get",result="not_found"} 1`,
			`fenceline_bus_request_seconds_count{op="acquire"} 2`,
			"fenceline_bus_append_seconds_count",
			"go_goroutines",
		} {
			if !strings.Contains(string(body), want) {
				return fmt.Errorf("metrics lack %q:\n%s", want, body)
			}
		}
		return nil
	})
}
