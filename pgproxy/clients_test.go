package pgproxy

import (
	"crypto/tls"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Issue 18, findings 1-7: clients work through the fence as they do direct.

// Finding 2: the proxy's own prepared statements are forgotten only when
// Postgres forgets them (DISCARD ALL, DEALLOCATE ALL), not after SET
// search_path, RESET ALL or set_config.
func TestOwnStatementsFollowPostgres(t *testing.T) {
	lease := newStaticLease(t, "lease_stmt2", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease, AllowOpaque: true})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	write := func(after string) {
		t.Helper()
		if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", pgx.QueryExecModeExec, "after "+after); err != nil {
			t.Fatalf("extended write after %s: %v", after, err)
		}
	}
	write("nothing")
	for _, q := range []string{"SET search_path = public, app", "RESET ALL", "SELECT set_config('search_path', 'public', false)",
		"DEALLOCATE ALL", "DISCARD ALL"} { // (DEALLOCATE of one of the fence's own is refused: TestOwnNamesInSQLAreRefused)
		if err := simple(ctx, c, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
		write(q)
		write(q + ", twice")
	}
}

// Finding 3: notices raised while Postgres parses a rewritten query reach
// the client.
func TestParseNoticesForwarded(t *testing.T) {
	lease := newStaticLease(t, "lease_notice3", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	cfg, err := pgx.ParseConfig(proxyDSN(p, "agent"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var notices []string
	cfg.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) {
		mu.Lock()
		notices = append(notices, n.Message)
		mu.Unlock()
	}
	c, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(ctx)
	long := strings.Repeat("a", 70)
	if err := simple(ctx, c, "INSERT INTO app.log (msg) VALUES ('notice') RETURNING id AS "+long); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(notices) != 1 || !strings.Contains(notices[0], "will be truncated") {
		t.Fatalf("notices %q, want the parser's \"identifier will be truncated\"", notices)
	}
}

// Finding 6: with the certificate the fence makes when none is given
// (fenceline run/sidecar without --pg-tls-cert), sslmode=require works.
func TestSelfSignedTLSRequire(t *testing.T) {
	cfg, err := SelfSignedTLS()
	if err != nil {
		t.Fatal(err)
	}
	p := startProxy(t, Config{TLS: cfg})
	ctx := ctxT(t)
	c := connect(t, strings.Replace(proxyDSN(p, "agent"), "sslmode=disable", "sslmode=require", 1))
	if _, ok := c.PgConn().Conn().(*tls.Conn); !ok {
		t.Fatal("sslmode=require: the connection is not TLS")
	}
	var one int
	if err := c.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil || one != 1 {
		t.Fatalf("read over TLS: %v", err)
	}
}

// Finding 4: statements that must run outside a transaction block run
// alone, and writable when the lease allows them; the read-only default is
// back for the next unit.
func TestOutsideTransactionStatements(t *testing.T) {
	lease := newStaticLease(t, "lease_outside4", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	resetState(t, "DROP INDEX IF EXISTS app.log_msg; ALTER TABLE app.log OWNER TO agent")
	for _, q := range []string{
		"CREATE INDEX CONCURRENTLY log_msg ON app.log (msg)",
		"REINDEX TABLE CONCURRENTLY app.log",
		"REINDEX INDEX CONCURRENTLY app.log_msg",
		"DROP INDEX CONCURRENTLY app.log_msg",
		"VACUUM app.log",
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			if _, err := c.Exec(ctx, q, mode); err != nil && !(strings.HasPrefix(q, "DROP") && mode == pgx.QueryExecModeExec && pgCode(err) == "42704") &&
				!(strings.HasPrefix(q, "CREATE") && pgCode(err) == "42P07") && !(strings.Contains(q, "INDEX CONCURRENTLY app.log_msg") && pgCode(err) == "42P01") {
				t.Errorf("%s (%v): %v", q, mode, err)
			}
			var ro string
			if err := c.QueryRow(ctx, "SELECT current_setting('transaction_read_only')", mode).Scan(&ro); err != nil || ro != "on" {
				t.Fatalf("after %s (%v): a read's transaction_read_only %q, %v; want on (the read-only default back)", q, mode, ro, err)
			}
		}
	}
	lease.lose(errors.New("lease lost: test"))
	if _, err := c.Exec(ctx, "CREATE INDEX CONCURRENTLY log_msg ON app.log (msg)"); pgCode(err) != "42501" {
		t.Fatalf("without the lease: %v, want 42501", err)
	}
}

// Finding 5: a syntax error is Postgres's own (42601, message, position),
// and nothing runs.
func TestSyntaxErrorIsPostgres(t *testing.T) {
	lease := newStaticLease(t, "lease_syntax5", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	err := simple(ctx, c, "SELEC 1")
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Code != "42601" || pe.Message != `syntax error at or near "SELEC"` || pe.Position != 1 {
		t.Fatalf("SELEC 1: %+v, want Postgres's 42601 at 1", err)
	}
	if err := simple(ctx, c, "BEGIN"); err != nil {
		t.Fatal(err)
	}
	if err := simple(ctx, c, "INSERT INTO app.log (msg) VALUES ('x') RETURNING"); pgCode(err) != "42601" {
		t.Fatalf("in a block: %v, want 42601", err)
	}
	if err := simple(ctx, c, "SELECT 1"); pgCode(err) != "25P02" {
		t.Fatalf("after a syntax error the block is failed: %v", err)
	}
	if err := simple(ctx, c, "ROLLBACK"); err != nil {
		t.Fatal(err)
	}
}

// Finding 5: SHOW default_transaction_read_only says what the client was
// told at startup (off), or what it set since.
func TestShowDefaultReadOnly(t *testing.T) {
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_show5", 0, "app.*")})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, step := range []struct{ set, want string }{{"", "off"}, {"SET default_transaction_read_only = on", "on"}, {"RESET default_transaction_read_only", "off"}} {
		if step.set != "" {
			if err := simple(ctx, c, step.set); err != nil {
				t.Fatal(err)
			}
		}
		// (Not a statement prepared before the change: see doc.go.)
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			var v string
			if err := c.QueryRow(ctx, "SHOW default_transaction_read_only", mode).Scan(&v); err != nil || v != step.want {
				t.Errorf("after %q (%v): SHOW default_transaction_read_only = %q (%v), want %s", step.set, mode, v, err, step.want)
			}
		}
	}
}

// Finding 1: the proxy's own queries between a client's Parse of the unnamed
// statement and its Bind (search path, session binding, read-only reset)
// leave that statement alone (pgx's describe-exec mode).
func TestUnnamedStatementSurvivesOwnQueries(t *testing.T) {
	lease := newStaticLease(t, "lease_unnamed1", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease, AllowOpaque: true})
	ctx := ctxT(t)
	for _, first := range []string{"", "DISCARD ALL", "SELECT public.f_flip()"} {
		c := connect(t, proxyDSN(p, "agent"))
		if first != "" {
			simple(ctx, c, first)
		}
		// Unqualified: the proxy learns the search path first.
		if _, err := c.Exec(ctx, "INSERT INTO accounts (id, balance) VALUES ($1, 0) ON CONFLICT (id) DO NOTHING", pgx.QueryExecModeDescribeExec, 1000); err != nil {
			t.Fatalf("describe-exec write after %q: %v", first, err)
		}
	}
}
