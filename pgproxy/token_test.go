package pgproxy

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// holdTables takes a lease on tables from the bus b and holds it.
func holdTables(t *testing.T, b *bustest.Bus, ws string, ttl time.Duration, tables ...string) *bustest.Lease {
	t.Helper()
	claim, err := scope.New(nil, false, tables)
	if err != nil {
		t.Fatal(err)
	}
	return b.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/tokens", Scope: claim, WorkspaceID: ws,
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(ttl)}, leasebus.HoldOptions{})
}

// revoke revokes l on the bus and returns once its holder knows.
func revoke(t *testing.T, b *bustest.Bus, l *bustest.Lease) time.Time {
	t.Helper()
	if _, err := b.Operator.Revoke(ctxT(t), l.Record.LeaseID, "test: "+t.Name()); err != nil {
		t.Fatalf("revoke %s: %v", l.Record.LeaseID, err)
	}
	revoked := time.Now()
	testutil.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if _, err := l.Fence(); err == nil {
			return errors.New("the holder still holds the revoked lease")
		}
		return nil
	})
	return revoked
}

// TestTokenReplayedElsewhereRefused is the attack found in issue 16: inside
// a write transaction through the proxy the agent reads its fence token
// with current_setting, then replays it on another connection straight to
// Postgres. Postgres refuses it there, on both triggers, naming the reason
// and the lease, while the lease is live (the proxy's transaction open, then
// committed) and after the lease is revoked on the bus (nobody regranted).
func TestTokenReplayedElsewhereRefused(t *testing.T) { forEachTrigger(t, testTokenReplayed) }

func testTokenReplayed(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race") // a fresh bus starts its fences at 1
	ctx := ctxT(t)
	b := bustest.Start(t)
	l := holdTables(t, b, "ws-replay", 30*time.Second, "public.race")
	p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
	c := f.via(t, p, "agent")
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, "INSERT INTO public.race VALUES (1, 'through the proxy')"); err != nil {
		t.Fatalf("fenced write through the proxy: %v", err)
	}
	var tok string
	// (The proxy refuses current_setting('fenceline.token'), but not a
	// name it cannot read: a token is no secret from its own agent.)
	if err := tx.QueryRow(ctx, "SELECT current_setting('fence' || 'line.token')").Scan(&tok); err != nil {
		t.Fatalf("read the token inside the write transaction: %v", err)
	}
	if !strings.HasPrefix(tok, tokenVersion+":") {
		t.Fatalf("token %q", tok)
	}
	id := 10
	replay := func(when string) {
		t.Helper()
		unbound := f.agent(t)
		bound := f.agent(t)
		sessionOf(t, bound) // a session number of its own, not the token's
		for _, d := range []struct {
			name string
			c    *pgx.Conn
		}{{"a new connection", unbound}, {"a connection bound to its own session", bound}} {
			id++
			err := writeWithToken(ctx, d.c, tok, fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'replayed')", id))
			if pgCode(err) != "40001" || !strings.Contains(err.Error(), "bound to another connection") ||
				!strings.Contains(err.Error(), l.Record.LeaseID) {
				t.Fatalf("%s: the token replayed on %s: want 40001 bound to another connection naming lease %s, got %v",
					when, d.name, l.Record.LeaseID, err)
			}
		}
	}
	replay("lease live, the proxy's transaction open")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	replay("lease live")
	revoke(t, b, l)
	replay("lease revoked")
	var rows string
	if err := f.admin(t).QueryRow(ctx, "SELECT string_agg(writer, ',' ORDER BY id) FROM public.race").Scan(&rows); err != nil || rows != "through the proxy" {
		t.Fatalf("public.race holds %q (%v): want only the proxy's row", rows, err)
	}
}

// TestForgedBindingRefused: a token whose session number was changed (to
// the replaying connection's own) fails the MAC, on both triggers.
func TestForgedBindingRefused(t *testing.T) { forEachTrigger(t, testForgedBinding) }

