package pgproxy

import (
	"github.com/jackc/pgx/v5"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"
)

// Prepared statements and portals are the server's: a name runs what the
// server holds under it, whatever the client sent since. These attacks
// each made the fence judge one statement while the server ran another (a
// write outside the lease landed), before the fence followed the names as
// the server does (names.go): PREPARE and Parse share one namespace; a
// Parse, PREPARE or Bind of a name that exists fails and leaves the old
// one; messages after an error are skipped up to Sync.

const (
	outsideWrite = "INSERT INTO other.t VALUES (41)"
	insideWrite  = "INSERT INTO app.log (msg) VALUES ('names')"
)

// wantNoOutsideWrite: err is the fence's refusal naming the outside table,
// and other.t is still empty.
func wantNoOutsideWrite(t *testing.T, what string, err error) {
	t.Helper()
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "other.t") {
		t.Errorf("%s: %v, want the fence's refusal of the write to other.t (the statement the server holds)", what, err)
	}
	if n := otherRows(t); n != 0 {
		t.Fatalf("%s: %d rows in other.t: the server ran a write the fence judged as another statement", what, n)
	}
}

func TestNamesFollowTheServer(t *testing.T) {
	smuggleSetup(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_names", 0, "public.*", "app.*")})
	ctx := ctxT(t)

	t.Run("Parse over an existing name fails and keeps the old", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent")).PgConn()
		if _, err := c.Prepare(ctx, "n1", outsideWrite, nil); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Prepare(ctx, "n1", insideWrite, nil); pgCode(err) != "42P05" {
			t.Fatalf("second Parse of n1: %v, want 42P05 as direct", err)
		}
		wantNoOutsideWrite(t, "Execute n1", c.ExecPrepared(ctx, "n1", nil, nil, nil).Read().Err)
	})

	t.Run("PREPARE over an existing name fails and keeps the old", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent"))
		if err := simple(ctx, c, "PREPARE n2 AS "+outsideWrite); err != nil {
			t.Fatal(err)
		}
		if err := simple(ctx, c, "PREPARE n2 AS "+insideWrite); pgCode(err) != "42P05" {
			t.Fatalf("second PREPARE n2: %v, want 42P05 as direct", err)
		}
		wantNoOutsideWrite(t, "EXECUTE n2", simple(ctx, c, "EXECUTE n2"))
	})

	t.Run("a PREPARE later in a Query that failed earlier never ran", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent"))
		if err := simple(ctx, c, "PREPARE n3 AS "+outsideWrite); err != nil {
			t.Fatal(err)
		}
		err := simple(ctx, c, "SELECT 1/0; DEALLOCATE n3; PREPARE n3 AS "+insideWrite)
		if pgCode(err) != "22012" {
			t.Fatalf("the Query: %v, want 22012 from its first statement", err)
		}
		wantNoOutsideWrite(t, "EXECUTE n3", simple(ctx, c, "EXECUTE n3"))
	})

	t.Run("DEALLOCATE and PREPARE replace a statement Parse made", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent"))
		if _, err := c.PgConn().Prepare(ctx, "n4", insideWrite, nil); err != nil {
			t.Fatal(err)
		}
		if err := simple(ctx, c, "DEALLOCATE n4; PREPARE n4 AS "+outsideWrite); err != nil {
			t.Fatal(err)
		}
		wantNoOutsideWrite(t, "Bind/Execute n4", c.PgConn().ExecPrepared(ctx, "n4", nil, nil, nil).Read().Err)
	})

	t.Run("Close and Parse skipped after an error in the pipeline", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent")).PgConn()
		if _, err := c.Prepare(ctx, "n5", outsideWrite, nil); err != nil {
			t.Fatal(err)
		}
		pl := c.StartPipeline(ctx)
		pl.SendQueryParams("SELECT 1/0", nil, nil, nil, nil)
		pl.SendDeallocate("n5")
		pl.SendPrepare("n5", insideWrite, nil)
		if err := pl.Sync(); err != nil {
			t.Fatal(err)
		}
		var first error
		for {
			r, err := pl.GetResults()
			if err != nil {
				if first == nil {
					first = err
				}
				continue
			}
			if _, ok := r.(*pgconn.PipelineSync); ok {
				break
			}
			if rr, ok := r.(*pgconn.ResultReader); ok {
				if _, err := rr.Close(); err != nil && first == nil {
					first = err
				}
			}
		}
		if err := pl.Close(); err != nil && first == nil {
			first = err
		}
		if pgCode(first) != "22012" {
			t.Fatalf("the pipeline: %v, want 22012 from its first statement", first)
		}
		wantNoOutsideWrite(t, "Execute n5", c.ExecPrepared(ctx, "n5", nil, nil, nil).Read().Err)
	})

	// (Inside a block, where named portals outlive a Sync; the failed Bind
	// aborts it, and a ROLLBACK TO SAVEPOINT made before lets it go on.)
	t.Run("Bind to a named portal that exists fails and keeps the old", func(t *testing.T) {
		send := wireSession(t, p)
		step := func(what string, msgs ...pgproto3.FrontendMessage) string { return what + ": " + send(msgs...) }
		t.Log(step("begin", &pgproto3.Query{String: "BEGIN"}))
		t.Log(step("portal p1 on the outside write",
			&pgproto3.Parse{Name: "o", Query: outsideWrite}, &pgproto3.Bind{DestinationPortal: "p1", PreparedStatement: "o"}, &pgproto3.Sync{}))
		t.Log(step("savepoint", &pgproto3.Query{String: "SAVEPOINT before_rebind"}))
		if tr := step("portal p1 again, on the inside write",
			&pgproto3.Parse{Name: "i", Query: insideWrite}, &pgproto3.Bind{DestinationPortal: "p1", PreparedStatement: "i"}, &pgproto3.Sync{}); !strings.Contains(tr, "42P03") {
			t.Fatalf("%s: want 42P03 (portal exists) as direct", tr)
		}
		t.Log(step("rollback to the savepoint (p1, made before it, stays)", &pgproto3.Query{String: "ROLLBACK TO SAVEPOINT before_rebind"}))
		tr := step("execute p1", &pgproto3.Execute{Portal: "p1"}, &pgproto3.Sync{})
		if !strings.Contains(tr, "42501") {
			t.Errorf("%s: want the fence's refusal (42501) of the write the portal holds", tr)
		}
		step("commit", &pgproto3.Query{String: "COMMIT"})
		if n := otherRows(t); n != 0 {
			t.Fatalf("%d rows in other.t: the server ran the portal's outside write", n)
		}
	})

	// FETCH and MOVE run a portal: a Bind's portal of an INSERT ...
	// RETURNING wrote other.t under FETCH, which the fence took for a read.
	t.Run("FETCH and MOVE run a Bind's portal", func(t *testing.T) {
		for _, run := range []string{"FETCH ALL p2", "MOVE ALL p2", "FETCH ALL IN p2"} {
			step := wireSession(t, p)
			step(&pgproto3.Query{String: "BEGIN; " + insideWrite}) // a block the fence made writable
			step(&pgproto3.Parse{Name: "o2", Query: outsideWrite + " RETURNING 1"}, &pgproto3.Bind{DestinationPortal: "p2", PreparedStatement: "o2"}, &pgproto3.Sync{})
			if tr := step(&pgproto3.Query{String: run}); !strings.Contains(tr, "42501") {
				t.Errorf("%s: %s, want the fence's refusal (42501) of the INSERT the portal runs", run, tr)
			}
			step(&pgproto3.Query{String: "COMMIT"})
			if n := otherRows(t); n != 0 {
				t.Fatalf("%s: %d rows in other.t: the portal's INSERT ran under a FETCH", run, n)
			}
		}
	})

	t.Run("what direct allows still runs", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent"))
		if err := simple(ctx, c, "PREPARE ok1 AS "+insideWrite); err != nil {
			t.Fatal(err)
		}
		if res := c.PgConn().ExecPrepared(ctx, "ok1", nil, nil, nil).Read(); res.Err != nil || res.CommandTag.String() != "INSERT 0 1" {
			t.Errorf("Bind/Execute of a PREPAREd in-lease write: %v %q, want INSERT 0 1 as direct", res.Err, res.CommandTag)
		}
		if _, err := c.PgConn().Prepare(ctx, "ok2", insideWrite, nil); err != nil {
			t.Fatal(err)
		}
		if err := simple(ctx, c, "EXECUTE ok2"); err != nil {
			t.Errorf("EXECUTE of a Parsed in-lease write: %v, want it to run as direct", err)
		}
		if err := simple(ctx, c, "DEALLOCATE ALL; PREPARE ok1 AS SELECT 1; EXECUTE ok1"); err != nil {
			t.Errorf("DEALLOCATE ALL then PREPARE of a freed name: %v", err)
		}
		// Cursors: DECLARE, FETCH, MOVE, CLOSE, in a block and WITH HOLD.
		if err := simple(ctx, c, "BEGIN; DECLARE cur1 CURSOR FOR SELECT g FROM pg_catalog.generate_series(1, 3) g; MOVE 1 cur1; FETCH 1 FROM cur1; CLOSE cur1; DECLARE cur1 CURSOR FOR SELECT 1; FETCH ALL cur1; CLOSE ALL; COMMIT"); err != nil {
			t.Errorf("cursors in a block: %v", err)
		}
		if err := simple(ctx, c, "DECLARE cur2 CURSOR WITH HOLD FOR SELECT 2"); err != nil {
			t.Fatal(err)
		}
		var two int
		if err := c.QueryRow(ctx, "FETCH cur2").Scan(&two); err != nil || two != 2 {
			t.Errorf("FETCH of a cursor WITH HOLD: %d, %v", two, err)
		}
		if err := simple(ctx, c, "CLOSE cur2"); err != nil {
			t.Errorf("CLOSE cur2: %v", err)
		}
	})
}

