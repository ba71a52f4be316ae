//go:build integration

package pgproxy

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
)

// A database whose encoding is not UTF8 cuts a long identifier at
// NAMEDATALEN (63 bytes) in its own encoding, where the fence's parser cuts
// it in UTF8: 40 'é' are 80 bytes in UTF8, cut to 31 'é' by the parser, and
// 40 bytes in LATIN1, kept whole by the server. The fence judged the name
// it read, the server ran the one it kept: a table of a schema outside the
// claim was written, and a user function was taken for no function at all
// (so not a user's) and ran in a writable transaction, writing outside the
// claim. Either is refused now, with the reason, before it reaches the
// server; short non-ASCII names still work, as do long ASCII ones.
func TestIdentifiersCutByTheServersEncoding(t *testing.T) {
	ctx := ctxT(t)
	const db = "fenceline_latin1"
	root := connect(t, pg.AdminDSN(""))
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db,
		"CREATE DATABASE " + db + " ENCODING 'LATIN1' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"} {
		if _, err := root.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		root.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)") //nolint:errcheck // best effort
	})
	long, cut := strings.Repeat("é", 40), strings.Repeat("é", 31) // the parser's cut of long: 62 bytes
	short := strings.Repeat("é", 12)
	admin := connect(t, withUTF8(pg.AdminDSN(db)))
	if _, err := admin.Exec(ctx, fmt.Sprintf(`
CREATE SCHEMA %[1]q; CREATE SCHEMA %[2]q; CREATE SCHEMA %[3]q;
CREATE TABLE %[1]q.t (v int); CREATE TABLE %[2]q.t (v int); CREATE TABLE %[3]q.t (v int);
CREATE TABLE public.victim (v int);
CREATE FUNCTION public.%[1]q() RETURNS int LANGUAGE sql AS 'INSERT INTO public.victim VALUES (1) RETURNING 1';
CREATE TABLE public.%[4]s (v int);
GRANT USAGE ON SCHEMA %[1]q, %[2]q, %[3]q TO agent;
GRANT ALL ON %[1]q.t, %[2]q.t, %[3]q.t, public.victim, public.%[4]s TO agent`, long, cut, short, strings.Repeat("a", 70))); err != nil {
		t.Fatal(err)
	}
	// The agent's lease claims the schema of the parser's cut, the short
	// non-ASCII one and public's long ASCII name; never the long schema,
	// nor public.victim.
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_latin1", 0, cut+".*", short+".*", "public."+strings.Repeat("a", 63))})
	dsn := withUTF8(fmt.Sprintf("postgres://agent@%s/%s?sslmode=disable", p.Addr(), db))
	rows := func(table string) int {
		t.Helper()
		var n int
		if err := admin.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, attack := range []struct {
		name, sql string
		target    string // what must stay empty
	}{
		{"write a table of the long schema", fmt.Sprintf("INSERT INTO %q.t VALUES (1)", long), fmt.Sprintf("%q.t", long)},
		{"write it by Unicode escapes", fmt.Sprintf(`INSERT INTO U&"%s".t VALUES (1)`, strings.Repeat(`\00E9`, 40)), fmt.Sprintf("%q.t", long)},
		{"call a function of the long name in a writable block", fmt.Sprintf("BEGIN; INSERT INTO %q.t VALUES (0); SELECT public.%q(); COMMIT", short, long), "public.victim"},
	} {
		for _, mode := range []string{"simple", "extended"} {
			t.Run(attack.name+"/"+mode, func(t *testing.T) {
				c := connect(t, dsn)
				var err error
				if mode == "simple" {
					err = simple(ctx, c, attack.sql)
				} else {
					err = extendedEach(ctx, c, attack.sql)
				}
				simple(ctx, c, "ROLLBACK") //nolint:errcheck // (a warning outside a block)
				if n := rows(attack.target); n != 0 || pgCode(err) != "42501" || !strings.Contains(err.Error(), "encoding") {
					t.Errorf("%s: %v; %s has %d rows: want it refused (42501) for the server's encoding, nothing written", attack.sql, err, attack.target, n)
				}
			})
		}
	}
	// What the encodings read alike passes: a short non-ASCII name, a
	// long ASCII one, and non-ASCII text in a string.
	c := connect(t, dsn)
	for _, q := range []string{
		fmt.Sprintf("INSERT INTO %q.t VALUES (2)", short),
		fmt.Sprintf("INSERT INTO %q.t SELECT length('%s')", short, long),
		fmt.Sprintf("INSERT INTO public.%s VALUES (3)", strings.Repeat("a", 70)),
	} {
		if err := simple(ctx, c, q); err != nil {
			t.Errorf("%s: %v; want it to pass", q, err)
		}
	}
	if n := rows(fmt.Sprintf("%q.t", short)); n != 2 {
		t.Errorf("%q.t has %d rows: want 2", short, n)
	}
	// A statement name the server may cut (16 'é', up to 64 bytes in some
	// encoding) could be one on the server with another the fence tells
	// apart; 15 cannot.
	if _, err := c.PgConn().Prepare(ctx, strings.Repeat("é", 16), "SELECT 1", nil); err == nil || !strings.Contains(err.Error(), "encoding") {
		t.Errorf("a statement named 16 'é': %v; want it refused for the server's encoding", err)
	}
	if _, err := c.PgConn().Prepare(ctx, strings.Repeat("é", 15), "SELECT 1", nil); err != nil {
		t.Errorf("a statement named 15 'é': %v; want it prepared", err)
	}
}

// withUTF8 is dsn asking for client_encoding UTF8, as drivers do (a
// session's default is the database's encoding).
func withUTF8(dsn string) string {
	if strings.Contains(dsn, "?") {
		return dsn + "&client_encoding=UTF8"
	}
	return dsn + "?client_encoding=UTF8"
}

// extendedEach runs each ';'-separated statement of sql with the extended
// protocol (Parse, Bind, Execute, Sync) and returns the first error.
func extendedEach(ctx context.Context, c *pgx.Conn, sql string) error {
	for _, q := range strings.Split(sql, "; ") {
		if err := c.PgConn().ExecParams(ctx, q, nil, nil, nil, nil).Read().Err; err != nil {
			return err
		}
	}
	return nil
}
