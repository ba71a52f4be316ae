package pgproxy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

func benchQueries(b *testing.B, dsn string, mode pgx.QueryExecMode, sql string, args ...any) {
	c := connect(b, dsn)
	ctx := context.Background()
	b.ResetTimer()
	for b.Loop() {
		var v int
		if err := c.QueryRow(ctx, sql, append([]any{mode}, args...)...).Scan(&v); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkSelect(b *testing.B) {
	p := startProxy(b, Config{})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		b.Run("direct/"+mode.String(), func(b *testing.B) {
			benchQueries(b, pg.DSN("agent", "", testDB), mode, "SELECT balance FROM accounts WHERE id = $1", 1)
		})
		b.Run("fenceline/"+mode.String(), func(b *testing.B) {
			benchQueries(b, proxyDSN(p, "agent"), mode, "SELECT balance FROM accounts WHERE id = $1", 1)
		})
	}
}

func BenchmarkFencedUpdate(b *testing.B) {
	lease := newStaticLease(b, "lease_bench", 0, "public.accounts")
	p := startProxy(b, Config{Lease: lease})
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		b.Run(mode.String(), func(b *testing.B) {
			benchQueries(b, proxyDSN(p, "agent"), mode, "UPDATE accounts SET balance = balance + 1 WHERE id = $1 RETURNING 1", 4)
		})
	}
}

