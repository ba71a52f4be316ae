package pgproxy

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/testutil"
)

// indirectSchema is the tables of the indirect-write attacks: lease A
// claims ia.*, lease B ib.* (fenced at storage), and inone.* nobody claims
// (not fenced). Every route below lets a statement that names only A's
// tables write B's or nobody's.
const indirectSchema = `
DROP SCHEMA IF EXISTS ia CASCADE;
DROP SCHEMA IF EXISTS ib CASCADE;
DROP SCHEMA IF EXISTS inone CASCADE;
DROP SCHEMA IF EXISTS ia2 CASCADE;
CREATE EXTENSION IF NOT EXISTS dblink;
CREATE SCHEMA ia; CREATE SCHEMA ib; CREATE SCHEMA inone;
GRANT USAGE, CREATE ON SCHEMA ia, ib, inone TO PUBLIC;
CREATE TABLE inone.t (v int);
CREATE TABLE ib.vbase (id int);
-- partition and inheritance children of A's tables that B claims
CREATE TABLE ia.part (id int, v text) PARTITION BY RANGE (id);
CREATE TABLE ia.part_lo PARTITION OF ia.part FOR VALUES FROM (0) TO (100);
CREATE TABLE ib.part_hi PARTITION OF ia.part FOR VALUES FROM (100) TO (200);
CREATE TABLE ia.inh (id int, v text);
CREATE TABLE ib.inh_child () INHERITS (ia.inh);
-- B's tables whose foreign keys act on A's
CREATE TABLE ia.parent (id int PRIMARY KEY);
CREATE TABLE ib.child (id int, pid int REFERENCES ia.parent ON DELETE CASCADE ON UPDATE CASCADE);
CREATE TABLE ia.parent2 (id int PRIMARY KEY);
CREATE TABLE ib.child_null (pid int REFERENCES ia.parent2 ON DELETE SET NULL);
CREATE TABLE ia.parent3 (id int PRIMARY KEY);
CREATE TABLE inone.child3 (pid int REFERENCES ia.parent3 ON DELETE CASCADE);
-- a rule, a trigger and a view on A's tables that write nobody's
CREATE TABLE ia.ruled (id int);
CREATE RULE also_none AS ON INSERT TO ia.ruled DO ALSO INSERT INTO inone.t VALUES (NEW.id);
CREATE FUNCTION inone.trig_fn() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN INSERT INTO inone.t VALUES (NEW.id); RETURN NULL; END $$;
CREATE TABLE ia.trig (id int);
CREATE TRIGGER also_none AFTER INSERT ON ia.trig FOR EACH ROW EXECUTE FUNCTION inone.trig_fn();
CREATE VIEW ia.v AS SELECT v FROM inone.t;
CREATE VIEW ia.iv AS SELECT 1 AS id;
CREATE TRIGGER instead_none INSTEAD OF INSERT ON ia.iv FOR EACH ROW EXECUTE FUNCTION inone.trig_fn();
-- a foreign table of A's that is nobody's table, through postgres_fdw
CREATE EXTENSION IF NOT EXISTS postgres_fdw;
DROP SERVER IF EXISTS loopback CASCADE;
CREATE SERVER loopback FOREIGN DATA WRAPPER postgres_fdw OPTIONS (%s);
CREATE USER MAPPING FOR PUBLIC SERVER loopback OPTIONS (user 'scram_user', password 'scram-secret');
CREATE FOREIGN TABLE ia.ft (v int) SERVER loopback OPTIONS (schema_name 'inone', table_name 't');
-- a user function that writes nobody's table
CREATE FUNCTION inone.f_write(int) RETURNS int LANGUAGE sql AS $$ INSERT INTO inone.t VALUES ($1) RETURNING $1 $$;
CREATE VIEW inone.vf AS SELECT inone.f_write(3) AS x;
CREATE TABLE ia.deflt (id int, w int DEFAULT inone.f_write(5));
CREATE VIEW inone.vvf AS SELECT x FROM inone.vf;
-- user code that runs without being called by name: a domain's check, a
-- user cast, an index expression or predicate
CREATE FUNCTION inone.f_chk(int) RETURNS bool LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN PERFORM inone.f_write($1); RETURN true; END $$;
CREATE DOMAIN inone.dom AS int CHECK (inone.f_chk(VALUE));
CREATE TABLE ia.dcol (v inone.dom);
CREATE TYPE inone.e AS ENUM ('a', 'b');
CREATE FUNCTION inone.e2i(inone.e) RETURNS int LANGUAGE plpgsql AS $$ BEGIN PERFORM inone.f_write(1); RETURN 1; END $$;
CREATE CAST (inone.e AS int) WITH FUNCTION inone.e2i(inone.e) AS ASSIGNMENT;
CREATE TABLE ia.ecol (v inone.e);
INSERT INTO ia.ecol VALUES ('a');
CREATE TABLE ia.icol (v int);
CREATE FUNCTION inone.f_imm(int) RETURNS int LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN PERFORM inone.f_write($1); RETURN $1; END $$;
CREATE TABLE ia.idx (id int);
CREATE INDEX ON ia.idx (inone.f_imm(id));
CREATE TABLE ia.pidx (id int);
CREATE INDEX ON ia.pidx (id) WHERE inone.f_chk(id);
CREATE FUNCTION inone.op_fn(int, int) RETURNS bool LANGUAGE plpgsql IMMUTABLE AS $$ BEGIN PERFORM inone.f_write($1); RETURN true; END $$;
CREATE OPERATOR inone.=!= (LEFTARG = int, RIGHTARG = int, FUNCTION = inone.op_fn);
CREATE TABLE ia.opchk (id int CHECK (id OPERATOR(inone.=!=) 0));
-- sequences of B's tables: owned (serial), and taken as a default
CREATE TABLE ib.ser (id serial);
CREATE SEQUENCE inone.shared;
CREATE TABLE ib.usesq (id bigint DEFAULT nextval('inone.shared'));
CREATE SEQUENCE ia.free;
CREATE SEQUENCE ia.ser_id_seq;
CREATE TABLE ia.takesb (id int DEFAULT nextval('ib.ser_id_seq'));
GRANT ALL ON ALL SEQUENCES IN SCHEMA ia, ib, inone TO PUBLIC;
-- legitimate: a claim that covers parent, children and cascades
CREATE TABLE ia.lp (id int, v text) PARTITION BY LIST (id);
CREATE TABLE ia.lp1 PARTITION OF ia.lp FOR VALUES IN (1);
CREATE TABLE ia.lparent (id int PRIMARY KEY);
CREATE TABLE ia.lchild (pid int REFERENCES ia.lparent ON DELETE CASCADE);
GRANT ALL ON ALL TABLES IN SCHEMA ia, ib, inone TO PUBLIC;
-- DDL on A's objects that changes B's tables (agents share a role: the
-- agent owns both): a table attached as a partition of A's, inherited
-- by A's, referenced by A's foreign key, typed by A's type, defaulting
-- from A's sequence
CREATE TABLE ib.free (id int, v text);
CREATE TABLE ib.base (id int, v text);
CREATE TABLE ia.orphan (id int, v text);
INSERT INTO ia.orphan VALUES (9, 'a');
CREATE TABLE ib.ref (id int PRIMARY KEY);
CREATE TABLE ia.fkc (id int);
CREATE TYPE ia.comp AS (a int);
CREATE TABLE ib.typed OF ia.comp;
CREATE SEQUENCE ia.bseq;
CREATE TABLE ib.usesa (id bigint DEFAULT nextval('ia.bseq'));
ALTER TABLE ib.free OWNER TO agent; ALTER TABLE ib.base OWNER TO agent; ALTER TABLE ia.orphan OWNER TO agent;
ALTER TABLE ib.ref OWNER TO agent; ALTER TABLE ia.fkc OWNER TO agent; ALTER TYPE ia.comp OWNER TO agent;
ALTER TABLE ib.typed OWNER TO agent; ALTER SEQUENCE ia.bseq OWNER TO agent; ALTER TABLE ia.lp OWNER TO agent;
CREATE TABLE ia.pk2 (id int PRIMARY KEY);
CREATE TABLE ib.fk2 (pid int REFERENCES ia.pk2);
ALTER TABLE ia.pk2 OWNER TO agent; ALTER TABLE ib.fk2 OWNER TO agent;
ALTER TABLE ib.usesa OWNER TO agent; ALTER TABLE ia.part OWNER TO agent; ALTER TABLE ib.part_hi OWNER TO agent;
-- user code that maintenance runs: an expression index rebuilt, extended
-- statistics on an expression, a materialized view refreshed, a
-- generated column; and a foreign table over a view that writes
CREATE TABLE ia.rix (id int);
INSERT INTO ia.rix VALUES (1);
CREATE INDEX rix_expr ON ia.rix (inone.f_imm(id));
CREATE TABLE ia.st (id int);
INSERT INTO ia.st VALUES (1), (2);
CREATE STATISTICS ia.st_expr ON (inone.f_imm(id)) FROM ia.st;
CREATE MATERIALIZED VIEW ia.mv AS SELECT inone.f_write(4) AS x WITH NO DATA;
CREATE TABLE ia.gen (id int, g int GENERATED ALWAYS AS (inone.f_imm(id)) STORED);
CREATE FOREIGN TABLE ia.ftv (x int) SERVER loopback OPTIONS (schema_name 'inone', table_name 'vf');
-- user functions that write through another connection, called from a
-- read-only transaction: dblink, and a foreign table's server
CREATE FUNCTION inone.f_dbl(text) RETURNS text LANGUAGE sql AS $$ SELECT dblink_exec($1, 'INSERT INTO inone.t VALUES (8)') $$;
CREATE TABLE inone.ftv (x int); -- named as A's foreign table, not one
CREATE FUNCTION inone.f_ft() RETURNS bigint LANGUAGE sql AS $$ SELECT count(*) FROM ia.ftv $$;
ALTER SCHEMA ia OWNER TO agent; ALTER TABLE ia.rix OWNER TO agent; ALTER TABLE ia.st OWNER TO agent; ALTER MATERIALIZED VIEW ia.mv OWNER TO agent;
GRANT ALL ON ALL TABLES IN SCHEMA ia, ib, inone TO PUBLIC;
GRANT ALL ON ALL SEQUENCES IN SCHEMA ia, ib, inone TO PUBLIC;
`

