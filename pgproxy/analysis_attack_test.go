package pgproxy

import (
	"strconv"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Attacks a reviewer ran against stop 61's fixes: Postgres runs code while
// it only analyzes a statement (a composite literal's input runs its
// fields' domain checks), in a PREPARE or a protocol Parse with no Execute.
// Such code can prepare statement names again behind the proxy; a name is
// trusted only when the client set it after the last code of its unit.

// reprepDomain makes app.<typ>, a composite type whose one field's domain
// CHECK prepares name again as rest (app.reprep).
func reprepDomain(t *testing.T, typ, name, rest string) {
	t.Helper()
	if _, err := adminConn(t).Exec(ctxT(t), `CREATE OR REPLACE FUNCTION app.reprep(n text, rest text) RETURNS int LANGUAGE plpgsql AS
  $$BEGIN EXECUTE 'DEALLOCATE ' || n; EXECUTE 'PREPARE ' || n || rest; RETURN 1; END$$;
DROP TYPE IF EXISTS app.`+typ+`; DROP DOMAIN IF EXISTS app.`+typ+`_d;
CREATE DOMAIN app.`+typ+`_d AS int CHECK (app.reprep(`+sqlText(name)+`, `+sqlText(rest)+`) = 1);
CREATE TYPE app.`+typ+` AS (v app.`+typ+`_d)`); err != nil {
		t.Fatal(err)
	}
}

func TestAnalysisThatPreparesAgainIsNoted(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	t.Run("the proxy's own name, by a PREPARE", func(t *testing.T) {
		reprepDomain(t, "an_tok", "fence"+"line_tok", "(text) AS INSERT INTO other.t SELECT 65 WHERE $1 IS NOT NULL")
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_tok", 0, "public.*", "app.*")})
		c := connect(t, proxyDSN(p, "agent"))
		if _, err := c.Exec(ctx, "INSERT INTO public.sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 1); err != nil {
			t.Fatal(err) // the proxy prepares its own statements
		}
		truncateOther(t)
		err := simple(ctx, c, "PREPARE innocent AS SELECT '(5)'::app.an_tok")
		_, err2 := c.Exec(ctx, "INSERT INTO public.sp_t (id) VALUES ($1)", pgx.QueryExecModeExec, 2)
		noRowsOutside(t, "fenceline_tok prepared again while a PREPARE was analyzed", err, err2)
	})
	for _, how := range []string{"PREPARE", "Parse"} {
		t.Run("a client's name, by a "+how, func(t *testing.T) {
			reprepDomain(t, "an_cl", "an_w", " AS INSERT INTO other.t VALUES (71)")
			p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_cl", 0, "public.*", "app.*")})
			c := connect(t, proxyDSN(p, "agent"))
			for _, q := range []string{"PREPARE an_w AS SELECT 1", "SELECT 1"} { // its prepare_time learnt
				if err := simple(ctx, c, q); err != nil {
					t.Fatal(err)
				}
			}
			truncateOther(t)
			var errs []error
			if how == "PREPARE" {
				errs = append(errs, simple(ctx, c, "PREPARE innocent AS SELECT '(5)'::app.an_cl"))
			} else {
				errs = pipeline(t, c, func(pl *pgconn.Pipeline) { pl.SendPrepare("innocent", "SELECT '(5)'::app.an_cl", nil) })
			}
			q := "SELECT 2; BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXECUTE an_w; COMMIT"
			errs = append(errs, simple(ctx, c, q))
			simple(ctx, c, "ROLLBACK") //nolint:errcheck // after a refusal
			noRowsOutside(t, "a client's name prepared again while a "+how+" was analyzed, then executed in a write's block", errs...)
		})
	}
	// What the client prepares after the code of its unit, or with
	// builtin types only, stays its own.
	t.Run("names prepared with builtin types, or after the code", func(t *testing.T) {
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_ok", 0, "public.*", "app.*")})
		c := connect(t, proxyDSN(p, "agent"))
		for _, q := range []string{
			"PREPARE ok_w(int, text) AS INSERT INTO public.sp_t (id) VALUES ($1); PREPARE ok_s(varchar) AS SELECT $1",
			"EXECUTE ok_w(1, 'a')",
			"SELECT abs(-1) + 1; PREPARE ok_after(int) AS INSERT INTO public.sp_t (id) VALUES ($1 + 1)",
			"EXECUTE ok_after(2)",
			"EXECUTE ok_s('b')",
		} {
			if err := simple(ctx, c, q); err != nil {
				t.Errorf("%s: %v", q, err)
			}
		}
		if _, err := c.Exec(ctx, "INSERT INTO public.sp_t (id) SELECT $1::int + abs(-1)", 3); err != nil { // pgx's own cached statement
			t.Errorf("a Parse calling builtins: %v", err)
		}
		if _, err := c.Exec(ctx, "INSERT INTO public.sp_t (id) SELECT $1::int + abs(-1)", 4); err != nil {
			t.Errorf("the same statement again: %v", err)
		}
	})
}

// In a writable unit what a Parse's analysis or a Bind's planning runs
// writes as an Execute's call would: judged as one.
func TestAnalysisInAWritableUnitIsJudged(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `DROP TYPE IF EXISTS app.an_w; DROP DOMAIN IF EXISTS app.an_w_d;
CREATE DOMAIN app.an_w_d AS int CHECK (VALUE > 0 AND other.f_writes() > 0);
CREATE TYPE app.an_w AS (v app.an_w_d);
CREATE OR REPLACE FUNCTION app.an_imm(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$BEGIN PERFORM other.f_writes(); RETURN x; END$$`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_writable", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	truncateOther(t)
	errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
		pl.SendPrepare("an_p", "SELECT '(5)'::app.an_w", nil)
		pl.SendQueryParams("INSERT INTO public.sp_t (id) VALUES (1)", nil, nil, nil, nil)
	})
	noRowsOutside(t, "a Parse whose analysis writes, in a write's unit", errs...)

	truncateOther(t)
	refused := sendUntilReady(t, c.PgConn().Frontend(), []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: "an_b", Query: "SELECT app.an_imm(1)"}, &pgproto3.Bind{PreparedStatement: "an_b", DestinationPortal: "an_portal"},
		&pgproto3.Parse{Query: "INSERT INTO public.sp_t (id) VALUES (1)"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{},
	})
	if n := otherRows(t); n != 0 || len(refused) == 0 {
		t.Fatalf("a Bind whose planning folds a writing function, in a write's unit: %d rows outside, refusals %v", n, refused)
	}
}

