package pgproxy

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/scope"
)

// Names of what "fenceline pg install" creates.
const (
	// Schema holds the fence: fenceline.secret (the signing key, readable
	// only by the installing role), fenceline.epoch (the highest fence
	// that wrote each fenced table) and fenceline.fence_check(), the
	// SECURITY DEFINER trigger function.
	Schema = "fenceline"
	// triggerName is the statement-level trigger on every fenced table.
	triggerName = "fenceline_fence"
	// tokenSetting carries the token, transaction-locally.
	tokenSetting = "fenceline.token"
	// advisoryKey is the first key of the advisory locks the trigger takes
	// ("FENC").
	advisoryKey = 1178946115
)

// tokenVersion starts every token; the trigger refuses anything else.
const tokenVersion = "v2"

// MakeToken signs a fence token for a lease:
//
//	payload = "v2:" fence ":" hex(lease) ":" table ("," table)*
//	table   = hex(schema) "." (hex(name) | "*")
//	token   = payload ":" hex(sha256(secret || sha256(secret || payload)))
//
// Names are the raw (unquoted) identifiers as UTF-8, hex-encoded so that the
// trigger can match a table with one strpos and no parsing, and so that the
// token needs no quoting in SQL. Postgres verifies the MAC with its built-in
// sha256().
func MakeToken(secret []byte, leaseID string, fence uint64, tables []string) (string, error) {
	if fence > math.MaxInt64 {
		return "", fmt.Errorf("fence token %d does not fit a Postgres bigint", fence)
	}
	b := make([]byte, 0, 96+2*len(leaseID)+40*len(tables))
	b = append(b, tokenVersion...)
	b = append(b, ':')
	b = strconv.AppendUint(b, fence, 10)
	b = append(b, ':')
	b = hex.AppendEncode(b, []byte(leaseID))
	b = append(b, ':')
	for i, t := range tables {
		s, n, err := SplitTable(t)
		if err != nil {
			return "", err
		}
		if i > 0 {
			b = append(b, ',')
		}
		b = hex.AppendEncode(b, []byte(s))
		b = append(b, '.')
		if n == "*" {
			b = append(b, '*')
		} else {
			b = hex.AppendEncode(b, []byte(n))
		}
	}
	payload := string(b)
	return payload + ":" + tokenMAC(secret, payload), nil
}

func tokenMAC(secret []byte, payload string) string {
	inner := sha256.Sum256(append(append([]byte{}, secret...), payload...))
	outer := sha256.Sum256(append(append([]byte{}, secret...), inner[:]...))
	return hex.EncodeToString(outer[:])
}

// SplitTable splits a normalized table claim ("schema.table", "schema.*",
// quoted identifiers allowed) into its raw schema and table names; the table
// is "*" for a wildcard.
func SplitTable(t string) (schemaName, table string, err error) {
	norm, err := scope.NormalizeTable(t)
	if err != nil {
		return "", "", err
	}
	s, rest, err := readIdent(norm)
	if err != nil || !strings.HasPrefix(rest, ".") {
		return "", "", fmt.Errorf("table %q: want schema.table", t)
	}
	rest = rest[1:]
	if rest == "*" {
		return s, "*", nil
	}
	n, rest, err := readIdent(rest)
	if err != nil || rest != "" {
		return "", "", fmt.Errorf("table %q: want schema.table", t)
	}
	return s, n, nil
}

// readIdent reads one identifier of a normalized name: bare (as is) or
// double-quoted with "" for a quote.
func readIdent(s string) (ident, rest string, err error) {
	if !strings.HasPrefix(s, `"`) {
		i := strings.IndexByte(s, '.')
		if i < 0 {
			return s, "", nil
		}
		return s[:i], s[i:], nil
	}
	var b strings.Builder
	for i := 1; i < len(s); i++ {
		if s[i] == '"' {
			if i+1 < len(s) && s[i+1] == '"' {
				b.WriteByte('"')
				i++
				continue
			}
			return b.String(), s[i+1:], nil
		}
		b.WriteByte(s[i])
	}
	return "", "", errors.New("unterminated quoted identifier")
}

