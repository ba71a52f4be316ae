package pgproxy

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/base64"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func TestTransactionsAndSavepoints(t *testing.T) {
	lease := newStaticLease(t, "lease_tx1", 7, "public.accounts", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))

	// Read, then write in one block (the block is writable from BEGIN).
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var bal int
	if err := tx.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = 3").Scan(&bal); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "SAVEPOINT s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "UPDATE accounts SET balance = $1 WHERE id = 3", bal+10); err != nil {
		t.Fatalf("write after read in a block: %v", err)
	}
	if _, err := tx.Exec(ctx, "ROLLBACK TO SAVEPOINT s1"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO app.items (name) VALUES ('kept')"); err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "RELEASE SAVEPOINT s1"); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var bal2 int
	if err := c.QueryRow(ctx, "SELECT balance FROM accounts WHERE id = 3").Scan(&bal2); err != nil || bal2 != bal {
		t.Fatalf("rolled-back savepoint: balance %d, want %d (%v)", bal2, bal, err)
	}

	// A refused write inside a block leaves it failed, as Postgres would.
	tx, err = c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO app.items (name) VALUES ('doomed')"); err != nil {
		t.Fatal(err)
	}
	_, err = tx.Exec(ctx, "DELETE FROM public.other")
	if pgCode(err) != "42501" {
		t.Fatalf("out-of-scope write in a block: %v", err)
	}
	_, err = tx.Exec(ctx, "SELECT 1")
	if pgCode(err) != "25P02" {
		t.Fatalf("after a refused write the block must be failed (25P02), got %v", err)
	}
	tx.Rollback(ctx)
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM app.items WHERE name = 'doomed'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("doomed rows %d %v", n, err)
	}

	// Lease lost mid-block: later writes refused, reads go on, COMMIT works.
	tx, err = c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO app.items (name) VALUES ('before-loss')"); err != nil {
		t.Fatal(err)
	}
	lease.lose(errors.New("lease lost: test"))
	_, err = tx.Exec(ctx, "INSERT INTO app.items (name) VALUES ('after-loss')")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_tx1") || !strings.Contains(err.Error(), fmt.Sprintf("fence %d", lease.lease.Fence)) {
		t.Fatalf("write after loss: want 42501 naming lease and fence, got %v", err)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit of a failed block must report the rollback")
	}
	if err := c.QueryRow(ctx, "SELECT count(*) FROM app.items WHERE name LIKE '%loss'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("rows of the failed block %d %v", n, err)
	}
	// Reads in a block begun without a lease; a write there is refused.
	tx, err = c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.QueryRow(ctx, "SELECT count(*) FROM big").Scan(&n); err != nil || n != 50000 {
		t.Fatal(n, err)
	}
	tx.Rollback(ctx)
}