// wireSession starts a session of the agent through p on the wire and
// returns what sends messages on it: it flushes them and returns the
// answers up to ReadyForQuery (see answers).
func wireSession(t *testing.T, p *Proxy) func(msgs ...pgproto3.FrontendMessage) string {
	t.Helper()
	raw, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { raw.Close() })
	raw.SetDeadline(time.Now().Add(20 * time.Second))
	fe := pgproto3.NewFrontend(raw, raw)
	fe.Send(&pgproto3.StartupMessage{ProtocolVersion: pgproto3.ProtocolVersionNumber,
		Parameters: map[string]string{"user": "agent", "database": testDB}})
	send := func(msgs ...pgproto3.FrontendMessage) string {
		for _, m := range msgs {
			fe.Send(m)
		}
		if err := fe.Flush(); err != nil {
			t.Fatal(err)
		}
		return answers(t, fe)
	}
	if tr := send(); !strings.HasSuffix(tr, "Ready(I)") {
		t.Fatalf("startup: %s", tr)
	}
	return send
}

// answers reads the proxy's answers up to ReadyForQuery: their types, with
// each error's SQLSTATE and command tag.
func answers(t *testing.T, fe *pgproto3.Frontend) string {
	t.Helper()
	var out []string
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatalf("after %v: %v", out, err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			out = append(out, "Error("+m.Code+": "+m.Message+")")
		case *pgproto3.CommandComplete:
			out = append(out, "Complete("+string(m.CommandTag)+")")
		case *pgproto3.ReadyForQuery:
			return strings.Join(append(out, "Ready("+string(m.TxStatus)+")"), " ")
		}
	}
}