// installSQL creates the fence schema. It is idempotent.
const installSQL = `
CREATE SCHEMA IF NOT EXISTS fenceline;
REVOKE ALL ON SCHEMA fenceline FROM PUBLIC;
CREATE TABLE IF NOT EXISTS fenceline.secret (
	id  int PRIMARY KEY CHECK (id = 1),
	key bytea NOT NULL CHECK (length(key) >= 16)
);
CREATE TABLE IF NOT EXISTS fenceline.epoch (
	relid      oid PRIMARY KEY,
	relname    text NOT NULL,
	fence      bigint NOT NULL DEFAULT 0,
	lease_id   text NOT NULL DEFAULT '',
	updated_at timestamptz
);
REVOKE ALL ON fenceline.secret, fenceline.epoch FROM PUBLIC;

CREATE OR REPLACE FUNCTION fenceline.fence_check() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
-- Runs before every write statement on a fenced table, so it is kept cheap:
-- two queries (the secret with an unlocked peek at the epoch; the epoch again
-- under the lock), string functions instead of JSON. See pgproxy.MakeToken
-- for the token format.
DECLARE
	tok     text := current_setting('fenceline.token', true);
	n       int := coalesce(length(tok), 0);
	rc      boolean := current_setting('transaction_isolation') = 'read committed';
	payload text;
	tabs    text;
	sch     text;
	k       bytea;
	peek    bigint;
	f       bigint;
	lease   text;
	curf    bigint;
	curl    text;
	lk      text;
BEGIN
	IF n = 0 THEN
		RAISE EXCEPTION 'fenceline: % on %.% carries no fence token', TG_OP, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
			USING ERRCODE = '40001',
			HINT = 'fenced tables accept writes only through a fenceline proxy that holds a live lease claiming them';
	END IF;
	IF n < 71 OR left(tok, 3) <> 'v2:' OR substr(tok, n - 64, 1) <> ':' THEN
		RAISE EXCEPTION 'fenceline: malformed fence token on %.%', quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
			USING ERRCODE = '40001', HINT = 'the proxy and "fenceline pg install" must be the same version';
	END IF;
	payload := left(tok, n - 65);
	SELECT s.key, ep.fence INTO k, peek
		FROM fenceline.secret s LEFT JOIN fenceline.epoch ep ON ep.relid = TG_RELID WHERE s.id = 1;
	IF k IS NULL OR right(tok, 64) <> encode(sha256(k || sha256(k || convert_to(payload, 'UTF8'))), 'hex') THEN
		RAISE EXCEPTION 'fenceline: forged or foreign fence token on %.%', quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
			USING ERRCODE = '40001';
	END IF;
	f := split_part(payload, ':', 2)::bigint;
	lease := convert_from(decode(split_part(payload, ':', 3), 'hex'), 'UTF8');
	tabs := ',' || split_part(payload, ':', 4) || ',';
	sch := ',' || encode(convert_to(TG_TABLE_SCHEMA, 'UTF8'), 'hex') || '.';
	IF strpos(tabs, sch || '*,') = 0 AND strpos(tabs, sch || encode(convert_to(TG_TABLE_NAME, 'UTF8'), 'hex') || ',') = 0 THEN
		RAISE EXCEPTION 'fenceline: lease % (fence %) does not claim table %.%', lease, f, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
			USING ERRCODE = '42501';
	END IF;
	IF peek IS NULL THEN
		RAISE EXCEPTION 'fenceline: %.% has a fence trigger but no epoch row', quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME)
			USING ERRCODE = '40001', HINT = 'run "fenceline pg install" for this table again';
	END IF;
	IF rc THEN
		IF f > peek THEN
			lk := pg_advisory_xact_lock(1178946115, (TG_RELID::bigint - 2147483648)::int)::text;
		ELSE
			lk := pg_advisory_xact_lock_shared(1178946115, (TG_RELID::bigint - 2147483648)::int)::text;
		END IF;
		SELECT ep.fence, ep.lease_id INTO curf, curl FROM fenceline.epoch ep WHERE ep.relid = TG_RELID;
	ELSIF f > peek THEN
		SELECT ep.fence, ep.lease_id INTO curf, curl FROM fenceline.epoch ep WHERE ep.relid = TG_RELID FOR UPDATE;
	ELSE
		SELECT ep.fence, ep.lease_id INTO curf, curl FROM fenceline.epoch ep WHERE ep.relid = TG_RELID FOR SHARE;
	END IF;
	IF f < curf OR (f = curf AND lease <> curl) THEN
		RAISE EXCEPTION 'fenceline: stale fence: lease % (fence %) may no longer write %.%; lease % (fence %) already wrote it',
			lease, f, quote_ident(TG_TABLE_SCHEMA), quote_ident(TG_TABLE_NAME), curl, curf
			USING ERRCODE = '40001', HINT = 'the lease was lost and granted again; acquire a new lease before writing';
	END IF;
	IF f > curf THEN
		IF rc AND f <= peek THEN
			-- peeked an equal-or-newer fence, then found an older one: impossible
			-- without a rollback of the epoch; take the exclusive lock to be safe.
			lk := pg_advisory_xact_lock(1178946115, (TG_RELID::bigint - 2147483648)::int)::text;
		END IF;
		UPDATE fenceline.epoch SET fence = f, lease_id = lease, updated_at = now() WHERE relid = TG_RELID;
	END IF;
	RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION fenceline.fence_check() FROM PUBLIC;
`