func TestMultiStatementAndForbidden(t *testing.T) {
	resetState(t, "DELETE FROM app.items WHERE name IN ('ms', 'ms2')")
	lease := newStaticLease(t, "lease_ms1", 9, "public.accounts", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	pc := c.PgConn()
	res, err := pc.Exec(ctx, "SELECT 1; UPDATE accounts SET balance = balance WHERE id = 1; SELECT 2").ReadAll()
	if err != nil || len(res) != 3 || res[1].CommandTag.String() != "UPDATE 1" {
		t.Fatalf("read+write+read: %v %v", res, err)
	}
	_, err = pc.Exec(ctx, "INSERT INTO app.items (name) VALUES ('ms'); DELETE FROM public.other").ReadAll()
	if pgCode(err) != "42501" {
		t.Fatalf("second statement out of scope: %v", err)
	}
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM app.items WHERE name = 'ms'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("the implicit transaction must have rolled back: %d %v", n, err)
	}
	res, err = pc.Exec(ctx, "BEGIN; INSERT INTO app.items (name) VALUES ('ms2'); COMMIT; SELECT count(*) FROM app.items WHERE name = 'ms2'").ReadAll()
	if err != nil || len(res) != 4 || string(res[3].Rows[0][0]) != "1" {
		t.Fatalf("explicit block in one query: %v %v", res, err)
	}
	for _, q := range []string{
		// (SET default_transaction_read_only = off and SET SESSION
		// CHARACTERISTICS AS TRANSACTION READ WRITE set the client's own
		// default, Postgres's kept: TestClientReadWriteDefaultAsDirect.
		// SET transaction_read_only = off in a transaction the proxy made
		// writable changes nothing: TestSetTransactionReadWriteAsDirect.)
		"SET LOCAL default_transaction_read_only = off",
		"SELECT set_config('default_transaction_read_only', 'off', false)",
		"SET LOCAL fenceline.token = 'x'",
		"ALTER TABLE public.accounts DISABLE TRIGGER ALL",
		"DO $$BEGIN INSERT INTO app.items (name) VALUES ('do'); END$$",
	} {
		_, err := pc.Exec(ctx, q).ReadAll()
		if pgCode(err) != "42501" {
			t.Errorf("%s: want 42501, got %v", q, err)
		}
	}
	// A function that flips the session default is caught and undone.
	if _, err := pc.Exec(ctx, "SELECT public.f_flip()").ReadAll(); err != nil {
		t.Fatal(err)
	}
	res, err = pc.Exec(ctx, "SELECT current_setting('transaction_read_only')").ReadAll()
	if err != nil || len(res) != 1 || len(res[0].Rows) != 1 || string(res[0].Rows[0][0]) != "on" {
		t.Fatalf("after a flip the session must be read-only again: %v, %v", res, err)
	}
	// Error positions point into the client's own text.
	_, err = pc.Exec(ctx, "UPDATE accounts SET balance = nosuchcolumn WHERE id = 1").ReadAll()
	var pe *pgconn.PgError
	if !errors.As(err, &pe) || pe.Position != int32(strings.Index("UPDATE accounts SET balance = nosuchcolumn WHERE id = 1", "nosuchcolumn")+1) {
		t.Fatalf("error position: %+v", err)
	}
}

func TestBatchPipelineLargeResult(t *testing.T) {
	lease := newStaticLease(t, "lease_b1", 11, "app.*", "public.accounts")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	b := &pgx.Batch{}
	b.Queue("SELECT count(*) FROM big")
	b.Queue("INSERT INTO app.items (name) VALUES ($1)", "batch")
	b.Queue("SELECT name FROM app.items WHERE name = $1", "batch")
	br := c.SendBatch(ctx, b)
	var n int
	if err := br.QueryRow().Scan(&n); err != nil || n != 50000 {
		t.Fatal(n, err)
	}
	if _, err := br.Exec(); err != nil {
		t.Fatalf("write in a batch after a read: %v", err)
	}
	var name string
	if err := br.QueryRow().Scan(&name); err != nil || name != "batch" {
		t.Fatal(name, err)
	}
	if err := br.Close(); err != nil {
		t.Fatal(err)
	}
	// Pipeline mode with several Syncs.
	pl := c.PgConn().StartPipeline(ctx)
	for i := 0; i < 5; i++ {
		pl.SendQueryParams("INSERT INTO app.items (name) VALUES ($1)", [][]byte{[]byte(fmt.Sprintf("pl%d", i))}, nil, nil, nil)
		pl.SendPipelineSync()
	}
	if err := pl.Flush(); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		r, err := pl.GetResults()
		if err != nil {
			t.Fatal(err)
		}
		if rr, ok := r.(*pgconn.ResultReader); ok {
			if _, err := rr.Close(); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := pl.GetResults(); err != nil { // the Sync
			t.Fatal(err)
		}
	}
	if err := pl.Close(); err != nil {
		t.Fatal(err)
	}
	// Large result set, both protocols.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheDescribe} {
		rows, err := c.Query(ctx, "SELECT id, payload FROM big ORDER BY id", mode)
		if err != nil {
			t.Fatal(err)
		}
		count := 0
		for rows.Next() {
			count++
		}
		if rows.Err() != nil || count != 50000 {
			t.Fatalf("%v: %d rows, %v", mode, count, rows.Err())
		}
	}
}

