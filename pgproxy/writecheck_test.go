package pgproxy

import (
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// writeCheckFixture makes the functions and tables of the checked-write
// tests, owned by the agent: functions writing app (claimed) and public
// (not), statically and by dynamic SQL, by a trigger, and by DDL.
func writeCheckFixture(t *testing.T) {
	t.Helper()
	_, err := adminConn(t).Exec(ctxT(t), `
DROP TABLE IF EXISTS app.wc35, app.wc35_trig, app.wc35_def, public.wc35_out CASCADE;
CREATE TABLE app.wc35 (id serial PRIMARY KEY, v text);
CREATE TABLE app.wc35_trig (v text);
CREATE TABLE public.wc35_out (v text);
CREATE OR REPLACE FUNCTION app.wc35_put(x text) RETURNS int LANGUAGE plpgsql AS $$
BEGIN INSERT INTO app.wc35 (v) VALUES (x); UPDATE app.wc35 SET v = v WHERE v = x; RETURN 1; END $$;
CREATE OR REPLACE FUNCTION app.wc35_sql(x text) RETURNS bigint LANGUAGE sql AS
  $$ INSERT INTO app.wc35 (v) VALUES (x) RETURNING id $$;
CREATE OR REPLACE FUNCTION app.wc35_both(x text) RETURNS int LANGUAGE plpgsql AS $$
BEGIN INSERT INTO app.wc35 (v) VALUES (x); INSERT INTO public.wc35_out VALUES (x); RETURN 1; END $$;
CREATE OR REPLACE FUNCTION app.wc35_dyn(tbl text, x text) RETURNS int LANGUAGE plpgsql AS $$
BEGIN EXECUTE pg_catalog.format('INSERT INTO %s VALUES ($1)', tbl) USING x; RETURN 1; END $$;
CREATE OR REPLACE FUNCTION app.wc35_ddl() RETURNS int LANGUAGE plpgsql AS $$
BEGIN EXECUTE 'CREATE TABLE app.wc35_new (i int)'; RETURN 1; END $$;
CREATE OR REPLACE FUNCTION app.wc35_tf() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN INSERT INTO public.wc35_out VALUES (NEW.v); RETURN NEW; END $$;
CREATE TRIGGER wc35_t AFTER INSERT ON app.wc35_trig FOR EACH ROW EXECUTE FUNCTION app.wc35_tf();
CREATE OR REPLACE FUNCTION app.wc35_via_trigger(x text) RETURNS int LANGUAGE sql AS
  $$ INSERT INTO app.wc35_trig VALUES (x); SELECT 1 $$;
CREATE TABLE app.wc35_def (v text);
CREATE CONSTRAINT TRIGGER wc35_d AFTER INSERT ON app.wc35_def DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION app.wc35_tf();
CREATE OR REPLACE FUNCTION app.wc35_deferred(x text) RETURNS int LANGUAGE sql AS
  $$ INSERT INTO app.wc35_def VALUES (x); SELECT 1 $$;
CREATE OR REPLACE FUNCTION app.wc35_path(x text) RETURNS int LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_catalog.set_config('search_path', 'app', false); INSERT INTO public.wc35_out VALUES (x); RETURN 1; END $$;
ALTER TABLE app.wc35 OWNER TO agent; ALTER TABLE app.wc35_trig OWNER TO agent; ALTER TABLE app.wc35_def OWNER TO agent; ALTER TABLE public.wc35_out OWNER TO agent;
ALTER SEQUENCE app.wc35_id_seq OWNER TO agent;
GRANT CREATE ON SCHEMA app TO agent;`)
	if err != nil {
		t.Fatal(err)
	}
}

func countRows(t *testing.T, table, v string) int {
	t.Helper()
	var n int
	if err := adminConn(t).QueryRow(ctxT(t), "SELECT count(*) FROM "+table+" WHERE v = $1", v).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// A read that calls a function writing only claimed tables runs under the
// lease as direct, in either protocol (SQL and plpgsql functions, a
// function's serial nextval); one whose function writes a table outside
// the claim — in its own text, by dynamic SQL, through a trigger, through
// a constraint trigger deferred to COMMIT, after switching search_path —
// is refused naming the lease and the table, and
// everything it wrote, claimed tables' too, is rolled back; DDL from a
// function is refused as opaque. Each refusal is audited. Without a live
// lease the read stays read-only (Postgres's 25006), as before.
func TestFunctionFromReadAsDirect(t *testing.T) {
	writeCheckFixture(t)
	lease := newStaticLease(t, "lease_fn35", 0, "app.*")
	rec := &recorder{}
	p := startProxy(t, Config{Lease: lease, Audit: rec})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	audited := 0
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeDescribeExec, pgx.QueryExecModeCacheStatement} {
		v := fmt.Sprint("ok ", mode)
		var n int64
		if err := c.QueryRow(ctx, "SELECT app.wc35_put($1)", mode, v).Scan(&n); err != nil || n != 1 {
			t.Errorf("plpgsql function writing a claimed table, from a read (%v): %d, %v", mode, n, err)
		}
		if err := c.QueryRow(ctx, "SELECT app.wc35_sql($1)", mode, v).Scan(&n); err != nil || n == 0 {
			t.Errorf("SQL function writing a claimed table, from a read (%v): %d, %v", mode, n, err)
		}
		if got := countRows(t, "app.wc35", v); got != 2 {
			t.Errorf("app.wc35 has %d rows %q, want 2", got, v)
		}
		bad := fmt.Sprint("attack ", mode)
		for _, q := range []struct{ sql, table string }{
			{"SELECT public.f_writes()", "public.sink"},
			{"SELECT app.wc35_both($1)", "public.wc35_out"},
			{"SELECT app.wc35_dyn('public.wc35_out', $1)", "public.wc35_out"},
			{"SELECT app.wc35_via_trigger($1)", "public.wc35_out"},
			{"SELECT app.wc35_path($1)", "public.wc35_out"},
			{"SELECT app.wc35_deferred($1)", "public.wc35_out"},
			{"SELECT v FROM app.wc35 WHERE app.wc35_both($1) = 1", "public.wc35_out"},
		} {
			args := []any{mode}
			if strings.Contains(q.sql, "$1") {
				args = append(args, bad)
			}
			_, err := c.Exec(ctx, q.sql, args...)
			var pe *pgconn.PgError
			if !errors.As(err, &pe) || pe.Code != "42501" || !strings.Contains(pe.Message, "lease_fn35") || !strings.Contains(pe.Message, q.table) {
				t.Errorf("%s (%v): %v, want the fence's refusal naming the lease and %s", q.sql, mode, err, q.table)
			} else {
				if q.table != "public.sink" {
					audited++
				}
				if q.table != "public.sink" && (pe.Where != "" || pe.Detail == "") { // (public.sink is fenced: the storage side refuses it first)
					t.Errorf("%s (%v): CONTEXT %q, DETAIL %q; want none and the lease's", q.sql, mode, pe.Where, pe.Detail)
				}
			}
		}
		for _, table := range []string{"app.wc35", "app.wc35_trig", "app.wc35_def", "public.wc35_out"} {
			if got := countRows(t, table, bad); got != 0 {
				t.Errorf("%s has %d rows of a refused read (%v), want 0 (rolled back)", table, got, mode)
			}
		}
		_, err := c.Exec(ctx, "SELECT app.wc35_ddl()", mode)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "catalogs") {
			t.Errorf("DDL from a function called by a read (%v): %v, want the fence's refusal (opaque)", mode, err)
		} else {
			audited++
		}
		// The session goes on as before: reads, and writes of the claim.
		if _, err := c.Exec(ctx, "INSERT INTO app.wc35 (v) VALUES ('after')", mode); err != nil {
			t.Errorf("write after a refused read (%v): %v", mode, err)
		}
	}
	if n := len(rec.events()); n != audited {
		t.Errorf("%d refusals audited, want %d", n, audited)
	}
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM pg_catalog.pg_class WHERE relname = 'wc35_new'").Scan(&n); err != nil || n != 0 {
		t.Errorf("the DDL of a refused read left %d tables (%v)", n, err)
	}

	// psql, the simple protocol of a real client.
	ci := fmt.Sprintf("host=127.0.0.1 port=%d dbname=%s user=agent sslmode=disable", p.Addr().(*net.TCPAddr).Port, testDB)
	if out := psql(t, ci, "SELECT app.wc35_put('psql')"); strings.Contains(out, "ERR") || countRows(t, "app.wc35", "psql") != 1 {
		t.Errorf("psql: SELECT of a function writing the claim:\n%s", out)
	}
	if out := psql(t, ci, "SELECT app.wc35_both('psql attack')"); !strings.Contains(out, "lease_fn35") || countRows(t, "public.wc35_out", "psql attack") != 0 {
		t.Errorf("psql: SELECT of a function writing outside the claim:\n%s", out)
	}

	lease.lose(errors.New("lost for the test"))
	if _, err := c.Exec(ctx, "SELECT app.wc35_put('no lease')"); pgCode(err) != "25006" {
		t.Errorf("function writing from a read without a live lease: %v, want Postgres's 25006 (read-only)", err)
	}
}