// indirectRows puts the rows every case starts from, as the admin with the
// fence triggers off.
const indirectRows = `
TRUNCATE ia.part, ia.inh, ib.child, ib.child_null, ia.ruled, ia.trig, inone.t, ia.lp, ia.lchild;
TRUNCATE ia.parent, ia.parent2, ia.parent3, ia.lparent CASCADE;
INSERT INTO ia.part VALUES (1, 'a'), (150, 'b');
INSERT INTO ia.inh VALUES (1, 'a');
INSERT INTO ib.inh_child VALUES (2, 'b');
INSERT INTO ia.parent VALUES (1);
INSERT INTO ib.child VALUES (1, 1);
INSERT INTO ia.parent2 VALUES (1);
INSERT INTO ib.child_null VALUES (1);
INSERT INTO ia.parent3 VALUES (1);
INSERT INTO inone.child3 VALUES (1);
INSERT INTO ia.lp VALUES (1, 'a');
INSERT INTO ia.lparent VALUES (1);
INSERT INTO ia.lchild VALUES (1);
SELECT setval('ib.ser_id_seq', 1, false), setval('inone.shared', 1, false), setval('ia.bseq', 1, false);
DO $$ BEGIN
  IF to_regclass('ib.orphan') IS NOT NULL THEN ALTER TABLE ib.orphan SET SCHEMA ia; END IF;
  IF EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = 'ia.comp'::regclass AND attname = 'z') THEN ALTER TYPE ia.comp RENAME ATTRIBUTE z TO a CASCADE; END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'ia.pk2'::regclass AND contype = 'p') THEN ALTER TABLE ia.pk2 ADD PRIMARY KEY (id); END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_constraint WHERE conrelid = 'ib.fk2'::regclass AND contype = 'f') THEN ALTER TABLE ib.fk2 ADD FOREIGN KEY (pid) REFERENCES ia.pk2; END IF;
  IF EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = 'ib.free'::regclass) THEN ALTER TABLE ia.lp DETACH PARTITION ib.free; END IF;
  IF EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = 'ia.orphan'::regclass) THEN ALTER TABLE ia.orphan NO INHERIT ib.base; END IF;
  IF NOT EXISTS (SELECT 1 FROM pg_inherits WHERE inhrelid = 'ib.part_hi'::regclass) THEN ALTER TABLE ia.part ATTACH PARTITION ib.part_hi FOR VALUES FROM (100) TO (200); END IF;
END $$;
ALTER TABLE ia.fkc DROP CONSTRAINT IF EXISTS fkc_id_fkey;
ALTER TYPE ia.comp DROP ATTRIBUTE IF EXISTS b CASCADE;
`