func testForgedBinding(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	ctx := ctxT(t)
	victim, attacker := f.agent(t), f.agent(t)
	tok := mustToken(t, f.secret, victim, "lease_victim", 40, "public.race")
	mine := sessionOf(t, attacker)
	parts := strings.Split(tok, ":")
	if len(parts) != 6 || parts[3] != fmt.Sprint(sessionOf(t, victim)) {
		t.Fatalf("token %q: want v4:fence:lease:session:tables:mac", tok)
	}
	parts[3] = fmt.Sprint(mine)
	forged := strings.Join(parts, ":")
	err := writeWithToken(ctx, attacker, forged, "INSERT INTO public.race VALUES (1, 'forged binding')")
	if pgCode(err) != "40001" || !strings.Contains(err.Error(), "forged") {
		t.Fatalf("a token rebound to the attacker's session: want 40001 forged, got %v", err)
	}
	// The genuine token still works where it belongs.
	if err := writeWithToken(ctx, victim, tok, "INSERT INTO public.race VALUES (2, 'victim')"); err != nil {
		t.Fatalf("the token on its own connection: %v", err)
	}
}

// TestRevokedLeaseStopsItsConnection: the proxy's own connection, where the
// token is valid, stops writing once the holder knows its lease is revoked
// (nobody regranted, so the epoch still equals the token's fence):
//   - a transaction block made writable before the revoke refuses every
//     statement but ROLLBACK, even a read that calls a function that writes,
//     and so never commits what it wrote before;
//   - a write running when the holder learns of the revoke is cancelled
//     within the bound (the holder's Lost channel, or one
//     LeaseCheckInterval), and does not land;
//   - a COPY FROM STDIN under way fails rather than land.
//
// Both triggers; the revokes go through the real bus.
func TestRevokedLeaseStopsItsConnection(t *testing.T) { forEachTrigger(t, testRevokedLeaseStops) }

