package pgproxy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

type bus struct {
	nc  *nats.Conn
	c   *leasebus.Client
	aud *leasebus.Auditor
}

// startBus starts a real bus through the shared test helper (which
// connects as the bus's test identity).
func startBus(t *testing.T) *bus {
	t.Helper()
	b := bustest.Start(t)
	return &bus{nc: b.Conn, c: b.Client, aud: b.Auditor}
}

func (b *bus) hold(t *testing.T, ws string, ttl time.Duration, tables ...string) *leasebus.Holder {
	t.Helper()
	claim, err := scope.New(nil, false, tables)
	if err != nil {
		t.Fatal(err)
	}
	cred := leasebus.NewCredential()
	h, err := b.c.AcquireAndHold(ctxT(t), leasebus.AcquireRequest{
		Repo: "github.com/acme/zombie", Scope: claim, WorkspaceID: ws, WorkspaceMode: lease.WorkspaceExclusive,
		Owner: lease.Owner{TaskID: "task-" + ws, AgentID: "agent-" + ws, AttemptID: "att-" + ws},
		TTL:   lease.Duration(ttl), Wait: lease.Duration(20 * time.Second),
	}, cred, leasebus.HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	return h
}

// TestZombieWriteRejectedByPostgres: holder A's lease expires and is granted
// to B, B writes; A's proxy, still believing it holds the lease, sends a
// write: Postgres itself rejects it with 40001. A's proxy driven by the real
// holder refuses the write itself, with an audit event on the bus.
func TestZombieWriteRejectedByPostgres(t *testing.T) { forEachTrigger(t, testZombieWrite) }

func testZombieWrite(t *testing.T, f *fenceDB) {
	// A fresh bus starts its fences at 1 again; forget an earlier run's.
	f.resetEpoch(t, "public.zombie")
	b := startBus(t)
	ctx := ctxT(t)
	a := b.hold(t, "ws-a", time.Second, "public.zombie")
	zombieSrc := leasebus.Frozen{Record: a.Lease()} // the holder just before it paused
	zombie := f.proxy(t, Config{Lease: zombieSrc})
	za := f.via(t, zombie, "agent")
	if _, err := za.Exec(ctx, "UPDATE public.zombie SET balance = 1 WHERE id = 2"); err != nil {
		t.Fatalf("A writes while its lease is live: %v", err)
	}
	// A pauses: no renewals; its lease expires and B gets the table.
	a.Orphan()
	bh := b.hold(t, "ws-b", 5*time.Second, "public.zombie")
	if bh.Lease().Fence <= zombieSrc.Record.Fence {
		t.Fatalf("B's fence %d is not above A's %d", bh.Lease().Fence, zombieSrc.Record.Fence)
	}
	bp := f.proxy(t, Config{Lease: bh, Audit: b.aud})
	bc := f.via(t, bp, "agent")
	if _, err := bc.Exec(ctx, "UPDATE public.zombie SET balance = 2 WHERE id = 2"); err != nil {
		t.Fatalf("B writes: %v", err)
	}
	// The zombie's write reaches Postgres with A's token: rejected there.
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		_, err := za.Exec(ctx, "UPDATE public.zombie SET balance = 3 WHERE id = 2", mode)
		if pgCode(err) != "40001" || !strings.Contains(err.Error(), "stale fence") {
			t.Fatalf("zombie write (%v): want SQLSTATE 40001 stale fence, got %v", mode, err)
		}
	}
	var bal int
	if err := bc.QueryRow(ctx, "SELECT balance FROM public.zombie WHERE id = 2").Scan(&bal); err != nil || bal != 2 {
		t.Fatalf("balance %d %v: want B's 2", bal, err)
	}
	// Reads still flow for the zombie.
	if err := za.QueryRow(ctx, "SELECT balance FROM public.zombie WHERE id = 2").Scan(&bal); err != nil {
		t.Fatal(err)
	}

	// A's own proxy with the real holder: refused before Postgres, audited.
	real := f.proxy(t, Config{Lease: a, Audit: b.aud})
	ra := f.via(t, real, "agent")
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		_, err := a.Fence()
		if err == nil {
			return errString("holder A still believes it holds the lease")
		}
		return nil
	})
	_, err := ra.Exec(ctx, "UPDATE public.zombie SET balance = 4 WHERE id = 2")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease not held") {
		t.Fatalf("A through its real holder: want 42501 lease not held, got %v", err)
	}
	testutil.CheckFor(t, 10*time.Second, 100*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.nc, "github.com/acme/zombie", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventDenied && ev.Boundary == lease.BoundaryPostgres && ev.LeaseID == a.Lease().LeaseID {
				if ev.Fence != zombieSrc.Record.Fence || ev.Reason != ReasonLeaseLost || ev.Owner.AgentID != "agent-ws-a" {
					return errString("denied event lacks fence/reason/owner")
				}
				return nil
			}
		}
		return errString("no postgres denied event for A on the audit stream")
	})
}

type errString string

func (e errString) Error() string { return string(e) }

// TestStorageFenceWithoutProxy: a write straight to Postgres (no token), a
// forged token, a token for another table, all fail in Postgres.
func TestStorageFenceWithoutProxy(t *testing.T) { forEachTrigger(t, testStorageFenceWithoutProxy) }

func testStorageFenceWithoutProxy(t *testing.T, f *fenceDB) {
	ctx := ctxT(t)
	c := f.agent(t)
	_, err := c.Exec(ctx, "INSERT INTO public.other VALUES (100, 'direct')")
	if pgCode(err) != "40001" || !strings.Contains(err.Error(), "no fence token") {
		t.Fatalf("direct write: want 40001 no fence token, got %v", err)
	}
	forged := mustToken(t, []byte("not-the-secret-not-the-secret!!"), c, "lease_forged", 1<<40, "public.*")
	err = writeWithToken(ctx, c, forged, "INSERT INTO public.other VALUES (101, 'forged')")
	if pgCode(err) != "40001" || !strings.Contains(err.Error(), "forged") {
		t.Fatalf("forged token: want 40001 forged, got %v", err)
	}
	// The agent's role cannot read the secret.
	var k []byte
	err = c.QueryRow(ctx, "SELECT key FROM fenceline.secret").Scan(&k)
	if pgCode(err) != "42501" {
		t.Fatalf("agent reads the secret: want 42501 permission denied, got %v", err)
	}
	// A genuine token for another table does not cover this one.
	tok := mustToken(t, f.secret, c, "lease_scoped", 1, "public.accounts")
	err = writeWithToken(ctx, c, tok, "INSERT INTO public.other VALUES (102, 'scoped')")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "does not claim") {
		t.Fatalf("token for another table: want 42501, got %v", err)
	}
}