// bState is what B's and nobody's tables hold: unchanged after a refusal.
const bState = `SELECT concat_ws('|', (SELECT count(*) FROM ib.base), (SELECT count(*) FROM pg_inherits WHERE inhrelid IN ('ib.free'::regclass, 'ib.part_hi'::regclass)),
 (SELECT count(*) FROM pg_trigger WHERE tgrelid = 'ib.ref'::regclass), (SELECT string_agg(attname, ',' ORDER BY attnum) FROM pg_attribute WHERE attrelid = 'ib.typed'::regclass AND attnum > 0 AND NOT attisdropped),
 (SELECT count(*) FROM pg_constraint WHERE conrelid = 'ib.fk2'::regclass), (SELECT count(*) FROM pg_class WHERE relnamespace = 'ib'::regnamespace AND relname = 'orphan'),
 (SELECT last_value || is_called::text FROM ia.bseq), (SELECT last_value || is_called::text FROM ib.ser_id_seq), (SELECT last_value || is_called::text FROM inone.shared), (SELECT string_agg(id || v, ',' ORDER BY id) FROM ib.part_hi),
 (SELECT string_agg(id || v, ',' ORDER BY id) FROM ib.inh_child),
 (SELECT string_agg(id || ':' || pid, ',') FROM ib.child),
 (SELECT string_agg(coalesce(pid::text, 'null'), ',') FROM ib.child_null),
 (SELECT count(*) FROM inone.t), (SELECT count(*) FROM inone.child3))`