func TestCopyBothWays(t *testing.T) {
	resetState(t, "TRUNCATE app.log")
	lease := newStaticLease(t, "lease_c1", 13, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	rows := make([][]any, 20000)
	for i := range rows {
		rows[i] = []any{fmt.Sprintf("copy-%d", i)}
	}
	n, err := c.CopyFrom(ctx, pgx.Identifier{"app", "log"}, []string{"msg"}, pgx.CopyFromRows(rows))
	if err != nil || n != 20000 {
		t.Fatalf("copy from: %d %v", n, err)
	}
	var buf bytes.Buffer
	tag, err := c.PgConn().CopyTo(ctx, &buf, "COPY (SELECT msg FROM app.log ORDER BY id) TO STDOUT")
	if err != nil || tag.RowsAffected() != 20000 || !strings.HasPrefix(buf.String(), "copy-0\n") {
		t.Fatalf("copy to: %v %v", tag, err)
	}
	// Out of scope COPY FROM is refused before any data flows.
	_, err = c.PgConn().CopyFrom(ctx, strings.NewReader("1\tx\n"), "COPY public.other FROM STDIN")
	if pgCode(err) != "42501" {
		t.Fatalf("out-of-scope copy: %v", err)
	}
	// Lost lease: COPY TO still works, COPY FROM refused.
	lease.lose(errors.New("lease lost: test"))
	buf.Reset()
	if _, err := c.PgConn().CopyTo(ctx, &buf, "COPY app.log TO STDOUT"); err != nil {
		t.Fatal(err)
	}
	_, err = c.PgConn().CopyFrom(ctx, strings.NewReader("x\n"), "COPY app.log (msg) FROM STDIN")
	if pgCode(err) != "42501" {
		t.Fatalf("copy from without lease: %v", err)
	}
}

func TestClientVanishesMidCopy(t *testing.T) {
	lease := newStaticLease(t, "lease_v1", 15, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	// Start a COPY by hand and drop the socket halfway.
	var w msgBuilder
	w.query("BEGIN; INSERT INTO app.log (msg) VALUES ('vanish-begin'); COPY app.log (msg) FROM STDIN")
	at := w.begin('d')
	w.b = append(w.b, "half\n"...)
	w.end(at)
	vanish(t, p, "vanisher", "COPY app.log", w.b)
	var n int
	if err := adminConn(t).QueryRow(ctx, "SELECT count(*) FROM app.log WHERE msg IN ('vanish-begin', 'half')").Scan(&n); err != nil || n != 0 {
		t.Fatalf("rows of the vanished transaction: %d %v", n, err)
	}
}

// vanish connects through p as application app, sends msgs on the raw
// socket, waits until the backend is busy with them (a statement whose text
// holds marker: not a lookup of the proxy's own before it), then drops the
// socket (no Terminate) and waits until the backend is gone.
func vanish(t *testing.T, p *Proxy, app, marker string, msgs []byte) {
	t.Helper()
	c, err := pgconn.Connect(ctxT(t), proxyDSN(p, "agent")+"&application_name="+app)
	if err != nil {
		t.Fatal(err)
	}
	conn := c.Conn()
	if _, err := conn.Write(msgs); err != nil {
		t.Fatal(err)
	}
	waitBackends(t, true, "application_name = $1 AND state = 'active' AND strpos(query, $2) > 0", app, marker)
	conn.Close()
	waitBackends(t, false, "application_name = $1", app)
}

// TestClientVanishesMidQuery: a client whose socket closes while its
// statement runs (no CancelRequest, no Terminate) gets that statement
// cancelled by the proxy; Postgres alone would run it to the end.
func TestClientVanishesMidQuery(t *testing.T) {
	p := startProxy(t, Config{})
	var w msgBuilder
	w.query("SELECT pg_sleep(30)")
	// The backend must be gone within waitBackends' 10 s: only a cancel
	// ends the 30 s sleep that soon.
	vanish(t, p, "vanisher_q", "pg_sleep(30)", w.b)
}

// TestClientVanishesMidExecute: the same for an extended-protocol Execute
// sent with Flush and no Sync (a statement runs, nothing awaits
// ReadyForQuery yet).
func TestClientVanishesMidExecute(t *testing.T) {
	p := startProxy(t, Config{})
	var w msgBuilder
	w.parse("", "SELECT pg_sleep(30)")
	w.bind("", "")
	w.execute("")
	w.end(w.begin('H'))
	vanish(t, p, "vanisher_x", "pg_sleep(30)", w.b)
}

func TestListenNotifyAndCancel(t *testing.T) {
	p := startProxy(t, Config{}) // no lease at all: reads and notifications only
	ctx := ctxT(t)
	l := connect(t, proxyDSN(p, "agent"))
	s := connect(t, proxyDSN(p, "agent"))
	if _, err := l.Exec(ctx, "LISTEN fl_chan"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Exec(ctx, "NOTIFY fl_chan, 'hello'"); err != nil {
		t.Fatal(err)
	}
	n, err := l.WaitForNotification(ctx)
	if err != nil || n.Payload != "hello" {
		t.Fatal(n, err)
	}
	// Cancel a long query through the proxy.
	qctx, cancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = s.Exec(qctx, "SELECT pg_sleep(20)")
	if err == nil || time.Since(start) > 10*time.Second {
		t.Fatalf("cancel: %v after %s", err, time.Since(start))
	}
	c2 := connect(t, proxyDSN(p, "agent"))
	var one int
	if err := c2.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
		t.Fatal(err)
	}
	// The cancelled connection: pgx closes it after a context cancel; the
	// server side must be gone too.
	waitBackends(t, false, "query LIKE 'SELECT pg_sleep(20)%' AND state = 'active'")
}

func TestAuthMethods(t *testing.T) {
	p := startProxy(t, Config{})
	ctx := ctxT(t)
	for _, tc := range []struct{ user, pw string }{{"agent", ""}, {"scram_user", "scram-secret"}, {"md5_user", "md5-secret"}} {
		dsn := fmt.Sprintf("postgres://%s:%s@%s/%s?sslmode=disable", tc.user, tc.pw, p.Addr(), testDB)
		c, err := pgx.Connect(ctx, dsn)
		if err != nil {
			t.Fatalf("%s: %v", tc.user, err)
		}
		var u string
		if err := c.QueryRow(ctx, "SELECT current_user").Scan(&u); err != nil || u != tc.user {
			t.Fatalf("%s: %q %v", tc.user, u, err)
		}
		c.Close(ctx)
		bad := fmt.Sprintf("postgres://%s:wrong@%s/%s?sslmode=disable", tc.user, p.Addr(), testDB)
		if tc.pw != "" {
			if _, err := pgx.Connect(ctx, bad); pgCode(err) != "28P01" {
				t.Fatalf("%s with a wrong password: %v", tc.user, err)
			}
		}
	}
}

func selfSigned(t *testing.T) (*tls.Config, []byte) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, DNSNames: []string{"localhost"}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}}}, der
}

