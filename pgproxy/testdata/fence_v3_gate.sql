-- The install SQL of the fence before tokens were bound to their connection
-- (commit e6960be: v3 tokens, the gate), verbatim, for
-- TestInstallUpgradesGateFence. Do not edit.

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
	f       bigint;
	lease   text;
	cur     bigint;
	curl    text;
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
	IF n < 71 OR left(tok, 3) <> 'v3:' OR substr(tok, n - 64, 1) <> ':' THEN
		RAISE EXCEPTION 'fenceline: malformed fence token on %.%', quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001', HINT = 'the proxy and "fenceline pg install" must be the same version';
	END IF;
	payload := left(tok, n - 65);
	SELECT s.key INTO k FROM fenceline.secret s WHERE s.id = 1;
	IF k IS NULL OR right(tok, 64) <> encode(sha256(k || sha256(k || convert_to(payload, 'UTF8'))), 'hex') THEN
		RAISE EXCEPTION 'fenceline: forged or foreign fence token on %.%', quote_ident(sch), quote_ident(tab)
			USING ERRCODE = '40001';
	END IF;
	-- Genuine: let the trigger's fast path take this token in this session.
	PERFORM setval('fenceline.verified', (pg_catalog.textcat('x', pg_catalog.encode(pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(tok, 'UTF8')), 1, 8), 'hex'))::pg_catalog."bit"(64))::pg_catalog.int8, true);
	PERFORM set_config('fenceline.verified', currval('fenceline.verified')::text, false);
	f := split_part(payload, ':', 2)::bigint;
	lease := convert_from(decode(split_part(payload, ':', 3), 'hex'), 'UTF8');
	tabs := split_part(payload, ':', 4);
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
		-- out), then raise the epoch.
		EXECUTE format('ALTER SEQUENCE %s OWNED BY NONE', gate);
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
		WHEN pg_catalog.byteaeq(pg_catalog.int8send(pg_catalog.currval('fenceline.verified'::pg_catalog.regclass)), pg_catalog.substr(pg_catalog.sha256(pg_catalog.convert_to(tok, 'UTF8')), 1, 8)) IS NOT TRUE THEN false
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