const bStateWant = "0|1|1|a|1|0|1false|1false|1false|150b|2b|1:1|1|0|1"

func setupIndirect(t *testing.T) {
	t.Helper()
	ctx := ctxT(t)
	admin := plpgsql.admin(t)
	var n int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM pg_available_extensions WHERE name IN ('dblink', 'postgres_fdw')").Scan(&n); err != nil || n != 2 {
		t.Fatalf("the test server lacks the contrib extensions dblink and postgres_fdw (%d of 2, %v): install postgresql-contrib", n, err)
	}
	host, port, _ := strings.Cut(pg.Addr(), ":")
	if _, err := admin.Exec(ctx, fmt.Sprintf(indirectSchema, fmt.Sprintf("host '%s', port '%s', dbname '%s'", host, port, testDB))); err != nil {
		t.Fatalf("indirect schema: %v", err)
	}
	if _, err := Install(ctx, admin, []string{"ib.*"}, InstallOptions{Trigger: TriggerPLpgSQL}); err != nil {
		t.Fatalf("fence ib.*: %v", err)
	}
	// Other tests judge reads in a database with no route to a connection
	// of its own.
	t.Cleanup(func() { dropIndirect(t) })
}

// dropIndirect removes what setupIndirect made, the extensions too.
func dropIndirect(t *testing.T) {
	t.Helper()
	if _, err := plpgsql.admin(t).Exec(ctxT(t), `DROP SCHEMA IF EXISTS ia, ia2, ib, inone CASCADE;
DROP SERVER IF EXISTS loopback CASCADE; DROP EXTENSION IF EXISTS postgres_fdw CASCADE; DROP EXTENSION IF EXISTS dblink CASCADE`); err != nil {
		t.Errorf("drop the indirect schema: %v", err)
	}
}

// TestUserFunctionReadOnly: in a database where code has no way to open a
// connection of its own (no dblink, no foreign server with tables), a user
// function called from a read outside a transaction block runs as direct,
// judged by what it wrote (see TestFunctionFromReadAsDirect): its write
// outside the claim is refused naming the table and rolled back. In a
// read-only block it runs in Postgres's read-only transaction, which
// refuses its write (25006), as direct.
func TestUserFunctionReadOnly(t *testing.T) {
	dropIndirect(t)
	t.Cleanup(func() { dropIndirect(t) })
	ctx := ctxT(t)
	admin := plpgsql.admin(t)
	if _, err := admin.Exec(ctx, `CREATE SCHEMA inone; GRANT USAGE, CREATE ON SCHEMA inone TO PUBLIC; CREATE TABLE inone.t (v int);
GRANT ALL ON inone.t TO PUBLIC;
CREATE FUNCTION inone.f_write(int) RETURNS int LANGUAGE sql AS $$ INSERT INTO inone.t VALUES ($1) RETURNING $1 $$`); err != nil {
		t.Fatal(err)
	}
	lease := newStaticLease(t, "lease_A_ro", 0, "ia.*")
	p := startProxy(t, Config{Lease: lease})
	c := plpgsql.via(t, p, "agent")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec} {
		_, err := c.Exec(ctx, "SELECT inone.f_write(9)", mode)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "inone.t") {
			t.Errorf("%v: user function from a read outside a block: %v, want the fence's refusal naming inone.t", mode, err)
		}
		tx, err := c.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := tx.Exec(ctx, "SELECT inone.f_write(9)", mode); pgCode(err) != "25006" {
			t.Errorf("%v: user function from a read in a read-only block: %v, want Postgres's 25006", mode, err)
		}
		tx.Rollback(ctx)
	}
	var n int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM inone.t").Scan(&n); err != nil || n != 0 {
		t.Errorf("inone.t has %d rows (%v), want 0", n, err)
	}
}