func TestTLS(t *testing.T) {
	cfg, der := selfSigned(t)
	p := startProxy(t, Config{TLS: cfg})
	ctx := ctxT(t)
	dir := t.TempDir()
	ca := filepath.Join(dir, "ca.pem")
	pemData := "-----BEGIN CERTIFICATE-----\n" + b64lines(der) + "-----END CERTIFICATE-----\n"
	if err := os.WriteFile(ca, []byte(pemData), 0o600); err != nil {
		t.Fatal(err)
	}
	dsn := fmt.Sprintf("postgres://scram_user:scram-secret@%s/%s?sslmode=verify-full&sslrootcert=%s", p.Addr(), testDB, ca)
	c, err := pgx.Connect(ctx, dsn)
	if err != nil {
		t.Fatalf("TLS with SCRAM: %v", err)
	}
	defer c.Close(ctx)
	if _, ok := c.PgConn().Conn().(*tls.Conn); !ok {
		t.Fatal("connection is not TLS")
	}
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM big").Scan(&n); err != nil || n != 50000 {
		t.Fatal(n, err)
	}
	// psql over TLS too.
	out := psql(t, fmt.Sprintf("host=127.0.0.1 port=%d dbname=%s user=agent sslmode=require", p.Addr().(*net.TCPAddr).Port, testDB), "SELECT 'tls-ok'")
	if !strings.Contains(out, "tls-ok") {
		t.Fatal(out)
	}
	// Without a TLS config, sslmode=require fails and prefer falls back.
	plain := startProxy(t, Config{})
	if _, err := pgx.Connect(ctx, fmt.Sprintf("postgres://agent@%s/%s?sslmode=require", plain.Addr(), testDB)); err == nil {
		t.Fatal("sslmode=require against a proxy that refuses TLS must fail")
	}
	c2, err := pgx.Connect(ctx, fmt.Sprintf("postgres://agent@%s/%s?sslmode=prefer", plain.Addr(), testDB))
	if err != nil {
		t.Fatal(err)
	}
	c2.Close(ctx)
}

