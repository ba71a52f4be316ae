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
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/fenceline/fenceline/lease"
)

// Names of what "fenceline pg install" creates.
const (
	// Schema holds the fence: fenceline.secret (the signing key, readable
	// only by the installing role), fenceline.epoch (each fenced table's
	// epoch sequence and last raise), the trigger functions
	// fenceline.fence_check() (plpgsql) or fence_check_c() (C), and the
	// functions they share (fence_fast, and fence_slow_gate, the SECURITY
	// DEFINER one that verifies, raises and refuses).
	Schema = "fenceline"
	// triggerName is the statement-level trigger on every fenced table.
	triggerName = "fenceline_fence"
	// tokenSetting carries the token, transaction-locally.
	tokenSetting = "fenceline.token"
)

// raiseLockTimeout bounds how long an epoch raise waits for the
// transactions that hold the table's gate (fence_slow_gate), unless the
// writing session set a lock_timeout of its own: then a raise is refused
// with SQLSTATE 55P03, naming the lease, the fence and the gate.
const raiseLockTimeout = "2s"

// tokenVersion starts every token; the trigger refuses anything else. v4
// binds the token to the connection it was made for (its session number).
const tokenVersion = "v5" // v5: the MAC's key is the lease's grant key, the tables sorted

// MakeToken signs a fence token for a lease, bound to one server connection,
// with grantKey, the lease's Postgres grant key from the lease service
// (lease.GrantKeys.Postgres):
//
//	payload = "v5:" fence ":" hex(lease) ":" session ":" tables
//	tables  = "," (table ",")+, sorted, no repeats (lease.PostgresTables)
//	table   = hex(schema) "." (hex(name) | "*")
//	token   = payload ":" hex(sha256(k || sha256(k || payload)))
//	k       = sha256(secret || sha256(secret || grant message))
//
// where secret is the database's fenceline.secret and the grant message is
// lease.PostgresGrantMessage of the token's lease, fence and tables fields:
// the trigger derives k from the token itself and its secret, so a token
// verifies only for the lease, fence and tables the lease service granted.
// The proxy never holds the secret, only k.
//
// session is the connection's session number, what fenceline.bind_session()
// returned on it (see BindSession): Postgres accepts the token only on the
// connection whose currval of sequence fenceline.session it is, so a token
// read inside a write transaction and replayed on any other connection is
// refused. Names are the raw (unquoted) identifiers as UTF-8, hex-encoded so
// that the token needs no quoting in SQL and so that the trigger matches a
// table with one strpos of ",schema.name," over the whole token (no other
// field holds a comma or a dot). Postgres verifies the MAC with its built-in
// sha256().
func MakeToken(grantKey []byte, leaseID string, fence uint64, session int64, tables []string) (string, error) {
	if fence > math.MaxInt64 {
		return "", fmt.Errorf("fence token %d does not fit a Postgres bigint", fence)
	}
	if session < 0 {
		return "", fmt.Errorf("session number %d: want the value fenceline.bind_session() returned", session)
	}
	b := make([]byte, 0, 116+2*len(leaseID)+40*len(tables))
	b = append(b, tokenVersion...)
	b = append(b, ':')
	b = strconv.AppendUint(b, fence, 10)
	b = append(b, ':')
	b = hex.AppendEncode(b, []byte(leaseID))
	b = append(b, ':')
	b = strconv.AppendInt(b, session, 10)
	b = append(b, ':')
	field, err := lease.PostgresTables(tables)
	if err != nil {
		return "", err
	}
	b = append(b, field...)
	payload := string(b)
	return payload + ":" + tokenMAC(grantKey, payload), nil
}

// bindSessionSQL gives the connection it runs on a session number: a new
// value of sequence fenceline.session, which becomes the connection's
// currval. It must run in a writable transaction (nextval writes).
const bindSessionSQL = "SELECT fenceline.bind_session()"

// BindSession gives conn's connection a session number for MakeToken (the
// proxy does the same on each of its server connections before it signs a
// token for one). Numbers are never reused; DISCARD SEQUENCES and DISCARD ALL
// forget the connection's, after which it needs a new one.
func BindSession(ctx context.Context, conn *pgx.Conn) (int64, error) {
	var n int64
	if err := conn.QueryRow(ctx, bindSessionSQL).Scan(&n); err != nil {
		return 0, fmt.Errorf("bind the connection to a fence session: %w", err)
	}
	return n, nil
}

func tokenMAC(secret []byte, payload string) string {
	inner := sha256.Sum256(append(append([]byte{}, secret...), payload...))
	outer := sha256.Sum256(append(append([]byte{}, secret...), inner[:]...))
	return hex.EncodeToString(outer[:])
}

// SplitTable splits a normalized table claim ("schema.table", "schema.*",
// quoted identifiers allowed) into its raw schema and table names; the table
// is "*" for a wildcard.
func SplitTable(t string) (schemaName, table string, err error) { return lease.SplitTable(t) }