// writeWithToken runs an INSERT into table on c (straight to Postgres, no
// proxy) in a transaction that carries tok, and commits it.
func writeWithToken(ctx context.Context, c *pgx.Conn, tok, sql string) error {
	tx, err := c.Begin(ctx)
	if err != nil {
		return err
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, "SELECT set_config('fenceline.token', $1, true)", tok); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, sql); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// TestStorageFenceSessionMark: the trigger's fast path trusts a token only
// when its hash is the session's currval of fenceline.verified, which only
// the slow path (after checking the MAC) can set. Swapping the token in a
// session, forging the session setting, or setting the sequence as the
// agent all fail.
func TestStorageFenceSessionMark(t *testing.T) { forEachTrigger(t, testStorageFenceSessionMark) }

func testStorageFenceSessionMark(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	ctx := ctxT(t)
	c := f.agent(t)
	good := mustToken(t, f.secret, c, "lease_mark", 7, "public.race")
	// Same fence, so only the token check stands between it and a write.
	forged := mustToken(t, []byte("not-the-secret-not-the-secret!!"), c, "lease_mark", 7, "public.*")
	for i := 1; i <= 3; i++ { // the first write takes the slow path, the rest the fast one
		if err := writeWithToken(ctx, c, good, fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'good')", i)); err != nil {
			t.Fatalf("write %d with a genuine token: %v", i, err)
		}
	}
	var mark string
	if err := c.QueryRow(ctx, "SELECT current_setting('fenceline.verified', true)").Scan(&mark); err != nil || mark == "" {
		t.Fatalf("no session mark after a verified write: %q %v", mark, err)
	}
	// The fast path is what takes the next write: with the secret rotated
	// under it, this session still writes (no MAC check), a new one cannot.
	admin := f.admin(t)
	var key []byte
	if err := admin.QueryRow(ctx, "SELECT key FROM fenceline.secret WHERE id = 1").Scan(&key); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "UPDATE fenceline.secret SET key = sha256(key) WHERE id = 1"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := f.admin(t).Exec(context.Background(), "UPDATE fenceline.secret SET key = $1 WHERE id = 1", key); err != nil {
			t.Errorf("restore the fence secret: %v", err)
		}
	})
	if err := writeWithToken(ctx, c, good, "INSERT INTO public.race VALUES (4, 'fast path')"); err != nil {
		t.Fatalf("verified session after the secret changed: %v (the fast path was not taken)", err)
	}
	if err := writeWithToken(ctx, f.agent(t), good, "INSERT INTO public.race VALUES (5, 'slow path')"); pgCode(err) != "40001" || !strings.Contains(err.Error(), "forged") {
		t.Fatalf("new session after the secret changed: want 40001 forged, got %v", err)
	}
	if _, err := admin.Exec(ctx, "UPDATE fenceline.secret SET key = $1 WHERE id = 1", key); err != nil {
		t.Fatal(err)
	}
	// The verified token does not claim public.other: refused even with the
	// table's epoch at the token's fence, where the fast path's only
	// remaining check is the claim.
	f.reset(t, "SELECT setval(seq, 7, true) FROM fenceline.epoch WHERE relid = 'public.other'::regclass")
	t.Cleanup(func() { f.resetEpoch(t, "public.other") })
	err := writeWithToken(ctx, c, good, "INSERT INTO public.other VALUES (7, 'unclaimed')")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "does not claim") {
		t.Fatalf("verified token on a table it does not claim: want 42501, got %v", err)
	}
	// Same session, mark in place, another token: the hash differs, the
	// slow path checks the MAC.
	err = writeWithToken(ctx, c, forged, "INSERT INTO public.race VALUES (10, 'swapped')")
	if pgCode(err) != "40001" || !strings.Contains(err.Error(), "forged") {
		t.Fatalf("token swapped after a verified one: want 40001 forged, got %v", err)
	}
	// A fresh session that forges the mark for its forged token: currval
	// was never set in it, so the write fails.
	fresh := f.agent(t)
	sum := sha256.Sum256([]byte(forged)) // the mark: the hash's first 8 bytes as a bigint
	forgedHash := strconv.FormatInt(int64(binary.BigEndian.Uint64(sum[:8])), 10)
	if _, err := fresh.Exec(ctx, "SELECT set_config('fenceline.verified', $1, false)", forgedHash); err != nil {
		t.Fatal(err)
	}
	// currval was never set in this session: the fast path fails on it.
	if err := writeWithToken(ctx, fresh, forged, "INSERT INTO public.race VALUES (11, 'forged mark')"); pgCode(err) != "55000" {
		t.Fatalf("a forged session mark: want 55000 (currval not yet defined), got %v", err)
	}
	// The agent cannot set the mark's sequence, nor an epoch.
	for _, q := range []string{
		"SELECT setval('fenceline.verified', " + forgedHash + ")",
		"SELECT setval(seq, 1 << 50) FROM fenceline.epoch",
		"SELECT nextval('fenceline.verified')",
		"SELECT setval('fenceline.session', " + strconv.FormatInt(sessionOf(t, c), 10) + ")",
		"SELECT nextval('fenceline.session')",
		"SELECT currval('fenceline.session')",
	} {
		_, err := fresh.Exec(ctx, q)
		if pgCode(err) != "42501" {
			t.Fatalf("%s as the agent: want 42501, got %v", q, err)
		}
	}
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM public.race").Scan(&n); err != nil || n != 4 {
		t.Fatalf("public.race has %d rows (%v): want the 4 genuine ones", n, err)
	}
}

// TestTokenSwappedWithinTransaction: the C trigger remembers, for the rest
// of a transaction, the token it found verified there. A token swapped in
// after it (a forged one, and the session's genuine token of another lease
// the slow path has not verified) is checked afresh, every time: the second
// attempt of the same forged token in the transaction is refused as the
// first was, and the genuine token still writes between them.
func TestTokenSwappedWithinTransaction(t *testing.T) { forEachTrigger(t, testTokenSwapped) }

