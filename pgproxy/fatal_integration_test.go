//go:build integration

package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testutil"
)

// TestShutdownDuringLookupReachesClient: a Postgres of its own stopped in
// immediate mode (as a crash of another backend does) while the client's
// backend runs a lookup of the fence's: the server's WARNING (57P01,
// "terminating connection due to immediate shutdown command"), which it
// sends instead of a FATAL before it closes the connection, reaches the
// client as it does direct, and the connection ends as direct.
func TestShutdownDuringLookupReachesClient(t *testing.T) {
	srv, err := pgtest.Start(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Stop()
	if srv.SocketPath() == "" {
		t.Skip("the test stops its own Postgres; " + pgtest.EnvDSN + " names a server it may not stop")
	}
	admin := connect(t, srv.AdminDSN(""))
	if _, err := admin.Exec(ctxT(t), `CREATE FUNCTION public.fatal35_one() RETURNS int LANGUAGE plpgsql AS $$BEGIN RETURN 1; END$$`); err != nil {
		t.Fatal(err)
	}
	type result struct {
		notices []pgconn.Notice
		err     error
	}
	run := func(dsn, sql string) (*pgx.Conn, chan result) {
		cfg, err := pgx.ParseConfig(dsn)
		if err != nil {
			t.Fatal(err)
		}
		var notices []pgconn.Notice
		cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, *n) }
		c, err := pgx.ConnectConfig(ctxT(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan result, 1)
		go func() {
			var n int
			err := c.QueryRow(context.Background(), sql).Scan(&n)
			done <- result{notices, err}
		}()
		return c, done
	}
	tx, err := admin.Begin(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctxT(t), "LOCK TABLE pg_catalog.pg_rewrite IN ACCESS EXCLUSIVE MODE"); err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{Upstream: srv.Addr(), Lease: newStaticLease(t, "lease_fatal35", 0, "public.*")})
	dc, direct := run(srv.AdminDSN(""), "SELECT 1 FROM pg_catalog.pg_sleep(60)")
	fc, fenced := run(fmt.Sprintf("postgres://%s@%s/postgres?sslmode=disable", srv.Admin, p.Addr()), "SELECT public.fatal35_one()")
	// (As TestFatalDuringLookupReachesClient's in cache_statement mode,
	// pgx's default: the backend waits on the lock in the fence's lookup,
	// or, idle after pgx's Parse, on the same lock while it processes
	// catalog invalidations before it reads the lookup, or in the
	// client's Parse itself, which the fence forwards before any lookup:
	// the shutdown's FATAL must reach the client as direct wherever it
	// waits. The narrower conditions timed out at load.)
	const waiting = "wait_event_type = 'Lock'"
	for _, w := range []struct {
		pid  uint32
		cond string
	}{{dc.PgConn().PID(), "wait_event = 'PgSleep'"}, {fc.PgConn().PID(), waiting}} {
		testutil.CheckFor(t, 20*time.Second, 10*time.Millisecond, func() error {
			var n int
			if err := tx.QueryRow(ctxT(t), "SELECT count(*) FROM pg_catalog.pg_stat_activity WHERE pid = $1 AND "+w.cond, w.pid).Scan(&n); err != nil {
				return err
			}
			if n != 1 {
				return fmt.Errorf("backend %d not yet where %s", w.pid, w.cond)
			}
			return nil
		})
	}
	srv.Stop() // SIGQUIT to the postmaster: immediate shutdown
	want, got := <-direct, <-fenced
	if len(want.notices) != 1 || want.notices[0].Code != "57P01" || want.err == nil {
		t.Fatalf("direct: notices %+v, error %v; want one 57P01 warning and the connection lost", want.notices, want.err)
	}
	if len(got.notices) != 1 || got.notices[0] != want.notices[0] {
		t.Fatalf("through the fence: notices %+v, want, as direct, %+v", got.notices, want.notices)
	}
	var pe *pgconn.PgError
	if errors.As(got.err, &pe) || got.err == nil || got.err.Error() != want.err.Error() {
		t.Fatalf("through the fence: error %v, want, as direct, %v", got.err, want.err)
	}
	if !fc.IsClosed() {
		t.Fatal("through the fence: the connection stays open")
	}
}
