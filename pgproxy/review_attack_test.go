package pgproxy

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Attacks a reviewer ran against the fix of the fence's own statement names
// (stop 60), each writing outside the claim (other.t) before its fix.

// pipeline sends what send queues in one pipeline, then a Sync, and returns
// the errors of its results.
func pipeline(t *testing.T, c *pgx.Conn, send func(pl *pgconn.Pipeline)) []error {
	t.Helper()
	pl := c.PgConn().StartPipeline(ctxT(t))
	send(pl)
	var errs []error
	if err := pl.Sync(); err != nil {
		errs = append(errs, err)
	}
	for {
		res, err := pl.GetResults()
		if err != nil {
			errs = append(errs, err)
		}
		if rr, ok := res.(*pgconn.ResultReader); ok {
			if _, err := rr.Close(); err != nil {
				errs = append(errs, err)
			}
		}
		if _, ok := res.(*pgconn.PipelineSync); ok || res == nil && err == nil {
			break
		}
	}
	if err := pl.Close(); err != nil {
		errs = append(errs, err)
	}
	return errs
}

func truncateOther(t *testing.T) {
	t.Helper()
	if _, err := adminConn(t).Exec(ctxT(t), "TRUNCATE other.t, other.sp_t"); err != nil {
		t.Fatal(err)
	}
}

func noRowsOutside(t *testing.T, what string, errs ...error) {
	t.Helper()
	if n := otherRows(t); n != 0 {
		t.Fatalf("%s: %d rows written outside the claim (errors: %v)", what, n, errs)
	}
}

// A function's call after a COMMIT in the same unit runs in the writable
// transaction the proxy makes for the write that follows: it is judged so,
// not as in the read-only transaction before the COMMIT.
func TestCallAfterCommitInOneUnitIsJudged(t *testing.T) {
	smuggleSetup(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_after_commit", 0, "public.*", "app.*")})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{
		"COMMIT; INSERT INTO public.sp_t (id) SELECT other.f_writes()",
		"SELECT 1; COMMIT; INSERT INTO public.sp_t (id) SELECT other.f_writes()",
	} {
		truncateOther(t)
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // outside a block: a warning
		noRowsOutside(t, q, err)
	}
	truncateOther(t)
	errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
		pl.SendQueryParams("COMMIT", nil, nil, nil, nil)
		pl.SendQueryParams("INSERT INTO public.sp_t (id) SELECT other.f_writes()", nil, nil, nil, nil)
	})
	noRowsOutside(t, "extended: COMMIT, then a write calling a function", errs...)
}

