//go:build integration

package pgproxy

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

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

// A catalog lookup is one large query. With JIT compilation on (Postgres's
// default wherever LLVM is installed, as in Debian's packages) and its
// estimated cost past jit_above_cost, which a few hundred relations are
// enough for, every lookup was compiled: 200–300 ms each in Postgres's
// regression database, 2.5 s with inlining. Lookups now run without JIT
// and with the planner's defaults, in the client's block too, where they
// leave the client's settings, path and savepoints as they were.
//
// The client here asks for JIT past a cost of 100, as a database of its
// own sets it past 100,000 (through its startup parameters, so they are its
// defaults, and again by SET LOCAL in its block), and switches the
// planner's scans off. A lookup's estimated cost is thousands here; its
// own statements', and those the proxy runs before a lookup to set it up,
// are under 30. (A client that asks for every statement compiled has
// those compiled too, in its own session.)
func TestCatalogLookupsCompileNothing(t *testing.T) {
	writeCheckFixture(t)
	lease := newStaticLease(t, "lease_jit", 0, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	t.Cleanup(cancel)
	admin := adminConn(t)
	var jit bool
	if err := admin.QueryRow(ctx, "SELECT pg_jit_available()").Scan(&jit); err != nil || !jit {
		t.Fatalf("pg_jit_available(): %v, %v; this test needs Postgres's LLVM JIT (Debian's postgresql-N has it)", jit, err)
	}
	var tables []string
	for _, name := range []string{"plain", "hostile", "direct"} {
		for i := range 5 {
			tables = append(tables, fmt.Sprintf("app.jit_%s%d", name, i))
		}
	}
	drop := func() {
		if _, err := admin.Exec(ctx, "DROP TABLE IF EXISTS "+strings.Join(tables, ", ")); err != nil {
			t.Fatal(err)
		}
	}
	drop()
	t.Cleanup(drop)

	const askJIT = "&jit=on&jit_above_cost=100&jit_inline_above_cost=100&jit_optimize_above_cost=100"
	plain := connect(t, proxyDSN(p, "agent"))
	hostile := connect(t, proxyDSN(p, "agent")+askJIT)
	direct := connect(t, pg.DSN("agent", "", plpgsql.db)+askJIT)
	const hostileBlock = "SET LOCAL jit = on; SET LOCAL jit_above_cost = 100; SET LOCAL jit_inline_above_cost = 100; SET LOCAL jit_optimize_above_cost = 100; " +
		"SET LOCAL enable_seqscan = off; SET LOCAL enable_indexscan = off; SET LOCAL enable_bitmapscan = off; SET LOCAL search_path = app, public"
	// Each CREATE TABLE makes the proxy forget what it learned (and in a
	// block, look up again for every write after it): each INSERT is a
	// lookup.
	lookups := func(c *pgx.Conn, name string, inBlock bool) time.Duration {
		t.Helper()
		start := time.Now()
		for i := range 5 {
			for _, q := range []string{fmt.Sprintf("CREATE TABLE app.jit_%s%d (i int)", name, i), fmt.Sprintf("INSERT INTO app.jit_%s%d VALUES (1)", name, i)} {
				if _, err := c.Exec(ctx, q); err != nil {
					t.Fatalf("%s (in a block: %v): %v", q, inBlock, err)
				}
			}
		}
		if !inBlock {
			for i := range 5 {
				if _, err := c.Exec(ctx, fmt.Sprintf("DROP TABLE app.jit_%s%d", name, i)); err != nil {
					t.Fatal(err)
				}
			}
		}
		return time.Since(start)
	}
	block := func(c *pgx.Conn, name string, settings string) time.Duration {
		t.Helper()
		for _, q := range []string{"BEGIN", settings, "SAVEPOINT fenceline_lookup", "SAVEPOINT sp"} {
			if q == "" {
				continue
			}
			if _, err := c.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		took := lookups(c, name, true)
		if _, err := c.Exec(ctx, "SELECT nextval('app.wc35_id_seq')"); err != nil { // a lookup of a sequence's tables
			t.Fatal(err)
		}
		return took
	}

	type run struct{ plain, hostile, direct time.Duration }
	out := run{lookups(plain, "plain", false), lookups(hostile, "hostile", false), lookups(direct, "direct", false)}
	in := run{block(plain, "plain", ""), block(hostile, "hostile", hostileBlock), block(direct, "direct", hostileBlock)}
	for _, tc := range []struct {
		where string
		run
	}{{"outside a block", out}, {"in a block", in}} {
		t.Logf("%s, 5 writes after DDL: through the fence %v, asking for JIT %v; direct asking for JIT %v", tc.where, tc.plain, tc.hostile, tc.direct)
		// Compiled, each lookup took seconds; uncompiled, milliseconds.
		if limit := tc.direct + 3*tc.plain + 2*time.Second; tc.hostile > limit {
			t.Errorf("%s, a client asking for JIT took %v through the fence, %v direct, a plain client %v through it (limit %v): the lookups were compiled", tc.where, tc.hostile, tc.direct, tc.plain, limit)
		}
	}

	// The client's block after its lookups: its settings, its path and its
	// savepoints, as it left them.
	for name, want := range map[string]string{"jit_above_cost": "100", "enable_seqscan": "off", "enable_indexscan": "off", "search_path": "app, public"} {
		var got string
		if err := hostile.QueryRow(ctx, "SHOW "+name, pgx.QueryExecModeSimpleProtocol).Scan(&got); err != nil || got != want {
			t.Errorf("in the block after lookups, SHOW %s: %q, %v; want the client's %q", name, got, err, want)
		}
	}
	for _, sp := range []string{"sp", "fenceline_lookup"} {
		if _, err := hostile.Exec(ctx, "ROLLBACK TO SAVEPOINT "+sp, pgx.QueryExecModeSimpleProtocol); err != nil {
			t.Errorf("the client's savepoint %s after lookups: %v", sp, err)
		}
	}
	var n int
	if err := hostile.QueryRow(ctx, "SELECT count(*) FROM pg_catalog.pg_class WHERE relname LIKE 'jit_hostile%'", pgx.QueryExecModeSimpleProtocol).Scan(&n); err != nil || n != 0 {
		t.Errorf("after ROLLBACK TO the client's savepoint: %d tables of the block left, %v; want 0", n, err)
	}
	for _, c := range []*pgx.Conn{plain, hostile, direct} {
		if _, err := c.Exec(ctx, "ROLLBACK"); err != nil {
			t.Fatal(err)
		}
	}
	var after string
	if err := hostile.QueryRow(ctx, "SHOW enable_seqscan", pgx.QueryExecModeSimpleProtocol).Scan(&after); err != nil || after != "on" {
		t.Errorf("after the block, SHOW enable_seqscan: %q, %v; want on (the client's SET LOCAL gone)", after, err)
	}
}

// A lookup the server refuses inside the client's block (here the client's
// own lock_timeout, while another session holds a catalog lock) is rolled
// back with the proxy's savepoint: the write is refused with the fence's
// reason, as any refused write, and the client's savepoints are its own —
// one named like the proxy's too, as direct. Before, the failed lookup
// left the block failed with the proxy's savepoint on top: the refusal
// came back as "current transaction is aborted", and the client's
// ROLLBACK TO of that name went to the proxy's.
func TestFailedLookupInABlock(t *testing.T) {
	writeCheckFixture(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_failed_lookup", 0, "app.*")})
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, "DROP TABLE IF EXISTS app.failed_lookup"); err != nil {
		t.Fatal(err)
	}
	c := connect(t, proxyDSN(p, "agent"))
	// DDL in the block: every write after it is looked up.
	for _, q := range []string{"BEGIN", "SAVEPOINT fenceline_lookup", "SAVEPOINT mine", "SET LOCAL lock_timeout = '200ms'", "CREATE TABLE app.failed_lookup (i int)"} {
		if err := simple(ctx, c, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	lock, err := admin.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := lock.Exec(ctx, "LOCK TABLE pg_catalog.pg_rewrite IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	werr := simple(ctx, c, "INSERT INTO app.failed_lookup VALUES (1)")
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if pgCode(werr) != "42501" || !strings.Contains(werr.Error(), "lease_failed_lookup") {
		t.Errorf("a write whose lookup failed in a block: %v; want the fence's refusal (42501) naming the lease", werr)
	}
	// The block failed as a refused statement fails it; the client's own
	// savepoint of the proxy's name is the one its ROLLBACK TO finds (and
	// that one is older than "mine", which it ends, as direct).
	if err := simple(ctx, c, "ROLLBACK TO SAVEPOINT fenceline_lookup"); err != nil {
		t.Fatalf("ROLLBACK TO the client's savepoint: %v", err)
	}
	if err := simple(ctx, c, "RELEASE SAVEPOINT mine"); pgCode(err) != "3B001" {
		t.Errorf("RELEASE SAVEPOINT mine after ROLLBACK TO the client's older savepoint: %v; want 3B001 (no such savepoint), as direct", err)
	}
	simple(ctx, c, "ROLLBACK") //nolint:errcheck // ends the block whatever its state
}

// A lookup in a REPEATABLE READ block reads the catalogs as of the block's
// snapshot: a foreign key another session committed since is not there,
// though Postgres runs the write with it. What such a lookup learns was
// cached, and another session's write within the second took it: a DELETE
// cascading into a table outside its claim passed (a review found it).
// Now it stays the block's own; the other session looks up for itself and
// is refused. (The block's own write is still judged by what its snapshot
// shows: docs/pg.md.)
func TestOldSnapshotLookupsAreNotShared(t *testing.T) {
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, `
DROP TABLE IF EXISTS public.rr_out, app.rr_parent;
CREATE TABLE app.rr_parent (id int PRIMARY KEY); INSERT INTO app.rr_parent VALUES (1), (2);
CREATE TABLE public.rr_out (pid int); INSERT INTO public.rr_out VALUES (1), (2);
GRANT ALL ON app.rr_parent, public.rr_out TO agent`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		admin.Exec(context.Background(), "DROP TABLE IF EXISTS public.rr_out, app.rr_parent") //nolint:errcheck // best effort
	})
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_old_snapshot", 0, "app.*")})
	a, b := connect(t, proxyDSN(p, "agent")), connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT 1"} {
		if err := simple(ctx, a, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	// Committed after the block's snapshot, straight to Postgres.
	if _, err := admin.Exec(ctx, "ALTER TABLE public.rr_out ADD FOREIGN KEY (pid) REFERENCES app.rr_parent (id) ON DELETE CASCADE"); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, a, "DELETE FROM app.rr_parent WHERE id = 1"); err != nil {
		t.Logf("the block's own write (judged under its snapshot): %v", err)
	}
	berr := simple(ctx, b, "DELETE FROM app.rr_parent WHERE id = 2")
	simple(ctx, a, "ROLLBACK") //nolint:errcheck // ends the block whatever its state
	var n int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM public.rr_out WHERE pid = 2").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 1 || pgCode(berr) != "42501" {
		t.Errorf("a READ COMMITTED session's DELETE cascading outside its claim, after a REPEATABLE READ block looked the table up: %v, %d of its rows left in public.rr_out; want it refused (42501), the row there", berr, n)
	}
}

// The same for the database's foreign tables (foreignSet), which a read
// that names one must be judged by: a REPEATABLE READ block's set, learned
// under its snapshot, lacked a foreign table created since, and a READ
// COMMITTED session's read of that table took it and ran unjudged.
func TestOldSnapshotForeignSetIsNotShared(t *testing.T) {
	setupIndirect(t)
	ctx := ctxT(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_old_snapshot_fdw", 0, "ia.*")})
	a, b := connect(t, proxyDSN(p, "agent")), connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"BEGIN ISOLATION LEVEL REPEATABLE READ", "SELECT 1"} {
		if err := simple(ctx, a, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := adminConn(t).Exec(ctx, "CREATE FOREIGN TABLE ia.ft_late (v int) SERVER loopback OPTIONS (schema_name 'inone', table_name 't'); GRANT SELECT ON ia.ft_late TO agent"); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, a, "SELECT count(*) FROM ia.parent2"); err != nil { // learns the foreign tables under its snapshot
		t.Fatal(err)
	}
	berr := simple(ctx, b, "SELECT v FROM ia.ft_late")
	simple(ctx, a, "ROLLBACK") //nolint:errcheck // ends the block
	if pgCode(berr) != "42501" {
		t.Errorf("a READ COMMITTED read of a foreign table created after a REPEATABLE READ block learned the foreign tables: %v; want it judged as a foreign table's read and refused (42501)", berr)
	}
}

// A sequence call whose lookup failed was judged as one with no tables:
// the lookup of every sequence a statement names fails when one of the
// names is one Postgres refuses to read (too many dotted names), and a
// setval of a sequence of a table outside the claim, beside it, passed.
// Unknown is unknown: refused.
func TestFailedSequenceLookupRefuses(t *testing.T) {
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, `DROP TABLE IF EXISTS public.seq_victim; CREATE TABLE public.seq_victim (id serial, v text);
GRANT ALL ON public.seq_victim, public.seq_victim_id_seq TO agent`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		admin.Exec(context.Background(), "DROP TABLE IF EXISTS public.seq_victim") //nolint:errcheck // best effort
	})
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_failed_seq", 0, "app.*")})
	const q = "SELECT setval('public.seq_victim_id_seq', 1000), CASE WHEN false THEN nextval('a.b.c.d'::text) END"
	for _, inBlock := range []bool{false, true} {
		c := connect(t, proxyDSN(p, "agent"))
		if inBlock {
			if err := simple(ctx, c, "BEGIN"); err != nil {
				t.Fatal(err)
			}
		}
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // (a warning outside a block)
		var last int64
		if err := admin.QueryRow(ctx, "SELECT last_value FROM public.seq_victim_id_seq").Scan(&last); err != nil {
			t.Fatal(err)
		}
		if last == 1000 || pgCode(err) != "42501" {
			t.Errorf("in a block: %v; setval of a sequence outside the claim beside a name the lookup fails on: %v, last_value %d; want it refused (42501), the sequence untouched", inBlock, err, last)
		}
	}
}