// Operators Postgres finds by name where the text does not spell them as
// an expression's operator (BETWEEN's >= and <=, IN (SELECT ...)'s =, op
// ANY (SELECT ...), CASE x WHEN, JOIN USING, NATURAL JOIN, ORDER BY
// USING), and a cast of a table's row type: each runs a user function in
// the write's transaction, and is judged as one.
func TestOperatorsFoundByNameAreJudged(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	if _, err := adminConn(t).Exec(ctx, `
CREATE OR REPLACE FUNCTION public.op_writes(a text, b int) RETURNS bool LANGUAGE sql AS $$ INSERT INTO other.t VALUES (98); SELECT true $$;
DROP OPERATOR IF EXISTS public.>= (text, int4); DROP OPERATOR IF EXISTS public.<= (text, int4);
DROP OPERATOR IF EXISTS public.= (text, int4); DROP OPERATOR IF EXISTS public.=== (text, int4); DROP OPERATOR IF EXISTS public.<<< (text, int4);
CREATE OPERATOR public.>= (LEFTARG = text, RIGHTARG = int4, FUNCTION = public.op_writes);
CREATE OPERATOR public.<= (LEFTARG = text, RIGHTARG = int4, FUNCTION = public.op_writes);
CREATE OPERATOR public.= (LEFTARG = text, RIGHTARG = int4, FUNCTION = public.op_writes);
CREATE OPERATOR public.=== (LEFTARG = text, RIGHTARG = int4, FUNCTION = public.op_writes);
DROP TYPE IF EXISTS app.op_e CASCADE; CREATE TYPE app.op_e AS ENUM ('a', 'b');
CREATE OR REPLACE FUNCTION app.op_eq(a app.op_e, b app.op_e) RETURNS bool LANGUAGE sql AS $$ INSERT INTO other.t VALUES (96); SELECT a::text OPERATOR(pg_catalog.=) b::text $$;
CREATE OPERATOR app.= (LEFTARG = app.op_e, RIGHTARG = app.op_e, FUNCTION = app.op_eq);
DROP TABLE IF EXISTS app.op_rt CASCADE; CREATE TABLE app.op_rt (x int); INSERT INTO app.op_rt VALUES (1); GRANT ALL ON app.op_rt TO PUBLIC;
CREATE OR REPLACE FUNCTION app.op_rt_text(app.op_rt) RETURNS text LANGUAGE sql AS $$ INSERT INTO other.t VALUES (97); SELECT 'x' $$;
CREATE CAST (app.op_rt AS text) WITH FUNCTION app.op_rt_text(app.op_rt) AS ASSIGNMENT`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		adminConn(t).Exec(ctxT(t), `DROP OPERATOR IF EXISTS public.>= (text, int4); DROP OPERATOR IF EXISTS public.<= (text, int4);
DROP OPERATOR IF EXISTS public.= (text, int4); DROP OPERATOR IF EXISTS public.=== (text, int4);
DROP FUNCTION IF EXISTS public.op_writes(text, int); DROP TABLE IF EXISTS app.op_rt CASCADE; DROP TYPE IF EXISTS app.op_e CASCADE`) //nolint:errcheck
	})
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_op_names", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	if err := simple(ctx, c, "SET search_path = public, app"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"INSERT INTO public.sp_t (id) SELECT 1 WHERE 'a'::text BETWEEN 1 AND 2",
		"INSERT INTO public.sp_t (id) SELECT 1 WHERE 'a'::text === ANY (SELECT 1)",
		"INSERT INTO public.sp_t (id) SELECT 1 WHERE 'a'::text === ALL (SELECT 1)",
		"INSERT INTO public.sp_t (id) SELECT 1 WHERE 'a'::text IN (SELECT 1)",
		"INSERT INTO public.sp_t (id) SELECT CASE 'a'::text WHEN 1 THEN 1 ELSE 2 END",
		"INSERT INTO public.sp_t (id) SELECT 1 FROM (SELECT 'a'::app.op_e AS k) x JOIN (SELECT 'a'::app.op_e AS k) y USING (k)",
		"INSERT INTO public.sp_t (id) SELECT 1 FROM (SELECT 'a'::app.op_e AS k) x NATURAL JOIN (SELECT 'a'::app.op_e AS k) y",
		"INSERT INTO public.sp_t (id) SELECT length(r::text) FROM app.op_rt r",
	} {
		truncateOther(t)
		err := simple(ctx, c, q)
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // outside a block: a warning
		if n := otherRows(t); err == nil || n != 0 {
			t.Errorf("%s: %d rows written outside the claim (error: %v), want refused", q, n, err)
		}
	}
}

