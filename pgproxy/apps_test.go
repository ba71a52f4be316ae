package pgproxy

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Issue 35: what real applications do, and a lease allows, works through
// the fence as it does direct.

// RESET ROLE, SET ROLE NONE (Postgres takes 'none' in any quoting as NONE) and RESET SESSION AUTHORIZATION only return to
// the session's own role (the one it connected as, which the proxy let in):
// they run, in either protocol. SET ROLE to another role stays refused.
func TestResetRoleAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_role35", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"RESET ROLE", "SET ROLE NONE", "SET ROLE 'none'", "SET role TO DEFAULT", "RESET SESSION AUTHORIZATION",
		"SET SESSION AUTHORIZATION DEFAULT", "RESET session_authorization"} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			if _, err := c.Exec(ctx, q, mode); err != nil {
				t.Errorf("%s (%v): %v, want it to run as direct", q, mode, err)
			}
		}
		var user string
		if err := c.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil || user != "agent" {
			t.Errorf("after %s: current_user %q (%v), want agent", q, user, err)
		}
		if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", "after "+q); err != nil {
			t.Errorf("write after %s: %v", q, err)
		}
	}
	for _, q := range []string{"SET ROLE postgres", `SET ROLE "None"`, "SET SESSION AUTHORIZATION postgres", "SET role = postgres", "SET LOCAL role = postgres"} {
		if _, err := c.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); pgCode(err) != "42501" {
			t.Errorf("%s: %v, want the fence's refusal (42501)", q, err)
		}
	}
}

// The client's own read-write default is the client's to set, as direct:
// SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE and SET
// default_transaction_read_only = off switch off the read-only default the
// client set itself (writes then run as they would direct, still only under
// the lease), while Postgres's own default, the proxy's, stays on.
func TestClientReadWriteDefaultAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_rw35", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	for _, set := range []string{
		"SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
		"SET default_transaction_read_only = off",
		"SET default_transaction_read_only TO false",
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			c := connect(t, proxyDSN(p, "agent"))
			if err := simple(ctx, c, "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ('read-only')"); pgCode(err) != "25006" {
				t.Fatalf("write with the client's default read-only: %v, want 25006", err)
			}
			tag, err := c.Exec(ctx, set, mode)
			if err != nil || tag.String() != "SET" {
				t.Errorf("%s (%v): tag %q, %v; want SET as direct", set, mode, tag.String(), err)
				continue
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", set); err != nil {
				t.Errorf("write after %s (%v): %v", set, mode, err)
			}
			var show, own string
			if err := c.QueryRow(ctx, "SHOW default_transaction_read_only", pgx.QueryExecModeSimpleProtocol).Scan(&show); err != nil || show != "off" {
				t.Errorf("after %s (%v): SHOW default_transaction_read_only = %q (%v), want off", set, mode, show, err)
			}
			if err := c.QueryRow(ctx, "SELECT current_setting('default_transaction_read_only')").Scan(&own); err != nil || own != "on" {
				t.Errorf("after %s (%v): Postgres's own default %q (%v), want on (the proxy's)", set, mode, own, err)
			}
			// Inside a block that rolls back, the change is gone, as direct.
			if err := simple(ctx, c, "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY; BEGIN; "+set+"; ROLLBACK"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ('rolled back')"); pgCode(err) != "25006" {
				t.Errorf("write after %s rolled back (%v): %v, want 25006", set, mode, err)
			}
			c.Close(ctx)
		}
	}
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"SET LOCAL default_transaction_read_only = off",
		"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ WRITE"} {
		if _, err := c.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); pgCode(err) != "42501" {
			t.Errorf("%s: %v, want the fence's refusal (42501)", q, err)
		}
	}
}

// A read that advances or sets a sequence of claimed tables (how ORMs fetch
// ids) runs under the lease, as direct; one of another table's sequence is
// refused naming that table; without a live lease it fails read-only, as
// before.
func TestSequenceFromReadAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_seq35", 0, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec} {
		c := connect(t, proxyDSN(p, "agent"))
		var a, b int64
		if err := c.QueryRow(ctx, "SELECT nextval('app.items_id_seq')", mode).Scan(&a); err != nil {
			t.Errorf("nextval of a claimed table's sequence (%v): %v", mode, err)
		}
		if err := c.QueryRow(ctx, "SELECT setval('app.log_id_seq', 1000 + $1::int)", mode, a).Scan(&b); err != nil || b != 1000+a {
			t.Errorf("setval of a claimed table's sequence (%v): %d, %v", mode, b, err)
		}
		if err := c.QueryRow(ctx, "SELECT nextval('app.items_id_seq')", mode).Scan(&b); err != nil || b != a+1 {
			t.Errorf("second nextval (%v): %d, %v; want %d", mode, b, err, a+1)
		}
		// A user function's write outside the claim is refused (see
		// TestFunctionFromReadAsDirect).
		if _, err := c.Exec(ctx, "SELECT public.f_writes()", mode); pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_seq35") {
			t.Errorf("user function writing outside the claim, from a read (%v): %v, want the refusal naming the lease", mode, err)
		}
		_, err := c.Exec(ctx, "SELECT nextval('public.seq'), public.f_writes()", mode)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_seq35") {
			t.Errorf("nextval beside a user function (%v): %v, want the fence's refusal naming the lease", mode, err)
		}
		c.Close(ctx)
	}
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM public.sink WHERE v = 'written by a read'").Scan(&n); err != nil || n != 0 {
		t.Errorf("public.sink written by a read: %d rows (%v)", n, err)
	}
	lease.lose(errors.New("lost for the test"))
	c := connect(t, proxyDSN(p, "agent"))
	if _, err := c.Exec(ctx, "SELECT nextval('app.items_id_seq')"); pgCode(err) != "25006" {
		t.Errorf("nextval without a live lease: %v, want Postgres's 25006 (read-only)", err)
	}
}