func testTokenSwapped(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	ctx := ctxT(t)
	c := f.agent(t)
	good := mustToken(t, f.secret, c, "lease_swap", 1, "public.race")
	forged := mustToken(t, []byte("not-the-secret-not-the-secret!!"), c, "lease_swap", 1, "public.race")
	// The first write verifies good (the slow path); the swaps below come
	// when the fast path has found it verified in this very transaction.
	if err := writeWithToken(ctx, c, good, "INSERT INTO public.race VALUES (1, 'good')"); err != nil {
		t.Fatalf("first write with the genuine token: %v", err)
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx) //nolint:errcheck // no-op after commit
	exec := func(sql string, args ...any) error {
		_, err := tx.Exec(ctx, sql, args...)
		return err
	}
	if err := exec("SELECT set_config('fenceline.token', $1, true)", good); err != nil {
		t.Fatal(err)
	}
	if err := exec("INSERT INTO public.race VALUES (2, 'good, fast path')"); err != nil {
		t.Fatalf("genuine token in the transaction: %v", err)
	}
	for round := range 2 {
		for i := range 2 { // twice in a row: the first attempt must not vouch for the second
			if err := exec("SAVEPOINT swap"); err != nil {
				t.Fatal(err)
			}
			if err := exec("SELECT set_config('fenceline.token', $1, true)", forged); err != nil {
				t.Fatal(err)
			}
			err := exec(fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'forged')", 10+2*round+i))
			if pgCode(err) != "40001" || !strings.Contains(err.Error(), "forged") {
				t.Fatalf("forged token swapped in after a verified one (round %d, attempt %d): want 40001 forged, got %v", round+1, i+1, err)
			}
			// The savepoint's rollback brings the genuine token back.
			if err := exec("ROLLBACK TO SAVEPOINT swap"); err != nil {
				t.Fatal(err)
			}
		}
		if err := exec(fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'good again')", 3+round)); err != nil {
			t.Fatalf("genuine token after the forged one was refused (round %d): %v", round+1, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var rows string
	if err := f.admin(t).QueryRow(ctx, "SELECT string_agg(writer, ',' ORDER BY id) FROM public.race").Scan(&rows); err != nil ||
		rows != "good,good, fast path,good again,good again" {
		t.Fatalf("public.race holds %q (%v): want only the genuine writes", rows, err)
	}
}

func testEpochRaise(t *testing.T, f *fenceDB) {
	for _, iso := range []string{"read committed", "repeatable read", "serializable"} {
		t.Run(strings.ReplaceAll(iso, " ", "_"), func(t *testing.T) {
			f.reset(t, "TRUNCATE public.race")
			f.resetEpoch(t, "public.race")
			ctx := ctxT(t)
			z := f.agent(t)
			n := f.agent(t)
			late := f.agent(t) // another session of the old lease, its token verified
			oldTok := mustToken(t, f.secret, z, "lease_old", 20, "public.race")
			lateTok := mustToken(t, f.secret, late, "lease_old", 20, "public.race")
			newTok := mustToken(t, f.secret, n, "lease_new", 21, "public.race")
			if err := writeWithToken(ctx, z, oldTok, "INSERT INTO public.race VALUES (1, 'old')"); err != nil {
				t.Fatalf("old lease's first write: %v", err)
			}
			if err := writeWithToken(ctx, late, lateTok, "INSERT INTO public.race VALUES (6, 'old, other session')"); err != nil {
				t.Fatalf("old lease's first write in another session: %v", err)
			}
			// The old holder has a transaction open on the table.
			ztx, err := z.BeginTx(ctx, pgx.TxOptions{IsoLevel: pgx.TxIsoLevel(iso)})
			if err != nil {
				t.Fatal(err)
			}
			defer ztx.Rollback(ctx)
			if _, err := ztx.Exec(ctx, "SELECT set_config('fenceline.token', $1, true)", oldTok); err != nil {
				t.Fatal(err)
			}
			if _, err := ztx.Exec(ctx, "INSERT INTO public.race VALUES (2, 'old, open')"); err != nil {
				t.Fatalf("old lease writes in an open transaction: %v", err)
			}
			var npid int
			if err := n.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&npid); err != nil {
				t.Fatal(err)
			}
			// The raise waits as long as the session's lock_timeout says
			// (raiseLockTimeout when it sets none).
			if _, err := n.Exec(ctx, "SET lock_timeout = '20s'"); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- writeWithToken(ctx, n, newTok, "INSERT INTO public.race VALUES (3, 'new')") }()
			// The new lease's write waits for the table's gate.
			a := f.admin(t)
			checkWaitsAtGate(t, a, npid, "public.race", "ShareRowExclusiveLock")
			// An old-fence write that starts now (its peek at the epoch still
			// passes) waits at the gate behind the raise.
			var latePid int
			if err := late.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&latePid); err != nil {
				t.Fatal(err)
			}
			lateDone := make(chan error, 1)
			go func() {
				lateDone <- writeWithToken(ctx, late, lateTok, "INSERT INTO public.race VALUES (7, 'old, late')")
			}()
			checkWaitsAtGate(t, a, latePid, "public.race", "RowExclusiveLock")
			// Meanwhile the old holder may still write: its epoch stands.
			if _, err := ztx.Exec(ctx, "INSERT INTO public.race VALUES (4, 'old, still open')"); err != nil {
				t.Fatalf("old lease writes again before the raise: %v", err)
			}
			if err := ztx.Commit(ctx); err != nil {
				t.Fatalf("old lease commits: %v", err)
			}
			if err := <-done; err != nil {
				t.Fatalf("new lease's write after the old transaction ended: %v", err)
			}
			if err := <-lateDone; pgCode(err) != "40001" || !strings.Contains(err.Error(), "stale fence") {
				t.Fatalf("old-fence write that waited at the gate: want 40001 stale fence, got %v", err)
			}
			err = writeWithToken(ctx, z, oldTok, "INSERT INTO public.race VALUES (5, 'zombie')")
			if pgCode(err) != "40001" || !strings.Contains(err.Error(), "stale fence") || !strings.Contains(err.Error(), "lease_new") {
				t.Fatalf("old lease after the raise: want 40001 stale fence naming lease_new, got %v", err)
			}
			var epoch int64
			if err := a.QueryRow(ctx, "SELECT pg_sequence_last_value(seq) FROM fenceline.epoch WHERE relid = 'public.race'::regclass").Scan(&epoch); err != nil || epoch != 21 {
				t.Fatalf("epoch %d (%v): want 21", epoch, err)
			}
		})
	}
}

