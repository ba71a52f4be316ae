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

// The client's own read-write default is the client's to set, as direct:
// SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE and SET
// default_transaction_read_only = off switch off the read-only default the
// client set itself (writes then run as they would direct, still only under
// the lease), while Postgres's own default, the proxy's, stays on.
func TestClientReadWriteDefaultAsDirect(t *testing.T) {
	lease := newStaticLease(t, "lease_rw35", 0, "public.*", "app.*")
	p := startProxy(t, Config{Lease: lease})
	ctx := ctxT(t)
	for _, set := range []string{
		"SET SESSION CHARACTERISTICS AS TRANSACTION READ WRITE",
		"SET default_transaction_read_only = off",
		"SET default_transaction_read_only TO false",
	} {
		for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeSimpleProtocol, pgx.QueryExecModeExec} {
			c := connect(t, proxyDSN(p, "agent"))
			if err := simple(ctx, c, "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ('read-only')"); pgCode(err) != "25006" {
				t.Fatalf("write with the client's default read-only: %v, want 25006", err)
			}
			tag, err := c.Exec(ctx, set, mode)
			if err != nil || tag.String() != "SET" {
				t.Errorf("%s (%v): tag %q, %v; want SET as direct", set, mode, tag.String(), err)
				continue
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ($1)", set); err != nil {
				t.Errorf("write after %s (%v): %v", set, mode, err)
			}
			var show, own string
			if err := c.QueryRow(ctx, "SHOW default_transaction_read_only", pgx.QueryExecModeSimpleProtocol).Scan(&show); err != nil || show != "off" {
				t.Errorf("after %s (%v): SHOW default_transaction_read_only = %q (%v), want off", set, mode, show, err)
			}
			if err := c.QueryRow(ctx, "SELECT current_setting('default_transaction_read_only')").Scan(&own); err != nil || own != "on" {
				t.Errorf("after %s (%v): Postgres's own default %q (%v), want on (the proxy's)", set, mode, own, err)
			}
			// Inside a block that rolls back, the change is gone, as direct.
			if err := simple(ctx, c, "SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY; BEGIN; "+set+"; ROLLBACK"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Exec(ctx, "INSERT INTO app.log (msg) VALUES ('rolled back')"); pgCode(err) != "25006" {
				t.Errorf("write after %s rolled back (%v): %v, want 25006", set, mode, err)
			}
			c.Close(ctx)
		}
	}
	c := connect(t, proxyDSN(p, "agent"))
	for _, q := range []string{"SET LOCAL default_transaction_read_only = off", "SET transaction_read_only = off",
		"SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL SERIALIZABLE, READ WRITE"} {
		if _, err := c.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol); pgCode(err) != "42501" {
			t.Errorf("%s: %v, want the fence's refusal (42501)", q, err)
		}
	}
}