// SET TRANSACTION READ WRITE (and SET transaction_read_only = off) in a
// transaction the proxy made writable under the lease changes nothing and
// runs as direct, in either protocol: after BEGIN, with an isolation level
// beside it, and alone outside a block (where Postgres only warns). In a
// block begun READ ONLY, or without a live lease, it stays refused: the
// proxy does not make a read-only block writable halfway (begin it READ
// WRITE).
func TestSetTransactionReadWriteAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_txrw35", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		for _, set := range []string{"SET TRANSACTION READ WRITE", "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ WRITE",
			"SET transaction_read_only = off", "SET LOCAL transaction_read_only TO false"} {
			tx, err := c.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if tag, err := tx.Exec(ctx, set, mode); err != nil || tag.String() != "SET" {
				t.Errorf("BEGIN; %s (%v): tag %q, %v; want SET as direct", set, mode, tag.String(), err)
			}
			if _, err := tx.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", mode, set); err != nil {
				t.Errorf("write after BEGIN; %s (%v): %v", set, mode, err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Errorf("COMMIT after %s (%v): %v", set, mode, err)
			}
		}
		if tag, err := c.Exec(ctx, "SET transaction_read_only = off", mode); err != nil || tag.String() != "SET" {
			t.Errorf("SET transaction_read_only = off outside a block (%v): tag %q, %v; want SET as direct", mode, tag.String(), err)
		}
		tx, err := c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SET TRANSACTION READ WRITE", mode); pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_txrw35") {
			t.Errorf("BEGIN READ ONLY; SET TRANSACTION READ WRITE (%v): %v, want the fence's refusal naming the lease", mode, err)
		}
		tx.Rollback(ctx)
	}
	lease.lose(errors.New("lost for the test"))
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SET TRANSACTION READ WRITE"); pgCode(err) != "42501" {
		t.Errorf("SET TRANSACTION READ WRITE without a live lease: %v, want the fence's refusal", err)
	}
}

