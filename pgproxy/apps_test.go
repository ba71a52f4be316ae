package pgproxy

import (
	"testing"

	"github.com/jackc/pgx/v5"
)

// Issue 35: what real applications do, and a lease allows, works through
// the fence as it does direct.

// RESET ROLE, SET ROLE NONE (Postgres takes 'none' in any quoting as NONE) and RESET SESSION AUTHORIZATION only return to
// the session's own role (the one it connected as, which the proxy let in):
// they run, in either protocol. SET ROLE to another role stays refused.
func TestResetRoleAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_role35", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"RESET ROLE", "SET ROLE NONE", "SET ROLE 'none'", "SET role TO DEFAULT", "RESET SESSION AUTHORIZATION",
		"SET SESSION AUTHORIZATION DEFAULT", "RESET session_authorization"} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			if _, err := c.Exec(ctx, q, mode); err != nil {
				t.Errorf("%s (%v): %v, want it to run as direct", q, mode, err)
			}
		}
		var user string
		if err := c.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil || user != "agent" {
			t.Errorf("after %s: current_user %q (%v), want agent", q, user, err)
		}
		if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", "after "+q); err != nil {
			t.Errorf("write after %s: %v", q, err)
		}
	}
	for _, q := range []string{"SET ROLE postgres", `SET ROLE "None"`, "SET SESSION AUTHORIZATION postgres", "SET role = postgres", "SET LOCAL role = postgres"} {
		if _, err := c.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); pgCode(err) != "42501" {
			t.Errorf("%s: %v, want the fence's refusal (42501)", q, err)
		}
	}
}
