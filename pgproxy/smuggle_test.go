package pgproxy

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Issue 18, findings 8-12: writes smuggled past the classifier. Each test
// failed on the proxy before the fix that names it.

// smuggleSetup makes an unfenced schema outside every test lease's claim
// (a write there lands unless the proxy stops it) and a function that
// writes it.
func smuggleSetup(t *testing.T) {
	t.Helper()
	resetState(t, `CREATE SCHEMA IF NOT EXISTS other;
CREATE TABLE IF NOT EXISTS other.t (id int);
GRANT USAGE ON SCHEMA other TO PUBLIC;
GRANT ALL ON other.t TO PUBLIC;
CREATE OR REPLACE FUNCTION other.f_writes() RETURNS int LANGUAGE sql AS $$ INSERT INTO other.t VALUES (99); SELECT 1 $$;
CREATE TABLE IF NOT EXISTS other.sp_t (id int);
CREATE TABLE IF NOT EXISTS public.sp_t (id int);
GRANT ALL ON other.sp_t, public.sp_t TO PUBLIC;
TRUNCATE other.t, other.sp_t`)
}

func otherRows(t *testing.T) int {
	t.Helper()
	var n int
	if err := adminConn(t).QueryRow(ctxT(t), "SELECT count(*) FROM other.t").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// simple runs sql with the simple protocol (several statements allowed)
// and returns the first error.
func simple(ctx context.Context, c *pgx.Conn, sql string) error {
	_, err := c.PgConn().Exec(ctx, sql).ReadAll()
	return err
}

// Finding 8: a client that asked for read-only gets no writes, as direct.
func TestClientReadOnlyIsKept(t *testing.T) {
	lease := newStaticLease(t, "lease_ro8", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	for _, set := range []string{
		"SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY",
		"SET default_transaction_read_only = on",
		"SET default_transaction_read_only TO true",
	} {
		t.Run(set, func(t *testing.T) {
			c := connect(t, proxyDSN(p, "agent"))
			if err := simple(ctx, c, set); err != nil {
				t.Fatal(err)
			}
			for _, w := range []string{
				"INSERT INTO app.log (msg) VALUES ('read-only client')",
				"BEGIN; INSERT INTO app.log (msg) VALUES ('read-only client'); COMMIT",
			} {
				if err := simple(ctx, c, w); pgCode(err) != "25006" {
					t.Errorf("%s after %s: %v, want 25006 as direct", w, set, err)
				}
				simple(ctx, c, "ROLLBACK")
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", "extended"); pgCode(err) != "25006" {
				t.Errorf("extended write after %s: %v, want 25006", set, err)
			}
			var v string
			if err := c.QueryRow(ctx, "SHOW default_transaction_read_only").Scan(&v); err != nil || v != "on" {
				t.Errorf("SHOW default_transaction_read_only = %q (%v), want on", v, err)
			}
			// Asking for a writable block explicitly works, as direct.
			if err := simple(ctx, c, "BEGIN READ WRITE; INSERT INTO app.log (msg) VALUES ('rw block'); COMMIT"); err != nil {
				t.Errorf("BEGIN READ WRITE after %s: %v", set, err)
			}
			// And the client may take it back.
			if err := simple(ctx, c, "RESET default_transaction_read_only"); err != nil {
				t.Fatal(err)
			}
			if err := simple(ctx, c, "INSERT INTO app.log (msg) VALUES ('after reset')"); err != nil {
				t.Errorf("write after RESET: %v", err)
			}
		})
	}
	// A read-only default set in a block that rolls back is gone, as direct.
	c := connect(t, proxyDSN(p, "agent"))
	if err := simple(ctx, c, "BEGIN; SET default_transaction_read_only = on; ROLLBACK"); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, c, "INSERT INTO app.log (msg) VALUES ('after rollback')"); err != nil {
		t.Errorf("write after a rolled-back SET: %v", err)
	}
}

// Finding 9: with standard_conforming_strings off, the proxy must not
// classify with a parse that differs from Postgres's.
func TestStandardConformingStringsOff(t *testing.T) {
	smuggleSetup(t)
	lease := newStaticLease(t, "lease_scs9", 0, "public.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	if err := simple(ctx, c, "SET standard_conforming_strings = off"); err != nil {
		t.Fatal(err)
	}
	smuggled := `select 'a\''; delete from other.t; insert into other.t values (9); select ''' as x; --'`
	for _, q := range []string{smuggled, "BEGIN; " + smuggled + "; COMMIT"} {
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK")
		if n := otherRows(t); n != 0 || err == nil {
			t.Fatalf("%s: %v; other.t has %d rows: a write outside the lease landed", q, err, n)
		}
	}
	// Extended protocol: the Parse comes after the SET in one pipeline.
	b := &pgx.Batch{}
	b.Queue("SET standard_conforming_strings = off")
	b.Queue(`select 'a\'' union all select 'b' where false and ''' = '''`)
	c2 := connect(t, proxyDSN(p, "agent"))
	c2.SendBatch(ctx, b).Close()
	// Text without a backslash still reads.
	if err := simple(ctx, c, "SELECT 1"); err != nil {
		t.Fatalf("plain read with standard_conforming_strings off: %v", err)
	}
	if err := simple(ctx, c, "SET standard_conforming_strings = on"); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, c, `select 'a\'`); err != nil {
		t.Fatalf("backslash with standard_conforming_strings on: %v", err)
	}
}

