package sidecar

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

var pg *pgtest.Server

func TestMain(m *testing.M) {
	if u := os.Getenv(goClientEnv); u != "" {
		os.Exit(goClient(u)) // the test binary as a Go program behind the proxy
	}
	pg = pgtest.MustStart()
	testutil.MainWith(m, func() { pg.Stop() })
}

// fencedPair creates tables public.<prefix>_mine and public.<prefix>_theirs
// in the test Postgres (afresh), installs the fence on both, and returns the
// admin connection (closed at the test's end), the fence secret and a claim
// on _mine only.
func fencedPair(ctx context.Context, t *testing.T, prefix string) (*pgx.Conn, []byte, scope.Claim) {
	t.Helper()
	admin, err := pgx.Connect(ctx, pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { admin.Close(context.Background()) })
	mine, theirs := prefix+"_mine", prefix+"_theirs"
	for _, q := range []string{
		"DROP TABLE IF EXISTS " + mine + ", " + theirs,
		"CREATE TABLE " + mine + " (id int)", "CREATE TABLE " + theirs + " (id int)",
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	in, err := pgproxy.Install(ctx, admin, []string{"public." + mine, "public." + theirs}, pgproxy.InstallOptions{Trigger: pgproxy.TriggerPLpgSQL})
	if err != nil {
		t.Fatal(err)
	}
	claim, err := scope.New([]string{"db"}, false, []string{"public." + mine})
	if err != nil {
		t.Fatal(err)
	}
	return admin, in.Secret, claim
}

// TestSidecarPostgresEnv: psql, given only the sidecar's environment, talks
// to Postgres through the fence: reads flow, in-scope writes land with the
// fence, out-of-scope writes are refused naming the lease.
func TestSidecarPostgresEnv(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	admin, secret, claim := fencedPair(ctx, t, "sc")
	bus := bustest.Start(t)
	// The database's secret goes to the lease service; the sidecar gets
	// only its lease's grant key.
	if err := leasebus.WriteFenceSecret(bus.FenceSecrets, "github.com/acme/payments", lease.StoragePostgres, secret); err != nil {
		t.Fatal(err)
	}
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: claim,
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	sc, err := Start(ctx, Config{Lease: l.Holder, Bus: bus.Client, Audit: bus.Auditor,
		PGUpstream: pg.Addr(), StateDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close(ctx)
	if len(sc.Ports()) != 2 {
		t.Fatalf("ports %v, want the Postgres fence's and the egress proxy's", sc.Ports())
	}
	dsn := pg.AdminDSN("")
	if strings.Contains(dsn, "?") {
		dsn += "&application_name=agent"
	} else {
		dsn += "?application_name=agent"
	}
	env := sc.AgentEnv([]string{"DATABASE_URL=" + dsn, "PGHOST=db.internal"})
	psql := func(sql string) (string, error) {
		cmd := exec.CommandContext(ctx, pg.BinDir+"/psql", "-X", "-v", "ON_ERROR_STOP=1", "-At", "-U", pg.Admin, "-d", "postgres", "-c", sql)
		cmd.Env = append([]string{"PATH=" + os.Getenv("PATH")}, env...)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	if out, err := psql("SELECT 40 + 2"); err != nil || strings.TrimSpace(out) != "42" {
		t.Fatalf("read through the fence: %v %q", err, out)
	}
	if out, err := psql("INSERT INTO sc_mine VALUES (1)"); err != nil {
		t.Fatalf("in-scope write: %v %s", err, out)
	}
	out, err := psql("INSERT INTO sc_theirs VALUES (1)")
	if err == nil || !strings.Contains(out, l.Record.LeaseID) {
		t.Fatalf("out-of-scope write: err=%v %s", err, out)
	}
	var n int
	if err := admin.QueryRow(ctx, "SELECT (SELECT count(*) FROM sc_mine) * 10 + (SELECT count(*) FROM sc_theirs)").Scan(&n); err != nil || n != 10 {
		t.Fatalf("rows landed: %d (%v), want only the in-scope one", n, err)
	}
	// The env routes libpq and DATABASE_URL to the fence, nowhere else.
	joined := strings.Join(env, "\n")
	addr := sc.PGAddr().(*net.TCPAddr)
	if strings.Contains(joined, "db.internal") || !strings.Contains(joined, fmt.Sprintf("PGPORT=%d", addr.Port)) ||
		!strings.Contains(joined, fmt.Sprintf("@127.0.0.1:%d/postgres?", addr.Port)) || !strings.Contains(joined, "application_name=agent") {
		t.Fatalf("agent env does not route Postgres through the fence:\n%s", joined)
	}
}

func TestRewriteDSN(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:p@db:5432/app?sslmode=disable", "postgres://u:p@127.0.0.1:6000/app?sslmode=disable"},
		{"postgresql://db/app?host=other&port=1", "postgresql://127.0.0.1:6000/app"},
		{"host=db port=5432 dbname=app user=u", "dbname=app user=u host=127.0.0.1 port=6000"},
	} {
		if got := rewriteDSN(tc.in, "127.0.0.1", "6000"); got != tc.want {
			t.Errorf("rewriteDSN(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

// TestFencesEnvProxy: the agent's environment points every HTTP client
// convention at the egress proxy and keeps loopback (the fences) direct;
// the proxy's port is one the guard lets the agent reach.
func TestFencesEnvProxy(t *testing.T) {
	f := Fences{Git: "http://127.0.0.1:7001", GitUpstream: "https://git.example.test", Egress: "http://127.0.0.1:7002"}
	env := f.Env([]string{"PATH=/bin", "NO_PROXY=corp.internal,localhost", "ALL_PROXY=socks5://10.0.0.1:1080", "https_proxy=http://corp-proxy:3128"})
	want := []string{"PATH=/bin", "HTTPS_PROXY=http://127.0.0.1:7002", "https_proxy=http://127.0.0.1:7002", "HTTP_PROXY=http://127.0.0.1:7002",
		"http_proxy=http://127.0.0.1:7002", "NO_PROXY=corp.internal,localhost,127.0.0.1,::1", "no_proxy=corp.internal,localhost,127.0.0.1,::1", "NODE_USE_ENV_PROXY=1"}
	for _, w := range want {
		if !slices.Contains(env, w) {
			t.Errorf("env lacks %s:\n%s", w, strings.Join(env, "\n"))
		}
	}
	for _, kv := range env {
		if strings.HasPrefix(kv, "ALL_PROXY=") || strings.Contains(kv, "corp-proxy") {
			t.Errorf("env keeps %s", kv)
		}
	}
	if got := f.Ports(); !slices.Equal(got, []uint16{7001, 7002}) {
		t.Errorf("ports %v, want [7001 7002]", got)
	}
	// glibc's resolver asks over TCP, which the guard captures.
	if !slices.Contains(env, "RES_OPTIONS=use-vc") {
		t.Errorf("env lacks RES_OPTIONS=use-vc:\n%s", strings.Join(env, "\n"))
	}
	if env := f.Env([]string{"RES_OPTIONS=ndots:2"}); !slices.Contains(env, "RES_OPTIONS=ndots:2 use-vc") {
		t.Errorf("RES_OPTIONS=ndots:2 not kept with use-vc:\n%s", strings.Join(env, "\n"))
	}
	if got, want := f.Capture().String(), "127.0.0.1:7002"; got != want {
		t.Errorf("capture %s, want %s", got, want)
	}
	if got, want := (Fences{Egress: "http://0.0.0.0:7002"}).Capture().String(), "127.0.0.1:7002"; got != want {
		t.Errorf("capture of a proxy on every address %s, want %s", got, want)
	}
	// A sidecar that predates the egress proxy: nothing about proxies.
	if env := (Fences{Postgres: "127.0.0.1:7003"}).Env(nil); slices.ContainsFunc(env, func(kv string) bool { return strings.Contains(kv, "PROXY") }) {
		t.Errorf("proxy env without an egress proxy: %v", env)
	}
}