// In a transaction block, or beside other statements in one Query, a read
// calling a writing function is judged as before: read-only in a block the
// proxy did not make writable (Postgres's 25006), opaque in a writable one.
func TestFunctionFromReadInBlock(t *testing.T) {
	writeCheckFixture(t)
	lease := newStaticLease(t, "lease_fnblk35", 0, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	tx, err := c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT app.wc35_put('ro block')"); pgCode(err) != "25006" {
		t.Errorf("in a read-only block: %v, want Postgres's 25006", err)
	}
	tx.Rollback(ctx)
	if _, err := c.Exec(ctx, "SELECT 1; SELECT app.wc35_both('two statements')", pgx.QueryExecModeSimpleProtocol); pgCode(err) != "25006" {
		t.Errorf("beside another statement: %v, want Postgres's 25006 (read-only, as before)", err)
	}
	if got := countRows(t, "public.wc35_out", "two statements"); got != 0 {
		t.Errorf("public.wc35_out written: %d rows", got)
	}
}

// A read that calls user code is checked by what it wrote, after it and
// in its transaction. DECLARE ... WITH HOLD runs its query later, when the
// transaction commits (Postgres materializes the cursor then), after any
// check: checked, the write landed outside the lease (other.t) while the
// check saw nothing. It runs as the read it is instead, read-only, and
// its write fails as it would in any read.
func TestHoldCursorIsNotChecked(t *testing.T) {
	smuggleSetup(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_hold", 0, "public.*", "app.*")})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	err := simple(ctx, c, "DECLARE hold1 CURSOR WITH HOLD FOR SELECT other.f_writes()")
	if pgCode(err) != "25006" {
		t.Errorf("DECLARE WITH HOLD over a writing function: %v, want 25006 (its write, at commit, in a read-only transaction)", err)
	}
	if n := otherRows(t); n != 0 {
		t.Fatalf("%d rows in other.t: the cursor's query wrote outside the lease at commit, after the check", n)
	}
	// A cursor over a read that writes nothing still works, as direct.
	if err := simple(ctx, c, "DECLARE hold2 CURSOR WITH HOLD FOR SELECT pg_catalog.lower('A')"); err != nil {
		t.Fatalf("DECLARE WITH HOLD of a plain read: %v", err)
	}
	var v string
	if err := c.QueryRow(ctx, "FETCH hold2").Scan(&v); err != nil || v != "a" {
		t.Fatalf("FETCH hold2 = %q, %v; want a", v, err)
	}
}

// The same through a function: a read calling a function that declares a
// cursor WITH HOLD over a writing query (EXECUTE 'DECLARE ... WITH HOLD')
// is checked, and the check ran before the commit that runs the cursor's
// query: the write landed outside the lease. The check now refuses a
// holdable cursor declared in its transaction.
func TestHoldCursorFromFunctionRefused(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `CREATE OR REPLACE FUNCTION app.f_hold() RETURNS int LANGUAGE plpgsql AS
  $$BEGIN EXECUTE 'DECLARE fhold CURSOR WITH HOLD FOR SELECT other.f_writes()'; RETURN 1; END$$`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fhold", 0, "public.*", "app.*")})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	err := simple(ctx, c, "SELECT app.f_hold()")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "WITH HOLD") || !strings.Contains(err.Error(), "fhold") {
		t.Errorf("a read whose function declares a cursor WITH HOLD: %v, want the check's refusal naming the cursor", err)
	}
	if n := otherRows(t); n != 0 {
		t.Fatalf("%d rows in other.t: the holdable cursor's query wrote at commit, after the check", n)
	}
	// The session goes on, the cursor gone with the rolled-back transaction.
	if err := simple(ctx, c, "FETCH fhold"); pgCode(err) != "34000" {
		t.Errorf("FETCH fhold after the refusal: %v, want 34000 (no such cursor)", err)
	}
}