func testRevokedLeaseStops(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race, public.sink")
	f.resetEpoch(t, "public.race")
	f.resetEpoch(t, "public.sink")
	ctx := ctxT(t)
	b := bustest.Start(t)
	admin := f.admin(t)
	count := func(table string) int {
		t.Helper()
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	t.Run("open block", func(t *testing.T) {
		l := holdTables(t, b, "ws-block", 30*time.Second, "public.race", "public.sink")
		p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
		// The lease's first writes raise the epochs (holding the gates to
		// their transactions' end): commit them before the blocks open.
		if _, err := f.via(t, p, "agent").Exec(ctx, "DELETE FROM public.race; DELETE FROM public.sink"); err != nil {
			t.Fatal(err)
		}
		modes := []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeExec}
		conns := make([]*pgx.Conn, len(modes))
		txs := make([]pgx.Tx, len(modes))
		for i, mode := range modes {
			conns[i] = f.via(t, p, "agent")
			tx, err := conns[i].Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx) //nolint:errcheck // the test checks the outcome
			if _, err := tx.Exec(ctx, fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'before the revoke')", i+1), mode); err != nil {
				t.Fatalf("%v: write under the live lease: %v", mode, err)
			}
			txs[i] = tx
		}
		revoke(t, b, l)
		for i, mode := range modes[:2] {
			_, err := txs[i].Exec(ctx, "SELECT public.f_writes()", mode)
			if pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease lost while this transaction was writable") ||
				!strings.Contains(err.Error(), l.Record.LeaseID) {
				t.Fatalf("%v: a writing function in the block after the revoke: want 42501 lease lost naming the lease, got %v", mode, err)
			}
			if i == 0 {
				// In the failed block Postgres refuses everything itself.
				if _, err := txs[i].Exec(ctx, "SELECT 1"); pgCode(err) != "25P02" {
					t.Fatalf("a read in the failed block: want 25P02, got %v", err)
				}
				// A stray CopyDone there (no COPY runs): the proxy fails
				// it, Postgres ignores it, nothing breaks.
				fe := conns[i].PgConn().Frontend()
				fe.Send(&pgproto3.CopyDone{})
				if err := fe.Flush(); err != nil {
					t.Fatal(err)
				}
			}
			if err := txs[i].Commit(ctx); !errors.Is(err, pgx.ErrTxCommitRollback) {
				t.Fatalf("%v: commit of the failed block: want it rolled back, got %v", mode, err)
			}
		}
		// COMMIT straight after the revoke is refused: what the block wrote
		// under the lease does not land after it.
		if err := txs[2].Commit(ctx); pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease lost while this transaction was writable") {
			t.Fatalf("commit after the revoke: want 42501 lease lost, got %v", err)
		}
		if n, m := count("public.race"), count("public.sink"); n != 0 || m != 0 {
			t.Fatalf("after the revoke %d rows landed in public.race and %d in public.sink, want none", n, m)
		}
		c := conns[0]
		// The connection reads on, and its next write is refused by the proxy.
		var one int
		if err := c.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
			t.Fatalf("read after the revoke: %v", err)
		}
		if _, err := c.Exec(ctx, "INSERT INTO public.race VALUES (2, 'after the revoke')"); pgCode(err) != "42501" {
			t.Fatalf("write after the revoke: want 42501, got %v", err)
		}
		testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
			evs, err := leasebus.ReadAudit(ctx, b.Conn, "github.com/acme/tokens", 0)
			if err != nil {
				return err
			}
			for _, ev := range evs {
				if ev.Type == lease.EventDenied && ev.LeaseID == l.Record.LeaseID && ev.Reason == ReasonLeaseLost &&
					strings.Contains(ev.Message, "lease lost while this transaction was writable") {
					return nil
				}
			}
			return errors.New("no audit event for the refused statement in the revoked lease's block")
		})
	})

	t.Run("statement in flight", func(t *testing.T) {
		l := holdTables(t, b, "ws-flight", 30*time.Second, "public.race")
		p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
		c := f.via(t, p, "agent")
		var pid int
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := c.Exec(ctx, "INSERT INTO public.race SELECT 10, 'in flight' FROM pg_sleep(20)")
			done <- err
		}()
		waitBackends(t, true, "pid = $1 AND wait_event = 'PgSleep'", pid)
		revoked := revoke(t, b, l)
		var err error
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the write in flight was not stopped within 10 s of the revoke")
		}
		took := time.Since(revoked)
		if pgCode(err) != "57014" {
			t.Fatalf("the write in flight: want 57014 (cancelled), got %v", err)
		}
		t.Logf("write in flight cancelled %v after the revoke returned", took.Round(time.Millisecond))
		if took > time.Second {
			t.Fatalf("the write in flight was cancelled %v after the revoke, want within 1 s", took)
		}
		if n := count("public.race"); n != 0 {
			t.Fatalf("%d rows landed in public.race, want none", n)
		}
	})

	t.Run("copy", func(t *testing.T) {
		l := holdTables(t, b, "ws-copy", 30*time.Second, "public.race")
		p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
		c := f.via(t, p, "agent")
		src := &revokingSource{t: t, revoke: func() { revoke(t, b, l) }}
		_, err := c.CopyFrom(ctx, pgx.Identifier{"public", "race"}, []string{"id", "writer"}, src)
		if err == nil || !strings.Contains(err.Error(), l.Record.LeaseID) && pgCode(err) != "57014" {
			t.Fatalf("COPY FROM STDIN across the revoke: want it failed, got %v", err)
		}
		t.Logf("COPY across the revoke: %v", err)
		if n := count("public.race"); n != 0 {
			t.Fatalf("%d rows landed in public.race, want none", n)
		}
	})

	// A lease source without a Lost channel is polled: the bound is one
	// LeaseCheckInterval. (Last: the static lease's fence is above the bus's.)
	t.Run("statement in flight, polled", func(t *testing.T) {
		src := newStaticLease(t, "lease_polled", 0, "public.race")
		const every = 50 * time.Millisecond
		p := f.proxy(t, Config{Lease: src, LeaseCheckInterval: every})
		c := f.via(t, p, "agent")
		var pid int
		if err := c.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() {
			_, err := c.Exec(ctx, "INSERT INTO public.race SELECT 20, 'in flight' FROM pg_sleep(20)")
			done <- err
		}()
		waitBackends(t, true, "pid = $1 AND wait_event = 'PgSleep'", pid)
		src.lose(lease.ErrLeaseLost)
		lost := time.Now()
		var err error
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the write in flight was not stopped within 10 s of the loss")
		}
		took := time.Since(lost)
		if pgCode(err) != "57014" {
			t.Fatalf("the write in flight: want 57014 (cancelled), got %v", err)
		}
		t.Logf("write in flight cancelled %v after the lease source said lost (check every %v)", took.Round(time.Millisecond), every)
		if took > every+500*time.Millisecond {
			t.Fatalf("the write in flight was cancelled %v after the loss, want within %v and the cancel's delivery", took, every)
		}
		if n := count("public.race"); n != 0 {
			t.Fatalf("%d rows landed in public.race, want none", n)
		}
	})
}