// Install creates the fence in the database conn is connected to (as a role
// that owns or may alter the tables, and that agents' roles are not): the
// fenceline schema, the signing secret (created once, then reused) and the
// trigger on each table ("schema.table", or "schema.*" for every table of a
// schema that exists now). It returns the secret for the proxy's Config.
// Running it again is safe and attaches newly named tables.
func Install(ctx context.Context, conn *pgx.Conn, tables []string) ([]byte, error) {
	if len(tables) == 0 {
		return nil, errors.New("pg install: no tables: name at least one schema.table or schema.*")
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("pg install: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, installSQL); err != nil {
		return nil, fmt.Errorf("pg install: create schema fenceline: %w", err)
	}
	key := make([]byte, 32)
	if _, err := rand.Read(key); err != nil {
		return nil, fmt.Errorf("pg install: random secret: %w", err)
	}
	if _, err := tx.Exec(ctx, `INSERT INTO fenceline.secret (id, key) VALUES (1, $1) ON CONFLICT (id) DO NOTHING`, key); err != nil {
		return nil, fmt.Errorf("pg install: store secret: %w", err)
	}
	if err := tx.QueryRow(ctx, `SELECT key FROM fenceline.secret WHERE id = 1`).Scan(&key); err != nil {
		return nil, fmt.Errorf("pg install: read secret: %w", err)
	}
	var rels []string // quoted schema.table
	for _, t := range tables {
		s, n, err := SplitTable(t)
		if err != nil {
			return nil, fmt.Errorf("pg install: %w", err)
		}
		if s == Schema {
			return nil, fmt.Errorf("pg install: %s: the fenceline schema itself cannot be fenced", t)
		}
		if n != "*" {
			rels = append(rels, pgx.Identifier{s, n}.Sanitize())
			continue
		}
		rows, err := tx.Query(ctx, `SELECT c.relname FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
			WHERE ns.nspname = $1 AND c.relkind IN ('r', 'p') ORDER BY 1`, s)
		if err != nil {
			return nil, fmt.Errorf("pg install: list tables of %s: %w", s, err)
		}
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("pg install: list tables of %s: %w", s, err)
		}
		for _, name := range names {
			rels = append(rels, pgx.Identifier{s, name}.Sanitize())
		}
	}
	for _, rel := range rels {
		sql := fmt.Sprintf(`
INSERT INTO fenceline.epoch (relid, relname) VALUES ('%[2]s'::regclass, '%[2]s') ON CONFLICT (relid) DO NOTHING;
DROP TRIGGER IF EXISTS %[1]s ON %[3]s;
CREATE TRIGGER %[1]s BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %[3]s
	FOR EACH STATEMENT EXECUTE FUNCTION fenceline.fence_check();`,
			triggerName, strings.ReplaceAll(rel, "'", "''"), rel)
		if _, err := tx.Exec(ctx, sql); err != nil {
			return nil, fmt.Errorf("pg install: fence %s: %w", rel, err)
		}
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("pg install: commit: %w", err)
	}
	return key, nil
}
