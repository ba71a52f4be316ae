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
// transaction carrying a fence token and updating two fenced tables twice,
// on the plpgsql trigger, on the C trigger, and on the same tables with the
// trigger disabled. pg-µs/tx is the backends' CPU per transaction, from
// /proc: beside "none", what the trigger costs Postgres. /proc counts in
// 10 ms ticks per backend, so run enough transactions (-benchtime 20000x
// gives about ±4 µs per transaction).
func BenchmarkStorageFence(b *testing.B) {
	const clients = 8
	for _, tc := range []struct {
		name    string
		f       *fenceDB
		disable bool
	}{{"plpgsql", plpgsql, false}, {"c", cTrigger, false}, {"none", plpgsql, true}} {
		b.Run(tc.name, func(b *testing.B) {
			tc.f.need(b)
			tc.f.reset(b, fmt.Sprintf("TRUNCATE public.race; INSERT INTO public.race SELECT g, 'x' FROM generate_series(1, %d) g", 10*clients))
			tc.f.resetEpoch(b, "public.race")
			tc.f.resetEpoch(b, "public.accounts")
			if tc.disable {
				toggle := func(on string) {
					tc.f.reset(b, "ALTER TABLE public.race "+on+" TRIGGER "+triggerName+"; ALTER TABLE public.accounts "+on+" TRIGGER "+triggerName)
				}
				toggle("DISABLE")
				b.Cleanup(func() { toggle("ENABLE") })
			}
			tok := mustToken(b, tc.f.secret, "lease_bench", 1, "public.race", "public.accounts")
			conns := make([]*pgx.Conn, clients)
			pids := make([]int, clients)
			for i := range conns {
				conns[i] = tc.f.agent(b)
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
						sql := fmt.Sprintf("BEGIN; SELECT set_config('fenceline.token', '%s', true); "+
							"UPDATE public.race SET writer = 'a' WHERE id = %[2]d; UPDATE public.accounts SET balance = balance + 1 WHERE id = %[3]d; "+
							"UPDATE public.race SET writer = 'b' WHERE id = %[2]d; UPDATE public.accounts SET balance = balance - 1 WHERE id = %[3]d; COMMIT",
							tok, row, i+1)
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
		})
	}
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