// revokingSource is a COPY source of three rows that revokes the lease
// after the first.
type revokingSource struct {
	t      *testing.T
	revoke func()
	n      int
}

func (r *revokingSource) Next() bool {
	r.n++
	if r.n == 2 {
		r.revoke()
	}
	return r.n <= 3
}

func (r *revokingSource) Values() ([]any, error) { return []any{100 + r.n, "copied"}, nil }
func (r *revokingSource) Err() error             { return nil }

// TestUnfencedDatabaseWrites: a proxy in front of a database without the
// fence cannot bind its connections; writes under the lease still land
// (nothing checks tokens there), and it says so once, not per connection.
func TestUnfencedDatabaseWrites(t *testing.T) {
	ctx := ctxT(t)
	const db = "fenceline_unfenced"
	root := connect(t, pg.AdminDSN(""))
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db, "CREATE DATABASE " + db} {
		if _, err := root.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	if _, err := connect(t, pg.AdminDSN(db)).Exec(ctx, "CREATE TABLE public.plain (id int); GRANT ALL ON public.plain TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	var logs lockedBuffer
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_unfenced", 0, "public.plain"),
		Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	dsn := fmt.Sprintf("postgres://agent@%s/%s?sslmode=disable", p.Addr(), db)
	for i, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeCacheStatement} {
		if _, err := connect(t, dsn).Exec(ctx, fmt.Sprintf("INSERT INTO public.plain VALUES (%d)", i), mode); err != nil {
			t.Fatalf("%v: write to an unfenced database: %v", mode, err)
		}
	}
	if n := strings.Count(logs.String(), "not bound to a fence session"); n != 1 {
		t.Fatalf("want one warning for three connections, got %d:\n%s", n, logs.String())
	}
}

// TestPrepareTransactionRefused: a prepared transaction would outlive its
// connection and its lease (COMMIT PREPARED lands it from anywhere, any
// time): refused in a transaction the proxy made writable.
func TestPrepareTransactionRefused(t *testing.T) {
	ctx := ctxT(t)
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_prepare", 0, "public.sink")})
	c := connect(t, proxyDSN(p, "agent"))
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
		tx, err := c.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		_, err = tx.Exec(ctx, "PREPARE TRANSACTION 'fenceline_test'", mode)
		if pgCode(err) != "42501" || !strings.Contains(err.Error(), "PREPARE TRANSACTION") {
			t.Fatalf("%v: want 42501 naming PREPARE TRANSACTION, got %v", mode, err)
		}
		if err := tx.Rollback(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// TestInternalQueriesKeepUnnamedStatement: the proxy's own queries between a
// client's units (drawing the session number before the first token,
// learning search_path for an unqualified write) leave the client's unnamed
// prepared statement alone: pgx's describe-exec mode prepares it, Syncs,
// and binds it in the next unit, which is when the proxy asks.
func TestInternalQueriesKeepUnnamedStatement(t *testing.T) {
	ctx := ctxT(t)
	resetState(t, "TRUNCATE public.sink")
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_unnamed", 0, "public.sink")})
	for _, sql := range []string{"INSERT INTO public.sink VALUES ($1)", "INSERT INTO sink VALUES ($1)"} {
		c := connect(t, proxyDSN(p, "agent")) // a new connection: its first write draws its session number
		if _, err := c.Exec(ctx, sql, pgx.QueryExecModeDescribeExec, "unnamed"); err != nil {
			t.Fatalf("%s, the connection's first write, describe-exec: %v", sql, err)
		}
	}
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM public.sink WHERE v = 'unnamed'").Scan(&n); err != nil || n != 2 {
		t.Fatalf("public.sink has %d of the 2 rows (%v)", n, err)
	}
}