func b64lines(der []byte) string {
	s := base64Std(der)
	var b strings.Builder
	for len(s) > 64 {
		b.WriteString(s[:64] + "\n")
		s = s[64:]
	}
	b.WriteString(s + "\n")
	return b.String()
}

func psql(t *testing.T, conninfo string, args ...string) string {
	t.Helper()
	cmdArgs := []string{"-X", "-v", "ON_ERROR_STOP=1", "-At", conninfo}
	for _, a := range args {
		cmdArgs = append(cmdArgs, "-c", a)
	}
	cmd := exec.Command(filepath.Join(pg.BinDir, "psql"), cmdArgs...)
	cmd.Env = append(os.Environ(), "PGCONNECT_TIMEOUT=10")
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out) + "\nERR: " + err.Error()
	}
	return string(out)
}

func TestPsql(t *testing.T) {
	lease := newStaticLease(t, "lease_psql", 17, "app.*")
	p := startProxy(t, Config{Lease: lease})
	ci := fmt.Sprintf("host=127.0.0.1 port=%d dbname=%s user=agent sslmode=disable", p.Addr().(*net.TCPAddr).Port, testDB)
	out := psql(t, ci, "SELECT count(*) FROM big", "INSERT INTO app.items (name) VALUES ('psql') RETURNING name",
		`\copy app.log (msg) FROM program 'printf "a\nb\n"'`, `\copy (SELECT 'copied-out') TO stdout`)
	for _, want := range []string{"50000", "psql", "COPY 2", "copied-out"} {
		if !strings.Contains(out, want) {
			t.Fatalf("psql output lacks %q:\n%s", want, out)
		}
	}
	out = psql(t, ci, "DELETE FROM public.other")
	if !strings.Contains(out, "write refused") || !strings.Contains(out, "lease_psql") {
		t.Fatalf("psql refusal:\n%s", out)
	}
}

// rawConn speaks the protocol by hand for bad-input tests.
func rawStartup(t *testing.T, p *Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(10 * time.Second))
	c.Write(buildStartup(protoV3, map[string]string{"user": "agent", "database": testDB}))
	r := newMsgReader(c, 1<<20)
	for {
		ty, _, err := r.next()
		if err != nil {
			t.Fatal(err)
		}
		if ty == 'Z' {
			return readerConn{c, r}
		}
	}
}

type readerConn struct {
	net.Conn
	r *msgReader
}

func (rc readerConn) Read(b []byte) (int, error) { return rc.r.r.Read(b) }

func expectFatal(t *testing.T, c net.Conn, want string) {
	t.Helper()
	r := newMsgReader(c, 1<<20)
	if rc, ok := c.(readerConn); ok {
		r = rc.r
	}
	for {
		ty, raw, err := r.next()
		if err != nil {
			t.Fatalf("want an ErrorResponse with %q, got %v", want, err)
		}
		if ty == 'E' {
			f := errorFields(raw)
			if !strings.Contains(f['M'], want) {
				t.Fatalf("error %q lacks %q", f['M'], want)
			}
			break
		}
	}
	// Then the connection closes.
	if _, _, err := r.next(); !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !isReset(err) {
		t.Fatalf("connection not closed after the error: %v", err)
	}
}

func isReset(err error) bool {
	var ne *net.OpError
	return errors.As(err, &ne)
}