// fenceTable attaches the fence to one table (a quoted schema.table): its
// epoch row and sequence (carrying over an epoch recorded by an earlier
// version), its gate sequence (never changed: writers pass it by reading it,
// which holds it in ROW EXCLUSIVE mode, and a raise locks it with ALTER
// SEQUENCE; a relation lock, unlike an advisory one, takes Postgres's
// per-backend fast path) and the trigger, calling function fn, with its
// arguments. Both sequences belong to owner, the role fence_slow_gate runs
// as, which sets the epoch and locks the gate.
func fenceTable(ctx context.Context, tx pgx.Tx, rel, fn, owner string) error {
	var relid uint32
	var schemaName, table string
	err := tx.QueryRow(ctx, `SELECT c.oid, ns.nspname, c.relname FROM pg_class c
		JOIN pg_namespace ns ON ns.oid = c.relnamespace WHERE c.oid = $1::regclass`, rel).Scan(&relid, &schemaName, &table)
	if err != nil {
		return err
	}
	seq := fmt.Sprintf("fenceline.epoch_%d", relid)
	gate := fmt.Sprintf("fenceline.gate_%d", relid)
	var newGate bool
	if err := tx.QueryRow(ctx, "SELECT to_regclass($1) IS NULL", gate).Scan(&newGate); err != nil {
		return err
	}
	// A new gate is set once; an install never reads an existing one (that
	// would hold it, and a raise would wait for the install).
	setGate := ""
	if newGate {
		setGate = fmt.Sprintf("SELECT setval('%s', 1, true);", gate)
	}
	hs := hex.EncodeToString([]byte(schemaName))
	sql := fmt.Sprintf(`
INSERT INTO fenceline.epoch (relid, relname) VALUES (%[4]d, %[2]s) ON CONFLICT (relid) DO NOTHING;
CREATE SEQUENCE IF NOT EXISTS %[5]s AS bigint MINVALUE 0;
REVOKE ALL ON SEQUENCE %[5]s FROM PUBLIC;
GRANT SELECT ON SEQUENCE %[5]s TO PUBLIC;
SELECT setval('%[5]s', greatest(coalesce(pg_sequence_last_value('%[5]s'), 0), ep.fence), true)
	FROM fenceline.epoch ep WHERE ep.relid = %[4]d;
CREATE SEQUENCE IF NOT EXISTS %[9]s AS bigint MINVALUE 1;
REVOKE ALL ON SEQUENCE %[9]s FROM PUBLIC;
GRANT SELECT ON SEQUENCE %[9]s TO PUBLIC;
%[10]s
UPDATE fenceline.epoch SET seq = '%[5]s', gate = '%[9]s' WHERE relid = %[4]d;
DROP TRIGGER IF EXISTS %[1]s ON %[3]s;
CREATE TRIGGER %[1]s BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON %[3]s
	FOR EACH STATEMENT EXECUTE FUNCTION %[8]s('%[5]s', ',%[6]s.*,', ',%[6]s.%[7]s,', '%[9]s');`,
		triggerName, quoteLiteral(rel), rel, relid, seq, hs, hex.EncodeToString([]byte(table)), fn, gate, setGate)
	if _, err = tx.Exec(ctx, sql); err != nil {
		return err
	}
	// Sequences another role created (an install by someone else) change
	// hands; ALTER ... OWNER locks them exclusively, so only when needed.
	rows, err := tx.Query(ctx, `SELECT c.oid::regclass::text FROM pg_class c
		WHERE c.oid IN ($1::regclass, $2::regclass) AND c.relowner <> $3::regrole`, seq, gate, owner)
	if err != nil {
		return err
	}
	others, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, o := range others {
		if _, err := tx.Exec(ctx, fmt.Sprintf("ALTER SEQUENCE %s OWNER TO %s", o, owner)); err != nil {
			return fmt.Errorf("give %s to %s, who raises epochs: %w", o, owner, err)
		}
	}
	return nil
}

// upgradeFenced re-attaches every fenced table that an earlier version fenced
// and the install did not name (their triggers lack the gate, and
// fence_slow_gate refuses writes to them until then), with the trigger
// function they have, unless that is a C function of an earlier protocol
// (the install did not replace it: no C trigger this time), which becomes
// the plpgsql one.
func upgradeFenced(ctx context.Context, tx pgx.Tx, owner string) error {
	rows, err := tx.Query(ctx, `SELECT ns.nspname, c.relname,
			CASE WHEN p.proname = 'fence_check_c' AND p.prosrc <> $2 THEN 'fence_check' ELSE p.proname END
		FROM fenceline.epoch ep
		JOIN pg_class c ON c.oid = ep.relid JOIN pg_namespace ns ON ns.oid = c.relnamespace
		JOIN pg_trigger tg ON tg.tgrelid = ep.relid AND tg.tgname = $1
		JOIN pg_proc p ON p.oid = tg.tgfoid AND p.pronamespace = 'fenceline'::regnamespace
		WHERE ep.gate IS NULL OR tg.tgnargs <> 4 ORDER BY 1, 2`, triggerName, cTriggerSymbol)
	if err != nil {
		return fmt.Errorf("list tables fenced by an earlier version: %w", err)
	}
	type stale struct{ schema, table, fn string }
	old, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (stale, error) {
		var s stale
		return s, r.Scan(&s.schema, &s.table, &s.fn)
	})
	if err != nil {
		return fmt.Errorf("list tables fenced by an earlier version: %w", err)
	}
	for _, o := range old {
		rel := pgx.Identifier{o.schema, o.table}.Sanitize()
		if err := fenceTable(ctx, tx, rel, pgx.Identifier{Schema, o.fn}.Sanitize(), owner); err != nil {
			return fmt.Errorf("upgrade the fence of %s: %w", rel, err)
		}
	}
	return nil
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