// TestGateSurvivesRollbackToSavepoint: a transaction that wrote under a
// savepoint and rolled back to it still holds the gate (the lock belongs to
// the whole transaction, as Postgres's own cache of it assumes), so a newer
// lease's raise still waits for it, and its later writes need no new pass.
func TestGateSurvivesRollbackToSavepoint(t *testing.T) { forEachTrigger(t, testGateSavepoint) }

func testGateSavepoint(t *testing.T, f *fenceDB) {
	// The write under the savepoint takes the slow path (its token not yet
	// verified in the session: fence_slow_gate reads the gate) or the fast
	// one (verified by a transaction before: the trigger passes the gate
	// itself).
	for _, verified := range []bool{false, true} {
		t.Run(map[bool]string{false: "slow_path", true: "fast_path"}[verified], func(t *testing.T) {
			testGateSavepointPath(t, f, verified)
		})
	}
}

func testGateSavepointPath(t *testing.T, f *fenceDB, verified bool) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	ctx := ctxT(t)
	w, n, a := f.agent(t), f.agent(t), f.admin(t)
	oldTok := mustToken(t, f.secret, w, "lease_old", 30, "public.race")
	newTok := mustToken(t, f.secret, n, "lease_new", 31, "public.race")
	want := "after rollback to, new"
	if verified {
		if err := writeWithToken(ctx, w, oldTok, "INSERT INTO public.race VALUES (0, 'verifies')"); err != nil {
			t.Fatal(err)
		}
		want = "verifies, " + want
	}
	wtx, err := w.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer wtx.Rollback(ctx)
	if _, err := wtx.Exec(ctx, "SELECT set_config('fenceline.token', $1, true)", oldTok); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"SAVEPOINT a", "INSERT INTO public.race VALUES (1, 'rolled back')", "ROLLBACK TO SAVEPOINT a"} {
		if _, err := wtx.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	var npid int
	if err := n.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&npid); err != nil {
		t.Fatal(err)
	}
	if _, err := n.Exec(ctx, "SET lock_timeout = '20s'"); err != nil { // (see testEpochRaise)
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- writeWithToken(ctx, n, newTok, "INSERT INTO public.race VALUES (3, 'new')") }()
	checkWaitsAtGate(t, a, npid, "public.race", "ShareRowExclusiveLock")
	if _, err := wtx.Exec(ctx, "INSERT INTO public.race VALUES (2, 'after rollback to')"); err != nil {
		t.Fatalf("old lease writes again after ROLLBACK TO, before the raise: %v", err)
	}
	if err := wtx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("new lease's write after the old transaction ended: %v", err)
	}
	var rows string
	if err := a.QueryRow(ctx, "SELECT string_agg(writer, ', ' ORDER BY id) FROM public.race").Scan(&rows); err != nil || rows != want {
		t.Fatalf("public.race holds %q (%v), want the old write, then the new", rows, err)
	}
}

// checkWaitsAtGate waits (bounded) until session pid waits for nothing but
// fenced table rel's gate, in lock mode mode.
func checkWaitsAtGate(t *testing.T, admin *pgx.Conn, pid int, rel, mode string) {
	t.Helper()
	want := gateOf(t, admin, rel) + " " + mode
	testutil.CheckFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		var waitsFor string
		err := admin.QueryRow(context.Background(), `SELECT coalesce(string_agg(l.relation::regclass || ' ' || l.mode, ', '), '')
			FROM pg_locks l WHERE l.pid = $1 AND NOT l.granted`, pid).Scan(&waitsFor)
		if err != nil {
			return err
		}
		if waitsFor != want {
			return fmt.Errorf("session %d waits for %q, want %s", pid, waitsFor, want)
		}
		return nil
	})
}

// TestGateMadeAgainIsTheOneHeld: the C trigger keeps the sequences it
// resolved by name. When the table's gate is dropped and made again under
// the same name (by hand, or an install after it went missing), a session
// that passed the old one waits at the new one while a raise holds it: the
// drop's invalidation sends it back to the name. A session that kept the
// dropped relation's number would lock a relation nobody raises under, and
// write through a raise.
func TestGateMadeAgainIsTheOneHeld(t *testing.T) { forEachTrigger(t, testGateMadeAgain) }

func testGateMadeAgain(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	ctx := ctxT(t)
	w, a := f.agent(t), f.admin(t)
	tok := mustToken(t, f.secret, w, "lease_again", 1, "public.race")
	for i := 1; i <= 2; i++ { // the first verifies the token, the second takes the fast path
		if err := writeWithToken(ctx, w, tok, fmt.Sprintf("INSERT INTO public.race VALUES (%d, 'before')", i)); err != nil {
			t.Fatalf("write %d through the first gate: %v", i, err)
		}
	}
	gate := gateOf(t, a, "public.race")
	var owner string
	if err := a.QueryRow(ctx, "SELECT relowner::regrole::text FROM pg_class WHERE oid = $1::regclass", gate).Scan(&owner); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Exec(ctx, fmt.Sprintf(`DROP SEQUENCE %[1]s;
CREATE SEQUENCE %[1]s AS bigint MINVALUE 1;
SELECT setval('%[1]s', 1, true);
GRANT SELECT ON SEQUENCE %[1]s TO PUBLIC;
ALTER SEQUENCE %[1]s OWNER TO %[2]s;
UPDATE fenceline.epoch SET gate = '%[1]s' WHERE relid = 'public.race'::regclass`, gate, owner)); err != nil {
		t.Fatalf("make the gate again: %v", err)
	}
	// (As fenceTable makes a gate; other tests read it.) A raise's hold
	// of the new gate, as fence_slow_gate takes it.
	raise, err := a.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer raise.Rollback(ctx) //nolint:errcheck // no-op after commit
	if _, err := raise.Exec(ctx, "ALTER SEQUENCE "+gate+" OWNED BY NONE"); err != nil {
		t.Fatal(err)
	}
	var wpid int
	if err := w.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&wpid); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- writeWithToken(ctx, w, tok, "INSERT INTO public.race VALUES (3, 'after')") }()
	checkWaitsAtGate(t, f.admin(t), wpid, "public.race", "RowExclusiveLock")
	if err := raise.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("write once the raise's hold ended (the epoch unchanged): %v", err)
	}
}

