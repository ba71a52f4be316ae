//go:build integration

package pgproxy

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgproto3"
)

// TestAnalysisThroughAConnectionOfItsOwn: where code may open a connection
// of its own (dblink here), what a Parse's analysis or a Bind's planning
// runs writes past everything that stops it elsewhere: a read-only
// transaction (the unit only reads), a refused Execute after it (its
// refusal rolls back the transaction, not dblink's), a checked write's
// check (it counts this connection's writes). An IMMUTABLE function that
// writes nobody's table through dblink, folded when a Bind is planned,
// and a composite literal whose field's domain CHECK calls it, analyzed
// at Parse: each is refused in its message's place, before Postgres plans
// or analyzes it, and nobody's table keeps its rows.
func TestAnalysisThroughAConnectionOfItsOwn(t *testing.T) {
	setupIndirect(t)
	ctx := ctxT(t)
	admin := plpgsql.admin(t)
	if _, err := admin.Exec(ctx, `CREATE FUNCTION inone.f_dbl_imm(text) RETURNS text LANGUAGE plpgsql IMMUTABLE AS
  $$ BEGIN PERFORM dblink_exec($1, 'INSERT INTO inone.t VALUES (8)'); RETURN 'x'; END $$;
CREATE DOMAIN inone.dd AS int CHECK (inone.f_dbl_imm(`+sqlText(dblinkConn())+`) = 'x');
CREATE TYPE inone.cd AS (v inone.dd)`); err != nil {
		t.Fatal(err)
	}
	rows := func() int {
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM inone.t").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_A_dbl", 0, "ia.*")})
	c := plpgsql.via(t, p, "agent")
	folded := "SELECT inone.f_dbl_imm(" + sqlText(dblinkConn()) + ")"
	for _, tc := range []struct {
		name string
		msgs []pgproto3.FrontendMessage
		want string // in the refusal
		ro   bool   // a read-only unit: the refusal says why that does not stop it
	}{
		{"a Bind planned, never executed, in a read-only unit",
			[]pgproto3.FrontendMessage{&pgproto3.Parse{Name: "dbl", Query: folded}, &pgproto3.Bind{PreparedStatement: "dbl"}, &pgproto3.Sync{}},
			"SelectStmt) writes: it calls inone.f_dbl_imm", true},
		{"a Bind planned before its Execute is refused",
			[]pgproto3.FrontendMessage{&pgproto3.Parse{Query: folded}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}},
			"SelectStmt) writes: it calls inone.f_dbl_imm", true},
		{"a Bind planned before its Execute, in a write's unit",
			[]pgproto3.FrontendMessage{&pgproto3.Parse{Query: folded}, &pgproto3.Bind{}, &pgproto3.Execute{},
				&pgproto3.Parse{Query: "INSERT INTO ia.ruled VALUES (1)"}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}},
			"SelectStmt) writes: it calls inone.f_dbl_imm", false},
		{"a Parse analyzing a literal whose domain check writes",
			[]pgproto3.FrontendMessage{&pgproto3.Parse{Name: "dbl_cd", Query: "SELECT '(5)'::inone.cd"}, &pgproto3.Sync{}},
			"Parse(SelectStmt) writes: it names type inone.cd", true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := rows()
			refused := sendUntilReady(t, c.PgConn().Frontend(), tc.msgs)
			if n := rows(); n != before {
				t.Errorf("nobody's table went from %d rows to %d (refusals %v)", before, n, refused)
			}
			if len(refused) == 0 || !strings.HasPrefix(refused[0], "42501 fenceline: write refused for lease lease_A_dbl") || !strings.Contains(refused[0], tc.want) ||
				tc.ro && !strings.Contains(refused[0], "through a connection of its own (the database has extension dblink") {
				t.Errorf("refusals %v: want the fence's first, naming %q (and, read-only, the connection of its own: %v)", refused, tc.want, tc.ro)
			}
		})
	}
	// With --pg-allow-opaque such a write passes under the live lease when
	// its statement runs (the unit is made writable for the Execute's
	// opaque write, and the Bind's planning is authorized in it); a Bind
	// planned with no Execute, in a unit begun read-only, is refused,
	// naming the lease.
	opaque := startProxy(t, Config{Lease: newStaticLease(t, "lease_A_dbl_opaque", 0, "ia.*"), AllowOpaque: true})
	oc := plpgsql.via(t, opaque, "agent")
	before := rows()
	if refused := sendUntilReady(t, oc.PgConn().Frontend(), []pgproto3.FrontendMessage{
		&pgproto3.Parse{Query: folded}, &pgproto3.Bind{}, &pgproto3.Execute{}, &pgproto3.Sync{}}); len(refused) != 0 || rows() <= before {
		t.Errorf("with opaque writes allowed, a statement whose planning writes through dblink: refusals %v, rows %d -> %d (want it to pass and write)", refused, before, rows())
	}
	before = rows()
	if refused := sendUntilReady(t, oc.PgConn().Frontend(), []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: "dbl", Query: folded}, &pgproto3.Bind{PreparedStatement: "dbl"}, &pgproto3.Sync{}}); len(refused) == 0 ||
		!strings.HasPrefix(refused[0], "42501 fenceline: write refused for lease lease_A_dbl_opaque") || rows() != before {
		t.Errorf("with opaque writes allowed, a Bind planned with no Execute in a read-only unit: refusals %v, rows %d -> %d (want the fence's refusal, naming the lease)", refused, before, rows())
	}
	// What only reads is not refused for it: a prepared read of A's table,
	// planned and run.
	refused := sendUntilReady(t, c.PgConn().Frontend(), []pgproto3.FrontendMessage{
		&pgproto3.Parse{Name: "rd", Query: "SELECT count(*) FROM ia.part WHERE id > $1"}, &pgproto3.Bind{PreparedStatement: "rd", Parameters: [][]byte{[]byte("0")}},
		&pgproto3.Execute{}, &pgproto3.Sync{}})
	if len(refused) != 0 {
		t.Errorf("a prepared read of A's table: %v", refused)
	}
}