// tokenHashBytesSQL is the SQL expression for the session mark of token tok:
// the first eight bytes of sha256(tok), every name qualified, because the
// fast path evaluates it with the writing role's search_path. It is stored as
// a sequence value, tokenHashSQL, and compared as int8send(currval) (no
// coercion in the fast path, which Postgres would set up per transaction).
const tokenHashBytesSQL = `pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(tok, 'UTF8')), 1, 8)`

// tokenHashSQL is tokenHashBytesSQL as a bigint (big-endian), for setval.
const tokenHashSQL = `(pg_catalog.textcat('x', pg_catalog.encode(` + tokenHashBytesSQL + `, 'hex'))::pg_catalog."bit"(64))::pg_catalog.int8`

// installSQL creates the fence schema. It is idempotent, and it upgrades a
// fence installed by an earlier version (the epochs carry over).
//
// The work is split so that the check a write pays for every statement
// reads no table and runs no query:
//
//   - fenceline.fence_check(), the trigger, runs as the writing role and
//     asks fenceline.fence_fast() (one function for all tables, so Postgres
//     sets up its expressions once per transaction rather than once per
//     table). That is one CASE expression of pg_catalog functions, every name
//     qualified (nothing resolves through the writer's search_path): the
//     token's hash equals the session's currval of sequence
//     fenceline.verified, the token claims the table, and the token's fence
//     equals the table's epoch both before and after passing the table's
//     gate (reading sequence fenceline.gate_<relid>, which holds it in ROW
//     EXCLUSIVE mode until the transaction ends). Anything else goes to
//     fence_slow_gate. BenchmarkStorageFence measures a fenced statement's
//     Postgres CPU against no trigger (docs/benchmarks.md); the earlier
//     trigger (two queries under SECURITY DEFINER, re-planned on every
//     call because of pg_temp in its search_path) cost several times more.
//   - fenceline.fence_slow_gate(), SECURITY DEFINER, does everything else and
//     explains every refusal: it checks the token's MAC against the secret,
//     and its binding (its session number is this connection's currval of
//     fenceline.session, which only fenceline.bind_session() draws), marks
//     the token verified for the session (setval of
//     fenceline.verified, plus the session setting fenceline.verified that
//     says currval is defined), and raises a table's epoch under ALTER
//     SEQUENCE's SHARE ROW EXCLUSIVE lock on the gate, which waits for every
//     transaction that passed the gate (at most lock_timeout, see
//     raiseLockTimeout) and keeps new ones out until the raise commits. It
//     runs once per session and token, and once per lease and table.
//
// Why a gate sequence: a relation lock in ROW EXCLUSIVE mode takes
// Postgres's per-backend fast path; the shared advisory lock it replaced
// went through the shared lock table. With eight clients each writing the
// same four tables (BenchmarkStorageFence, 4x1), the C trigger cost 50-100
// µs of Postgres CPU per transaction over no trigger with the advisory lock,
// 19-55 with the gate. The C trigger takes the gate's lock without reading
// the sequence, resolves the sequences' names once per backend (until an
// invalidation says a relation or schema changed), and asks currval once per
// transaction and token: 17-62 µs over no trigger before, -29 to 30 after, in
// five interleaved runs of 4x1 (medians 43 and 23; docs/benchmarks.md).
//
// Why currval is a sound mark: a session's currval is its own, writers may
// read it but only setval (which needs UPDATE, held by the installing role
// alone) changes it, and it holds a hash of the token, so a writer that swaps
// in another token or forges the setting fails over to fence_slow_gate. Verifying
// once per session weakens nothing: a genuine token stays genuine, and
// bound to this session (fence_slow_gate checked that before setting the
// mark), so the fast path needs no binding check of its own; the epoch,
// checked on every statement, stops a lease that was regranted, and the
// proxy, which alone may use the session, stops one that was lost.
//
// Why a session number and not the backend's pid: a pid is reused once its
// backend exits (and the agent can end its proxy's connection and open
// others until one gets the pid); the backend's start time would tell them
// apart, but pg_stat_activity shows it only to roles with
// pg_read_all_stats. A value of a sequence is never drawn twice, and a
// session's currval is invisible to other sessions and to writers' roles.
//
// An epoch is a sequence (fenceline.epoch_<relid>), read with
// pg_sequence_last_value, so a check sees the newest epoch whatever the
// transaction's snapshot or isolation level; setval is not undone by a
// rollback, so an epoch only ever rises, even if the raising write is rolled
// back. The fenceline.epoch table names each table's sequence and records the
// last committed raise (fence, lease, time) for people.
const installSQL = `
CREATE SCHEMA IF NOT EXISTS fenceline;
REVOKE ALL ON SCHEMA fenceline FROM PUBLIC;
-- Writers' roles resolve fenceline.* names (the trigger runs as them); every
-- object below stays private unless granted on its own.
GRANT USAGE ON SCHEMA fenceline TO PUBLIC;
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
ALTER TABLE fenceline.epoch ADD COLUMN IF NOT EXISTS seq regclass;
ALTER TABLE fenceline.epoch ADD COLUMN IF NOT EXISTS gate regclass;
REVOKE ALL ON fenceline.secret, fenceline.epoch FROM PUBLIC;
-- currval of this sequence is the hash of the last token fence_slow_gate verified
-- in the session: writers may read it (SELECT), only the owner may set it.
CREATE SEQUENCE IF NOT EXISTS fenceline.verified AS bigint
	MINVALUE -9223372036854775808 MAXVALUE 9223372036854775807;
REVOKE ALL ON SEQUENCE fenceline.verified FROM PUBLIC;
GRANT SELECT ON SEQUENCE fenceline.verified TO PUBLIC;
-- currval of this sequence is the connection's session number, which tokens
-- are bound to: only bind_session (SECURITY DEFINER) draws one, always a new
-- one; nobody else may read or set it.
CREATE SEQUENCE IF NOT EXISTS fenceline.session AS bigint MINVALUE 1;
REVOKE ALL ON SEQUENCE fenceline.session FROM PUBLIC;

CREATE OR REPLACE FUNCTION fenceline.bind_session() RETURNS pg_catalog.int8
LANGUAGE sql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
-- A new session number for this connection (its currval of
-- fenceline.session), for the proxy to bind its tokens to.
SELECT nextval('fenceline.session')
$fn$;
REVOKE ALL ON FUNCTION fenceline.bind_session() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fenceline.bind_session() TO PUBLIC;

CREATE OR REPLACE FUNCTION fenceline.fence_slow_gate(rel pg_catalog.oid, op pg_catalog.text) RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
-- The trigger's slow path; see pgproxy.MakeToken for the token format.
-- Anyone may call it: it trusts nothing but the token and the table's oid.
DECLARE
	tok     text := current_setting('fenceline.token', true);
	n       int := coalesce(length(tok), 0);
	sch     name;
	tab     name;
	seq     regclass;
	gate    regclass;
	payload text;
	tabs    text;
	hsch    text;
	k       bytea;
	gk      bytea; -- the grant key of the token's lease, fence and tables
	f       bigint;
	lease   text;
	cur     bigint;
	curl    text;
	bound   bigint;
	mine    bigint;
	wait    text;
BEGIN
	SELECT ns.nspname, c.relname, ep.seq, ep.gate INTO sch, tab, seq, gate
		FROM pg_class c JOIN pg_namespace ns ON ns.oid = c.relnamespace
		LEFT JOIN fenceline.epoch ep ON ep.relid = c.oid WHERE c.oid = rel;
	IF tab IS NULL THEN
		RAISE EXCEPTION 'fenceline: no table with oid %', rel USING ERRCODE = '42P01';
	END IF;
	IF n = 0 THEN
		RAISE EXCEPTION 'fenceline: % on %.% carries no fence token', op, quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001',
			HINT = 'fenced tables accept writes only through a fenceline proxy that holds a live lease claiming them';
	END IF;
	IF n < 73 OR left(tok, 3) <> 'v5:' OR substr(tok, n - 64, 1) <> ':' OR right(tok, 64) !~ '^[0-9a-f]{64}$' THEN
		RAISE EXCEPTION 'fenceline: malformed fence token on %.%', quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001', HINT = 'the proxy and "fenceline pg install" must be the same version';
	END IF;
	payload := left(tok, n - 65);
	SELECT s.key INTO k FROM fenceline.secret s WHERE s.id = 1;
	-- The grant key the lease service derived for this lease, fence and
	-- tables (lease.PostgresGrantMessage), then the token's MAC under it,
	-- compared in constant time: hashes under the secret of both sides, so
	-- where they first differ says nothing of the MAC.
	gk := sha256(k || sha256(k || convert_to('fenceline-grant v1' || chr(10) || 'storage postgres' || chr(10) ||
		'lease ' || split_part(payload, ':', 3) || chr(10) || 'fence ' || split_part(payload, ':', 2) || chr(10) ||
		'tables ' || split_part(payload, ':', 5) || chr(10), 'UTF8')));
	IF k IS NULL OR sha256(k || decode(right(tok, 64), 'hex')) <> sha256(k || sha256(gk || sha256(gk || convert_to(payload, 'UTF8')))) THEN
		RAISE EXCEPTION 'fenceline: forged fence token of lease % (fence %) on %.%: the lease service did not grant it (its MAC does not verify under the grant key of that lease, fence and tables)',
			CASE WHEN split_part(payload, ':', 3) ~ '^([0-9a-f]{2})+$' THEN convert_from(decode(split_part(payload, ':', 3), 'hex'), 'UTF8') ELSE '?' END,
			split_part(payload, ':', 2), quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001',
			HINT = 'a fence token is good only for the lease, fence and tables it was granted for; forged, or signed with another lease''s grant key';
	END IF;
	f := split_part(payload, ':', 2)::bigint;
	lease := convert_from(decode(split_part(payload, ':', 3), 'hex'), 'UTF8');
	bound := split_part(payload, ':', 4)::bigint;
	tabs := split_part(payload, ':', 5);
	-- Genuine; but only on the connection it was made for: this one's
	-- currval of fenceline.session, which only bind_session draws.
	BEGIN
		mine := currval('fenceline.session');
	EXCEPTION WHEN object_not_in_prerequisite_state THEN
		mine := NULL; -- never bound
	END;
	IF mine IS DISTINCT FROM bound THEN
		RAISE EXCEPTION 'fenceline: fence token of lease % (fence %) is bound to another connection; refused on %.%',
			lease, f, quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001',
			DETAIL = format('the token was made for session %s; this connection is %s', bound, coalesce('session ' || mine, 'not bound')),
			HINT = 'a fence token works only on the connection its fenceline proxy made it for; write through the proxy';
	END IF;
	-- Let the trigger's fast path take this token in this session.
	PERFORM setval('fenceline.verified', ` + tokenHashSQL + `, true);
	PERFORM set_config('fenceline.verified', currval('fenceline.verified')::text, false);
	hsch := ',' || encode(convert_to(sch, 'UTF8'), 'hex') || '.';
	IF strpos(tabs, hsch || '*,') = 0 AND strpos(tabs, hsch || encode(convert_to(tab, 'UTF8'), 'hex') || ',') = 0 THEN
		RAISE EXCEPTION 'fenceline: lease % (fence %) does not claim table %.%', lease, f, quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '42501';
	END IF;
	IF seq IS NULL OR gate IS NULL THEN
		RAISE EXCEPTION 'fenceline: %.% has a fence trigger but no epoch or gate', quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001', HINT = 'run "fenceline pg install" for this table again';
	END IF;
	IF f > coalesce(pg_sequence_last_value(seq), 0) THEN
		-- A newer lease's first write: wait for every writer of an older
		-- fence to finish (each holds the gate in ROW EXCLUSIVE mode, which
		-- ALTER SEQUENCE's SHARE ROW EXCLUSIVE waits for, and keeps new ones
		-- out), then raise the epoch. The wait is bounded (lock_timeout,
		-- ` + raiseLockTimeout + ` unless the session set one): a transaction that
		-- holds the gate and never ends (a reader of the gate sequence,
		-- anyone's) would otherwise stall this lease and queue every later
		-- writer of the table behind it. The raise is then refused,
		-- retryably, naming what blocked it.
		wait := current_setting('lock_timeout');
		BEGIN
			IF wait = '0' THEN
				PERFORM set_config('lock_timeout', '` + raiseLockTimeout + `', true);
			END IF;
			EXECUTE format('ALTER SEQUENCE %s OWNED BY NONE', gate);
			PERFORM set_config('lock_timeout', wait, true);
		EXCEPTION WHEN lock_not_available THEN
			RAISE EXCEPTION 'fenceline: lease % (fence %) cannot raise the epoch of %.%: a transaction holding its gate % blocked the raise for %',
				lease, f, quote_ident(sch), quote_ident(tab), gate, CASE WHEN wait = '0' THEN '` + raiseLockTimeout + `' ELSE wait END
				USING ERRCODE = '55P03',
				DETAIL = 'every transaction that read the gate sequence (a write of the table, or anyone reading it) holds it until it ends; an epoch raise waits for all of them',
				HINT = 'retry the transaction; if it keeps failing, end the transaction that holds the gate (pg_locks shows who holds ' || gate::text || ')';
		END;
		cur := coalesce(pg_sequence_last_value(seq), 0);
		IF f > cur THEN
			PERFORM setval(seq, f, true);
			UPDATE fenceline.epoch SET fence = f, lease_id = lease, updated_at = now() WHERE relid = rel;
			RETURN;
		END IF;
	ELSE
		PERFORM pg_sequence_last_value(gate); -- the gate, ROW EXCLUSIVE
		cur := coalesce(pg_sequence_last_value(seq), 0);
	END IF;
	IF f < cur THEN
		SELECT ep.lease_id INTO curl FROM fenceline.epoch ep WHERE ep.relid = rel;
		RAISE EXCEPTION 'fenceline: stale fence: lease % (fence %) may no longer write %.%; lease % (fence %) already wrote it',
			lease, f, quote_ident(sch), quote_ident(tab), coalesce(nullif(curl, ''), '?'), cur
			USING ERRCODE = '40001', HINT = 'the lease was lost and granted again; acquire a new lease before writing';
	END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fenceline.fence_slow_gate(oid, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fenceline.fence_slow_gate(oid, text) TO PUBLIC;

-- Earlier versions' fast path took an advisory lock instead of the gate.
DROP FUNCTION IF EXISTS fenceline.fence_fast(text, text, text, oid);
CREATE OR REPLACE FUNCTION fenceline.fence_fast(seqname pg_catalog.text, claim_schema pg_catalog.text,
	claim_table pg_catalog.text, gatename pg_catalog.text) RETURNS pg_catalog.bool
LANGUAGE plpgsql SECURITY INVOKER AS $fn$
-- The trigger's common case, as the writing role, so every name is qualified
-- (nothing resolves through its search_path). One function for every fenced
-- table: Postgres compiles a trigger function once per trigger and sets up
-- its expressions once per transaction, this one once per transaction.
-- Arguments (the trigger's, see "fenceline pg install"): the table's epoch
-- sequence, ",hex(schema).*,", ",hex(schema).hex(table)," and its gate.
-- The CASE fixes the order: peek at the epoch, pass the gate (reading a
-- sequence holds it in ROW EXCLUSIVE mode to the transaction's end), read
-- the epoch again. A raise holds the gate in SHARE ROW EXCLUSIVE mode.
DECLARE
	tok pg_catalog.text := pg_catalog.current_setting('fenceline.token', true);
	seq pg_catalog.regclass := seqname;
	gate pg_catalog.regclass := gatename;
BEGIN
	RETURN CASE
		-- fence_slow_gate sets fenceline.verified with currval; until then currval
		-- fails. RESET (and RESET ALL, DISCARD ALL) leave it '', not NULL.
		WHEN tok IS NULL OR pg_catalog.int4eq(pg_catalog.length(pg_catalog.current_setting('fenceline.verified', true)), 0) IS NOT FALSE THEN false
		WHEN pg_catalog.byteaeq(pg_catalog.int8send(pg_catalog.currval('fenceline.verified'::pg_catalog.regclass)), ` + tokenHashBytesSQL + `) IS NOT TRUE THEN false
		WHEN pg_catalog.int4eq(pg_catalog.strpos(tok, claim_schema), 0) AND pg_catalog.int4eq(pg_catalog.strpos(tok, claim_table), 0) THEN false
		WHEN pg_catalog.int8eq(pg_catalog.int8in(pg_catalog.textout(pg_catalog.split_part(tok, ':', 2))), pg_catalog.pg_sequence_last_value(seq)) IS NOT TRUE THEN false
		WHEN pg_catalog.pg_sequence_last_value(gate) IS NULL THEN false
		ELSE pg_catalog.int8eq(pg_catalog.int8in(pg_catalog.textout(pg_catalog.split_part(tok, ':', 2))), pg_catalog.pg_sequence_last_value(seq)) IS TRUE
	END;
END
$fn$;
REVOKE ALL ON FUNCTION fenceline.fence_fast(text, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fenceline.fence_fast(text, text, text, text) TO PUBLIC;

CREATE OR REPLACE FUNCTION fenceline.fence_check() RETURNS trigger
LANGUAGE plpgsql SECURITY INVOKER AS $fn$
-- Runs as the writing role before every write statement on a fenced table.
BEGIN
	IF fenceline.fence_fast(TG_ARGV[0], TG_ARGV[1], TG_ARGV[2], TG_ARGV[3]) THEN
		RETURN NULL;
	END IF;
	PERFORM fenceline.fence_slow_gate(TG_RELID, TG_OP);
	RETURN NULL;
END
$fn$;
REVOKE ALL ON FUNCTION fenceline.fence_check() FROM PUBLIC;
-- Earlier versions' slow path, which raised under an advisory lock that no
-- trigger takes now. A trigger still calling it fails closed until the
-- install brings it up to date (upgradeFenced, in the same transaction).
DROP FUNCTION IF EXISTS fenceline.fence_slow(oid, text);
`

