/*
 * fenceline_fence_gate: the storage-side fence's trigger function in C.
 *
 * It makes the same check as fenceline.fence_fast() in pgproxy/fence.go and
 * hands everything else to fenceline.fence_slow_gate(), the plpgsql SECURITY
 * DEFINER function that verifies a token's MAC, raises an epoch, or refuses
 * with the reason. The check reads no table and runs no query:
 *
 *   1. the token (setting fenceline.token) is the one the session verified:
 *      the first 8 bytes of its SHA-256 equal the session's currval of
 *      sequence fenceline.verified, which only fence_slow_gate may set, and the
 *      setting fenceline.verified says currval is defined. fence_slow_gate
 *      sets it only for a token bound to this connection (its session
 *      number is the connection's currval of fenceline.session), so the
 *      mark, which is the session's own, carries the binding: a token
 *      replayed on another connection never gets past the slow path;
 *   2. the token claims the table (",hex(schema).*," or
 *      ",hex(schema).hex(table)," occurs in it);
 *   3. the token's fence equals the table's epoch before and after passing
 *      the table's gate: reading the gate sequence holds it in ROW EXCLUSIVE
 *      mode to the end of the transaction, and fence_slow_gate raises an epoch
 *      under ALTER SEQUENCE's SHARE ROW EXCLUSIVE lock on it, which waits
 *      for every such reader and keeps new ones out. A relation lock takes
 *      Postgres's per-backend fast path; the advisory lock this replaced
 *      went through the shared lock table, and cost 50-100 us of Postgres
 *      CPU per transaction of four fenced writes in BenchmarkStorageFence
 *      (4x1) over no trigger, against 19-55 us with the gate.
 *
 * The plpgsql trigger pays for setting up its expressions in every
 * transaction (29-71 us of Postgres CPU per fenced statement under eight
 * pgbench clients, in docs/benchmarks.md's runs); this one, which also
 * resolves its sequences' names once per backend, passes the gate by locking
 * it without reading it and asks currval once per transaction, costs about
 * 6 us per statement in BenchmarkStorageFence (each client on its own rows;
 * about 11 before those three). Postgres
 * loads it only from a superuser's CREATE FUNCTION, so managed services
 * that allow no C extensions keep the plpgsql trigger; "fenceline pg
 * install" uses this one whenever the server loads it. PostgreSQL 15 or
 * later (it uses pg_cryptohash_error); tested with 15.
 *
 * Build and install (needs the server headers, postgresql-server-dev-NN):
 *
 *   make -C pgproxy/cfence install
 *   fenceline pg install --dsn ... --table ...     (--trigger c to insist on it)
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "common/cryptohash.h"
#include "common/sha2.h"
#include "executor/spi.h"
#include "fmgr.h"
#include "storage/lmgr.h"
#include "storage/proc.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/hsearch.h"
#include "utils/inval.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/resowner.h"
#include "utils/syscache.h"

PG_MODULE_MAGIC;

/*
 * The symbol names the protocol: a library of another one (the advisory lock
 * before the gate) lacks it, so CREATE FUNCTION fails and "pg install" falls
 * back to plpgsql rather than attaching a trigger that does not match
 * fence_slow_gate. So does the library's file name: a backend keeps the
 * libraries it loaded by path, and would not see a new protocol installed
 * over an old file.
 */
PG_FUNCTION_INFO_V1(fenceline_fence_check_gate);

/*
 * call1 calls a built-in SQL function of one argument and reports a NULL
 * result instead of raising an error for it, as DirectFunctionCall1 would.
 */
static Datum
call1(PGFunction fn, Datum arg, bool *isnull)
{
	LOCAL_FCINFO(fcinfo, 1);
	Datum		result;

	InitFunctionCallInfoData(*fcinfo, NULL, 1, InvalidOid, NULL, NULL);
	fcinfo->args[0].value = arg;
	fcinfo->args[0].isnull = false;
	result = (*fn) (fcinfo);
	*isnull = fcinfo->isnull;
	return result;
}

/* last_value returns the last value of sequence seq, false when it has none. */
static bool
last_value(Oid seq, int64 *value)
{
	bool		isnull;
	Datum		d = call1(pg_sequence_last_value, ObjectIdGetDatum(seq), &isnull);

	if (isnull)
		return false;
	*value = DatumGetInt64(d);
	return true;
}

/*
 * The sequences a trigger names, resolved once: a name (an argument of the
 * trigger's) is looked up with regclassin the first time and then found in
 * relids, until a relation or a schema changes anywhere in the database (a
 * relcache or pg_namespace invalidation, which a DROP, a RENAME or an ALTER of
 * either sends, taken in when this backend next takes a new lock): that moves
 * generation on, and every entry made before it is looked up again. Resolving
 * a qualified name (parsing it, the schema's and the relation's catalog
 * lookups) cost about as much as the rest of the check, and every fenced
 * write did it twice.
 */
typedef struct RelidEntry
{
	char		name[2 * NAMEDATALEN + 8];	/* the key: a qualified name as given */
	Oid			relid;
	uint64		generation;
} RelidEntry;

