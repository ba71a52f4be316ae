//go:build linux

package pgproxy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/jackc/pgx/v5"
)

// TestPlainSessionsRunOnTheLoop: a plain session moves to the proxy's event
// loop after startup and works there (a result larger than the sockets'
// buffers, so the relay waits for room; a prepared statement; an error);
// a TLS session stays on goroutines and works too.
func TestPlainSessionsRunOnTheLoop(t *testing.T) {
	ctx := ctxT(t)
	p := startProxy(t, Config{})
	c := connect(t, proxyDSN(p, "agent"))
	var total int64
	if err := c.QueryRow(ctx, "SELECT sum(length(x)) FROM (SELECT repeat('x', 1000) AS x FROM generate_series(1, 20000)) s").Scan(&total); err != nil || total != 20_000_000 {
		t.Fatalf("a sum through the loop: %d %v", total, err)
	}
	rows, err := c.Query(ctx, "SELECT repeat('y', 1000) FROM generate_series(1, $1::int)", 20000)
	if err != nil {
		t.Fatal(err)
	}
	n, bytes := 0, 0
	for rows.Next() {
		var s string
		if err := rows.Scan(&s); err != nil {
			t.Fatal(err)
		}
		n, bytes = n+1, bytes+len(s)
	}
	if err := rows.Err(); err != nil || n != 20000 || bytes != 20_000_000 {
		t.Fatalf("20 MB of rows through the loop: %d rows, %d bytes, %v", n, bytes, err)
	}
	if _, err := c.Exec(ctx, "SELECT 1/0"); err == nil || !strings.Contains(err.Error(), "22012") {
		t.Fatalf("division by zero through the loop: %v", err)
	}
	waitLoopSessions(t, p, 1) // the plain one

	cfg, _ := selfSigned(t)
	tp := startProxy(t, Config{TLS: cfg})
	tc := connect(t, fmt.Sprintf("postgres://agent@%s/%s?sslmode=require", tp.Addr(), plpgsql.db))
	var one int
	if err := tc.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("a select over TLS: %d %v", one, err)
	}
	if got := tp.loopSessions.Load(); got != 0 {
		t.Fatalf("%d TLS sessions moved to the loop; want none (crypto/tls owns their sockets)", got)
	}
}

// TestCloseEndsSessionsOnTheLoop: Close ends sessions whose statements are
// running on the loop, and the loop itself, promptly.
func TestCloseEndsSessionsOnTheLoop(t *testing.T) {
	p, err := Listen(context.Background(), func() Config {
		cfg := Config{Upstream: pg.Addr()}
		granted(t, &cfg, plpgsql.secret)
		return cfg
	}())
	if err != nil {
		t.Fatal(err)
	}
	const sessions = 3
	errc := make(chan error, sessions)
	for range sessions {
		c := connect(t, proxyDSN(p, "agent"))
		go func() {
			_, err := c.Exec(context.Background(), "SELECT pg_catalog.pg_sleep(30)")
			errc <- err
		}()
	}
	waitBackends(t, true, "pid <> pg_backend_pid() AND query LIKE '%pg_sleep(30)%' AND state = 'active' HAVING count(*) = $1", sessions)
	closed := make(chan struct{})
	go func() {
		p.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return within 10 s with statements running on the loop")
	}
	select {
	case <-p.loop.Done():
	default:
		t.Fatal("Close returned before the loop ended")
	}
	for range sessions {
		select {
		case err := <-errc:
			if err == nil {
				t.Error("a statement the proxy's Close cut off reported success")
			}
		case <-time.After(10 * time.Second):
			t.Fatal("a client never heard its session end")
		}
	}
}