// CTriggerLibrary is where "make -C pgproxy/cfence install" puts the C
// trigger, as CREATE FUNCTION names it.
const CTriggerLibrary = "$libdir/fenceline_fence_gate"

// cTriggerSymbol is the C trigger's function in its library. Like the
// library's name, it names the protocol (the gate), so that a library or
// backend of an earlier one is never paired with this fence_slow_gate.
const cTriggerSymbol = "fenceline_fence_check_gate"

// Trigger names the trigger function Install attaches to fenced tables.
type Trigger string

const (
	// TriggerAuto (the zero value) uses the C trigger when the server
	// loads its library and the plpgsql one otherwise.
	TriggerAuto Trigger = ""
	// TriggerC is fenceline.fence_check_c from pgproxy/cfence: the checks
	// of fence_fast for a fraction of the CPU; loading it takes a
	// superuser and the library on the database server.
	TriggerC Trigger = "c"
	// TriggerPLpgSQL is fenceline.fence_check, which every Postgres runs,
	// managed services included.
	TriggerPLpgSQL Trigger = "plpgsql"
)

// ParseTrigger reads a trigger choice as the CLI takes it.
func ParseTrigger(s string) (Trigger, error) {
	switch s {
	case "auto", "":
		return TriggerAuto, nil
	case "c", "C":
		return TriggerC, nil
	case "plpgsql":
		return TriggerPLpgSQL, nil
	}
	return "", fmt.Errorf("trigger %q: want auto, c or plpgsql", s)
}

