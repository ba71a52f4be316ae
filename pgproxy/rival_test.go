package pgproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgproto3"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
)

// The attacks of issue 28, item 7: one agent, through its own fence and
// under its own lease, against another agent's lease on the same database.
// Lease A claims public.race, lease B public.other; each agent has its own
// proxy (as each has its own sidecar).

// rivals is two agents with leases of their own, each behind its own proxy.
type rivals struct {
	b        *bustest.Bus
	a, bl    *bustest.Lease
	pa, pb   *Proxy
	recA     *recorder
	recB     *recorder
	gateRace string // public.race's gate sequence, fenceline.gate_<oid>
}

func startRivals(t *testing.T, f *fenceDB) *rivals {
	t.Helper()
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race") // a fresh bus starts its fences at 1
	r := &rivals{b: bustest.Start(t), recA: &recorder{}, recB: &recorder{}}
	r.a = holdTables(t, r.b, "ws-rival-a", 30*time.Second, "public.race")
	r.bl = holdTables(t, r.b, "ws-rival-b", 30*time.Second, "public.other")
	r.pa = f.proxy(t, Config{Lease: r.a.Holder, Audit: r.recA})
	r.pb = f.proxy(t, Config{Lease: r.bl.Holder, Audit: r.recB})
	r.gateRace = gateOf(t, f.admin(t), "public.race")
	return r
}

func testGateHolderCannotStall(t *testing.T, f *fenceDB) {
	r := startRivals(t, f)
	ctx := ctxT(t)
	holder := f.agent(t)
	htx, err := holder.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
	if err != nil {
		t.Fatal(err)
	}
	defer htx.Rollback(ctx) //nolint:errcheck // no-op after rollback
	var v int64
	if err := htx.QueryRow(ctx, "SELECT pg_sequence_last_value($1::regclass)", r.gateRace).Scan(&v); err != nil {
		t.Fatalf("read the gate %s: %v", r.gateRace, err)
	}
	a := f.via(t, r.pa, "agent")
	start := time.Now()
	_, err = a.Exec(ctx, "INSERT INTO public.race VALUES (1, 'lease A')")
	took := time.Since(start)
	t.Logf("the raise behind an open reader of the gate: %v after %v", err, took)
	fence := fmt.Sprintf("fence %d", r.a.Record.Fence)
	if pgCode(err) != "55P03" || !strings.Contains(err.Error(), r.a.Record.LeaseID) || !strings.Contains(err.Error(), fence) ||
		!strings.Contains(err.Error(), r.gateRace) {
		t.Fatalf("lease A's first write with the gate held: %v; want 55P03 naming lease %s, %s and gate %s", err, r.a.Record.LeaseID, fence, r.gateRace)
	}
	if took > 10*time.Second {
		t.Fatalf("the refusal took %v: want about 2s", took)
	}
	if err := htx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Exec(ctx, "INSERT INTO public.race VALUES (1, 'lease A')"); err != nil {
		t.Fatalf("lease A's write retried once the gate is free: %v", err)
	}
}