// TestLongTextDoesNotHoldTheLoop: parsing a long text (a quarter of a
// megabyte of short statements takes the parser a second) happens off the loop's thread, so
// another session's statements run meanwhile; parsed on the loop, they
// would wait for it.
func TestLongTextDoesNotHoldTheLoop(t *testing.T) {
	ctx := ctxT(t)
	p := startProxy(t, Config{})
	long, other := connect(t, proxyDSN(p, "agent")), connect(t, proxyDSN(p, "agent"))
	text := strings.Repeat("SELECT 1;", (256<<10)/9) // about 1 s of parsing, 10 s with -race
	longDone := make(chan error, 1)
	go func() {
		_, err := long.Exec(context.Background(), text, pgx.QueryExecModeSimpleProtocol)
		longDone <- err
	}()
	testutil.CheckFor(t, 20*time.Second, time.Millisecond, func() error {
		if p.parsingAside.Load() == 0 {
			return errors.New("the long text is not being parsed off the loop")
		}
		return nil
	})
	for i := range 20 {
		var n int
		if err := other.QueryRow(ctx, "SELECT $1::int", i).Scan(&n); err != nil || n != i {
			t.Fatalf("select %d beside the long text: %d %v", i, n, err)
		}
	}
	if p.parsingAside.Load() == 0 {
		t.Fatal("the long text's parse ended before the other session's 20 selects: the test proves nothing on this machine; make the text longer")
	}
	if err := <-longDone; err != nil {
		t.Fatalf("the long text: %v", err)
	}
}

// TestClientThatStopsReadingHoldsOnlyItself: a client that asks for a large
// result and stops reading fills the sockets' buffers until its relay
// waits for room (holding the lock on that client's writer) and Postgres
// waits to write (ClientWrite); the loop's other sessions go on.
func TestClientThatStopsReadingHoldsOnlyItself(t *testing.T) {
	ctx := ctxT(t)
	p := startProxy(t, Config{})
	stuck, other := connect(t, proxyDSN(p, "agent")), connect(t, proxyDSN(p, "agent"))
	rows, err := stuck.Query(ctx, "SELECT repeat('x', 1000) FROM generate_series(1, 200000) AS stop_reading")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	// Not reading the rows: the server is left waiting to write.
	waitBackends(t, true, "pid <> pg_backend_pid() AND query LIKE '%AS stop_reading%' AND wait_event = 'ClientWrite'")
	for i := range 20 {
		var n int
		if err := other.QueryRow(ctx, "SELECT $1::int", i).Scan(&n); err != nil || n != i {
			t.Fatalf("select %d beside a client that does not read: %d %v", i, n, err)
		}
	}
	waitLoopSessions(t, p, 2)
	stuck.Close(context.Background()) // ends the stuck session (its rows are never read)
}

// waitLoopSessions waits until n sessions have moved to p's loop. A session
// moves once its startup's answers are flushed, so its client may be ready
// a moment before it is counted.
func waitLoopSessions(t *testing.T, p *Proxy, n int64) {
	t.Helper()
	testutil.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		if got := p.loopSessions.Load(); got != n {
			return fmt.Errorf("%d sessions on the loop; want %d", got, n)
		}
		return nil
	})
}

// TestStalledLogHoldsNoSession: the proxy's log writer stalls (a log
// collector that stopped reading its pipe), and a session on the loop has
// writes refused, which the proxy logs from the loop's thread; the refusals
// still reach their client and the loop's other session goes on. Once the
// writer goes on, every refusal's record is written (queued, not lost).
// Written synchronously, the first record held the loop's thread in the
// writer, and every session on the loop with it.
func TestStalledLogHoldsNoSession(t *testing.T) {
	ctx := ctxT(t)
	w := &stallingWriter{}
	lease := newStaticLease(t, "lease_stalled_log", 0, "public.accounts")
	p := startProxy(t, Config{Lease: lease, Logger: slog.New(slog.NewTextHandler(w, nil))})
	t.Cleanup(w.release) // before the proxy's Close
	refused, other := connect(t, proxyDSN(p, "agent")), connect(t, proxyDSN(p, "agent"))
	waitLoopSessions(t, p, 2)
	w.stall()
	for i := range 3 {
		_, err := refused.Exec(ctx, "INSERT INTO public.other VALUES ($1, 'outside the lease')", 100+i)
		if err == nil || !strings.Contains(err.Error(), "write refused") {
			t.Fatalf("write %d outside the lease while the log's writer is stalled: want it refused, got %v", i, err)
		}
	}
	for i := range 20 {
		var n int
		if err := other.QueryRow(ctx, "SELECT $1::int", i).Scan(&n); err != nil || n != i {
			t.Fatalf("select %d while the log's writer is stalled: %d %v", i, n, err)
		}
	}
	w.release()
	testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if n := strings.Count(w.String(), "msg=\"write refused\""); n != 3 {
			return fmt.Errorf("the log has %d of the 3 refusals:\n%s", n, w.String())
		}
		return nil
	})
}
