package pgproxy

import (
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

func pgCode(err error) string {
	var pe *pgconn.PgError
	if errors.As(err, &pe) {
		return pe.Code
	}
	return ""
}

func TestReadsAndFencedWrites(t *testing.T) {
	lease := newStaticLease(t, "lease_rw1", 5, "public.accounts", "app.*")
	rec := &recorder{}
	p := startProxy(t, Config{Lease: lease, Audit: rec})
	ctx := ctxT(t)
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeCacheStatement, pgx.QueryExecModeExec} {
		t.Run(mode.String(), func(t *testing.T) {
			c := connect(t, proxyDSN(p, "agent"))
			var n int
			if err := c.QueryRow(ctx, "SELECT count(*) FROM public.big", mode).Scan(&n); err != nil || n != 50000 {
				t.Fatalf("read: %d %v", n, err)
			}
			if _, err := c.Exec(ctx, "UPDATE public.accounts SET balance = balance + 1 WHERE id = $1", mode, 1); err != nil {
				t.Fatalf("in-scope write: %v", err)
			}
			_, err := c.Exec(ctx, "UPDATE public.other SET note = 'x' WHERE id = $1", mode, 1)
			if err == nil || !strings.Contains(err.Error(), "outside the lease") || pgCode(err) != "42501" {
				t.Fatalf("out-of-scope write: got %v", err)
			}
			if _, err := c.Exec(ctx, "SELECT public.f_writes()", mode); pgCode(err) != "42501" || !strings.Contains(err.Error(), "lease_rw1") {
				t.Fatalf("read calling a function writing outside the lease: want the refusal (42501) naming the lease, got %v", err)
			}
			// The connection still works after refusals.
			if err := c.QueryRow(ctx, "SELECT 1", mode).Scan(&n); err != nil {
				t.Fatal(err)
			}
		})
	}
	if len(rec.events()) == 0 {
		t.Fatal("no audit events for refused writes")
	}
}