// gateOf names the gate sequence of fenced table rel.
func gateOf(t *testing.T, admin *pgx.Conn, rel string) string {
	t.Helper()
	var gate string
	if err := admin.QueryRow(ctxT(t), "SELECT gate::text FROM fenceline.epoch WHERE relid = $1::regclass", rel).Scan(&gate); err != nil {
		t.Fatalf("gate of %s: %v", rel, err)
	}
	return gate
}

// lockedBuffer is an io.Writer for a slog handler shared by goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// TestNoSecretRefusedByPostgresWarnedOnce: a proxy started without the
// fence secret cannot sign tokens. Postgres refuses its writes to fenced
// tables, and the proxy says why once per lease and fence, not once per write.
func TestNoSecretRefusedByPostgresWarnedOnce(t *testing.T) {
	ctx := ctxT(t)
	var logs lockedBuffer
	lease := newStaticLease(t, "lease_nosecret", 0, "public.accounts")
	p, err := Listen(ctx, Config{Upstream: pg.Addr(), Lease: lease, Logger: slog.New(slog.NewTextHandler(&logs, nil))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	c := connect(t, proxyDSN(p, "agent"))
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		_, err := c.Exec(ctx, "UPDATE public.accounts SET balance = balance + 1 WHERE id = 1", mode)
		if pgCode(err) != "40001" || !strings.Contains(err.Error(), "no fence token") {
			t.Fatalf("%v: want 40001 no fence token from Postgres, got %v", mode, err)
		}
	}
	if n := strings.Count(logs.String(), "no fence token"); n != 1 || !strings.Contains(logs.String(), "lease=lease_nosecret") {
		t.Fatalf("want one warning naming the lease for three writes, got %d:\n%s", n, logs.String())
	}
}

// TestDiscardKeepsFencedWrites: DISCARD SEQUENCES forgets the currval the
// trigger's fast path reads; the proxy resets the setting that says it is
// there, so the next fenced write takes the slow path instead of failing.
// DISCARD ALL resets both by itself.
func TestDiscardKeepsFencedWrites(t *testing.T) { forEachTrigger(t, testDiscardKeepsFencedWrites) }

func testDiscardKeepsFencedWrites(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	p := f.proxy(t, Config{Lease: newStaticLease(t, "lease_discard", 0, "public.race")})
	ctx := ctxT(t)
	c := f.via(t, p, "agent")
	simple, extended := pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec
	for _, step := range []struct {
		sql  string
		mode pgx.QueryExecMode
	}{
		{"INSERT INTO public.race VALUES (1, 'before')", simple},
		{"DISCARD SEQUENCES", extended},
		{"INSERT INTO public.race VALUES (2, 'after discard sequences')", extended},
		{"DISCARD SEQUENCES", simple},
		{"INSERT INTO public.race VALUES (3, 'after discard sequences')", simple},
		{"DISCARD ALL", simple},
		{"INSERT INTO public.race VALUES (4, 'after discard all')", extended},
	} {
		if _, err := c.Exec(ctx, step.sql, step.mode); err != nil {
			t.Fatalf("%s: %v", step.sql, err)
		}
	}
	var n int
	if err := f.admin(t).QueryRow(ctx, "SELECT count(*) FROM public.race").Scan(&n); err != nil || n != 4 {
		t.Fatalf("public.race has %d rows (%v): want 4", n, err)
	}
}

// TestInstallUpgradesOldFence: a database fenced by the previous version
// (testdata/fence_v3.sql, that version's schema and functions, and
// fence_v3_table.sql, its three-argument trigger, on two tables, with the
// advisory lock and no gate) keeps its secret and epochs when this version installs on one of the two
// tables; both get the gate protocol, the old functions are gone, and the
// epochs still stop a stale fence.
func TestInstallUpgradesOldFence(t *testing.T) {
	ctx := ctxT(t)
	const db = "fenceline_upgrade"
	root := connect(t, pg.AdminDSN(""))
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db, "CREATE DATABASE " + db} {
		if _, err := root.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	admin := connect(t, pg.AdminDSN(db))
	old, err := os.ReadFile("testdata/fence_v3.sql")
	if err != nil {
		t.Fatal(err)
	}
	oldTable, err := os.ReadFile("testdata/fence_v3_table.sql")
	if err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte{7}, 32)
	if _, err := admin.Exec(ctx, "CREATE TABLE public.named (id int); CREATE TABLE public.unnamed (id int); GRANT ALL ON public.named, public.unnamed TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, string(old)); err != nil {
		t.Fatalf("the previous version's install: %v", err)
	}
	if _, err := admin.Exec(ctx, "INSERT INTO fenceline.secret VALUES (1, $1)", secret); err != nil {
		t.Fatal(err)
	}
	for _, table := range []string{"named", "unnamed"} {
		var relid uint32
		if err := admin.QueryRow(ctx, "SELECT $1::regclass::oid", "public."+table).Scan(&relid); err != nil {
			t.Fatal(err)
		}
		q := fmt.Sprintf(string(oldTable),
			triggerName, quoteLiteral("public."+table), "public."+table, relid, fmt.Sprintf("fenceline.epoch_%d", relid),
			hex.EncodeToString([]byte("public")), hex.EncodeToString([]byte(table)), "fenceline.fence_check")
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("the previous version fences public.%s: %v", table, err)
		}
	}
	// The previous version's C trigger on a third table: its function linked
	// the previous symbol, which this install, on plpgsql, does not replace.
	oldC := cTrigger.unavailable == nil && !cTrigger.elsewhere
	if oldC {
		var relid uint32
		if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE TABLE public.cold (id int); GRANT ALL ON public.cold TO PUBLIC;
CREATE FUNCTION fenceline.fence_check_c() RETURNS trigger LANGUAGE c AS %s, %s;
UPDATE pg_proc SET prosrc = 'fenceline_fence_check' WHERE oid = 'fenceline.fence_check_c()'::regprocedure`,
			quoteLiteral(filepath.Join(cLibDir, "fenceline_fence_gate.so")), quoteLiteral(cTriggerSymbol))); err != nil {
			t.Fatal(err)
		}
		if err := admin.QueryRow(ctx, "SELECT 'public.cold'::regclass::oid").Scan(&relid); err != nil {
			t.Fatal(err)
		}
		if _, err := admin.Exec(ctx, fmt.Sprintf(`INSERT INTO fenceline.epoch (relid, relname) VALUES (%[1]d, 'public.cold');
CREATE SEQUENCE fenceline.epoch_%[1]d AS bigint MINVALUE 0;
UPDATE fenceline.epoch SET seq = 'fenceline.epoch_%[1]d' WHERE relid = %[1]d;
CREATE TRIGGER %[2]s BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON public.cold
	FOR EACH STATEMENT EXECUTE FUNCTION fenceline.fence_check_c('fenceline.epoch_%[1]d', ',%[3]s.*,', ',%[3]s.%[4]s,')`,
			relid, triggerName, hex.EncodeToString([]byte("public")), hex.EncodeToString([]byte("cold")))); err != nil {
			t.Fatal(err)
		}
	}
	agent := connect(t, pg.DSN("agent", "", db))
	tok5 := makeTokenV3(secret, "lease_v3", 5, "public.unnamed", "public.named")
	if err := writeWithToken(ctx, agent, tok5, "INSERT INTO public.unnamed VALUES (1)"); err != nil {
		t.Fatalf("write under the previous version: %v", err)
	}

	in, err := Install(ctx, admin, []string{"public.named"}, InstallOptions{Trigger: TriggerPLpgSQL})
	if err != nil {
		t.Fatalf("install over the previous version: %v", err)
	}
	if !bytes.Equal(in.Secret, secret) {
		t.Fatal("the install replaced the previous version's secret")
	}
	for _, table := range []string{"public.named", "public.unnamed"} {
		var nargs int
		if err := admin.QueryRow(ctx, "SELECT tgnargs FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = $2", table, triggerName).Scan(&nargs); err != nil || nargs != 4 {
			t.Fatalf("after the install %s's trigger has %d arguments (%v), want 4", table, nargs, err)
		}
		if gateOf(t, admin, table) == "" {
			t.Fatalf("%s has no gate after the install", table)
		}
	}
	var gone bool
	if err := admin.QueryRow(ctx, "SELECT to_regprocedure('fenceline.fence_slow(oid, text)') IS NULL AND to_regprocedure('fenceline.fence_fast(text, text, text, oid)') IS NULL").Scan(&gone); err != nil || !gone {
		t.Fatalf("the previous version's fence_slow and fence_fast are still there (%v)", err)
	}
	// A new connection takes the new slow path, which wants a v4 token bound
	// to it. (The session that verified tok5 before keeps its mark, and so
	// the fast path for it: bound to that session all the same.)
	agent = connect(t, pg.DSN("agent", "", db))
	if err := writeWithToken(ctx, agent, tok5, "INSERT INTO public.unnamed VALUES (2)"); pgCode(err) != "40001" || !strings.Contains(err.Error(), "malformed") {
		t.Fatalf("an unbound v3 token after the upgrade: want 40001 malformed, got %v", err)
	}
	tok5 = mustToken(t, secret, agent, "lease_v3", 5, "public.unnamed", "public.named")
	if err := writeWithToken(ctx, agent, tok5, "INSERT INTO public.unnamed VALUES (2)"); err != nil {
		t.Fatalf("write after the upgrade, same lease: %v", err)
	}
	tok4 := mustToken(t, secret, agent, "lease_older", 4, "public.unnamed")
	if err := writeWithToken(ctx, agent, tok4, "INSERT INTO public.unnamed VALUES (3)"); pgCode(err) != "40001" || !strings.Contains(err.Error(), "stale fence") {
		t.Fatalf("a fence below the epoch the previous version raised: want 40001 stale fence, got %v", err)
	}
	// Sequences another role made (an install by someone else) go to the
	// role fence_slow_gate runs as, which must set and lock them.
	if _, err := admin.Exec(ctx, `DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = 'fl_other_admin') THEN CREATE ROLE fl_other_admin; END IF; END$$`); err != nil {
		t.Fatal(err)
	}
	gate, epochSeq := gateOf(t, admin, "public.named"), ""
	if err := admin.QueryRow(ctx, "SELECT seq::text FROM fenceline.epoch WHERE relid = 'public.named'::regclass").Scan(&epochSeq); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, "ALTER SEQUENCE "+gate+" OWNER TO fl_other_admin; ALTER SEQUENCE "+epochSeq+" OWNER TO fl_other_admin"); err != nil {
		t.Fatal(err)
	}
	if _, err := Install(ctx, admin, []string{"public.named"}, InstallOptions{Trigger: TriggerPLpgSQL}); err != nil {
		t.Fatal(err)
	}
	var owners string
	if err := admin.QueryRow(ctx, `SELECT string_agg(DISTINCT c.relowner::regrole::text, ',') FROM pg_class c
		WHERE c.oid IN ($1::regclass, $2::regclass)`, gate, epochSeq).Scan(&owners); err != nil {
		t.Fatal(err)
	}
	var slowOwner string
	if err := admin.QueryRow(ctx, "SELECT proowner::regrole::text FROM pg_proc WHERE oid = 'fenceline.fence_slow_gate(oid, text)'::regprocedure").Scan(&slowOwner); err != nil {
		t.Fatal(err)
	}
	if owners != slowOwner {
		t.Fatalf("after an install the gate and epoch of public.named belong to %s, want %s (who runs fence_slow_gate)", owners, slowOwner)
	}
	t.Run("c", func(t *testing.T) {
		cTrigger.need(t)
		if !oldC {
			t.Fatal("no C library to play the previous version's C trigger")
		}
		var fn string
		var nargs int
		if err := admin.QueryRow(ctx, "SELECT tgfoid::regproc::text, tgnargs FROM pg_trigger WHERE tgrelid = 'public.cold'::regclass AND tgname = $1", triggerName).Scan(&fn, &nargs); err != nil {
			t.Fatal(err)
		}
		if fn != "fenceline.fence_check" || nargs != 4 {
			t.Fatalf("the previous version's C trigger became %s with %d arguments, want fenceline.fence_check with 4", fn, nargs)
		}
		tok := mustToken(t, secret, agent, "lease_v3", 5, "public.cold")
		if err := writeWithToken(ctx, agent, tok, "INSERT INTO public.cold VALUES (1)"); err != nil {
			t.Fatalf("write to the table the previous version fenced in C: %v", err)
		}
	})
}

// TestInstallChoosesTrigger: install again switches the named tables
// between the C and the plpgsql trigger and keeps the secret; a C library
// that is not there fails the install with what to do, and changes nothing,
// unless the choice is auto, which then installs plpgsql and says why.
func TestInstallChoosesTrigger(t *testing.T) {
	cTrigger.need(t)
	ctx := ctxT(t)
	admin := cTrigger.admin(t)
	tables := []string{"public.race", "app.*"}
	var lib string
	if err := admin.QueryRow(ctx, "SELECT probin FROM pg_proc WHERE oid = 'fenceline.fence_check_c'::regproc").Scan(&lib); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { // leave the C trigger for the tests that follow, whatever happened
		if _, err := Install(context.Background(), cTrigger.admin(t), tables, InstallOptions{Trigger: TriggerC, CLibrary: lib}); err != nil {
			t.Errorf("reinstall the C trigger: %v", err)
		}
	})
	lang := func() string {
		t.Helper()
		var langs []string
		rows, err := admin.Query(ctx, `SELECT DISTINCT l.lanname FROM pg_trigger tg
			JOIN pg_proc p ON p.oid = tg.tgfoid JOIN pg_language l ON l.oid = p.prolang
			WHERE tg.tgname = 'fenceline_fence' AND tg.tgrelid = ANY (ARRAY['public.race', 'app.items']::regclass[])`)
		if err != nil {
			t.Fatal(err)
		}
		if langs, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil {
			t.Fatal(err)
		}
		return strings.Join(langs, ",")
	}
	if got := lang(); got != "c" {
		t.Fatalf("triggers installed with the C library are %q", got)
	}
	install := func(opts InstallOptions, want string) *Installed {
		t.Helper()
		in, err := Install(ctx, admin, tables, opts)
		if err != nil {
			t.Fatalf("install %+v: %v", opts, err)
		}
		if !bytes.Equal(in.Secret, cTrigger.secret) {
			t.Fatal("install again changed the secret")
		}
		if got := lang(); got != want || string(in.Trigger) != want {
			t.Fatalf("install %+v: triggers are %q, reported %q, want %q", opts, got, in.Trigger, want)
		}
		return in
	}
	install(InstallOptions{Trigger: TriggerPLpgSQL}, "plpgsql")
	if in := install(InstallOptions{CLibrary: lib}, "c"); in.CLibrary != lib || in.NoC != nil {
		t.Fatalf("auto with a library that loads: library %q, why not C %v", in.CLibrary, in.NoC)
	}
	// Auto with a library the server cannot load: plpgsql, and why.
	in := install(InstallOptions{Trigger: TriggerAuto, CLibrary: "/nonexistent/fenceline_fence.so"}, "plpgsql")
	if in.NoC == nil || !strings.Contains(in.NoC.Error(), "/nonexistent/fenceline_fence.so") {
		t.Fatalf("auto with a missing library: want the reason naming it, got %v", in.NoC)
	}
	// From plpgsql, an install that must load its C library and cannot
	// changes nothing: not the triggers, not the C function's library.
	_, err := Install(ctx, admin, tables, InstallOptions{Trigger: TriggerC, CLibrary: "/nonexistent/fenceline_fence.so"})
	if err == nil || !strings.Contains(err.Error(), "/nonexistent/fenceline_fence.so") || !strings.Contains(err.Error(), "make -C pgproxy/cfence install") {
		t.Fatalf("install with a missing C library: want an error naming it and what to run, got %v", err)
	}
	var after string
	if err := admin.QueryRow(ctx, "SELECT probin FROM pg_proc WHERE oid = 'fenceline.fence_check_c'::regproc").Scan(&after); err != nil || after != lib {
		t.Fatalf("after a failed install the C function loads %q (%v), want %q", after, err, lib)
	}
	if got := lang(); got != "plpgsql" {
		t.Fatalf("a failed install left the triggers %q, want plpgsql", got)
	}
	install(InstallOptions{Trigger: TriggerC, CLibrary: lib}, "c")
	testStorageFenceSessionMark(t, cTrigger) // the switches left a working fence
}

// TestSlowPathNeedsExecute: both triggers reach fence_slow_gate as a query would,
// so revoking EXECUTE on it from the writers' roles refuses their writes.
func TestSlowPathNeedsExecute(t *testing.T) { forEachTrigger(t, testSlowPathNeedsExecute) }

func testSlowPathNeedsExecute(t *testing.T, f *fenceDB) {
	ctx := ctxT(t)
	admin := f.admin(t)
	if _, err := admin.Exec(ctx, "REVOKE EXECUTE ON FUNCTION fenceline.fence_slow_gate(oid, text) FROM PUBLIC"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := f.admin(t).Exec(context.Background(), "GRANT EXECUTE ON FUNCTION fenceline.fence_slow_gate(oid, text) TO PUBLIC"); err != nil {
			t.Errorf("grant EXECUTE on fence_slow_gate back: %v", err)
		}
	})
	_, err := f.agent(t).Exec(ctx, "INSERT INTO public.other VALUES (200, 'no execute')")
	if pgCode(err) != "42501" || !strings.Contains(err.Error(), "fence_slow_gate") {
		t.Fatalf("write with EXECUTE on fence_slow_gate revoked: want 42501 naming fence_slow_gate, got %v", err)
	}
}

// makeTokenV3 is MakeToken of the versions before tokens were bound to their
// connection (commit e6960be), verbatim but for its name: what a proxy of
// that version sends.
func makeTokenV3(secret []byte, leaseID string, fence uint64, tables ...string) string {
	b := make([]byte, 0, 96+2*len(leaseID)+40*len(tables))
	b = append(b, "v3"...)
	b = append(b, ':')
	b = strconv.AppendUint(b, fence, 10)
	b = append(b, ':')
	b = hex.AppendEncode(b, []byte(leaseID))
	b = append(b, ':', ',')
	for _, t := range tables {
		s, n, err := SplitTable(t)
		if err != nil {
			panic(err)
		}
		b = hex.AppendEncode(b, []byte(s))
		b = append(b, '.')
		if n == "*" {
			b = append(b, '*')
		} else {
			b = hex.AppendEncode(b, []byte(n))
		}
		b = append(b, ',')
	}
	payload := string(b)
	return payload + ":" + tokenMAC(secret, payload)
}

// TestInstallUpgradesGateFence: a database fenced by the version before
// tokens were bound to their connection (testdata/fence_v3_gate.sql and
// fence_v3_gate_table.sql, verbatim: v3 tokens and the gate), on a plpgsql
// table and, where the C trigger builds, a C one, keeps its secret, epochs
// and triggers when this version installs; from then on only a v4 token
// bound to the writing connection passes, on both triggers.
func TestInstallUpgradesGateFence(t *testing.T) {
	ctx := ctxT(t)
	const db = "fenceline_upgrade_gate"
	root := connect(t, pg.AdminDSN(""))
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db, "CREATE DATABASE " + db} {
		if _, err := root.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	admin := connect(t, pg.AdminDSN(db))
	old, err := os.ReadFile("testdata/fence_v3_gate.sql")
	if err != nil {
		t.Fatal(err)
	}
	oldTable, err := os.ReadFile("testdata/fence_v3_gate_table.sql")
	if err != nil {
		t.Fatal(err)
	}
	secret := bytes.Repeat([]byte{9}, 32)
	if _, err := admin.Exec(ctx, "CREATE TABLE public.gp (id int); CREATE TABLE public.gc (id int); GRANT ALL ON public.gp, public.gc TO PUBLIC"); err != nil {
		t.Fatal(err)
	}
	if _, err := admin.Exec(ctx, string(old)); err != nil {
		t.Fatalf("the previous version's install: %v", err)
	}
	if _, err := admin.Exec(ctx, "INSERT INTO fenceline.secret VALUES (1, $1)", secret); err != nil {
		t.Fatal(err)
	}
	tables := map[string]string{"gp": "fenceline.fence_check"}
	withC := cTrigger.unavailable == nil && !cTrigger.elsewhere
	if withC {
		// As the previous version's createCTrigger made it: the same symbol.
		if _, err := admin.Exec(ctx, fmt.Sprintf(`CREATE OR REPLACE FUNCTION fenceline.fence_check_c() RETURNS trigger LANGUAGE c AS %s, %s;
