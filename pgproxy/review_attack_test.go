package pgproxy

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
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