// TestFenceSchemaRefused: agent B, through its own proxy under its own
// live lease, names the fence's objects in every spelling it can: the gate
// of A's table by a string (any case, quoted, cast, dollar-quoted, through
// to_regclass), by oid, through a catalog scan and pg_sequences; the
// fence's tables, functions and settings; search_path. Each is refused by
// B's proxy naming lease, owner and fence, and audited; ordinary uses of
// the same functions pass. Meanwhile B's read-only block stays open, and
// A's first write (the epoch raise) goes straight through.
func TestFenceSchemaRefused(t *testing.T) {
	r := startRivals(t, plpgsql)
	gate := r.gateRace
	name := strings.TrimPrefix(gate, "fenceline.")
	var oid uint32
	if err := plpgsql.admin(t).QueryRow(ctxT(t), "SELECT $1::regclass::oid", gate).Scan(&oid); err != nil {
		t.Fatal(err)
	}
	refused := []string{
		"SELECT pg_sequence_last_value('" + gate + "')",
		"SELECT pg_sequence_last_value('FENCELINE." + strings.ToUpper(name) + "')",
		`SELECT pg_sequence_last_value('"fenceline"."` + name + `"')`,
		"SELECT pg_sequence_last_value(' fenceline . " + name + "')",
		"SELECT pg_sequence_last_value('" + gate + "'::regclass)",
		"SELECT pg_sequence_last_value(CAST('" + gate + "' AS regclass))",
		"SELECT pg_sequence_last_value($$" + gate + "$$)",
		"SELECT pg_sequence_last_value(to_regclass('" + gate + "'))",
		fmt.Sprintf("SELECT pg_sequence_last_value(%d)", oid),
		fmt.Sprintf("SELECT pg_catalog.pg_sequence_last_value(%d::oid)", oid),
		"SELECT pg_sequence_last_value(c.oid) FROM pg_class c WHERE c.relname = '" + name + "'",
		"SELECT pg_sequence_last_value(('fence' || 'line.' || '" + name + "')::regclass)",
		"SELECT * FROM pg_sequences",
		"SELECT last_value FROM pg_catalog.pg_sequences WHERE sequencename = '" + name + "'",
		"SELECT last_value FROM " + gate,
		`SELECT last_value FROM "fenceline".` + name,
		"SELECT last_value FROM FenceLine." + name,
		"SELECT fenceline." + name + ".last_value FROM fenceline." + name,
		"SELECT * FROM fenceline.epoch",
		"SELECT fenceline.bind_session()",
		"SELECT current_setting('fenceline.token')",
		"SELECT current_setting('fenceline.verified', true)",
		"SHOW fenceline.token",
		"SET search_path = public, fenceline",
		"SET search_path TO FenceLine",
		"SELECT 1 FROM pg_class WHERE oid = 'fenceline.epoch'::regclass",
		"PREPARE peek AS SELECT pg_sequence_last_value('" + gate + "')",
		"DECLARE cur CURSOR FOR SELECT pg_sequence_last_value('" + gate + "')",
		"EXPLAIN SELECT * FROM fenceline.epoch",
	}
	allowed := []string{
		"SELECT pg_sequence_last_value('public.seq')",
		"SELECT pg_sequence_last_value('public.seq'::regclass)",
		"SELECT 'fenceline keeps agents apart'",
		"SELECT count(*) FROM pg_class WHERE relname LIKE 'gate%'",
		"SET search_path = public",
	}
	ctx := ctxT(t)
	owner := r.bl.Record.Owner.String()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			b := plpgsql.via(t, r.pb, "agent")
			for _, q := range allowed {
				if _, err := b.Exec(ctx, q, mode); err != nil {
					t.Errorf("%s: %v", q, err)
				}
			}
			for _, q := range refused {
				// In a read-only block, left open: what B's read takes, it
				// holds until the block ends.
				tx, err := b.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
				if err != nil {
					t.Fatal(err)
				}
				_, err = tx.Exec(ctx, q, mode)
				if !refusedFor(err, r.bl) {
					t.Errorf("%s: %v; want the proxy's 42501 naming lease %s and owner %s", q, err, r.bl.Record.LeaseID, owner)
				}
				tx.Rollback(ctx) //nolint:errcheck // failed block
			}
			// B's read-only block, open: A's raise does not wait for it.
			tx, err := b.BeginTx(ctx, pgx.TxOptions{AccessMode: pgx.ReadOnly})
			if err != nil {
				t.Fatal(err)
			}
			defer tx.Rollback(ctx)                                          //nolint:errcheck
			tx.Exec(ctx, "SELECT pg_sequence_last_value('"+gate+"')", mode) //nolint:errcheck // refused, above
		})
	}
	// search_path set at startup, where unqualified names would resolve to
	// the fence's objects: refused.
	for _, param := range []string{"search_path=fenceline", "options=-c%20search_path%3Dpublic,fenceline"} {
		c, err := pgx.Connect(ctx, plpgsql.dsnVia(r.pb, "agent")+"&"+param)
		if err == nil {
			c.Close(ctx)
		}
		if !refusedFor(err, r.bl) {
			t.Errorf("connect with %s: %v; want the proxy's 42501 naming lease %s and owner %s", param, err, r.bl.Record.LeaseID, owner)
		}
	}
	// A's first write: the raise, with B's blocks as they were.
	a := plpgsql.via(t, r.pa, "agent")
	start := time.Now()
	if _, err := a.Exec(ctx, "SET lock_timeout = '20s'"); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Exec(ctx, "INSERT INTO public.race VALUES (1, 'lease A')"); err != nil {
		t.Fatalf("lease A's first write: %v", err)
	}
	if took := time.Since(start); took > 5*time.Second {
		t.Errorf("lease A's first write took %v: something held its gate", took)
	}
	var tampers int
	for _, ev := range r.recB.events() {
		if ev.Reason == ReasonFenceTamper && ev.LeaseID == r.bl.Record.LeaseID && ev.Fence == r.bl.Record.Fence &&
			ev.Type == lease.EventDenied && ev.Boundary == lease.BoundaryPostgres {
			tampers++
		}
	}
	if want := 2*len(refused) + 2; tampers < want {
		t.Errorf("%d fence-tamper audit events of lease B, want %d", tampers, want)
	}
}