REVOKE ALL ON FUNCTION fenceline.fence_check_c() FROM PUBLIC;`, quoteLiteral(filepath.Join(cLibDir, "fenceline_fence_gate.so")), quoteLiteral(cTriggerSymbol))); err != nil {
			t.Fatal(err)
		}
		tables["gc"] = "fenceline.fence_check_c"
	}
	for table, fn := range tables {
		var relid uint32
		if err := admin.QueryRow(ctx, "SELECT $1::regclass::oid", "public."+table).Scan(&relid); err != nil {
			t.Fatal(err)
		}
		gate := fmt.Sprintf("fenceline.gate_%d", relid)
		q := fmt.Sprintf(string(oldTable),
			triggerName, quoteLiteral("public."+table), "public."+table, relid, fmt.Sprintf("fenceline.epoch_%d", relid),
			hex.EncodeToString([]byte("public")), hex.EncodeToString([]byte(table)), fn, gate,
			fmt.Sprintf("SELECT setval('%s', 1, true);", gate))
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("the previous version fences public.%s: %v", table, err)
		}
	}
	agent := connect(t, pg.DSN("agent", "", db))
	for table := range tables {
		if err := writeWithToken(ctx, agent, makeTokenV3(secret, "lease_gate", 5, "public."+table), "INSERT INTO public."+table+" VALUES (1)"); err != nil {
			t.Fatalf("write to %s under the previous version: %v", table, err)
		}
	}

	in, err := Install(ctx, admin, []string{"public.gp"}, InstallOptions{Trigger: TriggerPLpgSQL})
	if err != nil {
		t.Fatalf("install over the previous version: %v", err)
	}
	if !bytes.Equal(in.Secret, secret) {
		t.Fatal("the install replaced the previous version's secret")
	}
	for table, fn := range tables {
		t.Run(table, func(t *testing.T) {
			var got string
			if err := admin.QueryRow(ctx, "SELECT tgfoid::regproc::text FROM pg_trigger WHERE tgrelid = $1::regclass AND tgname = $2", "public."+table, triggerName).Scan(&got); err != nil || got != fn {
				t.Fatalf("after the install public.%s's trigger is %q (%v), want %s", table, got, err, fn)
			}
			rel := "public." + table
			c := connect(t, pg.DSN("agent", "", db))
			err := writeWithToken(ctx, c, makeTokenV3(secret, "lease_gate", 5, rel), "INSERT INTO "+rel+" VALUES (2)")
			if pgCode(err) != "40001" || !strings.Contains(err.Error(), "malformed") {
				t.Fatalf("a v3 token after the upgrade: want 40001 malformed, got %v", err)
			}
			tok := mustToken(t, secret, c, "lease_gate", 5, rel)
			if err := writeWithToken(ctx, c, tok, "INSERT INTO "+rel+" VALUES (3)"); err != nil {
				t.Fatalf("a bound v4 token after the upgrade: %v", err)
			}
			other := connect(t, pg.DSN("agent", "", db))
			sessionOf(t, other)
			err = writeWithToken(ctx, other, tok, "INSERT INTO "+rel+" VALUES (4)")
			if pgCode(err) != "40001" || !strings.Contains(err.Error(), "bound to another connection") {
				t.Fatalf("the token on another connection after the upgrade: want 40001 bound to another connection, got %v", err)
			}
			stale := mustToken(t, secret, c, "lease_older", 4, rel)
			if err := writeWithToken(ctx, c, stale, "INSERT INTO "+rel+" VALUES (5)"); pgCode(err) != "40001" || !strings.Contains(err.Error(), "stale fence") {
				t.Fatalf("a fence below the epoch the previous version raised: want 40001 stale fence, got %v", err)
			}
		})
	}
	if !withC {
		t.Run("c", func(t *testing.T) { cTrigger.need(t) })
	}
}
