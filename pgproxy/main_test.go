package pgproxy

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	leasepkg "github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// pg is the one Postgres of this test binary. setupDB fences two
// databases alike, one with each kind of trigger: plpgsql (testDB, which
// the tests use unless they run for both) and cTrigger.
var (
	pg       *pgtest.Server
	plpgsql  = &fenceDB{trigger: "plpgsql", db: testDB}
	cTrigger = &fenceDB{trigger: "c", db: testDB + "_c"}
)

const testDB = "fenceline_test"

func TestMain(m *testing.M) {
	pg = pgtest.MustStart()
	if err := setupDB(); err != nil {
		pg.Stop()
		fmt.Fprintln(os.Stderr, "setup:", err, "\n", pg.Log())
		os.Exit(1)
	}
	testutil.MainWith(m, func() {
		pg.Stop()
		if cLibDir != "" {
			os.RemoveAll(cLibDir)
		}
	})
}

func setupDB() error {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		return err
	}
	defer admin.Close(ctx)
	for _, q := range []string{
		"DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname='agent') THEN CREATE ROLE agent LOGIN; END IF; END$$",
		"DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname='scram_user') THEN CREATE ROLE scram_user LOGIN; END IF; END$$",
		"DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname='md5_user') THEN CREATE ROLE md5_user LOGIN; END IF; END$$",
		"SET password_encryption = 'scram-sha-256'",
		"ALTER ROLE scram_user PASSWORD 'scram-secret'",
		"SET password_encryption = 'md5'",
		"ALTER ROLE md5_user PASSWORD 'md5-secret'",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	if err := plpgsql.setup(ctx, admin, InstallOptions{Trigger: TriggerPLpgSQL}); err != nil {
		return err
	}
	if pg.SocketPath() == "" {
		cTrigger.elsewhere = true
		return nil
	}
	// Without the C trigger only its tests fail, saying why.
	lib, err := buildCTrigger(ctx)
	if err == nil {
		err = cTrigger.setup(ctx, admin, InstallOptions{Trigger: TriggerC, CLibrary: lib})
	}
	cTrigger.unavailable = err
	return nil
}

// cLibDir holds the C trigger built for this test binary.
var cLibDir string

// fenceDB is a test database fenced with one kind of trigger.
type fenceDB struct {
	trigger     string // "plpgsql" or "c"
	db          string
	secret      []byte
	unavailable error // why the trigger could not be built
	elsewhere   bool  // the server is not on this machine (FENCELINE_TEST_PG)
}

// need fails (or, for a server elsewhere, skips) tb when the trigger is not
// installed.
func (f *fenceDB) need(tb testing.TB) {
	tb.Helper()
	if f.elsewhere {
		// The library is built here and loaded by path: a server on
		// another machine cannot load it.
		tb.Skip("the C trigger needs the test's Postgres on this machine; FENCELINE_TEST_PG names another")
	}
	if f.unavailable != nil {
		tb.Fatalf("the C trigger: %v", f.unavailable)
	}
}

// forEachTrigger runs test as a subtest against each kind of trigger,
// both at once: each kind has a database of its own (the test itself is
// not parallel to others, which share that database).
func forEachTrigger(t *testing.T, test func(t *testing.T, f *fenceDB)) {
	for _, f := range []*fenceDB{plpgsql, cTrigger} {
		t.Run(f.trigger, func(t *testing.T) {
			t.Parallel()
			f.need(t)
			test(t, f)
		})
	}
}