// BenchmarkFencedTransaction runs pgbench's tpcb-like shape through the
// proxy, one client: BEGIN, an update, a read, two more updates, an insert,
// COMMIT, with other values every time, in the simple protocol (literals
// in the text, as pgbench -M simple) and with prepared statements. With
// -cpuprofile it shows what the proxy spends per statement.
func BenchmarkFencedTransaction(b *testing.B) {
	lease := newStaticLease(b, "lease_bench", 0, "public.accounts", "public.other", "public.sink")
	p := startProxy(b, Config{Lease: lease})
	plpgsql.reset(b, "INSERT INTO public.other SELECT g, 'x' FROM generate_series(1, 10) g ON CONFLICT (id) DO NOTHING")
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement} {
		b.Run(mode.String(), func(b *testing.B) {
			c := connect(b, proxyDSN(p, "agent"))
			ctx := context.Background()
			for i := 0; b.Loop(); i++ {
				id, delta := 1+i%10, i%1000-500
				tx, err := c.Begin(ctx)
				if err != nil {
					b.Fatal(err)
				}
				var bal int
				for _, q := range []struct {
					sql  string
					args []any
				}{
					{"UPDATE accounts SET balance = balance + $1 WHERE id = $2", []any{delta, id}},
					{"SELECT balance FROM accounts WHERE id = $1", []any{id}},
					{"UPDATE other SET note = $1 WHERE id = $2", []any{strconv.Itoa(delta), id}},
					{"UPDATE accounts SET balance = balance - $1 WHERE id = $2", []any{delta, 1 + (i+3)%10}},
					{"INSERT INTO sink VALUES ($1)", []any{strconv.Itoa(i)}},
				} {
					if strings.HasPrefix(q.sql, "SELECT") {
						err = tx.QueryRow(ctx, q.sql, append([]any{mode}, q.args...)...).Scan(&bal)
					} else {
						_, err = tx.Exec(ctx, q.sql, append([]any{mode}, q.args...)...)
					}
					if err != nil {
						b.Fatal(err)
					}
				}
				if err := tx.Commit(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkClassify(b *testing.B) {
	c := NewClassifier(0)
	b.Run("cached-literals", func(b *testing.B) {
		for i := 0; b.Loop(); i++ {
			c.Classify("SELECT abalance FROM pgbench_accounts WHERE aid = " + string(rune('0'+i%10)))
		}
	})
	b.Run("uncached", func(b *testing.B) {
		for b.Loop() {
			Classify("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = 7")
		}
	})
}

// BenchmarkStorageFence: eight clients straight to Postgres (no proxy), each
// transaction carrying a fence token, on the plpgsql trigger, on the C
// trigger, and on the same tables with the trigger disabled; in two shapes:
// 2x2 updates two fenced tables twice each, 4x1 four fenced tables once each
// (pgbench's tpcb-like writes four). pg-µs/tx is the backends' CPU per
// transaction, from /proc: beside "none", what the trigger costs Postgres.
// /proc counts in 10 ms ticks per backend, so run enough transactions
// (-benchtime 20000x gives about ±4 µs per transaction).
func BenchmarkStorageFence(b *testing.B) {
	const clients = 8
	tables := []string{"public.race", "public.accounts", "public.other", "public.zombie"}
	shapes := []struct {
		name   string
		tables []string
		sql    string // %[1]s token, %[2]d this client's row, %[3]d its account
	}{
		{"2x2", tables[:2], "BEGIN; SELECT set_config('fenceline.token', '%s', true); " +
			"UPDATE public.race SET writer = 'a' WHERE id = %[2]d; UPDATE public.accounts SET balance = balance + 1 WHERE id = %[3]d; " +
			"UPDATE public.race SET writer = 'b' WHERE id = %[2]d; UPDATE public.accounts SET balance = balance - 1 WHERE id = %[3]d; COMMIT"},
		{"4x1", tables, "BEGIN; SELECT set_config('fenceline.token', '%s', true); " +
			"UPDATE public.race SET writer = 'a' WHERE id = %[2]d; UPDATE public.accounts SET balance = balance + 1 WHERE id = %[3]d; " +
			"UPDATE public.other SET note = 'b' WHERE id = %[2]d; UPDATE public.zombie SET balance = balance - 1 WHERE id = %[2]d; COMMIT"},
	}
	for _, tc := range []struct {
		name    string
		f       *fenceDB
		disable bool
	}{{"plpgsql", plpgsql, false}, {"c", cTrigger, false}, {"none", plpgsql, true}} {
		for _, shape := range shapes {
			b.Run(tc.name+"/"+shape.name, func(b *testing.B) {
				benchStorageFence(b, tc.f, tc.disable, shape.tables, shape.sql, clients)
			})
		}
	}
}

func benchStorageFence(b *testing.B, f *fenceDB, disable bool, tables []string, sqlFormat string, clients int) {
	f.need(b)
	// Every client's rows exist in every table (benchmarks run after the
	// tests, which need public.zombie's row 2 only).
	f.reset(b, fmt.Sprintf("TRUNCATE public.race, public.other, public.zombie; INSERT INTO public.race SELECT g, 'x' FROM generate_series(1, %[1]d) g; "+
		"INSERT INTO public.other SELECT g, 'x' FROM generate_series(1, %[1]d) g; INSERT INTO public.zombie SELECT g, 0 FROM generate_series(1, %[1]d) g", 10*clients))
	for _, t := range tables {
		f.resetEpoch(b, t)
	}
	if disable {
		toggle := func(on string) {
			for _, t := range tables {
				f.reset(b, "ALTER TABLE "+t+" "+on+" TRIGGER "+triggerName)
			}
		}
		toggle("DISABLE")
		b.Cleanup(func() { toggle("ENABLE") })
	}
	conns := make([]*pgx.Conn, clients)
	toks := make([]string, clients) // each bound to its connection
	pids := make([]int, clients)
	for i := range conns {
		conns[i] = f.agent(b)
		toks[i] = mustToken(b, f.secret, conns[i], "lease_bench", 1, tables...)
		if err := conns[i].QueryRow(context.Background(), "SELECT pg_backend_pid()").Scan(&pids[i]); err != nil {
			b.Fatal(err)
		}
	}
	cpu0 := backendCPU(b, pids)
	b.ResetTimer()
	var next atomic.Int64
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Rows of this client's own: no lock waits between clients.
			for k := next.Add(1); k <= int64(b.N); k = next.Add(1) {
				row := i*10 + int(k%10) + 1
				sql := fmt.Sprintf(sqlFormat, toks[i], row, i+1)
				if _, err := c.Exec(context.Background(), sql); err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	b.ReportMetric((backendCPU(b, pids)-cpu0)/float64(b.N), "pg-µs/tx")
}

// backendCPU is the CPU time, in µs, that the server processes pids have
// used (user and system, from /proc, so the server must run here).
func backendCPU(b *testing.B, pids []int) float64 {
	b.Helper()
	const userHZ = 100 // the unit of /proc/PID/stat's times on Linux
	var ticks int
	for _, pid := range pids {
		stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
		if err != nil {
			b.Fatalf("backend CPU (the server must run on this machine): %v", err)
		}
		// Fields after the command's closing parenthesis; utime and stime
		// are the 14th and 15th of the line.
		f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+1:]))
		for _, v := range f[11:13] {
			n, err := strconv.Atoi(v)
			if err != nil {
				b.Fatalf("/proc/%d/stat: %v", pid, err)
			}
			ticks += n
		}
	}
	return float64(ticks) * 1e6 / userHZ
}

// BenchmarkBindSession: what drawing a session number costs, the round
// trip the proxy adds once per server connection before its first token
// (rwSQL and bindSessionSQL in one implicit transaction, as the proxy sends
// them), straight to Postgres.
func BenchmarkBindSession(b *testing.B) {
	b.Run("direct", func(b *testing.B) {
		c := connect(b, pg.DSN("agent", "", testDB))
		ctx := context.Background()
		for b.Loop() {
			if _, err := c.Exec(ctx, rwSQL+"; "+bindSessionSQL, pgx.QueryExecModeSimpleProtocol); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkForeignToJudge is what the read fast path spends per statement
// to know that a read names no foreign table (issue 33: the set is learned
// once per catalogTTL; in between, a load and a map lookup).
func BenchmarkForeignToJudge(b *testing.B) {
	s := &session{p: &Proxy{catalog: newCatalog()}, database: "bench"}
	s.slot().foreign.Store(&foreignSet{names: map[string]bool{}, at: time.Now().Add(time.Hour)})
	cls := Classify("SELECT abalance FROM pgbench_accounts WHERE aid = $1")
	st := &cls.Stmts[0]
	b.ReportAllocs()
	for b.Loop() {
		if s.foreignToJudge(st) {
			b.Fatal("judged")
		}
	}
}
