package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestCancelDuringLookupReachesClient: the client's read calls a function
// that writes (app.cancel35_mark, in the lease's claim); before the fence
// forwards it, it looks the function up in the catalogs on the client's
// backend, and that lookup waits on a lock on pg_rewrite an administrator
// holds. The client cancels then (pgconn's CancelRequest, through the
// fence): the cancel lands on the fence's lookup, and is the client's. It
// gets Postgres's answer to a cancelled statement (57014, "canceling
// statement due to user request"), the function never runs (no row), and
// the session goes on. Before, the fence swallowed the lookup's error and
// ran the statement anyway: the row landed and the cancel was lost.
func TestCancelDuringLookupReachesClient(t *testing.T) {
	_, err := adminConn(t).Exec(ctxT(t), `
CREATE TABLE IF NOT EXISTS app.cancel35_t (id int);
GRANT ALL ON app.cancel35_t TO PUBLIC;
TRUNCATE app.cancel35_t;
CREATE OR REPLACE FUNCTION app.cancel35_mark() RETURNS int LANGUAGE sql AS $$ INSERT INTO app.cancel35_t VALUES (1); SELECT 1 $$;`)
	if err != nil {
		t.Fatal(err)
	}
	rows := func() int {
		var n int
		if err := adminConn(t).QueryRow(ctxT(t), "SELECT count(*) FROM app.cancel35_t").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	const inLookup = "wait_event_type = 'Lock' AND (query NOT LIKE '%cancel35_mark()%' OR state = 'idle')"
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		t.Run(mode.String(), func(t *testing.T) {
			// In cache_statement mode the fence forwards the client's
			// Parse (no write) before it looks anything up, and on a
			// loaded machine that Parse may itself wait on the lock
			// (catalog invalidations from other tests' DDL): the lookup
			// never comes while the lock is held (CI waited 20 s for it
			// once, as TestFatalDuringLookupReachesClient's did). The
			// cancel then lands on the client's Parse, and everything
			// below holds all the same: Postgres's 57014, no row, the
			// session goes on.
			cond := inLookup
			if mode == pgx.QueryExecModeCacheStatement {
				cond = "wait_event_type = 'Lock'"
			}
			p := startProxy(t, Config{Lease: newStaticLease(t, "lease_cancel35", 0, "app.*")}) // a catalog cache of its own
			c := connect(t, proxyDSN(p, "agent"))
			before := rows()
			tx, err := adminConn(t).Begin(ctxT(t))
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(context.Background())
			if _, err := tx.Exec(ctxT(t), "LOCK TABLE pg_catalog.pg_rewrite IN ACCESS EXCLUSIVE MODE"); err != nil {
				t.Fatal(err)
			}
			errc := make(chan error, 1)
			go func() {
				var n int
				errc <- c.QueryRow(context.Background(), "SELECT app.cancel35_mark()", mode).Scan(&n)
			}()
			pid := c.PgConn().PID()
			testutil.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
				select {
				case err := <-errc:
					t.Fatalf("the statement ended (%v) before the fence's lookup waited on the lock", err)
				default:
				}
				var n int
				if err := tx.QueryRow(ctxT(t), "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE pid = $1 AND "+cond, pid).Scan(&n); err != nil {
					return err
				}
				if n != 1 {
					return fmt.Errorf("backend %d not yet waiting in the fence's lookup", pid)
				}
				return nil
			})
			if err := c.PgConn().CancelRequest(ctxT(t)); err != nil {
				t.Fatal(err)
			}
			var got error
			select {
			case got = <-errc:
			case <-time.After(20 * time.Second):
				t.Fatal("no answer 20 s after the cancel: the cancel did not reach the client's statement")
			}
			var pe *pgconn.PgError
			if !pgErrorAs(got, &pe) || pe.Code != "57014" || pe.Message != "canceling statement due to user request" || pe.Severity != "ERROR" {
				t.Fatalf("the cancelled statement: %v, want Postgres's ERROR 57014 canceling statement due to user request", got)
			}
			if n := rows(); n != before {
				t.Fatalf("%d rows in app.cancel35_t after the cancel (before %d): the statement ran", n, before)
			}
			tx.Rollback(ctxT(t))
			var one int
			if err := c.QueryRow(ctxT(t), "SELECT 1", mode).Scan(&one); err != nil || one != 1 {
				t.Fatalf("the session after the cancel: %v", err)
			}
			var n int
			if err := c.QueryRow(ctxT(t), "SELECT app.cancel35_mark()", mode).Scan(&n); err != nil {
				t.Fatalf("the statement again, with nothing cancelling it: %v", err)
			}
			if got := rows(); got != before+1 {
				t.Fatalf("%d rows after the statement ran again, want %d", got, before+1)
			}
		})
	}
}

func pgErrorAs(err error, pe **pgconn.PgError) bool {
	return err != nil && errors.As(err, pe)
}