// InstallOptions choose how Install fences the tables.
type InstallOptions struct {
	// Trigger chooses the trigger function; TriggerAuto by default.
	Trigger Trigger
	// CLibrary is the C trigger's shared library as CREATE FUNCTION names
	// it: CTriggerLibrary (where "make -C pgproxy/cfence install" puts it)
	// when empty, or an absolute path.
	CLibrary string
}

// Installed is what Install did.
type Installed struct {
	// Secret is the signing secret, for the proxy's Config.
	Secret []byte
	// Trigger is the trigger the named tables now carry: TriggerC or
	// TriggerPLpgSQL (tables fenced earlier and not named keep theirs).
	Trigger Trigger
	// CLibrary is the C trigger's library when Trigger is TriggerC.
	CLibrary string
	// NoC says why TriggerAuto did not use the C trigger.
	NoC error
	// NoGuard says why the fence is not guarded against the tables'
	// owners (see guardSQL): nil when it is.
	NoGuard error
}

// Install creates the fence in the database conn is connected to (as a role
// that owns or may alter the tables, and that agents' roles are not): the
// fenceline schema, the signing secret (created once, then reused) and the
// trigger on each table ("schema.table", or "schema.*" for every table of a
// schema that exists now). Running it again is safe: it attaches newly
// named tables, and switches the named ones to the trigger opts chooses.
// With TriggerC, a library the server cannot load fails the install and
// changes nothing; with TriggerAuto it leaves the tables on plpgsql.
func Install(ctx context.Context, conn *pgx.Conn, tables []string, opts InstallOptions) (*Installed, error) {
	if len(tables) == 0 {
		return nil, errors.New("pg install: no tables: name at least one schema.table or schema.*")
	}
	lib := opts.CLibrary
	if lib == "" {
		lib = CTriggerLibrary
	}
	switch opts.Trigger {
	case TriggerAuto, TriggerC, TriggerPLpgSQL:
	default:
		return nil, fmt.Errorf("pg install: trigger %q: want auto (%q), %q or %q", opts.Trigger, TriggerAuto, TriggerC, TriggerPLpgSQL)
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("pg install: begin: %w", err)
	}
	defer tx.Rollback(context.WithoutCancel(ctx)) //nolint:errcheck // no-op after commit
	if _, err := tx.Exec(ctx, installSQL); err != nil {
		return nil, fmt.Errorf("pg install: create schema fenceline: %w", err)
	}
	res := &Installed{Trigger: TriggerPLpgSQL}
	fn, err := installTrigger(ctx, tx, lib, opts.Trigger, res)
	if err != nil {
		return nil, err
	}
	key, err := installSecret(ctx, tx)
	if err != nil {
		return nil, err
	}
	rels, err := installRels(ctx, tx, tables)
	if err != nil {
		return nil, err
	}
	var owner string
	if err := tx.QueryRow(ctx, "SELECT proowner::regrole::text FROM pg_proc WHERE oid = 'fenceline.fence_slow_gate(oid, text)'::regprocedure").Scan(&owner); err != nil {
		return nil, fmt.Errorf("pg install: owner of fence_slow_gate: %w", err)
	}
	for _, rel := range rels {
		if err := fenceTable(ctx, tx, rel, fn, owner); err != nil {
			return nil, fmt.Errorf("pg install: fence %s: %w", rel, err)
		}
	}
	if err := upgradeFenced(ctx, tx, owner); err != nil {
		return nil, fmt.Errorf("pg install: %w", err)
	}
	if err := installGuard(ctx, tx, owner, res); err != nil {
		return nil, err
	}
	if err := tx.Commit(ctx); err != nil {
		return nil, fmt.Errorf("pg install: commit: %w", err)
	}
	res.Secret = key
	return res, nil
}