// dblinkConn is a connection string for dblink: another connection to the
// test database, straight to Postgres (a password: dblink wants one from
// roles that are not superusers).
func dblinkConn() string {
	host, port, _ := strings.Cut(pg.Addr(), ":")
	return fmt.Sprintf("host=%s port=%s dbname=%s user=scram_user password=scram-secret", host, port, testDB)
}

// TestIndirectWritesInsideTheClaim: what the indirect routes reach is
// judged, not refused: a claim that covers a partitioned table and its
// partitions writes through the parent; a cascade into a claimed table
// passes; reads of builtin functions in a writable block pass, so does
// nextval of a sequence no table owns or takes defaults from; and a user
// function called from a read outside any writable transaction is
// Postgres's to refuse, as it is without the proxy.
func TestIndirectWritesInsideTheClaim(t *testing.T) {
	setupIndirect(t)
	lease := newStaticLease(t, "lease_A_ok", 0, "ia.*")
	p := startProxy(t, Config{Lease: lease})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			ctx := ctxT(t)
			plpgsql.reset(t, indirectRows)
			c := plpgsql.via(t, p, "agent")
			for _, q := range []string{
				"UPDATE ia.lp SET v = 'A'",
				"DELETE FROM ia.lparent WHERE id = 1",
				"UPDATE ONLY ia.inh SET v = 'A'", // (not its child, ib.inh_child)
			} {
				if _, err := c.Exec(ctx, q, mode); err != nil {
					t.Errorf("%s: %v", q, err)
				}
			}
			var v string
			var n int
			if err := c.QueryRow(ctx, "SELECT v, (SELECT count(*) FROM ia.lchild) FROM ia.lp", mode).Scan(&v, &n); err != nil {
				t.Fatal(err)
			}
			if v != "A" || n != 0 {
				t.Errorf("through the parent: v %q, cascaded rows left %d; want A, 0", v, n)
			}
			tx, err := c.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			var s string
			if err := tx.QueryRow(ctx, "SELECT lower('X') || count(*)::text || pg_catalog.now()::date::text FROM ia.lp", mode).Scan(&s); err != nil {
				t.Errorf("builtin functions in a writable block: %v", err)
			}
			var sq int64
			if err := tx.QueryRow(ctx, "SELECT nextval('ia.free')", mode).Scan(&sq); err != nil {
				t.Errorf("nextval of a sequence no table uses, in a writable block: %v", err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Error(err)
			}
			// Outside a writable transaction a user function runs read-only,
			// but this database has dblink and a foreign server: the
			// function may write through another connection, so the proxy
			// judges it as in a writable one (TestUserFunctionReadOnly: a
			// database without is Postgres's to refuse).
			_, err = c.Exec(ctx, "SELECT inone.f_write(9)", mode)
			if pgCode(err) != "42501" || !strings.Contains(err.Error(), "connection of its own") {
				t.Errorf("user function from a read outside a block, dblink installed: %v, want the proxy's refusal", err)
			}
			// A table named as a foreign table of another schema is read as
			// any table, by its qualified name.
			if err := c.QueryRow(ctx, "SELECT count(*) FROM inone.ftv", mode).Scan(&n); err != nil {
				t.Errorf("a plain table named as a foreign one: %v", err)
			}
		})
	}
}