static HTAB *relids;
static uint64 generation = 1;

static void
relcache_changed(Datum arg, Oid relid)
{
	generation++;
}

static void
syscache_changed(Datum arg, int cacheid, uint32 hashvalue)
{
	generation++;
}

/*
 * relid_of returns the relation name names, as regclassin would (a missing
 * one raises 42P01), from relids while nothing has changed since it was
 * looked up.
 */
static Oid
relid_of(const char *name)
{
	RelidEntry *e;
	uint64		gen;
	Oid			relid;
	bool		found;

	if (strlen(name) >= sizeof(e->name))
		return DatumGetObjectId(DirectFunctionCall1(regclassin, CStringGetDatum(name)));
	if (relids == NULL)
	{
		HASHCTL		ctl;

		ctl.keysize = sizeof(e->name);
		ctl.entrysize = sizeof(RelidEntry);
		relids = hash_create("fenceline fence relids", 16, &ctl, HASH_ELEM | HASH_STRINGS);
		CacheRegisterRelcacheCallback(relcache_changed, (Datum) 0);
		CacheRegisterSyscacheCallback(NAMESPACEOID, syscache_changed, (Datum) 0);
	}
	e = (RelidEntry *) hash_search(relids, name, HASH_FIND, &found);
	if (found && e->generation == generation)
		return e->relid;
	gen = generation;
	relid = DatumGetObjectId(DirectFunctionCall1(regclassin, CStringGetDatum(name)));
	e = (RelidEntry *) hash_search(relids, name, HASH_ENTER, &found);
	e->relid = relid;
	e->generation = gen;		/* a change during the lookup: look again next time */
	return relid;
}

/*
 * token_fence parses the fence of a token ("v4:" fence ":" ...); false when
 * the field is not a plain decimal int8.
 */
static bool
token_fence(const char *tok, int64 *fence)
{
	const char *p = strchr(tok, ':');
	uint64		v = 0;
	int			n = 0;

	if (p == NULL)
		return false;
	for (p++; *p != ':'; p++, n++)
	{
		if (*p < '0' || *p > '9' || n >= 19)
			return false;
		v = v * 10 + (uint64) (*p - '0');
	}
	if (n == 0 || v > (uint64) PG_INT64_MAX)
		return false;
	*fence = (int64) v;
	return true;
}

/*
 * The last token hashed in this session and its mark, so that the writes of
 * one transaction (one token) hash it once: OpenSSL's SHA-256 set-up alone
 * costs more than the rest of the check.
 */
static char *hashed_tok;
static int64 hashed_mark;

/*
 * token_mark returns the first 8 bytes of sha256(tok) as a big-endian int8,
 * the mark fence_slow_gate stores (it hashes convert_to(tok, 'UTF8'); the caller
 * has checked that tok is ASCII, the same bytes in every server encoding).
 */
static int64
token_mark(const char *tok)
{
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	pg_cryptohash_ctx *ctx;
	uint64		mark = 0;
	char	   *copy;

	if (hashed_tok != NULL && strcmp(hashed_tok, tok) == 0)
		return hashed_mark;
	ctx = pg_cryptohash_create(PG_SHA256);
	if (ctx == NULL)
		elog(ERROR, "fenceline: could not hash the fence token: out of memory");
	if (pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, (const uint8 *) tok, strlen(tok)) < 0 ||
		pg_cryptohash_final(ctx, digest, sizeof(digest)) < 0)
	{
		const char *why = pstrdup(pg_cryptohash_error(ctx));

		pg_cryptohash_free(ctx);
		elog(ERROR, "fenceline: could not hash the fence token: %s", why);
	}
	pg_cryptohash_free(ctx);
	for (int i = 0; i < 8; i++)
		mark = (mark << 8) | digest[i];
	/* Copy before letting go of the old one: never a dangling cache. */
	copy = MemoryContextStrdup(TopMemoryContext, tok);
	if (hashed_tok != NULL)
		pfree(hashed_tok);
	hashed_tok = copy;
	hashed_mark = (int64) mark;
	return hashed_mark;
}

/* is_ascii reports whether s is 7-bit: a token MakeToken signed always is. */
static bool
is_ascii(const char *s)
{
	for (; *s != '\0'; s++)
		if ((unsigned char) *s >= 0x80)
			return false;
	return true;
}

/*
 * The transaction in which hashed_tok was last found verified: the token and
 * the session are what the check binds, so that transaction's later writes
 * under the same token ask currval no more. Any other token clears it before
 * token_mark replaces hashed_tok.
 */
static LocalTransactionId verified_lxid = InvalidLocalTransactionId;

#if PG_VERSION_NUM >= 170000
#define MY_LXID (MyProc->vxid.lxid)
#else
#define MY_LXID (MyProc->lxid)
#endif

/*
 * verified reports whether tok is the token the session's slow path
 * verified: its hash is the session's currval of fenceline.verified.
 */
