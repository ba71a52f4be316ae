package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceline/fenceline/internal/testutil"
)

// A backend terminated by pg_terminate_backend sends its client a FATAL
// ErrorResponse (57P01, "terminating connection due to administrator
// command") and closes the connection; pgx reports it as a *PgError of
// severity FATAL and closes the Conn (pgx's own TestFatalRxError). Through
// the fence the client's backend also runs the fence's own queries (catalog
// lookups, the statistics flush before a checked write, SETs): when the
// terminate lands on one of those, the server's FATAL is the client's all
// the same, and must reach it as direct.

// fatalFixture makes the functions of the FATAL tests: user code, so a read
// calling them under a live lease is a checked write (a lookup, then the
// statistics flush, before it runs).
func fatalFixture(t *testing.T) {
	t.Helper()
	_, err := adminConn(t).Exec(ctxT(t), `
CREATE OR REPLACE FUNCTION app.fatal35_one() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$;
CREATE OR REPLACE FUNCTION app.fatal35_sleep(s float8) RETURNS int LANGUAGE plpgsql AS
  $$BEGIN PERFORM pg_catalog.pg_sleep(s); RETURN 1; END$$;`)
	if err != nil {
		t.Fatal(err)
	}
}

// terminateWhen waits until the backend pid matches cond (a condition on
// pg_stat_activity, run on conn q) and terminates it from q.
// A client's result arriving on errc (may be nil) before then fails t.
func terminateWhen(t *testing.T, q interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, pid uint32, cond string, errc chan error) {
	t.Helper()
	testutil.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		select {
		case err := <-errc:
			t.Fatalf("the client's statement ended (%v) before its backend %d was where %s", err, pid, cond)
		default:
		}
		var n int
		if err := q.QueryRow(ctxT(t), "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE pid = $1 AND "+cond, pid).Scan(&n); err != nil {
			return err
		}
		if n != 1 {
			var state, wait, query string
			q.QueryRow(ctxT(t), "SELECT coalesce(state, ''), coalesce(wait_event_type || '/' || wait_event, ''), coalesce(query, '') FROM pg_catalog.pg_stat_activity WHERE pid = $1", pid).Scan(&state, &wait, &query)
			return fmt.Errorf("backend %d not yet where %s (state %q, waiting on %q, query %.200q)", pid, cond, state, wait, query)
		}
		return nil
	})
	var ok bool
	if err := q.QueryRow(ctxT(t), "SELECT pg_catalog.pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
		t.Fatalf("pg_terminate_backend(%d): %v %v", pid, ok, err)
	}
}

// directFatal is what a client straight on Postgres gets when its backend
// is terminated during sql (a sleep): the reference.
func directFatal(t *testing.T, sql string) *pgconn.PgError {
	t.Helper()
	c := plpgsql.agent(t)
	errc := make(chan error, 1)
	go func() {
		var s string
		errc <- c.QueryRow(context.Background(), sql).Scan(&s)
	}()
	terminateWhen(t, adminConn(t), c.PgConn().PID(), "wait_event = 'PgSleep'", errc)
	err := <-errc
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Severity != "FATAL" || pe.Code != "57P01" {
		t.Fatalf("direct: %v, want a FATAL 57P01", err)
	}
	if !c.IsClosed() {
		t.Fatal("direct: the connection stays open after the FATAL")
	}
	return pe
}

// sameFatal: err is the server's FATAL, every field as direct (one of
// want: where the terminate landed decides the context, Where).
func sameFatal(t *testing.T, what string, err error, want ...*pgconn.PgError) {
	t.Helper()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		t.Fatalf("%s: %v (%T), want the server's FATAL %s %q", what, err, err, want[0].Code, want[0].Message)
	}
	for _, w := range want {
		if *pe == *w {
			return
		}
	}
	t.Fatalf("%s: error\n%+v\nwant, as direct,\n%+v", what, *pe, *want[0])
}

var fatalModes = []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement}