// Identifiers of any spelling Postgres accepts can be claimed and written:
// a quoted upper-case schema ("CURRENT_SCHEMA") and a quoted table name
// with a space (schema_one."table two"), both fenced at storage, written
// through the fence in either protocol; a table of the same schema the
// claim does not name stays refused.
func TestQuotedIdentifiersAsDirect(t *testing.T) {
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, `DROP SCHEMA IF EXISTS "CURRENT_SCHEMA" CASCADE; DROP SCHEMA IF EXISTS schema_one CASCADE;
CREATE SCHEMA "CURRENT_SCHEMA"; CREATE SCHEMA schema_one; GRANT USAGE, CREATE ON SCHEMA "CURRENT_SCHEMA", schema_one TO PUBLIC;
CREATE TABLE "CURRENT_SCHEMA"."Tab" (i int); CREATE TABLE schema_one."table two" (i int); CREATE TABLE schema_one.other (i int);
GRANT ALL ON ALL TABLES IN SCHEMA "CURRENT_SCHEMA", schema_one TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		adminConn(t).Exec(ctxT(t), `DROP SCHEMA IF EXISTS "CURRENT_SCHEMA" CASCADE; DROP SCHEMA IF EXISTS schema_one CASCADE`)
	})
	if _, err := Install(ctx, admin, []string{`"CURRENT_SCHEMA".*`, `schema_one."table two"`, "schema_one.other"}, InstallOptions{Trigger: TriggerPLpgSQL}); err != nil {
		t.Fatalf("fence the quoted tables: %v", err)
	}
	lease := newStaticLease(t, "lease_quoted35", 0, `"CURRENT_SCHEMA".*`, `schema_one."table two"`)
	p := startProxy(t, Config{Lease: lease})
	c := connect(t, proxyDSN(p, "agent"))
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		for _, q := range []string{`INSERT INTO "CURRENT_SCHEMA"."Tab" VALUES (1)`, `UPDATE schema_one."table two" SET i = 2`,
			`INSERT INTO schema_one."table two" VALUES (1)`, `CREATE TABLE IF NOT EXISTS "CURRENT_SCHEMA".made (i int)`} {
			if _, err := c.Exec(ctx, q, mode); err != nil {
				t.Errorf("%s (%v): %v, want it to run as direct", q, mode, err)
			}
		}
		if _, err := c.Exec(ctx, "INSERT INTO schema_one.other VALUES (1)", mode); pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_quoted35") {
			t.Errorf("a table of the schema outside the claim (%v): %v, want the fence's refusal", mode, err)
		}
	}
}

// A refusal reads as Postgres's own error would: message, detail and hint,
// and no CONTEXT line of the DO block that raises it, in either protocol;
// it is audited. An agent's own DO block keeps its context, as direct.
func TestRefusalWithoutContext(t *testing.T) {
	lease := newStaticLease(t, "lease_ctx35", 0, "app.*")
	rec := &recorder{}
	p := startProxy(t, Config{Lease: lease, Audit: rec, AllowOpaque: true})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		_, err := c.Exec(ctx, "INSERT INTO public.sink VALUES ('outside the claim')", mode)
		var pe *pgconn.PgError
		if !errors.As(err, &pe) || pe.Code != "42501" || !strings.Contains(pe.Message, "lease_ctx35") {
			t.Fatalf("write outside the claim (%v): %v, want the fence's refusal", mode, err)
		}
		if pe.Where != "" {
			t.Errorf("refusal (%v) carries CONTEXT %q, want none", mode, pe.Where)
		}
		if pe.Detail == "" || pe.Hint == "" {
			t.Errorf("refusal (%v): detail %q, hint %q; want both", mode, pe.Detail, pe.Hint)
		}
	}
	_, err := c.Exec(ctx, "DO $$BEGIN RAISE EXCEPTION 'refused by the agent itself'; END$$")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Where == "" {
		t.Errorf("the agent's own DO block: %v, want its error with its CONTEXT", err)
	}
	if n := len(rec.events()); n != 2 {
		t.Errorf("%d refusals audited, want 2", n)
	}
}

// DROP ... IF EXISTS of schemas and tables outside the claim that do not
// exist runs as direct (a notice each, tag DROP ...), in a Query of its
// own; one that names an existing one is refused naming the lease, the
// table is kept (the guard in the same transaction sees the DROP wrote,
// and Postgres rolls it back), and the refusal is audited. In a block it
// stays refused.
func TestDropIfExistsAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_drop35", 0, "app.*")
	rec := &recorder{}
	p := startProxy(t, Config{Lease: lease, Audit: rec})
	ctx := ctxT(t)
	cfg, err := pgx.ParseConfig(proxyDSN(p, "agent"))
	if err != nil {
		t.Fatal(err)
	}
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n.Message) }
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	for _, q := range []struct{ sql, tag string }{
		{"DROP SCHEMA IF EXISTS nosuch_schema35", "DROP SCHEMA"},
		{"DROP TABLE IF EXISTS public.nosuch35, other.nosuch35 -- gone", "DROP TABLE"},
		{"DROP SEQUENCE IF EXISTS public.nosuch_seq35;", "DROP SEQUENCE"},
	} {
		tag, err := c.Exec(ctx, q.sql, pgx.QueryExecModeSimpleProtocol)
		if err != nil || tag.String() != q.tag {
			t.Errorf("%s: tag %q, %v; want %s as direct", q.sql, tag.String(), err, q.tag)
		}
	}
	if len(notices) != 4 || !strings.Contains(notices[0], "does not exist, skipping") {
		t.Errorf("notices %q, want Postgres's four \"does not exist, skipping\"", notices)
	}
	if len(rec.events()) != 0 {
		t.Errorf("audited %d refusals of drops of nothing", len(rec.events()))
	}
	if _, err := adminConn(t).Exec(ctx, "DROP TABLE IF EXISTS public.drop35; CREATE TABLE public.drop35 (i int); ALTER TABLE public.drop35 OWNER TO agent"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { adminConn(t).Exec(ctxT(t), "DROP TABLE IF EXISTS public.drop35") })
	_, err = c.Exec(ctx, "DROP TABLE IF EXISTS public.drop35", pgx.QueryExecModeSimpleProtocol)
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42501" || !strings.Contains(pe.Message, "lease_drop35") || pe.Where != "" {
		t.Errorf("DROP TABLE IF EXISTS of an existing table outside the claim: %v, want the fence's refusal", err)
	}
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM pg_class WHERE oid = 'public.drop35'::regclass").Scan(&n); err != nil || n != 1 {
		t.Errorf("public.drop35 after the refused drop: %d, %v; want it kept", n, err)
	}
	if evs := rec.events(); len(evs) != 1 || evs[0].Reason != ReasonOutsideLease {
		t.Errorf("audit: %+v, want one outside-lease refusal", evs)
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "DROP SCHEMA IF EXISTS nosuch_schema35", pgx.QueryExecModeSimpleProtocol); pgCode(err) != "42501" {
		t.Errorf("DROP SCHEMA IF EXISTS in a block: %v, want the fence's refusal", err)
	}
}