// installTrigger creates the C trigger function from lib unless trigger
// asks for plpgsql, and returns the trigger function the tables get; res
// says which (and, for TriggerAuto, why not the C one).
func installTrigger(ctx context.Context, tx pgx.Tx, lib string, trigger Trigger, res *Installed) (string, error) {
	fn := "fenceline.fence_check"
	if trigger == TriggerPLpgSQL {
		return fn, nil
	}
	err := createCTrigger(ctx, tx, lib, trigger == TriggerAuto)
	switch {
	case errors.Is(err, errUndo):
		return "", fmt.Errorf("pg install: C trigger from %s: %w", lib, err)
	case err == nil:
		fn = "fenceline.fence_check_c"
		res.Trigger, res.CLibrary = TriggerC, lib
	case trigger == TriggerAuto && cUnavailable(err):
		res.NoC = err
	default:
		return "", fmt.Errorf("pg install: C trigger from %s: %w (build and install it with \"make -C pgproxy/cfence install\" as a superuser, or use the plpgsql trigger)", lib, err)
	}
	return fn, nil
}

// installSecret stores a new random signing secret unless the database
// has one, and returns the one it has.
func installSecret(ctx context.Context, tx pgx.Tx) ([]byte, error) {
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
	return key, nil
}

// installRels are the tables to fence, quoted schema.table: each named
// one, and for "schema.*" every table of the schema that exists now.
func installRels(ctx context.Context, tx pgx.Tx, tables []string) ([]string, error) {
	var rels []string
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
	return rels, nil
}