// TestFatalDuringLookupReachesClient: the client's read calls a function
// the fence has not looked up yet, so before forwarding it the fence looks
// it up in the catalogs, on the client's backend. That lookup waits on a
// lock on pg_rewrite (an administrator holds it), and the administrator
// terminates the backend there: the FATAL answers the fence's own query,
// and the client gets it, every field as direct, and the connection
// closes. In each protocol; and on the wire (pgproto3): the FATAL, then
// EOF.
func TestFatalDuringLookupReachesClient(t *testing.T) {
	fatalFixture(t)
	want := directFatal(t, "SELECT pg_catalog.pg_sleep(60)::text") // (no context: the lookup is plain SQL)
	locked := func(t *testing.T) pgx.Tx {
		tx, err := adminConn(t).Begin(ctxT(t))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tx.Rollback(context.Background()) })
		if _, err := tx.Exec(ctxT(t), "LOCK TABLE pg_catalog.pg_rewrite IN ACCESS EXCLUSIVE MODE"); err != nil {
			t.Fatal(err)
		}
		return tx
	}
	// The backend waits on a lock in a query of the fence's (not the
	// client's: the fence has not forwarded it yet); or, idle after the
	// client's Parse (pgx's cache_statement mode prepares first), on the
	// same lock before it reads the lookup the fence sent it: on a loaded
	// machine an idle backend may have catalog invalidations to process
	// first, and they wait on the lock too.
	//
	// In cache_statement mode the fence forwards the client's Parse (no
	// write) before it looks anything up, and on a loaded machine that
	// Parse may itself wait on the lock (catalog invalidations from the
	// other tests' DDL, processed as it starts): the fence's lookup never
	// comes while the lock is held, and the terminate lands on the
	// client's Parse instead — whose FATAL the client must get as direct
	// all the same (CI once waited 20 s for the lookup there).
	const inLookup = "wait_event_type = 'Lock' AND (query NOT LIKE '%fatal35_one()%' OR state = 'idle')"
	for _, mode := range fatalModes {
		t.Run(mode.String(), func(t *testing.T) {
			cond := inLookup
			if mode == pgx.QueryExecModeCacheStatement {
				cond = "wait_event_type = 'Lock'"
			}
			p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fatal35", 0, "app.*")}) // a catalog cache of its own
			c := connect(t, proxyDSN(p, "agent"))
			pid := c.PgConn().PID()
			tx := locked(t)
			errc := make(chan error, 1)
			go func() {
				var n int
				errc <- c.QueryRow(context.Background(), "SELECT app.fatal35_one()", mode).Scan(&n)
			}()
			terminateWhen(t, tx, pid, cond, errc)
			tx.Rollback(ctxT(t))
			sameFatal(t, "through the fence", <-errc, want)
			if !c.IsClosed() {
				t.Fatal("the connection stays open after the FATAL")
			}
			waitBackends(t, false, "pid = $1", pid)
		})
	}
	t.Run("wire", func(t *testing.T) {
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fatal35", 0, "app.*")})
		pc, err := pgconn.Connect(ctxT(t), proxyDSN(p, "agent"))
		if err != nil {
			t.Fatal(err)
		}
		pid := pc.PID()
		hc, err := pc.Hijack()
		if err != nil {
			t.Fatal(err)
		}
		defer hc.Conn.Close()
		tx := locked(t)
		hc.Frontend.Send(&pgproto3.Query{String: "SELECT app.fatal35_one()"})
		if err := hc.Frontend.Flush(); err != nil {
			t.Fatal(err)
		}
		terminateWhen(t, tx, pid, inLookup, nil)
		tx.Rollback(ctxT(t))
		hc.Conn.SetReadDeadline(time.Now().Add(20 * time.Second))
		msg, err := hc.Frontend.Receive()
		if err != nil {
			t.Fatalf("no answer to the Query: %v", err)
		}
		er, ok := msg.(*pgproto3.ErrorResponse)
		if !ok {
			t.Fatalf("answer %T %+v, want the server's FATAL", msg, msg)
		}
		sameFatal(t, "on the wire", pgconn.ErrorResponseToPgError(er), want)
		if msg, err := hc.Frontend.Receive(); !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("after the FATAL: %T %+v, %v; want the connection closed", msg, msg, err)
		}
	})
}

// TestFatalDuringCheckedWriteReachesClient: the read, a checked write
// (its function is user code), is running (the function sleeps) when the
// backend is terminated: the client gets the FATAL as direct and the
// connection closes; nothing of the fence's (the check after the
// statement) answers instead.
func TestFatalDuringCheckedWriteReachesClient(t *testing.T) {
	fatalFixture(t)
	want := directFatal(t, "SELECT app.fatal35_sleep(60)::text")
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fatal35", 0, "app.*")})
	admin := adminConn(t)
	for _, mode := range fatalModes {
		t.Run(mode.String(), func(t *testing.T) {
			c := connect(t, proxyDSN(p, "agent"))
			pid := c.PgConn().PID()
			errc := make(chan error, 1)
			go func() {
				var n int
				errc <- c.QueryRow(context.Background(), "SELECT app.fatal35_sleep(60)", mode).Scan(&n)
			}()
			terminateWhen(t, admin, pid, "wait_event = 'PgSleep' AND query LIKE '%fatal35_sleep(60)%'", errc)
			sameFatal(t, "through the fence", <-errc, want)
			if !c.IsClosed() {
				t.Fatal("the connection stays open after the FATAL")
			}
			waitBackends(t, false, "pid = $1", pid)
		})
	}
}

// TestFatalRxErrorThroughFence is pgx's TestFatalRxError through the fence,
// repeated: a read is sent on one connection while another terminates its
// backend, whenever that lands — before the read (the backend idle),
// during the fence's lookup or statistics flush before it, or during it.
// Each time the client gets the server's FATAL and the connection closes.
// Each round has a proxy of its own, so the fence looks the calls up
// again: a builtin (pg_sleep, as pgx's test) and user code (a checked
// write).
func TestFatalRxErrorThroughFence(t *testing.T) {
	fatalFixture(t)
	idle := directFatal(t, "SELECT pg_catalog.pg_sleep(60)::text") // (also in pg_sleep, or before a statement)
	inFunction := directFatal(t, "SELECT app.fatal35_sleep(60)::text")
	admin := adminConn(t)
	for i := range 16 {
		sql := "select 1::int4, pg_sleep(10)::varchar"
		if i%2 == 1 {
			sql = "select 1::int4, app.fatal35_sleep(10)::varchar"
		}
		p := startProxy(t, Config{Lease: newStaticLease(t, "lease_fatal35", 0, "app.*")})
		c := connect(t, proxyDSN(p, "agent"))
		pid := c.PgConn().PID()
		errc := make(chan error, 1)
		go func() {
			var n int32
			var s string
			errc <- c.QueryRow(context.Background(), sql).Scan(&n, &s)
		}()
		var ok bool
		if err := admin.QueryRow(ctxT(t), "SELECT pg_catalog.pg_terminate_backend($1)", pid).Scan(&ok); err != nil || !ok {
			t.Fatalf("pg_terminate_backend(%d): %v %v", pid, ok, err)
		}
		select {
		case err := <-errc:
			sameFatal(t, fmt.Sprintf("round %d (%s)", i, sql), err, idle, inFunction)
		case <-time.After(30 * time.Second):
			t.Fatalf("round %d (%s): no answer", i, sql)
		}
		if !c.IsClosed() {
			t.Fatalf("round %d: the connection stays open after the FATAL", i)
		}
		p.Close()
	}
}
