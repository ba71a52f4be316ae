package pgproxy

import (
	"context"
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

// BenchmarkStorageFence: one transaction straight to Postgres (no proxy)
// that carries a fence token and updates one row, on a table fenced by each
// kind of trigger and on an unfenced one; the difference is what the
// trigger costs per write statement (its set-up once per transaction
// included).
func BenchmarkStorageFence(b *testing.B) {
	for _, tc := range []struct {
		name, table string
		f           *fenceDB
	}{
		{"fenced-plpgsql", "public.race", plpgsql},
		{"fenced-c", "public.race", cTrigger},
		{"unfenced", "public.big", plpgsql},
	} {
		b.Run(tc.name, func(b *testing.B) {
			if tc.f.unavailable != nil {
				b.Fatalf("the C trigger: %v", tc.f.unavailable)
			}
			tc.f.reset(b, "TRUNCATE public.race; INSERT INTO public.race VALUES (1, 'bench')")
			tc.f.resetEpoch(b, "public.race")
			tok := mustToken(b, tc.f.secret, "lease_bench", 1, "public.race")
			c := tc.f.agent(b)
			sql := "BEGIN; SELECT set_config('fenceline.token', '" + tok + "', true); UPDATE " + tc.table + " SET id = id WHERE id = 1; COMMIT"
			ctx := context.Background()
			for b.Loop() {
				if _, err := c.Exec(ctx, sql); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