// setup creates the database with the tests' tables and installs the fence.
func (f *fenceDB) setup(ctx context.Context, admin *pgx.Conn, opts InstallOptions) error {
	for _, q := range []string{"DROP DATABASE IF EXISTS " + f.db, "CREATE DATABASE " + f.db} {
		if _, err := admin.Exec(ctx, q); err != nil {
			return fmt.Errorf("%s: %w", q, err)
		}
	}
	db, err := pgx.Connect(ctx, pg.AdminDSN(f.db))
	if err != nil {
		return err
	}
	defer db.Close(ctx)
	if _, err := db.Exec(ctx, `
CREATE SCHEMA app;
CREATE TABLE public.accounts (id int PRIMARY KEY, balance int NOT NULL DEFAULT 0);
CREATE TABLE public.other (id int PRIMARY KEY, note text);
CREATE TABLE public.big (id int PRIMARY KEY, payload text);
CREATE TABLE app.items (id serial PRIMARY KEY, name text);
CREATE TABLE app.log (id serial PRIMARY KEY, msg text);
CREATE SEQUENCE public.seq;
CREATE TABLE public.sink (v text);
CREATE TABLE public.zombie (id int PRIMARY KEY, balance int);
CREATE TABLE public.race (id int PRIMARY KEY, writer text);
INSERT INTO public.zombie VALUES (2, 0);
CREATE FUNCTION public.f_writes() RETURNS int LANGUAGE sql AS $$ INSERT INTO public.sink VALUES ('written by a read'); SELECT 1 $$;
CREATE FUNCTION public.f_flip() RETURNS text LANGUAGE sql AS $$ SELECT set_config('default_transaction_read_only', 'off', false) $$;
INSERT INTO public.big SELECT g, repeat('x', 100) FROM generate_series(1, 50000) g;
INSERT INTO public.accounts SELECT g, 100 FROM generate_series(1, 10) g;
GRANT USAGE ON SCHEMA app TO PUBLIC;
GRANT ALL ON ALL TABLES IN SCHEMA public, app TO PUBLIC;
GRANT ALL ON ALL SEQUENCES IN SCHEMA public, app TO PUBLIC;
GRANT CREATE ON SCHEMA public, app TO PUBLIC;
`); err != nil {
		return fmt.Errorf("%s: create test tables: %w", f.db, err)
	}
	in, err := Install(ctx, db, []string{"public.accounts", "public.other", "public.sink", "public.zombie", "public.race", "app.*"}, opts)
	if err != nil {
		return fmt.Errorf("%s: %w", f.db, err)
	}
	f.secret = in.Secret
	return nil
}