// TestSignalAnotherLeaseRefused: agent B, through its own proxy under its
// own live lease, ends or cancels agent A's session (the same database
// role: Postgres lets a role signal its own backends), by A's pid, by a
// query over pg_stat_activity, or with a CancelRequest carrying A's key on
// a new connection through B's proxy. Each is refused (the CancelRequest
// dropped), and A's session goes on. B may still signal its own backend.
func TestSignalAnotherLeaseRefused(t *testing.T) {
	r := startRivals(t, plpgsql)
	ctx := ctxT(t)
	a := plpgsql.via(t, r.pa, "agent")
	apid := a.PgConn().PID()
	refused := []string{
		fmt.Sprintf("SELECT pg_terminate_backend(%d)", apid),
		fmt.Sprintf("SELECT pg_catalog.pg_terminate_backend(%d, 1000)", apid),
		fmt.Sprintf("SELECT pg_cancel_backend(%d)", apid),
		fmt.Sprintf("SELECT pg_cancel_backend('%d'::int)", apid),
		fmt.Sprintf("SELECT pg_cancel_backend(%d + 0)", apid),
		"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid() AND usename = 'agent'",
		"SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE pid <> pg_backend_pid()",
		fmt.Sprintf("SELECT pg_log_backend_memory_contexts(%d)", apid),
		fmt.Sprintf("DO $$BEGIN PERFORM pg_terminate_backend(%d); END$$", apid),
	}
	owner := r.bl.Record.Owner.String()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeDescribeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			b := plpgsql.via(t, r.pb, "agent")
			for _, q := range refused {
				_, err := b.Exec(ctx, q, mode)
				if !refusedFor(err, r.bl) {
					t.Errorf("%s: %v; want the proxy's 42501 naming lease %s and owner %s", q, err, r.bl.Record.LeaseID, owner)
				}
				var one int
				if err := a.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
					t.Fatalf("A's session after B sent %s: %v", q, err)
				}
			}
			// A's pid as a parameter (a Bind's, in the extended protocol;
			// PREPARE/EXECUTE's in the simple one).
			for _, q := range []string{"SELECT pg_terminate_backend($1)", "SELECT pg_cancel_backend($1::int4)"} {
				var err error
				if mode == pgx.QueryExecModeSimpleProtocol {
					if _, err = b.Exec(ctx, "PREPARE sig AS "+q, mode); err == nil {
						_, err = b.Exec(ctx, fmt.Sprintf("EXECUTE sig(%d)", apid), mode)
						b.Exec(ctx, "DEALLOCATE sig", mode) //nolint:errcheck
					}
				} else {
					_, err = b.Exec(ctx, q, mode, apid)
				}
				if !refusedFor(err, r.bl) {
					t.Errorf("%s: %v; want the proxy's 42501 naming lease %s and owner %s", q, err, r.bl.Record.LeaseID, owner)
				}
				var one int
				if err := a.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
					t.Fatalf("A's session after B sent %s: %v", q, err)
				}
			}
			// Its own backends (this session's, or another of B's through
			// the same proxy): Postgres's to answer, not a refusal.
			b2 := plpgsql.via(t, r.pb, "agent")
			for _, q := range []string{"SELECT pg_cancel_backend(pg_backend_pid()) AND false",
				fmt.Sprintf("SELECT pg_cancel_backend(%d) AND false", b.PgConn().PID()),
				fmt.Sprintf("SELECT pg_cancel_backend(%d) AND false", b2.PgConn().PID())} {
				if _, err := b.Exec(ctx, q, mode); pgCode(err) == "42501" {
					t.Errorf("%s (its own backend): %v", q, err)
				}
			}
			if mode != pgx.QueryExecModeSimpleProtocol {
				if _, err := b.Exec(ctx, "SELECT pg_cancel_backend($1) AND false", mode, b2.PgConn().PID()); pgCode(err) == "42501" {
					t.Errorf("pg_cancel_backend($1) of B's other session: %v", err)
				}
			}
		})
	}
	// The fast-path FunctionCall, in a block B's lease made writable (where
	// a fast-path call passes): A's pid, and A's gate by oid, as data.
	t.Run("fast-path", func(t *testing.T) {
		b := plpgsql.via(t, r.pb, "agent")
		var gateOID uint32
		if err := plpgsql.admin(t).QueryRow(ctx, "SELECT $1::regclass::oid", r.gateRace).Scan(&gateOID); err != nil {
			t.Fatal(err)
		}
		for _, c := range []struct {
			name string
			oid  uint32
			arg  []byte
		}{
			{"pg_terminate_backend", 2096, binary.BigEndian.AppendUint32(nil, apid)},
			{"pg_cancel_backend", 2171, binary.BigEndian.AppendUint32(nil, apid)},
			{"pg_sequence_last_value", 4032, binary.BigEndian.AppendUint32(nil, gateOID)},
		} {
			if _, err := b.Exec(ctx, "BEGIN"); err != nil {
				t.Fatal(err)
			}
			if e := fastPathCall(t, b, c.oid, c.arg); e == nil || e.Code != "42501" || !strings.Contains(e.Message, r.bl.Record.LeaseID) {
				t.Errorf("fast-path %s: %v; want the proxy's 42501 naming lease %s", c.name, e, r.bl.Record.LeaseID)
			}
			if _, err := b.Exec(ctx, "ROLLBACK"); err != nil {
				t.Fatal(err)
			}
		}
		var one int
		if err := a.QueryRow(ctx, "SELECT 1").Scan(&one); err != nil {
			t.Fatalf("A's session after B's fast-path calls: %v", err)
		}
	})
	// A CancelRequest for A's backend on a new connection through B's
	// proxy, while A runs a statement: dropped.
	done := make(chan error, 1)
	go func() {
		_, err := a.Exec(ctx, "SELECT pg_sleep(1)")
		done <- err
	}()
	waitBackends(t, true, "pid = $1 AND state = 'active' AND query LIKE '%pg_sleep%'", apid)
	c, err := net.Dial("tcp", r.pb.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	pkt := binary.BigEndian.AppendUint32(nil, 16)
	pkt = binary.BigEndian.AppendUint32(pkt, cancelRequest)
	pkt = binary.BigEndian.AppendUint32(pkt, a.PgConn().PID())
	pkt = append(pkt, a.PgConn().SecretKey()...)
	if _, err := c.Write(pkt); err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if n, err := c.Read(make([]byte, 1)); n != 0 || err == nil {
		t.Fatalf("B's proxy after a CancelRequest: read %d bytes, %v; want the connection closed", n, err)
	}
	c.Close()
	if err := <-done; err != nil {
		t.Fatalf("A's statement, with A's key sent to B's proxy: %v", err)
	}
}