// Code the fence does not parse prepares statements too: a function a read
// calls ran EXECUTE 'DEALLOCATE n; PREPARE n AS <write outside the lease>'
// and the client's next Bind of n, judged as the in-lease write it had
// Parsed, ran the outside write (prepared statements outlive the
// transaction, read-only or rolled back). The fence compares the server's
// prepared statements after such code: a name prepared again is judged as
// an opaque write. In a checked read and in a read-only block.
func TestNamesChangedByCode(t *testing.T) {
	smuggleSetup(t)
	if _, err := adminConn(t).Exec(ctxT(t), `
CREATE OR REPLACE FUNCTION app.reprepare(n text) RETURNS int LANGUAGE plpgsql AS
  $$BEGIN EXECUTE 'DEALLOCATE ' || n; EXECUTE 'PREPARE ' || n || ' AS INSERT INTO other.t VALUES (61)'; RETURN 1; END$$;
CREATE OR REPLACE FUNCTION app.harmless() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$;`); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_bycode", 0, "public.*", "app.*")})
	ctx := ctxT(t)
	for _, around := range []struct{ name, before, after string }{
		{"checked read", "", ""},
		{"read-only block", "BEGIN READ ONLY", "COMMIT"},
	} {
		t.Run(around.name, func(t *testing.T) {
			c := connect(t, proxyDSN(p, "agent"))
			if _, err := c.PgConn().Prepare(ctx, "bycode", insideWrite, nil); err != nil {
				t.Fatal(err)
			}
			sql := "SELECT app.reprepare('bycode')"
			if around.before != "" {
				sql = around.before + "; " + sql + "; " + around.after
			}
			if err := simple(ctx, c, sql); err != nil {
				t.Fatalf("%s: %v", sql, err)
			}
			err := c.PgConn().ExecPrepared(ctx, "bycode", nil, nil, nil).Read().Err
			if pgCode(err) != "42501" || !strings.Contains(err.Error(), "prepared again") {
				t.Errorf("Bind/Execute of a statement a function prepared again: %v, want the fence's refusal of an opaque write", err)
			}
			if n := otherRows(t); n != 0 {
				t.Fatalf("%d rows in other.t: the statement the function prepared ran", n)
			}
		})
	}
	t.Run("code that prepares nothing changes nothing", func(t *testing.T) {
		c := connect(t, proxyDSN(p, "agent"))
		if _, err := c.PgConn().Prepare(ctx, "kept", insideWrite, nil); err != nil {
			t.Fatal(err)
		}
		for range 2 {
			if err := simple(ctx, c, "SELECT app.harmless()"); err != nil {
				t.Fatal(err)
			}
			if res := c.PgConn().ExecPrepared(ctx, "kept", nil, nil, nil).Read(); res.Err != nil {
				t.Fatalf("Bind/Execute of the client's statement after a harmless function: %v", res.Err)
			}
		}
	})
	// The proxy's own statements, which it runs unjudged: code that
	// prepares one again must not have its text run in the next
	// transaction the proxy makes writable. Each is prepared again (its
	// Close first) when the next unit begins after such code.
	for _, own := range []struct{ name, params, write string }{
		{rwStmtName, "", "INSERT INTO sp_t (id) VALUES ($1)"},
		{tokSpStmtName, "(text, text)", "INSERT INTO sp_t (id) VALUES ($1)"}, // unqualified: the token and the path at once
		{tokStmtName, "(text)", "INSERT INTO public.sp_t (id) VALUES ($1)"},
	} {
		t.Run("the proxy's own "+own.name, func(t *testing.T) {
			if _, err := adminConn(t).Exec(ctx, `
CREATE OR REPLACE FUNCTION app.reprepare_own(n text, params text) RETURNS int LANGUAGE plpgsql AS
  $$BEGIN EXECUTE 'DEALLOCATE ' || n; EXECUTE 'PREPARE ' || n || params || ' AS INSERT INTO other.t VALUES (62)'; RETURN 1; END$$;
TRUNCATE other.t`); err != nil {
				t.Fatal(err)
			}
			c := connect(t, proxyDSN(p, "agent"))
			write := func() {
				t.Helper()
				if _, err := c.Exec(ctx, own.write, pgx.QueryExecModeExec, 1); err != nil {
					t.Fatalf("a write: %v", err)
				}
			}
			write() // the proxy prepares its own statements
			if err := simple(ctx, c, "SELECT app.reprepare_own('"+own.name+"', '"+own.params+"')"); err != nil {
				t.Fatal(err)
			}
			write()
			write()
			if n := otherRows(t); n != 0 {
				t.Fatalf("%d rows in other.t: the text a function prepared as %s ran", n, own.name)
			}
		})
	}
}