// installGuard installs the event trigger that keeps the fence triggers on
// (guardSQL) when the installing role is a superuser, the only kind that
// may; otherwise res.NoGuard says what that leaves open.
func installGuard(ctx context.Context, tx pgx.Tx, owner string, res *Installed) error {
	var super bool
	if err := tx.QueryRow(ctx, "SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user").Scan(&super); err != nil {
		return fmt.Errorf("pg install: is the installing role a superuser: %w", err)
	}
	if !super {
		res.NoGuard = fmt.Errorf("the installing role %s is not a superuser, and only a superuser makes event triggers: a fenced table's owner can switch its fence off (ALTER TABLE ... DISABLE TRIGGER, even inside a function an agent calls), so no agent's role may own a fenced table", owner)
		return nil
	}
	// The owner by oid: a role name may need quoting.
	var ownerOID uint32
	if err := tx.QueryRow(ctx, "SELECT proowner FROM pg_proc WHERE oid = 'fenceline.fence_slow_gate(oid, text)'::regprocedure").Scan(&ownerOID); err != nil {
		return fmt.Errorf("pg install: owner of fence_slow_gate: %w", err)
	}
	if _, err := tx.Exec(ctx, strings.ReplaceAll(guardSQL, "{{owner}}", strconv.FormatUint(uint64(ownerOID), 10)+"::pg_catalog.oid")); err != nil {
		return fmt.Errorf("pg install: guard the fence triggers: %w", err)
	}
	return nil
}