// TestConcurrentLookupsShared: sessions that need what the same relation
// reaches at the same moment (its cached answer lapsed, and each writes
// it) share one catalog lookup: the second waits for the first's and
// takes its answer, rather than running the same recursive catalog query
// inside its own client's transaction.
func TestConcurrentLookupsShared(t *testing.T) {
	setupIndirect(t)
	lease := newStaticLease(t, "lease_A_flight", 0, "ia.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	plpgsql.reset(t, indirectRows)
	var looked atomic.Int32
	entered, release := make(chan struct{}, 4), make(chan struct{})
	p.catalog.lookupHook = func(rels []string) {
		if slices.Contains(rels, `"ia"."lp"`) {
			looked.Add(1)
			entered <- struct{}{}
			<-release
		}
	}
	a, b := plpgsql.via(t, p, "agent"), plpgsql.via(t, p, "agent")
	errs := make(chan error, 2)
	go func() {
		_, err := a.Exec(ctx, "UPDATE ia.lp SET v = 'A'", pgx.QueryExecModeSimpleProtocol)
		errs <- err
	}()
	select {
	case <-entered:
	case <-ctx.Done():
		t.Fatal("the first session never looked ia.lp up")
	}
	go func() {
		_, err := b.Exec(ctx, "UPDATE ia.lp SET v = 'B'", pgx.QueryExecModeSimpleProtocol)
		errs <- err
	}()
	// The second waits for the first's lookup (or, wrongly, runs its own,
	// which the hook holds too): wait until one or the other shows.
	testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if looked.Load() > 1 || p.catalog.waits.Load() > 0 {
			return nil
		}
		return errors.New("the second session has not reached the lookup")
	})
	close(release)
	for range 2 {
		if err := <-errs; err != nil {
			t.Errorf("a write of ia.lp: %v", err)
		}
	}
	if n := looked.Load(); n != 1 {
		t.Errorf("ia.lp was looked up %d times by two sessions at once; want 1, shared", n)
	}
	if n := p.catalog.shared.Load(); n < 1 { // the relation's, and its calls' if any
		t.Errorf("%d lookups were taken from another session's; want the relation's at least", n)
	}
}

// TestDDLThenWriteInOneQuery: the proxy learns what a write reaches before
// the unit runs, so DDL earlier in the same Query (here a trigger that
// writes nobody's table, on a table the lease claims and the agent owns)
// would go unseen: the write after it is refused. Sent on its own later,
// the write is judged with the trigger (the cache was forgotten when the
// DDL passed).
func TestDDLThenWriteInOneQuery(t *testing.T) {
	setupIndirect(t)
	lease := newStaticLease(t, "lease_A_ddl", 0, "ia.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	plpgsql.reset(t, indirectRows)
	c := plpgsql.via(t, p, "agent")
	if _, err := c.Exec(ctx, "CREATE TABLE ia.own (id int); INSERT INTO ia.own VALUES (1)"); err != nil {
		t.Fatalf("a new table and a write to it: %v", err)
	}
	_, err := c.Exec(ctx, "CREATE TRIGGER also_none AFTER INSERT ON ia.own FOR EACH ROW EXECUTE FUNCTION inone.trig_fn(); INSERT INTO ia.own VALUES (7)")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "DDL earlier in this query") {
		t.Errorf("DDL, then a write in one query: %v; want the proxy's refusal", err)
	}
	if _, err := c.Exec(ctx, "CREATE TRIGGER also_none AFTER INSERT ON ia.own FOR EACH ROW EXECUTE FUNCTION inone.trig_fn()"); err != nil {
		t.Fatal(err)
	}
	_, err = c.Exec(ctx, "INSERT INTO ia.own VALUES (7)")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "also_none") {
		t.Errorf("a write to a table given a trigger just before: %v; want the proxy's refusal naming the trigger", err)
	}
	var n int
	if err := plpgsql.admin(t).QueryRow(ctx, "SELECT count(*) FROM inone.t").Scan(&n); err != nil || n != 0 {
		t.Errorf("nobody's table has %d rows (%v), want 0", n, err)
	}
}

// TestSequenceBySearchPath: an unqualified sequence name is resolved on
// the search path of the moment, not taken from the cache: ia.ser_id_seq
// (nobody's) passes, then the same text under search_path ib names B's
// ib.ser_id_seq and is refused.
func TestSequenceBySearchPath(t *testing.T) {
	setupIndirect(t)
	lease := newStaticLease(t, "lease_A_seq", 0, "ia.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	plpgsql.reset(t, indirectRows)
	c := plpgsql.via(t, p, "agent")
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, "SET search_path = ia"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SELECT nextval('ser_id_seq')"); err != nil {
		t.Fatalf("nobody's sequence: %v", err)
	}
	if _, err := tx.Exec(ctx, "SET search_path = ib"); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, "SELECT nextval('ser_id_seq')")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "ib.ser") {
		t.Errorf("B's sequence by the same text: %v; want the proxy's refusal naming ib.ser", err)
	}
}