func TestBadInput(t *testing.T) {
	p := startProxy(t, Config{MaxMessageSize: 1 << 16})
	t.Run("unknown message type", func(t *testing.T) {
		c := rawStartup(t, p)
		c.Write([]byte{'?', 0, 0, 0, 4})
		expectFatal(t, c, "unknown message type")
	})
	t.Run("oversized message", func(t *testing.T) {
		c := rawStartup(t, p)
		var hdr [5]byte
		hdr[0] = 'Q'
		binary.BigEndian.PutUint32(hdr[1:], 1<<20)
		c.Write(hdr[:])
		expectFatal(t, c, "over the limit")
	})
	t.Run("bad length", func(t *testing.T) {
		c := rawStartup(t, p)
		c.Write([]byte{'Q', 0, 0, 0, 2})
		expectFatal(t, c, "length")
	})
	t.Run("protocol version", func(t *testing.T) {
		c, err := net.Dial("tcp", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write(buildStartup(2<<16, map[string]string{"user": "agent"}))
		expectFatal(t, c, "unsupported frontend protocol")
	})
	t.Run("garbage startup", func(t *testing.T) {
		c, err := net.Dial("tcp", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		c.Write([]byte{0, 0, 0, 3})
		expectFatal(t, c, "startup packet")
	})
	t.Run("gssenc refused", func(t *testing.T) {
		c, err := net.Dial("tcp", p.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		var b [8]byte
		binary.BigEndian.PutUint32(b[:], 8)
		binary.BigEndian.PutUint32(b[4:], gssEncRequest)
		c.Write(b[:])
		var ans [1]byte
		if _, err := io.ReadFull(c, ans[:]); err != nil || ans[0] != 'N' {
			t.Fatalf("GSSENCRequest answer %q %v", ans[0], err)
		}
	})
	t.Run("malformed Parse", func(t *testing.T) {
		c := rawStartup(t, p)
		c.Write([]byte{'P', 0, 0, 0, 7, 'a', 'b', 'c', 'S', 0, 0, 0, 4})
		expectFatal(t, c, "unterminated")
	})
	// Mid-transaction bad input: the backend rolls back.
	t.Run("mid transaction", func(t *testing.T) {
		c := rawStartup(t, p)
		var w msgBuilder
		w.query("BEGIN")
		c.Write(w.b)
		r := c.(readerConn).r
		for {
			ty, _, err := r.next()
			if err != nil {
				t.Fatal(err)
			}
			if ty == 'Z' {
				break
			}
		}
		c.Write([]byte{0xff, 0, 0, 0, 4})
		expectFatal(t, c, "unknown message type")
		waitBackends(t, false, "datname = $1 AND state LIKE 'idle in transaction%'", testDB)
	})
}

func base64Std(b []byte) string { return base64.StdEncoding.EncodeToString(b) }

// TestUnixSocketUpstream: with Upstream the path of Postgres's Unix socket,
// reads, fenced writes (the trigger checks the token) and cancel requests
// all reach the server over it.
func TestUnixSocketUpstream(t *testing.T) {
	sock := pg.SocketPath()
	if sock == "" {
		t.Skip("FENCELINE_TEST_PG names an external server: its socket is not known here")
	}
	lease := newStaticLease(t, "lease_unix", 0, "public.accounts")
	p := startProxy(t, Config{Upstream: sock, Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	var addr *string
	if err := c.QueryRow(ctx, "SELECT inet_client_addr()::text").Scan(&addr); err != nil {
		t.Fatal(err)
	}
	if addr != nil {
		t.Fatalf("the proxy reached Postgres from %s: want its Unix socket (no client address)", *addr)
	}
	if _, err := c.Exec(ctx, "UPDATE public.accounts SET balance = balance WHERE id = 1"); err != nil {
		t.Fatalf("fenced write over the Unix socket: %v", err)
	}
	qctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := c.Exec(qctx, "SELECT pg_sleep(20.5)"); err == nil || time.Since(start) > 10*time.Second {
		t.Fatalf("cancel over the Unix socket: %v after %s", err, time.Since(start))
	}
	// The CancelRequest reached the server: the query is gone, not just the client.
	waitBackends(t, false, "query = 'SELECT pg_sleep(20.5)' AND state = 'active'")
}

// TestUpstreamValidation: a bad Upstream is named, with what to write.
func TestUpstreamValidation(t *testing.T) {
	for _, tc := range []struct{ upstream, want string }{
		{"db.internal", "want host:port or the absolute path of a Unix socket"},
		{t.TempDir(), "is a directory: name the socket in it"},
	} {
		err := (&Config{Upstream: tc.upstream}).Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Upstream %q: want an error containing %q, got %v", tc.upstream, tc.want, err)
		}
	}
	if err := (&Config{Upstream: "/var/run/postgresql/.s.PGSQL.5432"}).Validate(); err != nil {
		t.Errorf("a socket path: %v", err)
	}
}