// Code that prepares one of the proxy's own statements again, run in the
// same unit as the write the proxy then uses it for (after a COMMIT in the
// unit): the proxy prepares its own again, its Close first, in that unit.
func TestOwnStatementsPreparedAgainInTheSameUnit(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `CREATE OR REPLACE FUNCTION app.reprep(n text, rest text) RETURNS int LANGUAGE plpgsql AS
  $$BEGIN EXECUTE 'DEALLOCATE ' || n; EXECUTE 'PREPARE ' || n || rest; RETURN 1; END$$;`); err != nil {
		t.Fatal(err)
	}
	ctx := ctxT(t)
	t.Run("fenceline_tok", func(t *testing.T) {
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_reprep_tok", 0, "public.*", "app.*")})
		c := connect(t, proxyDSN(p, "agent"))
		if _, err := c.Exec(ctx, "INSERT INTO public.sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 1); err != nil {
			t.Fatal(err) // the proxy prepares fenceline_rw and fenceline_tok
		}
		truncateOther(t)
		errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
			pl.SendQueryParams("SELECT app.reprep('fence' || 'line_tok', '(text) AS INSERT INTO other.t SELECT 65 WHERE $1 IS NOT NULL')", nil, nil, nil, nil)
			pl.SendQueryParams("COMMIT", nil, nil, nil, nil)
			pl.SendQueryParams("INSERT INTO public.sp_t (id) VALUES (1)", nil, nil, nil, nil)
		})
		noRowsOutside(t, "fenceline_tok prepared again by a function, used after a COMMIT in the same unit", errs...)
	})
	t.Run("fenceline_ro, the lease lost", func(t *testing.T) {
		lease := newStaticLease(t, "lease_reprep_ro", 0, "public.*", "app.*")
		p := startProxy(t, Config{Lease: lease})
		c := connect(t, proxyDSN(p, "agent"))
		if errs := pipeline(t, c, func(pl *pgconn.Pipeline) { // the proxy prepares fenceline_ro
			pl.SendQueryParams("SELECT 1", nil, nil, nil, nil)
			pl.SendQueryParams("COMMIT", nil, nil, nil, nil)
			pl.SendQueryParams("SELECT 2", nil, nil, nil, nil)
		}); len(errs) != 0 {
			t.Fatal(errs)
		}
		lease.lose(errors.New("lease lost: test"))
		truncateOther(t)
		flip := `SELECT query_to_xml('select set_config(''default_transaction_read_only'',''off'',false)', true, true, '')`
		errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
			pl.SendQueryParams("SELECT app.reprep('fence' || 'line_ro', ' AS SELECT 1')", nil, nil, nil, nil)
			pl.SendQueryParams(flip, nil, nil, nil, nil)
			pl.SendQueryParams("COMMIT", nil, nil, nil, nil)
			pl.SendQueryParams("SELECT other.f_writes()", nil, nil, nil, nil)
		})
		noRowsOutside(t, "fenceline_ro prepared again by a function, then the client's default made writable", errs...)
	})
}

// Postgres keeps 63 bytes of a statement or portal name: two longer names
// the proxy tells apart are one on the server. A name over 63 bytes is
// refused.
func TestLongNamesAreRefused(t *testing.T) {
	smuggleSetup(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_long_names", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	truncateOther(t)
	base := strings.Repeat("a", maxNameLen)
	n1, n2 := base+"X", base+"Y"
	errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
		pl.SendPrepare(n1, "SELECT 1", nil)
		pl.SendDeallocate(n2)
		pl.SendPrepare(n2, "INSERT INTO other.t VALUES (66)", nil)
		pl.SendQueryParams("INSERT INTO sp_t (id) VALUES (1)", nil, nil, nil, nil)
		pl.SendQueryPrepared(n1, nil, nil, nil)
	})
	noRowsOutside(t, "two names of 64 bytes, one on the server", errs...)
	if len(errs) == 0 || !strings.Contains(errs[0].Error(), "64 bytes") {
		t.Fatalf("a name of 64 bytes: %v, want refused naming its length", errs)
	}
	if _, err := c.PgConn().Prepare(ctxT(t), base, "SELECT 1", nil); err != nil {
		t.Fatalf("a name of 63 bytes: %v", err)
	}
}