static bool
verified(const char *tok)
{
	const char *mark = GetConfigOption("fenceline.verified", true, false);
	Oid			nsp;
	Oid			seq;
	int64		have;
	bool		isnull;

	/* Until fence_slow_gate sets the mark currval is undefined (RESET leaves ''). */
	if (mark == NULL || mark[0] == '\0' || !is_ascii(tok))
		return false;
	if (verified_lxid == MY_LXID && hashed_tok != NULL && strcmp(hashed_tok, tok) == 0)
		return true;
	verified_lxid = InvalidLocalTransactionId;	/* token_mark may replace hashed_tok */
	nsp = get_namespace_oid("fenceline", true);
	seq = OidIsValid(nsp) ? get_relname_relid("verified", nsp) : InvalidOid;
	if (!OidIsValid(seq))
		return false;
	have = DatumGetInt64(call1(currval_oid, ObjectIdGetDatum(seq), &isnull));
	if (isnull || token_mark(tok) != have)
		return false;
	verified_lxid = MY_LXID;	/* token_mark left tok in hashed_tok */
	return true;
}

/*
 * fast is fence_fast(): true lets the statement write; false sends it to
 * fence_slow_gate. args are the trigger's: the epoch sequence's name,
 * ",hex(schema).*,", ",hex(schema).hex(table)," and the gate sequence's
 * name.
 */
static bool
fast(char **args)
{
	const char *setting = GetConfigOption("fenceline.token", true, false);
	char	   *tok;
	Oid			seq;
	Oid			gate;
	int64		fence;
	int64		cur;
	uint64		gen;
	ResourceOwner owner;

	if (setting == NULL)
		return false;
	tok = pstrdup(setting);		/* the setting's own string may be replaced */
	if (!verified(tok))
		return false;
	if (strstr(tok, args[1]) == NULL && strstr(tok, args[2]) == NULL)
		return false;
	if (!token_fence(tok, &fence))
		return false;
	/* As plpgsql's "seq regclass := seqname": a missing one raises 42P01. */
	seq = relid_of(args[0]);
	if (!last_value(seq, &cur) || cur != fence)
		return false;

	/*
	 * Peek, pass the gate, read again: a raise holds the gate. Passing it
	 * is holding it in ROW EXCLUSIVE mode to the end of the transaction,
	 * as reading it (plpgsql's way) does, without reading its page: the
	 * lock belongs to the top transaction, as sequence.c's does, so a
	 * ROLLBACK TO a savepoint before this write keeps it. Taking a new lock
	 * takes in the invalidations that came before it: if the gate's name
	 * may no longer be this relation, the slow path decides.
	 */
	gen = generation;
	gate = relid_of(args[3]);
	owner = CurrentResourceOwner;
	CurrentResourceOwner = TopTransactionResourceOwner;
	LockRelationOid(gate, RowExclusiveLock);	/* an error aborts, which resets the owner */
	CurrentResourceOwner = owner;
	if (generation != gen && relid_of(args[3]) != gate)
		return false;
	return last_value(seq, &cur) && cur == fence;
}

/*
 * slow runs fenceline.fence_slow_gate(rel, op), which returns or raises, as
 * plpgsql's PERFORM does: a query, so its EXECUTE privilege and hooks apply.
 */
static void
slow(Oid rel, const char *op)
{
	Oid			argtypes[2] = {OIDOID, TEXTOID};
	Datum		values[2] = {ObjectIdGetDatum(rel), CStringGetTextDatum(op)};
	int			rc;

	if ((rc = SPI_connect()) != SPI_OK_CONNECT)
		elog(ERROR, "fenceline: SPI_connect: %s", SPI_result_code_string(rc));
	rc = SPI_execute_with_args("SELECT fenceline.fence_slow_gate($1, $2)", 2, argtypes, values, NULL, false, 0);
	if (rc != SPI_OK_SELECT)
		elog(ERROR, "fenceline: fence_slow_gate: %s", SPI_result_code_string(rc));
	SPI_finish();
}

Datum
fenceline_fence_check_gate(PG_FUNCTION_ARGS)
{
	TriggerData *td = (TriggerData *) fcinfo->context;
	Trigger    *tg;
	const char *op;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fenceline: fence_check_c() is a trigger function")));
	tg = td->tg_trigger;
	if (!TRIGGER_FIRED_BEFORE(td->tg_event) || !TRIGGER_FIRED_FOR_STATEMENT(td->tg_event) || tg->tgnargs != 4)
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fenceline: trigger %s on %s is not one \"fenceline pg install\" made",
						tg->tgname, RelationGetRelationName(td->tg_relation)),
				 errhint("run \"fenceline pg install\" for this table again")));
	if (fast(tg->tgargs))
		return PointerGetDatum(NULL);
	if (TRIGGER_FIRED_BY_INSERT(td->tg_event))
		op = "INSERT";
	else if (TRIGGER_FIRED_BY_UPDATE(td->tg_event))
		op = "UPDATE";
	else if (TRIGGER_FIRED_BY_DELETE(td->tg_event))
		op = "DELETE";
	else
		op = "TRUNCATE";
	slow(RelationGetRelid(td->tg_relation), op);
	return PointerGetDatum(NULL);
}
