//go:build integration

package pgproxy

import (
	"context"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgproto3"
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

// encodingDB makes database db in encoding enc with public.victim and
// app.x, writable by agent, and a proxy whose lease claims claim; it
// returns an admin's query runner, a row counter and a DSN through the
// proxy in a client encoding.
func encodingDB(t *testing.T, db, enc string, claim ...string) (admin func(string), rows func(table string) int, dsn func(clientEnc string) string) {
	ctx := ctxT(t)
	root := connect(t, pg.AdminDSN(""))
	for _, q := range []string{"DROP DATABASE IF EXISTS " + db,
		"CREATE DATABASE " + db + " ENCODING '" + enc + "' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0"} {
		if _, err := root.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		root.Exec(context.Background(), "DROP DATABASE IF EXISTS "+db+" WITH (FORCE)") //nolint:errcheck // best effort
	})
	ac := connect(t, withUTF8(pg.AdminDSN(db)))
	admin = func(q string) {
		t.Helper()
		if err := simple(ctx, ac, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	admin(`CREATE SCHEMA app; CREATE TABLE app.x (v int); CREATE TABLE public.victim (v int);
GRANT ALL ON SCHEMA app TO agent; GRANT ALL ON app.x, public.victim TO agent`)
	rows = func(table string) int {
		t.Helper()
		var n int
		if err := ac.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_"+db, 0, claim...)})
	dsn = func(clientEnc string) string {
		return fmt.Sprintf("postgres://agent@%s/%s?sslmode=disable&client_encoding=%s", p.Addr(), db, clientEnc)
	}
	return admin, rows, dsn
}

// Found by a review of the cut above, each wrote outside the claim before:
//   - a client in SQL_ASCII sends its bytes unconverted, so a LATIN1
//     database read "éf" as "Ã©f" while the fence's lookup, which names
//     what it looks up in UTF8, asked for "éf", found no function and let
//     the user function of the other name write public.victim;
//   - Postgres sends the names it returns in the client's encoding: the
//     schema "Ã©" came back to a LATIN1 client as the bytes of "é", which
//     passed a claim of "é.*", and a search path learned in UTF8 was pinned
//     after the client switched to LATIN1, where its bytes are "Ã©".
func TestEncodingsNamesComeBackIn(t *testing.T) {
	ctx := ctxT(t)
	t.Run("SQL_ASCII client, LATIN1 database", func(t *testing.T) {
		admin, rows, dsn := encodingDB(t, "fenceline_sqlascii", "LATIN1", "app.*")
		admin(`CREATE FUNCTION public."Ã©f"() RETURNS int LANGUAGE sql AS 'INSERT INTO public.victim VALUES (1) RETURNING 1'`)
		c := connect(t, dsn("SQL_ASCII"))
		err := simple(ctx, c, `BEGIN; INSERT INTO app.x VALUES (0); SELECT public."éf"(); COMMIT`)
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // (a warning outside a block)
		if n := rows("public.victim"); n != 0 || pgCode(err) != "42501" {
			t.Errorf("%v; public.victim has %d rows: want it refused (42501), nothing written", err, n)
		}
	})
	t.Run("SQL_ASCII client, UTF8 database: as UTF8", func(t *testing.T) {
		// Nothing is converted either way, so names come back as the
		// parser reads them: psql in a C locale asks for SQL_ASCII, and
		// its writes under a claim not in ASCII pass.
		admin, rows, dsn := encodingDB(t, "fenceline_sqlascii_utf8", "UTF8", "é.*")
		admin(`CREATE SCHEMA "é"; CREATE TABLE "é".t (v int); GRANT ALL ON SCHEMA "é" TO agent; GRANT ALL ON "é".t TO agent`)
		c := connect(t, dsn("SQL_ASCII"))
		for _, q := range []string{`INSERT INTO "é".t VALUES (1)`, `SET search_path = "é"`, `INSERT INTO t VALUES (2)`} {
			if err := simple(ctx, c, q); err != nil {
				t.Errorf("%s: %v; want it to pass", q, err)
			}
		}
		if n := rows(`"é".t`); n != 2 {
			t.Errorf(`"é".t has %d rows: want 2`, n)
		}
	})
	for _, variant := range []string{"LATIN1 from the start", "LATIN1 after the path was learned"} {
		t.Run(variant, func(t *testing.T) {
			db := "fenceline_back_" + strings.ReplaceAll(strings.Fields(variant)[2], "the", "late")
			admin, rows, dsn := encodingDB(t, db, "UTF8", "é.*")
			admin(`CREATE SCHEMA "é"; CREATE TABLE "é".t (v int); CREATE SCHEMA "Ã©"; CREATE TABLE "Ã©".t (v int);
GRANT ALL ON SCHEMA "é", "Ã©" TO agent; GRANT ALL ON "é".t, "Ã©".t TO agent`)
			var c *pgx.Conn
			var qs []string
			if variant == "LATIN1 from the start" {
				c = connect(t, dsn("LATIN1"))
				qs = []string{`SET search_path = U&"\00C3\00A9"`} // in ASCII: "Ã©"
			} else {
				c = connect(t, dsn("UTF8"))
				qs = []string{`SET search_path = "é"`, `INSERT INTO t VALUES (0)`, `SET client_encoding = 'LATIN1'`}
			}
			for _, q := range qs {
				if err := simple(ctx, c, q); err != nil {
					t.Fatalf("%s: %v", q, err)
				}
			}
			err := simple(ctx, c, `INSERT INTO t VALUES (1)`)
			if n := rows(`"Ã©".t`); n != 0 || pgCode(err) != "42501" || !strings.Contains(err.Error(), "client encoding") {
				t.Errorf(`INSERT INTO t: %v; "Ã©".t has %d rows: want it refused (42501) for the client's encoding, nothing written`, err, n)
			}
		})
	}
}

// Without a database in its startup message a session reaches the
// database named as its user; the catalog's cache is by database, and ""
// was every such user's: a lookup in one role's database was taken for
// another's, where the function it found missing writes public.victim.
func TestSessionsWithoutADatabaseName(t *testing.T) {
	ctx := ctxT(t)
	root := connect(t, pg.AdminDSN(""))
	for _, r := range []string{"fenceline_nodb_a", "fenceline_nodb_b"} {
		for _, q := range []string{"DROP DATABASE IF EXISTS " + r,
			"DO $$BEGIN IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = '" + r + "') THEN CREATE ROLE " + r + " LOGIN; END IF; END$$",
			"CREATE DATABASE " + r} {
			if _, err := root.Exec(ctx, q); err != nil {
				t.Fatalf("%s: %v", q, err)
			}
		}
		t.Cleanup(func() {
			root.Exec(context.Background(), "DROP DATABASE IF EXISTS "+r+" WITH (FORCE)") //nolint:errcheck // best effort
		})
		ac := connect(t, pg.AdminDSN(r))
		setup := `CREATE SCHEMA app; CREATE TABLE app.x (v int); CREATE TABLE public.victim (v int);
GRANT ALL ON SCHEMA app TO PUBLIC; GRANT ALL ON app.x, public.victim TO PUBLIC`
		if r == "fenceline_nodb_b" {
			setup += `; CREATE FUNCTION public.f() RETURNS int LANGUAGE sql AS 'INSERT INTO public.victim VALUES (1) RETURNING 1'`
		}
		if err := simple(ctx, ac, setup); err != nil {
			t.Fatal(err)
		}
	}
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_nodb", 0, "app.*")})
	const q = `BEGIN; INSERT INTO app.x VALUES (0); SELECT public.f(); COMMIT`
	var err error
	for _, r := range []string{"fenceline_nodb_a", "fenceline_nodb_b"} {
		c := connect(t, fmt.Sprintf("postgres://%s@%s/?sslmode=disable", r, p.Addr()))
		err = simple(ctx, c, q)    // a: no such function (learned as none); b: a user function
		simple(ctx, c, "ROLLBACK") //nolint:errcheck // (a warning outside a block)
	}
	bc := connect(t, pg.AdminDSN("fenceline_nodb_b"))
	var n int
	if err := bc.QueryRow(ctx, "SELECT count(*) FROM public.victim").Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 || pgCode(err) != "42501" {
		t.Errorf("the second role's call of its own user function: %v; its public.victim has %d rows: want it refused (42501), nothing written", err, n)
	}
}

// A SET client_encoding in a pipeline changes how Postgres reads the Binds
// after it, the pin of the search path among them: the path "é", learned
// and checked in UTF8, was pinned as the bytes of "é" read in LATIN1, "Ã©",
// and the write went there (found by a review). The pin now goes as hex
// of its UTF8 text (extended protocol) or in Unicode escapes (simple), the
// same in any encoding.
func TestPinReadsAlikeInAnyEncoding(t *testing.T) {
	ctx := ctxT(t)
	admin := adminConn(t)
	if _, err := admin.Exec(ctx, `DROP SCHEMA IF EXISTS "é", "Ã©" CASCADE;
CREATE SCHEMA "é"; CREATE TABLE "é".t (v int); CREATE SCHEMA "Ã©"; CREATE TABLE "Ã©".t (v int);
GRANT ALL ON SCHEMA "é", "Ã©" TO agent; GRANT ALL ON "é".t, "Ã©".t TO agent`); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		admin.Exec(context.Background(), `DROP SCHEMA IF EXISTS "é", "Ã©" CASCADE`) //nolint:errcheck // best effort
	})
	p := startProxy(t, Config{Lease: newStaticLease(t, "lease_pin_enc", 0, "é.*")})
	exec := func(q string) []pgproto3.FrontendMessage {
		return []pgproto3.FrontendMessage{&pgproto3.Parse{Query: q}, &pgproto3.Bind{}, &pgproto3.Execute{}}
	}
	for _, mode := range []string{"extended", "simple"} {
		send := wireSession(t, p)
		var tr []string
		for _, q := range []string{`SET search_path = "é"`, `INSERT INTO t VALUES (0)`} {
			tr = append(tr, send(&pgproto3.Query{String: q}))
		}
		qs := []string{"BEGIN", "SET client_encoding TO 'LATIN1'", "SAVEPOINT s", "ROLLBACK TO s", "INSERT INTO t VALUES (1)", "COMMIT"}
		if mode == "extended" {
			var msgs []pgproto3.FrontendMessage
			for _, q := range qs {
				msgs = append(msgs, exec(q)...)
			}
			tr = append(tr, send(append(msgs, &pgproto3.Sync{})...))
		} else {
			tr = append(tr, send(&pgproto3.Query{String: strings.Join(qs, "; ")}))
		}
		var out int
		if err := admin.QueryRow(ctx, `SELECT count(*) FROM "Ã©".t`).Scan(&out); err != nil {
			t.Fatal(err)
		}
		if out != 0 {
			t.Errorf("%s: %v; \"Ã©\".t has %d rows: the pin after a switch to LATIN1 named another schema than the one checked", mode, tr, out)
		}
	}
}

// A Query's pin (pinnedPathSQL) names the same schemas in any client
// encoding: Postgres, asked in LATIN1, holds the path the proxy checked.
func TestPinnedPathSQLInLatin1(t *testing.T) {
	ctx := ctxT(t)
	want := []string{"é", `a"b`, `x\y`, "public"}
	s := &session{searchPath: want}
	c := connect(t, withUTF8(pg.AdminDSN(testDB)))
	for _, q := range []string{"SET client_encoding = 'LATIN1'", "SET search_path = " + s.pinnedPathSQL()} {
		if err := simple(ctx, c, q); err != nil { // (one Query each: Postgres converts a Query's text as it arrives)
			t.Fatalf("%s: %v", q, err)
		}
	}
	var h string
	if err := c.QueryRow(ctx, "SELECT encode(convert_to(current_setting('search_path'), 'UTF8'), 'hex')").Scan(&h); err != nil {
		t.Fatal(err)
	}
	b, err := hex.DecodeString(h)
	if err != nil {
		t.Fatal(err)
	}
	if got := parseSearchPath(string(b)); strings.Join(got, "|") != strings.Join(want, "|") {
		t.Errorf("SET search_path = %s in LATIN1 holds %q: want %q", s.pinnedPathSQL(), got, want)
	}
}