// CREATE TABLE ... AS EXECUTE runs a prepared statement its text does not
// show: it is an opaque write, and with one of the fence's own names it is
// refused whatever the lease.
func TestCreateTableAsExecute(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_ctas_exec", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	truncateOther(t)
	for _, prep := range []string{
		"PREPARE ctas_f AS SELECT other.f_writes()",
		"PREPARE ctas_w AS WITH x AS (INSERT INTO other.t VALUES (69) RETURNING 1) SELECT * FROM x",
	} {
		if err := simple(ctx, c, prep); err != nil {
			t.Fatalf("%s: %v", prep, err)
		}
	}
	for _, q := range []string{
		"CREATE TEMP TABLE ctas1 AS EXECUTE ctas_f",
		"CREATE TABLE public.ctas2 AS EXECUTE ctas_f",
		"CREATE TEMP TABLE ctas3 AS EXECUTE ctas_w",
	} {
		err := simple(ctx, c, q)
		noRowsOutside(t, q, err)
		if pgCode(err) != "42501" {
			t.Errorf("%s: %v, want refused", q, err)
		}
	}
	// The pinned search path moved by the fence's own fenceline_sp.
	if _, err := c.Exec(ctx, "INSERT INTO sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 0); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, c, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	_, e1 := c.Exec(ctx, "INSERT INTO sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 1)
	e2 := simple(ctx, c, "CREATE TEMP TABLE ctas4 AS EXECUTE fenceline_sp('other')")
	simple(ctx, c, "ROLLBACK") //nolint:errcheck
	if e2 == nil || !strings.Contains(e2.Error(), "the fence's own") {
		t.Errorf("CREATE TABLE AS EXECUTE fenceline_sp: %v (before it: %v), want refused as naming the fence's own", e2, e1)
	}
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM other.sp_t").Scan(&n); err != nil || n != 0 {
		t.Fatalf("other.sp_t has %d rows (%v)", n, err)
	}
}

// A fast-path FunctionCall runs a function by its oid: code the fence does
// not parse, an opaque write, refused in a writable block unless the
// fence allows opaque writes (as a CALL or DO is).
func TestFastPathCallIsOpaque(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	var oid uint32
	if err := adminConn(t).QueryRow(ctx, "SELECT 'other.f_writes'::regproc::oid").Scan(&oid); err != nil {
		t.Fatal(err)
	}
	for _, allow := range []bool{false, true} {
		truncateOther(t)
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fastpath", 0, "public.*", "app.*"), AllowOpaque: allow})
		c := connect(t, proxyDSN(p, "agent"))
		if err := simple(ctx, c, "BEGIN"); err != nil {
			t.Fatal(err)
		}
		er := fastPathCall(t, c, oid)
		if err := simple(ctx, c, "COMMIT"); err != nil && allow {
			t.Fatal(err)
		}
		n := otherRows(t)
		switch {
		case !allow && (er == nil || er.Code != "42501" || n != 0):
			t.Errorf("without --pg-allow-opaque: a fast-path call of other.f_writes in a writable block: %v, %d rows outside the claim; want refused, none", er, n)
		case allow && (er != nil || n != 1):
			t.Errorf("with --pg-allow-opaque: %v, %d rows; want it run, as a CALL would", er, n)
		}
	}
}

// The write check's own SQL runs with the search path a checked function
// left: it pins pg_catalog before its first operator, so an operator of
// the same name earlier in that path (app.>= here) cannot blind its look
// for a cursor WITH HOLD, whose query would run at COMMIT, after the check.
func TestWriteCheckPinsItsPathFirst(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	falseOperator(t, "app", "timestamptz", "timestamptz")
	if _, err := adminConn(t).Exec(ctx, `
CREATE OR REPLACE FUNCTION app.hold_behind_path() RETURNS int LANGUAGE plpgsql AS $$BEGIN
  PERFORM set_config('search_path', 'app, pg_catalog', true);
  EXECUTE 'DECLARE held_behind_path CURSOR WITH HOLD FOR SELECT other.f_writes()';
  RETURN 1; END$$;`); err != nil {
		t.Fatal(err)
	}
	truncateOther(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_check_path", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	err := simple(ctx, c, "SELECT app.hold_behind_path()")
	noRowsOutside(t, "a cursor WITH HOLD declared behind an operator in the path", err)
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "WITH HOLD") {
		t.Fatalf("%v, want the check's refusal of the cursor WITH HOLD", err)
	}
}