// Finding 10: SQL run from text inside a function switches the read-only
// default off; a COMMIT in the same Query must not open a writable
// transaction the proxy did not classify.
func TestHiddenSetConfigThenCommit(t *testing.T) {
	smuggleSetup(t)
	lease := newStaticLease(t, "lease_hid10", 0, "public.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	lease.lose(errors.New("lease lost: test"))
	flip := `SELECT query_to_xml('select set_config(''default_transaction_read_only'',''off'',false)', true, true, '')`
	for _, q := range []string{
		flip + "; COMMIT; SELECT other.f_writes()",
		flip + "; COMMIT; INSERT INTO other.t VALUES (1)",
		"BEGIN; " + flip + "; COMMIT; SELECT other.f_writes()",
		flip + "; ROLLBACK; SELECT other.f_writes()",
		flip + "; COMMIT; BEGIN; SELECT other.f_writes(); COMMIT",
	} {
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK")
		if n := otherRows(t); n != 0 {
			t.Fatalf("%s: %v; other.t has %d rows after the lease was lost", q, err, n)
		}
	}
	// Extended protocol, one pipeline.
	b := &pgx.Batch{}
	b.Queue(flip)
	b.Queue("COMMIT")
	b.Queue("SELECT other.f_writes()")
	c.SendBatch(ctx, b).Close()
	if n := otherRows(t); n != 0 {
		t.Fatalf("pipeline: other.t has %d rows after the lease was lost", n)
	}
	// The session's default is back on for the next unit.
	if _, err := c.Exec(ctx, "SELECT other.f_writes()"); pgCode(err) != "25006" {
		t.Fatalf("next unit: %v, want 25006", err)
	}
}

// Finding 11: large-object functions are writes.
func TestLargeObjectsAreWrites(t *testing.T) {
	lease := newStaticLease(t, "lease_lo11", 0, "public.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	admin := adminConn(t)
	count := func() int {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_largeobject_metadata").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	var oid uint32
	if err := admin.QueryRow(ctx, "SELECT lo_from_bytea(0, 'kept')").Scan(&oid); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "ALTER LARGE OBJECT "+itoa(int(oid))+" OWNER TO agent"); err != nil {
		t.Fatal(err)
	}
	before := count()
	c := connect(t, proxyDSN(p, "agent"))
	lease.lose(errors.New("lease lost: test"))
	for _, q := range []string{
		"SELECT lo_from_bytea(0, 'x')",
		"SELECT lo_create(0)",
		"SELECT lo_creat(-1)",
		"SELECT pg_catalog.lo_put(" + itoa(int(oid)) + ", 0, 'overwritten')",
		"SELECT lo_truncate(lo_open(" + itoa(int(oid)) + ", 131072), 0)",
		"SELECT lo_unlink(" + itoa(int(oid)) + ")",
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			_, err := c.Exec(ctx, q, mode)
			if err == nil || pgCode(err) != "42501" {
				t.Errorf("%s (%v) without a lease: %v, want 42501", q, mode, err)
			}
		}
	}
	var got string
	if err := admin.QueryRow(ctx, "SELECT convert_from(lo_get($1), 'UTF8')", oid).Scan(&got); err != nil || got != "kept" {
		t.Errorf("large object %d: %q %v, want it unchanged", oid, got, err)
	}
	if n := count(); n != before {
		t.Errorf("large objects: %d, were %d", n, before)
	}
}

func itoa(n int) string {
	var b [20]byte
	i := len(b)
	for {
		i--
		b[i] = byte('0' + n%10)
		n /= 10
		if n == 0 {
			return string(b[i:])
		}
	}
}

// Finding 12: the classifier's cache key never changes the answer.
func TestClassifierCacheNeverChangesTheAnswer(t *testing.T) {
	pairs := [][2]string{
		{"SELECT('a', false)", "SELECT('\xe8', false)"},
		{"SELECT 1 x", "SELECT 1into x"},
		{"SELECT 1 x FROM public.big", "SELECT 1into x FROM public.big"},
		{"SELECT 'a' 'b'", "SELECT 'a'\n'b'"},
		{"SELECT 'a'\n'b'", "SELECT 'a' 'b'"},
		{"SELECT 1.5 x", "SELECT 1.5into x"},
		{"SELECT 1e5 x", "SELECT 1e5into x"},
		{"UPDATE public.accounts SET balance = 1 WHERE id = 2", "UPDATE public.accounts SET balance = 1returning WHERE id = 2"},
		{"SELECT 'x' FROM public.big", "SELECT '\x00' FROM public.big"},
	}
	for _, p := range pairs {
		c := NewClassifier(0)
		c.Classify(p[0])
		got, want := summarize(c.Classify(p[1])), summarize(Classify(p[1]))
		if got != want {
			t.Errorf("after %q, %q is %s from the cache, %s fresh", p[0], p[1], got, want)
		}
	}
}

func summarize(c *Classification) string {
	var b strings.Builder
	b.WriteString(c.Class.String())
	if c.ParseError != "" {
		b.WriteString(" parse-error")
	}
	for _, st := range c.Stmts {
		b.WriteString(" " + st.Tag)
		for _, tg := range st.Targets {
			b.WriteString(" " + tg.String())
		}
	}
	return b.String()
}

// The search path is session state the fence relies on and Postgres 15 does
// not report: SQL run from text inside a function changes it, and the next
// unqualified write must not resolve elsewhere than the proxy checked.
func TestHiddenSearchPathChange(t *testing.T) {
	smuggleSetup(t)
	lease := newStaticLease(t, "lease_sp", 0, "public.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	rows := func() int {
		var n int
		if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM other.sp_t").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	hide := `SELECT query_to_xml('select set_config(''search_path'',''other'',false)', true, true, '')`
	for _, w := range []string{"INSERT INTO sp_t VALUES (2)", "BEGIN; INSERT INTO sp_t VALUES (3); COMMIT", "extended", "block-extended"} {
		c := connect(t, proxyDSN(p, "agent"))
		if err := simple(ctx, c, "INSERT INTO sp_t VALUES (1)"); err != nil { // the proxy learns the path
			t.Fatal(err)
		}
		if err := simple(ctx, c, hide); err != nil {
			t.Fatal(err)
		}
		var err error
		switch w {
		case "extended":
			_, err = c.Exec(ctx, "INSERT INTO sp_t VALUES ($1)", 4)
		case "block-extended":
			tx, berr := c.Begin(ctx)
			if berr != nil {
				t.Fatal(berr)
			}
			_, err = tx.Exec(ctx, "INSERT INTO sp_t VALUES ($1)", 5)
			tx.Commit(ctx)
		default:
			err = simple(ctx, c, w)
		}
		if n := rows(); n != 0 {
			t.Fatalf("%s after a hidden search_path change: %v; other.sp_t, outside the lease, has %d rows", w, err, n)
		}
	}
}

// The proxy's own prepared statements (fenceline_rw, fenceline_tok, ...)
// run without being judged: they are its own text. A client that closes
// one with the protocol's Close and prepares its own text under the name,
// in the pipeline of a write the proxy prepares them for, would have that
// text run, unjudged, in the next transaction the proxy makes writable.
// Every message of the client that names a statement or portal with the
// proxy's prefix is refused.
func TestOwnStatementNamesAreNotTheClients(t *testing.T) {
	smuggleSetup(t)
	lease := newStaticLease(t, "lease_own_names", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	for _, name := range []string{tokStmtName, rwStmtName, spStmtName, roStmtName, checkName, refuseName, internalStmtName + "0"} {
		t.Run(name, func(t *testing.T) {
			if _, err := adminConn(t).Exec(ctx, "TRUNCATE other.t"); err != nil {
				t.Fatal(err)
			}
			c := connect(t, proxyDSN(p, "agent"))
			write := func() error {
				_, err := c.Exec(ctx, "INSERT INTO sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 1) // unqualified: the path is pinned
				return err
			}
			// In one pipeline with a write: the proxy prepares its own
			// statements first, then the client's messages replace one.
			errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
				pl.SendDeallocate(name)
				pl.SendPrepare(name, "SELECT other.f_writes(), $1::text", nil)
				pl.SendQueryParams("INSERT INTO sp_t (id) VALUES ($1)", [][]byte{[]byte("1")}, nil, nil, nil)
			})
			if len(errs) == 0 || !strings.Contains(errs[0].Error(), "the fence's own") {
				t.Errorf("the client closed and prepared %s: %v, want refused as naming the fence's own", name, errs)
			}
			for range 2 {
				if err := write(); err != nil {
					t.Fatalf("a write after the attempt: %v", err)
				}
			}
			if n := otherRows(t); n != 0 {
				t.Fatalf("the client's text under %s ran unjudged: %d rows written outside the claim", name, n)
			}
		})
	}
}

// The SQL that names prepared statements and portals (PREPARE, EXECUTE,
// DEALLOCATE, DECLARE, FETCH, MOVE, CLOSE) may not name the proxy's own
// either: EXECUTE fenceline_rw would make the client's transaction
// writable where the proxy made it read-only, and a function's writes in
// it (a read's, judged by the read-only transaction alone) would land.
func TestOwnNamesInSQLAreRefused(t *testing.T) {
	smuggleSetup(t)
	lease := newStaticLease(t, "lease_own_sql", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease, AllowOpaque: true})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	if _, err := c.Exec(ctx, "INSERT INTO sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 1); err != nil {
		t.Fatal(err) // the proxy prepares its own statements
	}
	for _, q := range []string{
		"BEGIN; EXECUTE fenceline_rw; SELECT other.f_writes(); COMMIT",
		"EXECUTE fenceline_tok('x')",
		"PREPARE fenceline_x AS SELECT 1",
		"DEALLOCATE fenceline_tok",
		"BEGIN; DECLARE fenceline_sp CURSOR FOR SELECT 1; COMMIT",
		"BEGIN; DECLARE c CURSOR FOR SELECT 1; FETCH fenceline_sp; COMMIT",
		"CLOSE fenceline_check",
	} {
		err := simple(ctx, c, q)
		if err == nil || !strings.Contains(err.Error(), "the fence's own") {
			t.Errorf("%s: %v, want refused as naming the fence's own", q, err)
		}
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // outside a block: a warning
	}
	if n := otherRows(t); n != 0 {
		t.Fatalf("%d rows written outside the claim", n)
	}
	if _, err := c.Exec(ctx, "INSERT INTO sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 2); err != nil {
		t.Fatalf("a write after the refusals: %v", err)
	}
}