// buildCTrigger compiles cfence/fenceline_fence_gate.c with the server's
// compiler flags and headers (as its Makefile would, through PGXS) into a
// directory the server, another user, can read, and returns the library.
func buildCTrigger(ctx context.Context) (string, error) {
	pgConfig := filepath.Join(pg.BinDir, "pg_config")
	if _, err := os.Stat(pgConfig); err != nil {
		pgConfig = "pg_config"
	}
	out, err := exec.CommandContext(ctx, pgConfig, "--includedir-server", "--cflags", "--cflags_sl", "--cppflags").Output()
	if err != nil {
		return "", fmt.Errorf("%s: %w", pgConfig, err)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	if len(lines) != 4 {
		return "", fmt.Errorf("%s printed %q: want four lines", pgConfig, out)
	}
	inc := lines[0]
	if _, err := os.Stat(filepath.Join(inc, "postgres.h")); err != nil {
		return "", fmt.Errorf("no server headers in %s: install postgresql-server-dev-%s", inc, filepath.Base(filepath.Dir(pg.BinDir)))
	}
	if cLibDir, err = os.MkdirTemp("", "fenceline-cfence-"); err != nil {
		return "", err
	}
	if err := os.Chmod(cLibDir, 0o755); err != nil {
		return "", err
	}
	lib := filepath.Join(cLibDir, "fenceline_fence_gate.so")
	args := strings.Fields(strings.Join(lines[1:], " "))
	args = append(args, "-Werror", "-shared", "-I", inc, "-o", lib, filepath.Join("cfence", "fenceline_fence_gate.c"))
	cc := exec.CommandContext(ctx, "gcc", args...)
	if out, err := cc.CombinedOutput(); err != nil {
		return "", fmt.Errorf("%s: %w\n%s", strings.Join(cc.Args, " "), err, out)
	}
	return lib, os.Chmod(lib, 0o755)
}

// agent connects to the database as the agent's role, straight to Postgres.
func (f *fenceDB) agent(t testing.TB) *pgx.Conn { return connect(t, pg.DSN("agent", "", f.db)) }

// admin connects to the database as the superuser.
func (f *fenceDB) admin(t testing.TB) *pgx.Conn { return connect(t, pg.AdminDSN(f.db)) }

// proxy starts a proxy whose lease holds a grant key for this database
// (see granted).
func (f *fenceDB) proxy(t testing.TB, cfg Config) *Proxy {
	granted(t, &cfg, f.secret)
	return startProxy(t, cfg)
}

// granted gives cfg's lease a Postgres grant key derived from secret, as
// the lease service does when the database's secret is registered with
// it, unless it has one: a static lease derives it from its record, a
// frozen record gets it, and a holder from a bus that has no secret
// registered is wrapped (heldWithGrant).
func granted(t testing.TB, cfg *Config, secret []byte) {
	t.Helper()
	if g, ok := cfg.Lease.(lease.Granter); ok && g.GrantKeys() != nil && g.GrantKeys().Postgres != nil {
		return
	}
	switch l := cfg.Lease.(type) {
	case *staticLease:
		l.mu.Lock()
		l.secret = secret
		l.mu.Unlock()
	case leasebus.Frozen:
		keys, err := lease.GrantKeysFor(&l.Record, nil, secret)
		if err != nil {
			t.Fatal(err)
		}
		l.Record.Grants = keys
		cfg.Lease = l
	case *leasebus.Holder:
		cfg.Lease = heldWithGrant{l, secret}
	}
}

// heldWithGrant is a holder whose grant keys are derived from the
// database's secret here, as the lease service would have had the secret
// been registered with it.
type heldWithGrant struct {
	*leasebus.Holder
	secret []byte
}

func (h heldWithGrant) GrantKeys() *lease.GrantKeys {
	l := h.Holder.Lease()
	keys, _ := lease.GrantKeysFor(&l, nil, h.secret)
	return keys
}

// via connects to the database through p as user.
func (f *fenceDB) via(t testing.TB, p *Proxy, user string) *pgx.Conn {
	return connect(t, f.dsnVia(p, user))
}

// dsnVia is a DSN for the database through p as user.
func (f *fenceDB) dsnVia(p *Proxy, user string) string {
	return fmt.Sprintf("postgres://%s@%s/%s?sslmode=disable", user, p.Addr().String(), f.db)
}

// reset runs sql as the admin, fence triggers off for it, before a test
// that needs the database as setup left it — so the test passes with
// -count=N too.
func (f *fenceDB) reset(t testing.TB, sql string) {
	t.Helper()
	c := f.admin(t)
	for _, q := range []string{"SET session_replication_role = replica", sql} {
		if _, err := c.Exec(ctxT(t), q); err != nil {
			t.Fatalf("reset: %s: %v", q, err)
		}
	}
}

// resetEpoch lowers a table's epoch to 0, as the admin (sequences may go
// back only by setval).
func (f *fenceDB) resetEpoch(t testing.TB, table string) {
	t.Helper()
	f.reset(t, "UPDATE fenceline.epoch SET fence = 0, lease_id = '' WHERE relid = '"+table+"'::regclass; "+
		"SELECT setval(seq, 0, true) FROM fenceline.epoch WHERE relid = '"+table+"'::regclass")
}

// staticLease is a lease whose state the test sets.
type staticLease struct {
	mu     sync.Mutex
	lease  lease.Lease
	err    error
	secret []byte // the database's: GrantKeys derives the lease's grant key
}

// GrantKeys are the grant keys the lease service would give the lease as
// it is now.
func (l *staticLease) GrantKeys() *lease.GrantKeys {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.secret == nil {
		return nil
	}
	keys, _ := lease.GrantKeysFor(&l.lease, nil, l.secret)
	return keys
}

// fences makes every static lease's fence higher than all before it: the
// tests share tables, and the storage-side fence remembers.
var fences atomic.Uint64

func init() { fences.Store(1 << 20) }

func newStaticLease(t testing.TB, id string, _ uint64, tables ...string) *staticLease {
	t.Helper()
	fence := fences.Add(1)
	c, err := scope.New(nil, false, tables)
	if err != nil {
		t.Fatal(err)
	}
	return &staticLease{lease: lease.Lease{LeaseID: id, Repo: "github.com/acme/test", Scope: c, Fence: fence,
		Owner: lease.Owner{TaskID: "task-1", AgentID: "agent-1", AttemptID: "att-1"}, Status: lease.StatusActive}}
}

func (l *staticLease) Fence() (uint64, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.err != nil {
		return 0, l.err
	}
	return l.lease.Fence, nil
}

func (l *staticLease) Lease() lease.Lease {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.lease
}

func (l *staticLease) lose(err error) {
	l.mu.Lock()
	l.err = err
	l.mu.Unlock()
}

// recorder is an Auditor that keeps events in memory (the bus-backed one is
// exercised in the zombie test).
type recorder struct {
	mu  sync.Mutex
	evs []lease.AuditEvent
}

func (r *recorder) Record(_ context.Context, ev lease.AuditEvent) error {
	r.mu.Lock()
	r.evs = append(r.evs, ev)
	r.mu.Unlock()
	return nil
}

func (r *recorder) events() []lease.AuditEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]lease.AuditEvent(nil), r.evs...)
}

