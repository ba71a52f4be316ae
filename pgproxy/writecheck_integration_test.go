//go:build integration

package pgproxy

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// The proxy's catalog lookups run with the planner's defaults, whatever the
// client set (enable_seqscan off made each take seconds), and leave the
// client's settings as it set them.
func TestCatalogLookupPlannerDefaults(t *testing.T) {
	writeCheckFixture(t)
	lease := newStaticLease(t, "lease_plan35", 0, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	if _, err := c.Exec(ctx, "SET enable_seqscan = off; SET enable_hashjoin = off; SET plan_cache_mode = force_generic_plan", pgx.QueryExecModeSimpleProtocol); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"INSERT INTO app.wc35 (v) VALUES ('planner')", "SELECT app.wc35_put('planner')", "CREATE TABLE app.wc35_plan (i int)", "INSERT INTO app.wc35_plan VALUES (1)", "DROP TABLE app.wc35_plan"} {
		if _, err := c.Exec(ctx, q); err != nil {
			t.Errorf("%s: %v", q, err)
		}
	}
	// In a block, the lookup runs in the client's transaction: SET LOCAL
	// stays as the client set it.
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SET LOCAL enable_mergejoin = off"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "CREATE TABLE app.wc35_plan (i int)"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO app.wc35_plan VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	var local string
	if err := tx.QueryRow(ctx, "SHOW enable_mergejoin").Scan(&local); err != nil || local != "off" {
		t.Errorf("SET LOCAL enable_mergejoin in a block after a lookup: %q, %v; want the client's off", local, err)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]string{"enable_seqscan": "off", "enable_hashjoin": "off", "plan_cache_mode": "force_generic_plan"} {
		var got string
		if err := c.QueryRow(ctx, "SHOW "+name).Scan(&got); err != nil || got != want {
			t.Errorf("SHOW %s: %q, %v; want the client's %q", name, got, err, want)
		}
	}
}