// The fence's catalog lookups compare oids with numbers and regclasses; an
// operator of that name and those exact types in a schema of the session's
// path (public.>=(oid, int4) here) would be taken over pg_catalog's, which
// needs a cast. A lookup outside a block runs with pg_catalog alone as its
// path, and takes other.f_writes for the user function it is.
func TestLookupIgnoresOperatorsInThePath(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	falseOperator(t, "public", "oid", "int4")
	truncateOther(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_lookup_path", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	err := simple(ctx, c, "INSERT INTO public.sp_t (id) SELECT other.f_writes()")
	noRowsOutside(t, "a write calling a user function, an operator in the path", err)
	if pgCode(err) != "42501" {
		t.Fatalf("%v, want refused", err)
	}
}

// The same inside the client's transaction block, where the lookup runs
// with the client's search path: its text names pg_catalog's operators.
func TestLookupInABlockIgnoresOperatorsInThePath(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	falseOperator(t, "public", "oid", "int4")
	truncateOther(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_lookup_block", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"BEGIN", "INSERT INTO public.sp_t (id) VALUES (1)"} {
		if err := simple(ctx, c, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	err := simple(ctx, c, "INSERT INTO public.sp_t (id) SELECT other.f_writes()")
	simple(ctx, c, "COMMIT") //nolint:errcheck // after a refusal: ROLLBACK
	noRowsOutside(t, "in a block, a write calling a user function, an operator in the path", err)
	if pgCode(err) != "42501" {
		t.Fatalf("%v, want refused", err)
	}
}

// The proxy's own queries run in the client's session, with its path: an
// operator of the same name and types as pg_catalog's, in a schema the
// client put first, would run its code inside them, where the proxy does
// not look for code (it could prepare the proxy's own statement names
// again, as TestNamesChangedByCode's functions do). None runs: neither
// before a lookup in a transaction of its own, nor in one inside a block.
func TestOwnQueriesRunNoOperatorOfThePath(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	if _, err := adminConn(t).Exec(ctx, `CREATE TABLE IF NOT EXISTS public.sp_t2 (id int); GRANT ALL ON public.sp_t2 TO PUBLIC;
CREATE TABLE IF NOT EXISTS public.sp_t3 (id int); GRANT ALL ON public.sp_t3 TO PUBLIC;
CREATE OR REPLACE FUNCTION public.eq_marks(a text, b text) RETURNS bool LANGUAGE plpgsql AS $f$BEGIN
  PERFORM pg_catalog.set_config('fl.marked', 'yes', false);
  RETURN a OPERATOR(pg_catalog.=) b; END$f$;
DROP OPERATOR IF EXISTS public.= (text, text);
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = text, FUNCTION = public.eq_marks)`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		adminConn(t).Exec(ctxT(t), "DROP OPERATOR IF EXISTS public.= (text, text); DROP FUNCTION IF EXISTS public.eq_marks(text, text)") //nolint:errcheck
	})
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_own_queries", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{
		"SET search_path = public, pg_catalog",
		"INSERT INTO public.sp_t2 (id) VALUES (1)", // a lookup of its own
		"BEGIN",
		"INSERT INTO public.sp_t3 (id) SELECT abs(-1)", // one inside the block
		"COMMIT",
	} {
		if err := simple(ctx, c, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		var marked bool
		if err := c.QueryRow(ctx, "SELECT pg_catalog.current_setting('fl.marked', true) IS NOT NULL", pgx.QueryExecModeSimpleProtocol).Scan(&marked); err != nil {
			t.Fatal(err)
		}
		if marked {
			t.Fatalf("after %s: the operator in the path ran in the proxy's own query", q)
		}
	}
}

// A portal bound before a pause is bound again after the proxy ends the
// paused prefix's transaction (a replay of its Bind). When the statement
// the Bind names was parsed again meanwhile (the unnamed one, here, as an
// INSERT outside the claim), the replay would bind the portal to that,
// while the proxy judges the portal's Execute as what it was first bound
// to (SELECT 1): the Bind is not replayed, and the Execute fails.
//
// The pauses are the fault under test (as in TestClientPausesMidUnit),
// not waits for state.
func TestReplayBindsWhatWasJudged(t *testing.T) {
	smuggleSetup(t)
	truncateOther(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_replay", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	fe := c.PgConn().Frontend()
	send := func(msgs ...pgproto3.FrontendMessage) {
		t.Helper()
		for _, m := range msgs {
			fe.Send(m)
		}
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
	}
	const pause = 300 * time.Millisecond
	receive := func() []string {
		t.Helper()
		return errorsUntilReady(t, fe)
	}
	// First a unit whose stalled prefix kept a Bind and which ended with
	// the client's own Sync: nothing of it may be taken for the next
	// replay's (the same texts classify to the same statements).
	send(&pgproto3.Parse{Query: "SELECT 1"})
	time.Sleep(pause)
	send(&pgproto3.Parse{Query: "INSERT INTO other.t VALUES (67)"}, &pgproto3.Bind{DestinationPortal: "q"}, &pgproto3.Flush{})
	time.Sleep(pause)
	send(&pgproto3.Sync{})
	receive()
	send(&pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Bind{DestinationPortal: "p"})
	time.Sleep(pause) // the proxy forwards the prefix, stalled
	send(&pgproto3.Parse{Query: "INSERT INTO other.t VALUES (67)"})
	time.Sleep(pause) // and this one
	send(&pgproto3.Parse{Name: "w", Query: "INSERT INTO public.sp_t (id) VALUES (1)"}, &pgproto3.Bind{PreparedStatement: "w"},
		&pgproto3.Execute{}, &pgproto3.Execute{Portal: "p"}, &pgproto3.Sync{})
	errs := receive()
	noRowsOutside(t, "a portal bound again after a pause to a statement parsed since")
	if len(errs) == 0 {
		t.Fatal("the Execute of the portal not bound again succeeded")
	}
}

// The write check puts the session's path back when it passes: a Parse
// after the checked Execute, before its Sync, resolves its names with it.
func TestWriteCheckPutsThePathBack(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	if _, err := adminConn(t).Exec(ctx, `CREATE OR REPLACE FUNCTION app.writes_nothing() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$;`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_check_back", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	fe := c.PgConn().Frontend()
	for _, m := range []pgproto3.FrontendMessage{
		&pgproto3.Parse{Query: "SELECT app.writes_nothing()"}, &pgproto3.Bind{}, &pgproto3.Execute{},
		&pgproto3.Parse{Name: "after_check", Query: "SELECT count(*) FROM sp_t"}, &pgproto3.Sync{},
	} {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	if errs := errorsUntilReady(t, fe); len(errs) > 0 {
		t.Fatalf("a Parse of an unqualified name after a checked read: %v", errs)
	}
}

// falseOperator makes schema.>= (left, right) an operator that is always
// false, for the rest of the test.
func falseOperator(t *testing.T, schema, left, right string) {
	t.Helper()
	sig := fmt.Sprintf("%s.>= (%s, %s)", schema, left, right)
	fn := fmt.Sprintf("%s.never_ge(%s, %s)", schema, left, right)
	if _, err := adminConn(t).Exec(ctxT(t), "CREATE OR REPLACE FUNCTION "+fn+" RETURNS bool LANGUAGE sql IMMUTABLE AS 'SELECT false'; "+
		"DROP OPERATOR IF EXISTS "+sig+"; CREATE OPERATOR "+schema+".>= (LEFTARG = "+left+", RIGHTARG = "+right+", FUNCTION = "+schema+".never_ge)"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		adminConn(t).Exec(ctxT(t), "DROP OPERATOR IF EXISTS "+sig+"; DROP FUNCTION IF EXISTS "+fn) //nolint:errcheck
	})
}

// EXECUTE's arguments are expressions the server evaluates before the
// prepared statement runs, in its transaction: a function called there
// runs in the writable transaction of a prepared write, and is judged as
// the statement's own calls are. Arguments that call only builtins keep
// working, and so does the prepared statement after them.
func TestExecuteArgumentsAreJudged(t *testing.T) {
	smuggleSetup(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_execute_args", 0, "public.*", "app.*")})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	if err := simple(ctx, c, "PREPARE w(int) AS INSERT INTO public.sp_t (id) VALUES ($1); PREPARE s(int) AS SELECT $1"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"EXECUTE w(other.f_writes())",
		"EXECUTE w((SELECT other.f_writes()))",
		"PREPARE w2(int) AS INSERT INTO public.sp_t (id) VALUES ($1); EXECUTE w2(other.f_writes())",
		"BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXECUTE s(other.f_writes()); COMMIT",
		"BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXPLAIN EXECUTE s(other.f_writes()); COMMIT",
		"BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXPLAIN ANALYZE EXECUTE s(other.f_writes()); COMMIT",
	} {
		truncateOther(t)
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK; DEALLOCATE w2") //nolint:errcheck // w2 may not be there
		if err == nil {
			t.Errorf("%s: not refused", q)
		}
		noRowsOutside(t, q, err)
	}
	for _, q := range []string{
		"EXECUTE w(41 + 1)",
		"EXECUTE s(41 + 1)",
		"PREPARE w3(int) AS INSERT INTO public.sp_t (id) VALUES ($1); EXECUTE w3(abs(-3) + 1)",
		"EXECUTE w3(2)",
		"EXECUTE w(length('abc'))",
		"EXECUTE s(1)",
	} {
		if err := simple(ctx, c, q); err != nil {
			t.Errorf("%s: %v", q, err)
		}
	}
}

// A statement's parameter types run code when a value is bound: a domain's
// CHECK calls its functions, in the statement's transaction. Named in a
// PREPARE, or given by oid in a Parse (where the text never names them),
// such a type is judged as a type the statement names.
func TestParameterTypesAreJudged(t *testing.T) {
	smuggleSetup(t)
	admin := adminConn(t)
	ctx := ctxT(t)
	if _, err := admin.Exec(ctx, `DROP DOMAIN IF EXISTS app.d_writes, app.d_plain;
CREATE DOMAIN app.d_writes AS int CHECK (VALUE > 0 AND other.f_writes() > 0);
CREATE DOMAIN app.d_plain AS int CHECK (VALUE > 0)`); err != nil {
		t.Fatal(err)
	}
	var writes, plain uint32
	if err := admin.QueryRow(ctx, "SELECT 'app.d_writes'::regtype::oid, 'app.d_plain'::regtype::oid").Scan(&writes, &plain); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_param_types", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	insert := "INSERT INTO public.sp_t (id) VALUES ($1)"
	if err := simple(ctx, c, "PREPARE w(app.d_writes) AS "+insert+"; PREPARE s(app.d_writes) AS SELECT $1"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"EXECUTE w(6)",
		"BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXECUTE s(6); COMMIT",
		"PREPARE w2(app.d_writes) AS " + insert + "; EXECUTE w2(5)",
	} {
		truncateOther(t)
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // outside a block: a warning
		if err == nil {
			t.Errorf("%s: not refused", q)
		}
		noRowsOutside(t, q, err)
	}
	truncateOther(t)
	_, err := c.PgConn().ExecParams(ctx, insert, [][]byte{[]byte("7")}, []uint32{writes}, nil, nil).Close()
	if err == nil {
		t.Error("a Parse with the parameter type's oid: not refused")
	}
	noRowsOutside(t, "a Parse with the parameter type's oid", err)

	// Types whose checks call only builtins bind as direct.
	if _, err := c.PgConn().ExecParams(ctx, insert, [][]byte{[]byte("8")}, []uint32{plain}, nil, nil).Close(); err != nil {
		t.Errorf("a Parse with a plain domain's oid: %v", err)
	}
	if err := simple(ctx, c, "PREPARE p(app.d_plain) AS "+insert+"; EXECUTE p(9)"); err != nil {
		t.Errorf("PREPARE with a plain domain: %v", err)
	}
}

// sendUntilReady sends msgs and reads until ReadyForQuery, returning each
// ErrorResponse as "code message".
func sendUntilReady(t *testing.T, fe *pgproto3.Frontend, msgs []pgproto3.FrontendMessage) []string {
	t.Helper()
	for _, m := range msgs {
		fe.Send(m)
	}
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	return errorsUntilReady(t, fe)
}

// errorsUntilReady reads until ReadyForQuery, returning each
// ErrorResponse as "code message".
func errorsUntilReady(t *testing.T, fe *pgproto3.Frontend) []string {
	t.Helper()
	var errs []string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			errs = append(errs, m.Code+" "+m.Message)
		case *pgproto3.ReadyForQuery:
			return errs
		}
	}
}

// The proxy pins search_path (SET LOCAL) before a block's first write to an
// unqualified name, because a function it cannot see into may have changed
// the session's path. A ROLLBACK TO a savepoint made before the pin undid
// it, as a COMMIT AND CHAIN ends the transaction it was set in, and the
// proxy did not pin again: the next write resolved with the changed path,
// to a table outside the claim. Both protocols, each with the undoing
// statement and the write apart and together (one Query, one pipeline).
// And a portal bound before the pin (Postgres plans it at Bind) ran with
// the path it was planned with.
func TestPinSurvivesRollbackTo(t *testing.T) {
	ctx := ctxT(t)
	if _, err := adminConn(t).Exec(ctx, `
DROP SCHEMA IF EXISTS pinrb_in, pinrb_out CASCADE;
CREATE SCHEMA pinrb_in; CREATE SCHEMA pinrb_out;
CREATE TABLE pinrb_in.t (v text); CREATE TABLE pinrb_out.t (v text);
CREATE FUNCTION pinrb_in.sneak() RETURNS int LANGUAGE plpgsql AS $$
BEGIN PERFORM pg_catalog.set_config('search_path', 'pinrb_out, pinrb_in', false); RETURN 1; END $$;
GRANT USAGE ON SCHEMA pinrb_in, pinrb_out TO agent;
GRANT ALL ON pinrb_in.t, pinrb_out.t TO agent;
GRANT EXECUTE ON FUNCTION pinrb_in.sneak() TO agent`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_pin_rollback_to", 0, "pinrb_in.*")})
	check := func(what string, errs ...error) {
		t.Helper()
		var out, in int
		if err := adminConn(t).QueryRow(ctx, "SELECT (SELECT count(*) FROM pinrb_out.t), (SELECT count(*) FROM pinrb_in.t WHERE v = 'after')").Scan(&out, &in); err != nil {
			t.Fatal(err)
		}
		if out != 0 {
			t.Errorf("%s: %d rows written to pinrb_out.t, outside the claim (errors: %v)", what, out, errs)
		}
		if in != 1 || errors.Join(errs...) != nil {
			t.Errorf("%s: the write after: %d rows in pinrb_in.t, errors %v; want it written there", what, in, errs)
		}
		if _, err := adminConn(t).Exec(ctx, "TRUNCATE pinrb_in.t, pinrb_out.t"); err != nil {
			t.Fatal(err)
		}
	}
	// The proxy learns the path as pinrb_in; then the function changes it
	// behind the proxy (a read that calls it runs read-only, as any read
	// may); then a block's first write pins it.
	setup := []string{"SET search_path = pinrb_in", "INSERT INTO t VALUES ('learn the path')", "SELECT pinrb_in.sneak()",
		"BEGIN", "SAVEPOINT a", "INSERT INTO t VALUES ('pinned')"}
	for _, undo := range []string{"ROLLBACK TO SAVEPOINT a", "COMMIT AND CHAIN"} {
		for _, mode := range []string{"simple", "one query", "extended", "pipeline"} {
			c := connect(t, proxyDSN(p, "agent"))
			exec := func(q string) error {
				if mode == "simple" || mode == "one query" {
					return simple(ctx, c, q)
				}
				return c.PgConn().ExecParams(ctx, q, nil, nil, nil, nil).Read().Err // Parse, Bind, Execute
			}
			for _, q := range setup {
				if err := exec(q); err != nil {
					t.Fatalf("%s, %s: %s: %v", undo, mode, q, err)
				}
			}
			var errs []error
			switch mode {
			case "one query":
				errs = append(errs, simple(ctx, c, undo+"; INSERT INTO t VALUES ('after')"))
			case "pipeline":
				b := &pgx.Batch{}
				b.Queue(undo)
				b.Queue("INSERT INTO t VALUES ('after')")
				errs = append(errs, c.SendBatch(ctx, b).Close())
			default:
				errs = append(errs, exec(undo), exec("INSERT INTO t VALUES ('after')"))
			}
			errs = append(errs, exec("COMMIT"))
			check(undo+", "+mode, errs...)
		}
	}

	// In a failed block, a pipeline that rolls back to a savepoint and then
	// writes: the client's ROLLBACK TO runs (a pin before it failed too,
	// and Postgres skipped it), and the write is refused, not written
	// outside the claim: in a failed block the proxy cannot learn the path
	// (its query to learn it failed there, and ended the session).
	send := wireSession(t, p)
	var tr []string
	for _, step := range [][]pgproto3.FrontendMessage{
		{&pgproto3.Query{String: "SET search_path = pinrb_in"}}, {&pgproto3.Query{String: "BEGIN"}}, {&pgproto3.Query{String: "SAVEPOINT a"}},
		{&pgproto3.Query{String: "SELECT 1/0"}},
		{&pgproto3.Parse{Query: "ROLLBACK TO SAVEPOINT a"}, &pgproto3.Bind{}, &pgproto3.Execute{},
			&pgproto3.Parse{Query: "INSERT INTO t VALUES ('after')"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}},
		{&pgproto3.Query{String: "ROLLBACK"}},
	} {
		tr = append(tr, send(step...))
	}
	var out int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM pinrb_out.t").Scan(&out); err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(tr[4], "Complete(ROLLBACK)") || out != 0 || !strings.Contains(tr[5], "Complete(ROLLBACK)") {
		t.Errorf("in a failed block, ROLLBACK TO and an unqualified write in one pipeline: %q, then %q, %d rows in pinrb_out.t; want the ROLLBACK TO run, nothing outside the claim, the session going on", tr[4], tr[5], out)
	}

	// A portal bound with nothing to execute yet, then executed.
	send = wireSession(t, p)
	tr = nil
	for _, step := range [][]pgproto3.FrontendMessage{
		{&pgproto3.Query{String: "SET search_path = pinrb_in"}}, {&pgproto3.Query{String: "INSERT INTO t VALUES ('learn the path')"}},
		{&pgproto3.Query{String: "SELECT pinrb_in.sneak()"}}, {&pgproto3.Query{String: "BEGIN"}},
		{&pgproto3.Parse{Name: "w", Query: "INSERT INTO t VALUES ('after')"}, &pgproto3.Bind{DestinationPortal: "pw", PreparedStatement: "w"}, &pgproto3.Sync{}},
		{&pgproto3.Execute{Portal: "pw"}, &pgproto3.Sync{}},
		{&pgproto3.Query{String: "COMMIT"}},
	} {
		tr = append(tr, send(step...))
	}
	check("a portal bound before its Execute", wireErrors(tr)...)
}

// wireErrors are the exchanges of wireSession's transcripts tr that hold an
// error.
func wireErrors(tr []string) []error {
	var errs []error
	for _, s := range tr {
		if strings.Contains(s, "Error(") {
			errs = append(errs, errors.New(s))
		}
	}
	return errs
}
