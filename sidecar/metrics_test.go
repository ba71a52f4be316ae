package sidecar

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestReasonCode(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"outside-lease", "outside-lease"},
		{"lease-unknown", "lease-unknown"},
		{"read-only-transaction", "read-only-transaction"},
		{"lease lost: lease_x is revoked: runaway", "other"}, // a sentence, not a code
		{"Something-New", "other"},
		{strings.Repeat("x", 33), "other"},
	} {
		if got := ReasonCode(tc.in); got != tc.want {
			t.Errorf("ReasonCode(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestSidecarMetricsPostgres: a real client through the Postgres fence
// shows up as connections and bytes both ways, and a refused write as a
// refusal of the postgres boundary.
func TestSidecarMetricsPostgres(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	_, secret, claim := fencedPair(ctx, t, "mt")
	bus := bustest.Start(t)
	if err := leasebus.WriteFenceSecret(bus.FenceSecrets, "github.com/acme/metrics", lease.StoragePostgres, secret); err != nil {
		t.Fatal(err)
	}
	m := NewMetrics()
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/metrics", Scope: claim,
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{OnRenew: m.ObserveRenew})
	sc, err := Start(ctx, Config{Lease: l.Holder, Bus: bus.Client, Audit: bus.Auditor, Metrics: m,
		PGUpstream: pg.Addr(), StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close(ctx)
	a := startAdmin(t, AdminConfig{Metrics: m})
	a.SetLease(l.Holder, sc.Fences())

	conn, err := pgx.Connect(ctx, strings.Replace(pg.AdminDSN(""), pg.Addr(), sc.Fences().Postgres, 1))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO mt_mine VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "INSERT INTO mt_theirs VALUES (1)"); err == nil || !strings.Contains(err.Error(), l.Record.LeaseID) {
		t.Fatalf("out-of-scope write: %v", err)
	}
	conn.Close(ctx)

	_, body := testutil.HTTPGet(t, a.URL()+PathMetrics, "")
	if n := metricValue(body, `fenceline_proxy_requests_total{boundary="postgres"}`); n < 1 {
		t.Errorf("postgres connections counted: %v\n%s", n, grepMetrics(body, "fenceline_proxy"))
	}
	for _, dir := range []string{DirToUpstream, DirToAgent} {
		if n := metricValue(body, `fenceline_proxy_bytes_total{boundary="postgres",direction="`+dir+`"}`); n < 100 {
			t.Errorf("postgres bytes %s: %v\n%s", dir, n, grepMetrics(body, "fenceline_proxy"))
		}
	}
	if n := metricValue(body, `fenceline_refusals_total{boundary="postgres",reason="outside-lease"}`); n != 1 {
		t.Errorf("postgres refusals: %v\n%s", n, grepMetrics(body, "fenceline_refusals"))
	}
}
