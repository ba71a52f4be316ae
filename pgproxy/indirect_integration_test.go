//go:build integration

package pgproxy

import (
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// TestWritesByIndirection: agent A, whose lease claims ia.*, sends
// statements that name only A's tables (or only read) but write B's tables
// (ib.*, fenced) or nobody's (inone.*): through partition and inheritance
// children, cascading foreign keys, TRUNCATE ... CASCADE, a rule, a user
// trigger, an updatable view, a user function called from a read in a
// writable block, and dblink (another connection, past the proxy) called
// from a read, a cast to a user type, a column whose type runs user code,
// an index expression or predicate, a check with a user operator,
// nextval/setval of B's sequences — and (refused already before these
// were judged): CREATE EVENT TRIGGER, EXPLAIN ANALYZE of a write,
// EXECUTE, a cursor or CREATE TABLE AS over a user function, COPY FROM
// PROGRAM. Each is refused by the proxy, naming lease, fence and the
// table reached or the route, and B's rows stay as they were. Each runs in
// the simple and the extended protocol.
func TestWritesByIndirection(t *testing.T) {
	setupIndirect(t)
	lease := newStaticLease(t, "lease_A", 0, "ia.*", "ia2.*")
	p := startProxy(t, Config{Lease: lease})
	for _, tc := range []struct {
		name  string
		block bool   // inside BEGIN ... COMMIT (writable under the lease)
		sql   string // names only A's tables
		want  string // in the refusal: the table reached, or the route
	}{
		{"partition child", false, "UPDATE ia.part SET v = 'A'", "ib.part_hi"},
		{"partition child delete", false, "DELETE FROM ia.part", "ib.part_hi"},
		{"inheritance child", false, "UPDATE ia.inh SET v = 'A'", "ib.inh_child"},
		{"cascade delete", false, "DELETE FROM ia.parent WHERE id = 1", "ib.child"},
		{"cascade update", false, "UPDATE ia.parent SET id = 2 WHERE id = 1", "ib.child"},
		{"set null", false, "DELETE FROM ia.parent2", "ib.child_null"},
		{"cascade into nobody's table", false, "DELETE FROM ia.parent3", "inone.child3"},
		{"foreign table", false, "INSERT INTO ia.ft VALUES (7)", "foreign table"},
		{"truncate cascade", false, "TRUNCATE ia.parent CASCADE", "ib.child"},
		{"merge into parent", false, "MERGE INTO ia.part p USING (SELECT 150 AS id) s ON p.id = s.id WHEN MATCHED THEN UPDATE SET v = 'A'", "ib.part_hi"},
		{"writable cte", false, "WITH d AS (DELETE FROM ia.parent RETURNING id) SELECT count(*) FROM d", "ib.child"},
		{"rule", false, "INSERT INTO ia.ruled VALUES (7)", "rule"},
		{"user trigger", false, "INSERT INTO ia.trig VALUES (7)", "trigger"},
		{"default calling a function", false, "INSERT INTO ia.deflt (id) VALUES (1)", "defaults"},
		{"instead of trigger on a view", false, "INSERT INTO ia.iv VALUES (7)", "instead_none"},
		{"updatable view", false, "INSERT INTO ia.v VALUES (7)", "inone.t"},
		{"function from a read", true, "SELECT inone.f_write(7)", "inone.f_write"},
		{"view calling a function, from a read", true, "SELECT * FROM inone.vvf", "inone.vvf"},
		{"dblink from a read", false, "SELECT dblink_exec('" + dblinkConn() + "', 'INSERT INTO inone.t VALUES (7)')", "dblink_exec"},
		{"cast to a domain with a user check", true, "SELECT 1::inone.dom", "inone.dom"},
		{"CAST to a domain with a user check", true, "SELECT CAST(2 AS inone.dom)", "inone.dom"},
		{"typed literal of a domain with a user check", true, "SELECT inone.dom '3'", "inone.dom"},
		{"user cast of a named type", true, "SELECT 'a'::inone.e::int", "inone.e"},
		{"user cast of a column read", true, "SELECT v::int FROM ia.ecol", "ia.ecol"},
		{"user cast on assignment", false, "INSERT INTO ia.icol SELECT v FROM ia.ecol", "ia.ecol"},
		{"domain check on write", false, "INSERT INTO ia.dcol VALUES (1)", "ia.dcol"},
		{"index expression", false, "INSERT INTO ia.idx VALUES (1)", "index"},
		{"partial index predicate", false, "INSERT INTO ia.pidx VALUES (1)", "index"},
		{"check calling a user operator", false, "INSERT INTO ia.opchk VALUES (1)", "checks"},
		{"nextval of a sequence B's table owns", true, "SELECT nextval('ib.ser_id_seq')", "ib.ser"},
		{"setval of a sequence B's table owns", true, "SELECT setval('ib.ser_id_seq'::regclass, 100)", "ib.ser"},
		{"nextval of a sequence B's default takes", true, "SELECT nextval('inone.shared')", "ib.usesq"},
		{"default advancing B's sequence", false, "INSERT INTO ia.takesb VALUES (DEFAULT)", "ib.ser"},
		{"nextval of a sequence named by an expression", true, "SELECT nextval('ib.ser_' || 'id_seq')", "sequence"},
		{"create event trigger", false, "CREATE EVENT TRIGGER et ON ddl_command_end EXECUTE FUNCTION inone.trig_fn()", "CreateEventTrigStmt"},
		{"explain analyze of a write", false, "EXPLAIN ANALYZE UPDATE ia.part SET v = 'A'", "ib.part_hi"},
		{"execute of a prepared statement", false, "EXECUTE p", "ExecuteStmt"},
		{"cursor over a user function", true, "DECLARE c CURSOR FOR SELECT inone.f_write(7)", "inone.f_write"},
		{"temp table as a user function", false, "CREATE TEMP TABLE tt AS SELECT inone.f_write(7)", "inone.f_write"},
		{"copy from program", false, "COPY ia.ruled FROM PROGRAM 'true'", "CopyStmt"},
		{"attach B's table as a partition", false, "ALTER TABLE ia.lp ATTACH PARTITION ib.free FOR VALUES IN (5)", "ib.free"},
		{"detach B's partition, only", false, "ALTER TABLE ONLY ia.part DETACH PARTITION ib.part_hi", "ib.part_hi"},
		{"inherit from B's table", false, "ALTER TABLE ia.orphan INHERIT ib.base", "ib.base"},
		{"foreign key onto B's table", false, "ALTER TABLE ia.fkc ADD FOREIGN KEY (id) REFERENCES ib.ref ON DELETE CASCADE", "ib.ref"},
		{"alter a type B's table is typed by", false, "ALTER TYPE ia.comp ADD ATTRIBUTE b int CASCADE", "CASCADE"},
		{"rename an attribute of a type B's table is typed by", false, "ALTER TYPE ia.comp RENAME ATTRIBUTE a TO z CASCADE", "CASCADE"},
		{"drop a constraint B's foreign key needs", false, "ALTER TABLE ia.pk2 DROP CONSTRAINT pk2_pkey CASCADE", "CASCADE"},
		{"move a table into B's schema", false, "ALTER TABLE ia.orphan SET SCHEMA ib", "ib.orphan"},
		{"alter a sequence B's default takes", false, "ALTER SEQUENCE ia.bseq RESTART WITH 100", "ib.usesa"},
		{"setval of a sequence B's default takes", false, "SELECT setval('ia.bseq', 100)", "ib.usesa"},
		{"reindex a schema with an expression index", false, "REINDEX SCHEMA ia", "REINDEX SCHEMA"},
		{"create a schema with a foreign key onto B's table", false, "CREATE SCHEMA ia2 CREATE TABLE t (id int REFERENCES ib.ref ON DELETE CASCADE)", "ib.ref"},
		{"create an index on a user function (autovacuum runs it later)", false, "CREATE INDEX ON ia.icol (inone.f_imm(v))", "inone.f_imm"},
		{"create statistics on a user function (autovacuum runs it later)", false, "CREATE STATISTICS ia.s2 ON (inone.f_imm(v)) FROM ia.icol", "inone.f_imm"},
		{"reindex an expression index", false, "REINDEX INDEX ia.rix_expr", "rix_expr"},
		{"analyze statistics on an expression", true, "ANALYZE ia.st", "statistics"},
		{"refresh a materialized view", false, "REFRESH MATERIALIZED VIEW ia.mv", "ia.mv"},
		{"generated column", false, "INSERT INTO ia.gen (id) VALUES (1)", "ia.gen"},
		{"foreign table read", false, "SELECT * FROM ia.ftv", "foreign table"},
		{"a function calling dblink, from a read", false, "SELECT inone.f_dbl('" + dblinkConn() + "')", "extension dblink"},
		{"a function reading a foreign table, from a read", false, "SELECT inone.f_ft()", "inone.f_ft"},
		{"dblink from a read in a block", true, "SELECT dblink_exec('" + dblinkConn() + "', 'INSERT INTO inone.t VALUES (7)')", "dblink_exec"},
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec} {
			t.Run(tc.name+"/"+mode.String(), func(t *testing.T) {
				ctx := ctxT(t)
				plpgsql.reset(t, indirectRows)
				c := plpgsql.via(t, p, "agent")
				var err error
				if tc.block {
					tx, berr := c.Begin(ctx)
					if berr != nil {
						t.Fatal(berr)
					}
					_, err = tx.Exec(ctx, tc.sql, mode)
					if cerr := tx.Commit(ctx); cerr != nil && err == nil {
						err = cerr
					}
				} else {
					_, err = c.Exec(ctx, tc.sql, mode)
				}
				var got string
				if qerr := plpgsql.admin(t).QueryRow(ctx, bState).Scan(&got); qerr != nil {
					t.Fatal(qerr)
				}
				if got != bStateWant {
					t.Errorf("B's and nobody's tables changed: %q, want %q (the statement: %v)", got, bStateWant, err)
				}
				if err == nil {
					t.Fatalf("%s: accepted", tc.sql)
				}
				t.Logf("refused: %v", err)
				wantMsg := fmt.Sprintf("fenceline: write refused for lease lease_A (fence %d)", lease.lease.Fence)
				if pgCode(err) != "42501" || !strings.Contains(err.Error(), wantMsg) || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("%s: %v; want 42501 from the proxy (%q) naming %q", tc.sql, err, wantMsg, tc.want)
				}
			})
		}
	}
}