// refusedFor: err is the proxy's refusal naming lease l, its fence and its
// owner.
func refusedFor(err error, l *bustest.Lease) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	return pe.Code == "42501" && strings.Contains(pe.Message, fmt.Sprintf("write refused for lease %s (fence %d)", l.Record.LeaseID, l.Record.Fence)) &&
		strings.Contains(pe.Detail, l.Record.Owner.String())
}

// fastPathCall sends a FunctionCall of function oid with binary arguments
// args on c and returns the error it got (nil: none).
func fastPathCall(t *testing.T, c *pgx.Conn, oid uint32, args ...[]byte) *pgproto3.ErrorResponse {
	t.Helper()
	fe := c.PgConn().Frontend()
	fe.Send(&pgproto3.FunctionCall{Function: oid, ArgFormatCodes: []uint16{1}, Arguments: args, ResultFormatCode: 1})
	if err := fe.Flush(); err != nil {
		t.Fatal(err)
	}
	var got *pgproto3.ErrorResponse
	for {
		m, err := fe.Receive()
		if err != nil {
			t.Fatal(err)
		}
		switch m := m.(type) {
		case *pgproto3.ErrorResponse:
			cp := *m
			got = &cp
		case *pgproto3.ReadyForQuery:
			return got
		}
	}
}