func startProxy(t testing.TB, cfg Config) *Proxy {
	t.Helper()
	if cfg.Upstream == "" {
		cfg.Upstream = pg.Addr()
	}
	granted(t, &cfg, plpgsql.secret)
	p, err := Listen(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// mustToken signs a fence token with key bound to connection c (session 0,
// which no connection has, for nil), as a proxy holding the lease would.
func mustToken(t testing.TB, key []byte, c *pgx.Conn, lease string, fence uint64, tables ...string) string {
	t.Helper()
	var session int64
	if c != nil {
		session = sessionOf(t, c)
	}
	gk, err := leasepkg.PostgresGrantKey(key, lease, fence, tables)
	if err != nil {
		t.Fatal(err)
	}
	tok, err := MakeToken(gk, lease, fence, session, tables)
	if err != nil {
		t.Fatal(err)
	}
	return tok
}

// boundSessions holds the session number of each connection sessionOf bound.
var boundSessions sync.Map // *pgx.Conn -> int64

// sessionOf binds c to a fence session, once, and returns its number.
func sessionOf(t testing.TB, c *pgx.Conn) int64 {
	t.Helper()
	if n, ok := boundSessions.Load(c); ok {
		return n.(int64)
	}
	n, err := BindSession(ctxT(t), c)
	if err != nil {
		t.Fatal(err)
	}
	boundSessions.Store(c, n)
	t.Cleanup(func() { boundSessions.Delete(c) })
	return n
}

// proxyDSN is a DSN for testDB through p as user.
func proxyDSN(p *Proxy, user string) string { return plpgsql.dsnVia(p, user) }

func connect(t testing.TB, dsn string) *pgx.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(context.Background()) })
	return c
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// resetState is plpgsql.reset, for the tests that use testDB.
func resetState(t testing.TB, sql string) {
	t.Helper()
	plpgsql.reset(t, sql)
}

// waitBackends waits until the number of the server's backends matching
// where (a condition on pg_stat_activity) is zero (gone) or not (present).
func waitBackends(t testing.TB, present bool, where string, args ...any) {
	t.Helper()
	admin := adminConn(t)
	testutil.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		var n int
		if err := admin.QueryRow(ctxT(t), "SELECT count(*) FROM pg_stat_activity WHERE "+where, args...).Scan(&n); err != nil {
			return err
		}
		if present && n == 0 {
			return fmt.Errorf("no backend where %s", where)
		}
		if !present && n != 0 {
			return fmt.Errorf("%d backends where %s remain", n, where)
		}
		return nil
	})
}

func adminConn(t testing.TB) *pgx.Conn { return plpgsql.admin(t) }