// guardSQL ({{owner}}: the oid of the role that installs) keeps the fence triggers
// on: an event trigger, after every DDL command of anyone but that role
// (or a superuser), refuses the command when a fenced table's trigger is
// missing, disabled (or set to fire only for replicas), calls another
// function or fires for other events. The proxy refuses such statements
// when it sees them, but not inside a function a read calls in a block the
// lease made writable — and a table's owner may alter its triggers. Only a
// superuser makes event triggers. (Dropping a fenced table, and tables
// created later in a fenced schema, are not covered: both are unfenced
// until "pg install" names them.)
const guardSQL = `
CREATE OR REPLACE FUNCTION fenceline.fence_broken() RETURNS pg_catalog.text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $fn$
-- The first fenced table whose fence trigger is not as "pg install" made it.
SELECT format('%I.%I', ns.nspname, c.relname)
	FROM fenceline.epoch ep
	JOIN pg_class c ON c.oid = ep.relid JOIN pg_namespace ns ON ns.oid = c.relnamespace
	LEFT JOIN pg_trigger tg ON tg.tgrelid = ep.relid AND tg.tgname = 'fenceline_fence'
	WHERE ep.seq IS NOT NULL AND (tg.oid IS NULL OR tg.tgenabled NOT IN ('O', 'A') OR tg.tgtype <> 62
		OR tg.tgfoid NOT IN (SELECT p.oid FROM pg_proc p WHERE p.pronamespace = 'fenceline'::regnamespace
			AND p.proname IN ('fence_check', 'fence_check_c')))
	ORDER BY 1 LIMIT 1
$fn$;
REVOKE ALL ON FUNCTION fenceline.fence_broken() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fenceline.fence_broken() TO PUBLIC;
CREATE OR REPLACE FUNCTION fenceline.guard_fence() RETURNS event_trigger
LANGUAGE plpgsql SECURITY INVOKER SET search_path = pg_catalog, pg_temp AS $fn$
DECLARE
	bad text;
BEGIN
	IF pg_has_role(current_user, {{owner}}, 'MEMBER') THEN
		RETURN; -- the installing role (and superusers) may change the fence
	END IF;
	bad := fenceline.fence_broken();
	IF bad IS NOT NULL THEN
		RAISE EXCEPTION 'fenceline: % would switch off the storage fence of %', tg_tag, bad
			USING ERRCODE = '42501',
			HINT = 'the fence trigger of a fenced table stays as "fenceline pg install" made it; only its installing role may change it';
	END IF;
END
$fn$;
REVOKE ALL ON FUNCTION fenceline.guard_fence() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION fenceline.guard_fence() TO PUBLIC;
DROP EVENT TRIGGER IF EXISTS fenceline_guard;
CREATE EVENT TRIGGER fenceline_guard ON ddl_command_end
	WHEN TAG IN ('ALTER TABLE', 'DROP TRIGGER', 'CREATE TRIGGER', 'ALTER TRIGGER')
	EXECUTE FUNCTION fenceline.guard_fence();`

// cUnavailable reports whether err, from creating the C trigger, says the
// server cannot have it (no such file, a library it cannot load or of
// another version or protocol, not a superuser) rather than that something
// went wrong, which fails even an auto install.
func cUnavailable(err error) bool {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return false
	}
	switch pe.Code {
	case "58P01", // undefined_file: "could not access file"
		"42883", // undefined_function: the library lacks the symbol
		"42501": // insufficient_privilege: LANGUAGE c needs a superuser
		return true
	}
	return strings.HasPrefix(pe.Message, "could not load library") || strings.HasPrefix(pe.Message, "incompatible library")
}

// errUndo: a tentative step failed in a way no savepoint covers; the
// install's transaction is lost.
var errUndo = errors.New("no savepoint to fall back to")

// createCTrigger defines fenceline.fence_check_c from lib. With tentative,
// a failure is undone (a savepoint) so that the install can go on without
// it, unless the error wraps errUndo.
func createCTrigger(ctx context.Context, tx pgx.Tx, lib string, tentative bool) error {
	q := fmt.Sprintf(`CREATE OR REPLACE FUNCTION fenceline.fence_check_c() RETURNS trigger LANGUAGE c AS %s, %s;
REVOKE ALL ON FUNCTION fenceline.fence_check_c() FROM PUBLIC;`, quoteLiteral(lib), quoteLiteral(cTriggerSymbol))
	if !tentative {
		_, err := tx.Exec(ctx, q)
		return err
	}
	sp, err := tx.Begin(ctx)
	if err != nil {
		return fmt.Errorf("savepoint: %w (the install's transaction is unusable: %w)", err, errUndo)
	}
	if _, err := sp.Exec(ctx, q); err != nil {
		if rerr := sp.Rollback(ctx); rerr != nil {
			return fmt.Errorf("%w (%w: %w)", err, errUndo, rerr)
		}
		return err
	}
	if err := sp.Commit(ctx); err != nil {
		return fmt.Errorf("release savepoint: %w (the install's transaction is unusable: %w)", err, errUndo)
	}
	return nil
}