// nextval and setval of a sequence named without its schema, which the
// session's path resolves to one owned by a table outside the claim: the
// lookup runs with the path pinned to pg_catalog, where the name resolved
// to nothing, and the call passed. Every sequence of that name is judged.
func TestUnqualifiedSequenceIsJudged(t *testing.T) {
	smuggleSetup(t)
	admin := adminConn(t)
	ctx := ctxT(t)
	if _, err := admin.Exec(ctx, `DROP SEQUENCE IF EXISTS other.uq_s, other."uq.s"; CREATE SEQUENCE other.uq_s OWNED BY other.t.id; GRANT ALL ON other.uq_s TO PUBLIC;
CREATE SEQUENCE other."uq.s" OWNED BY other.t.id; GRANT ALL ON other."uq.s" TO PUBLIC;
DROP TABLE IF EXISTS public.uq_own; CREATE TABLE public.uq_own (id serial); GRANT ALL ON public.uq_own, public.uq_own_id_seq TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_uq_seq", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	last := func() int64 {
		var n int64
		if err := admin.QueryRow(ctx, `SELECT (SELECT last_value FROM other.uq_s) + (SELECT last_value FROM other."uq.s")`).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	before := last()
	if err := simple(ctx, c, "SET search_path = other, public"); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"SELECT nextval('uq_s')", "SELECT setval('uq_s', 1000)", `SELECT nextval('"uq_s"')`,
		`SELECT setval('"uq.s"', 700)`, `SELECT nextval('uq_own_id_seq'), setval('"uq.s"', 500)`} {
		if err := simple(ctx, c, q); err == nil {
			t.Errorf("%s: not refused", q)
		}
	}
	if got := last(); got != before {
		t.Fatalf("other's sequences moved from %d to %d: a sequence of a table outside the claim was written", before, got)
	}
	// The claimed table's own sequence, unqualified, as ORMs call it.
	if err := simple(ctx, c, "SELECT nextval('uq_own_id_seq')"); err != nil {
		t.Errorf("nextval of a claimed table's sequence: %v", err)
	}
}

// A PREPARE or Parse the server refuses (its name taken meanwhile by code
// its analysis ran) leaves the name as code made it: not the client's.
// And a literal coerced to a column's type at Parse runs that type's
// input (a domain's check) with no type named in the text.
func TestAnalysisOfRefusedOrColumnTypedStatements(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	reprepDomain(t, "an_fr", "an_x", " AS INSERT INTO other.t VALUES (81)")
	if _, err := adminConn(t).Exec(ctx, `DROP TABLE IF EXISTS other.an_ct; CREATE TABLE other.an_ct (c app.an_fr); GRANT ALL ON other.an_ct TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	use := "SELECT 2; BEGIN; INSERT INTO public.sp_t (id) VALUES (1); EXECUTE an_x; COMMIT"
	for _, tc := range []struct {
		name string
		run  func(c *pgx.Conn) []error
	}{
		{"a PREPARE refused", func(c *pgx.Conn) []error {
			return []error{simple(ctx, c, "PREPARE an_x AS SELECT '(5)'::app.an_fr")}
		}},
		{"a Parse refused", func(c *pgx.Conn) []error {
			return pipeline(t, c, func(pl *pgconn.Pipeline) { pl.SendPrepare("an_x", "SELECT '(5)'::app.an_fr", nil) })
		}},
		{"a Parse coercing to a column's type", func(c *pgx.Conn) []error {
			return pipeline(t, c, func(pl *pgconn.Pipeline) {
				pl.SendPrepare("an_other", "INSERT INTO other.an_ct (c) VALUES ('(5)')", nil)
			})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_refused", 0, "public.*", "app.*")})
			c := connect(t, proxyDSN(p, "agent"))
			for _, q := range []string{"PREPARE an_x AS SELECT 1", "SELECT 1"} { // its prepare_time learnt
				if err := simple(ctx, c, q); err != nil {
					t.Fatal(err)
				}
			}
			truncateOther(t)
			errs := append(tc.run(c), simple(ctx, c, use))
			simple(ctx, c, "ROLLBACK") //nolint:errcheck // after a refusal
			if n := otherRows(t); n != 0 {
				t.Fatalf("%d rows written outside the claim (errors %v)", n, errs)
			}
		})
	}
	// In a write's unit, the same Parse writes through the domain's check.
	if _, err := adminConn(t).Exec(ctx, `DROP TABLE IF EXISTS other.an_cw; DROP TYPE IF EXISTS app.an_cwt; DROP DOMAIN IF EXISTS app.an_cwd;
CREATE DOMAIN app.an_cwd AS int CHECK (VALUE > 0 AND other.f_writes() > 0); CREATE TYPE app.an_cwt AS (v app.an_cwd);
CREATE TABLE other.an_cw (c app.an_cwt); GRANT ALL ON other.an_cw TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_coerce", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	truncateOther(t)
	errs := pipeline(t, c, func(pl *pgconn.Pipeline) {
		pl.SendPrepare("", "INSERT INTO other.an_cw (c) VALUES ('(5)')", nil)
		pl.SendQueryParams("INSERT INTO public.sp_t (id) VALUES (1)", nil, nil, nil, nil)
	})
	noRowsOutside(t, "a Parse coercing a literal to a column's type, in a write's unit", errs...)
}

// What a Parse's analysis or a Bind's planning runs beyond the relations
// and types its text names (a reviewer's attacks on stop 62's first fix),
// in a write's unit, where the write's transaction would commit what it
// wrote: a literal coerced to a function's parameter type (a composite
// whose field's domain CHECK writes), a column default folded when a
// Bind of an INSERT is planned, and a text the proxy is unsure of, whose
// Parse it cannot judge at all. Each is refused in its message's place.
func TestAnalysisRunsWhatItCoercesAndFolds(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `DROP TABLE IF EXISTS public.an_dflt; DROP FUNCTION IF EXISTS app.an_takes(app.an_c);
DROP TYPE IF EXISTS app.an_c; DROP DOMAIN IF EXISTS app.an_c_d;
CREATE DOMAIN app.an_c_d AS int CHECK (VALUE > 0 AND other.f_writes() > 0);
CREATE TYPE app.an_c AS (v app.an_c_d);
CREATE FUNCTION app.an_takes(x app.an_c) RETURNS int LANGUAGE sql AS 'SELECT 1';
CREATE OR REPLACE FUNCTION app.an_fold(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$BEGIN PERFORM other.f_writes(); RETURN x; END$$;
CREATE TABLE public.an_dflt (id int, w int DEFAULT app.an_fold(1));
DROP TABLE IF EXISTS other.an_dflt; CREATE TABLE other.an_dflt (id int, w int DEFAULT app.an_fold(1));
GRANT ALL ON public.an_dflt, other.an_dflt TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_an_coerce", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	for i, tc := range []struct {
		name, text, want string
		bind             bool // Bind it too (no Execute)
		after            bool // after an Execute of the same segment (the proxy no longer knows the session's settings)
	}{
		{"a literal coerced to a function's parameter type", "SELECT app.an_takes('(5)')", "app.an_takes", false, false},
		{"a column default folded when an INSERT is planned", "INSERT INTO public.an_dflt (id) VALUES (1)", "an_dflt", true, false},
		{"a text the proxy is unsure of", "SELECT '(5)'::app.an_c -- \\", "Postgres may parse this text otherwise", false, true},
		{"a column default folded when an INSERT outside the claim is planned", "INSERT INTO other.an_dflt (id) VALUES (1)", "table other.an_dflt: its defaults", true, false},
	} {
		// A statement name of its own: a refusal skips the Close.
		name := "an_x_" + strconv.Itoa(i)
		t.Run(tc.name, func(t *testing.T) {
			truncateOther(t)
			var msgs []pgproto3.FrontendMessage
			if tc.after {
				msgs = append(msgs, &pgproto3.Parse{Query: "SELECT 1"}, &pgproto3.Bind{}, &pgproto3.Execute{})
			}
			msgs = append(msgs, &pgproto3.Parse{Name: name, Query: tc.text})
			if tc.bind {
				msgs = append(msgs, &pgproto3.Bind{PreparedStatement: name})
			}
			msgs = append(msgs, &pgproto3.Parse{Query: "INSERT INTO public.sp_t (id) VALUES (1)"}, &pgproto3.Bind{}, &pgproto3.Execute{},
				&pgproto3.Close{ObjectType: 'S', Name: name}, &pgproto3.Sync{})
			refused := sendUntilReady(t, c.PgConn().Frontend(), msgs)
			noRowsOutside(t, tc.name, nil)
			if len(refused) == 0 || !strings.Contains(refused[0], "fenceline: write refused for lease lease_an_coerce") || !strings.Contains(refused[0], tc.want) {
				t.Fatalf("refusals %v: want the fence's, naming %q", refused, tc.want)
			}
		})
	}
}

// The parser knows Postgres 17's grammar, where JSON_SCALAR(...),
// JSON(...), JSON_SERIALIZE(...), the other SQL/JSON constructors and
// MERGE_ACTION() are syntax; the test server (15) parses the same text as
// a call of a function of that name on the search path. A user's function
// so named writes outside the claim in a write's transaction unless it is
// judged as the call it is there (a reviewer's attacks).
func TestNewerSyntaxIsACallOnOlderServers(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `CREATE OR REPLACE FUNCTION public.json_scalar(x text) RETURNS int LANGUAGE sql AS $$ INSERT INTO other.t VALUES (97); SELECT 1 $$;
CREATE OR REPLACE FUNCTION public.json_serialize(x text) RETURNS int LANGUAGE sql AS $$ INSERT INTO other.t VALUES (96); SELECT 1 $$;
CREATE OR REPLACE FUNCTION public.merge_action() RETURNS int LANGUAGE sql AS $$ INSERT INTO other.t VALUES (95); SELECT 1 $$`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_json_syntax", 0, "public.*")})
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"SELECT json_scalar('x')", "SELECT json_serialize('x')", "SELECT merge_action()"} {
		truncateOther(t)
		err := simple(ctxT(t), c, "BEGIN; INSERT INTO public.sp_t (id) VALUES (1); "+q+"; COMMIT")
		noRowsOutside(t, q+" in a write's transaction", err)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_json_syntax") {
			t.Errorf("%s in a write's transaction: %v, want the fence's refusal", q, err)
		}
		_ = simple(ctxT(t), c, "ROLLBACK")
	}
}

// A partitioned table whose partition key calls a user function runs it
// for every row written to route it (a reviewer's attack): the write is
// refused as one whose tables cannot be named, as a write to a table whose
// index expressions call user code is.
func TestPartitionKeyCallingUserCodeIsJudged(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `DROP TABLE IF EXISTS app.pkw;
CREATE OR REPLACE FUNCTION app.pk_key(x int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$BEGIN PERFORM other.f_writes(); RETURN x; END$$;
CREATE TABLE app.pkw (id int) PARTITION BY RANGE (app.pk_key(id));
CREATE TABLE app.pkw_all PARTITION OF app.pkw FOR VALUES FROM (MINVALUE) TO (MAXVALUE);
GRANT ALL ON app.pkw, app.pkw_all TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	// The same with a key whose operator class compares with a user's
	// function (CREATE OPERATOR CLASS takes a superuser: the admin's).
	if _, err := adminConn(t).Exec(ctxT(t), `DROP TABLE IF EXISTS app.pko; DROP OPERATOR CLASS IF EXISTS app.pk_ops USING btree;
CREATE OR REPLACE FUNCTION app.pk_cmp(a int, b int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$BEGIN PERFORM other.f_writes(); RETURN btint4cmp(a, b); END$$;
CREATE OPERATOR CLASS app.pk_ops FOR TYPE int USING btree AS OPERATOR 1 <, OPERATOR 2 <=, OPERATOR 3 =, OPERATOR 4 >=, OPERATOR 5 >, FUNCTION 1 app.pk_cmp(int, int);
CREATE TABLE app.pko (id int) PARTITION BY RANGE (id app.pk_ops);
CREATE TABLE app.pko_lo PARTITION OF app.pko FOR VALUES FROM (MINVALUE) TO (10);
CREATE TABLE app.pko_hi PARTITION OF app.pko FOR VALUES FROM (10) TO (MAXVALUE);
GRANT ALL ON app.pko, app.pko_lo, app.pko_hi TO PUBLIC`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_pk_key", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	// Written through the parent, the key routes the row; written to the
	// partition, its partition constraint (the key again) checks it.
	for _, q := range []string{"INSERT INTO app.pkw VALUES (1)", "INSERT INTO app.pkw_all VALUES (1)", "INSERT INTO app.pko VALUES (1)"} {
		truncateOther(t)
		err := simple(ctxT(t), c, q)
		noRowsOutside(t, q, err)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "partition key (or a partitioned ancestor's) calls user functions") {
			t.Fatalf("%s: %v, want the fence's refusal naming the partition key", q, err)
		}
	}
}

// Postgres analyzes a prepared statement again when a Describe of it finds
// its search path changed (or a relation or type it depends on): a domain
// CHECK that writes, added since the statement was prepared, then runs in
// the Describe, in a write's transaction (a reviewer's attack). The
// Describe is judged as the Parse would be.
func TestDescribeAnalyzesAgain(t *testing.T) {
	smuggleSetup(t)
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, `DROP TYPE IF EXISTS app.ds_c; DROP DOMAIN IF EXISTS app.ds_d;
CREATE DOMAIN app.ds_d AS int; CREATE TYPE app.ds_c AS (v app.ds_d)`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_describe", 0, "public.*", "app.*")})
	c := connect(t, proxyDSN(p, "agent"))
	fe := c.PgConn().Frontend()
	if refused := sendUntilReady(t, fe, []pgproto3.FrontendMessage{&pgproto3.Parse{Name: "ds", Query: "SELECT '(5)'::app.ds_c"}, &pgproto3.Sync{}}); len(refused) > 0 {
		t.Fatalf("prepare while the domain is harmless: %v", refused)
	}
	if _, err := admin.Exec(ctx, `ALTER DOMAIN app.ds_d ADD CHECK (VALUE > 0 AND other.f_writes() > 0)`); err != nil {
		t.Fatal(err)
	}
	p.catalog.invalidate() // as once catalogTTL passed: the proxy learns the type anew
	if err := simple(ctx, c, "SET search_path = app, public"); err != nil {
		t.Fatal(err)
	}
	truncateOther(t)
	refused := sendUntilReady(t, fe, []pgproto3.FrontendMessage{
		&pgproto3.Parse{Query: "INSERT INTO public.sp_t (id) VALUES (1)"}, &pgproto3.Bind{}, &pgproto3.Execute{},
		&pgproto3.Describe{ObjectType: 'S', Name: "ds"}, &pgproto3.Sync{}})
	noRowsOutside(t, "a Describe that analyzes again, in a write's unit", nil)
	if len(refused) == 0 || !strings.Contains(refused[0], "lease_describe") || !strings.Contains(refused[0], "app.ds_c") {
		t.Fatalf("refusals %v: want the fence's, naming app.ds_c", refused)
	}
}
