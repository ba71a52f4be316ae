/*
 * fenceline_fence: the storage-side fence's trigger function in C.
 *
 * It makes the same check as fenceline.fence_fast() in pgproxy/fence.go and
 * hands everything else to fenceline.fence_slow(), the plpgsql SECURITY
 * DEFINER function that verifies a token's MAC, raises an epoch, or refuses
 * with the reason. The check reads no table and runs no query:
 *
 *   1. the token (setting fenceline.token) is the one the session verified:
 *      the first 8 bytes of its SHA-256 equal the session's currval of
 *      sequence fenceline.verified, which only fence_slow may set, and the
 *      setting fenceline.verified says currval is defined;
 *   2. the token claims the table (",hex(schema).*," or
 *      ",hex(schema).hex(table)," occurs in it);
 *   3. the token's fence equals the table's epoch before and after a shared
 *      transaction-level advisory lock on the table (fence_slow raises an
 *      epoch under the exclusive one).
 *
 * The plpgsql trigger pays for setting up its expressions in every
 * transaction (about 35 us of Postgres CPU per fenced statement under
 * load); this one costs a few microseconds. Postgres loads it only from a
 * superuser's CREATE FUNCTION, so managed services that allow no C
 * extensions keep the plpgsql trigger, which "fenceline pg install" uses
 * unless told otherwise.
 *
 * Build and install (needs the server headers, postgresql-server-dev-NN):
 *
 *   make -C pgproxy/cfence install
 *   fenceline pg install --c-trigger ...
 */
#include "postgres.h"

#include "catalog/namespace.h"
#include "catalog/pg_collation.h"
#include "catalog/pg_type.h"
#include "commands/trigger.h"
#include "common/cryptohash.h"
#include "common/sha2.h"
#include "fmgr.h"
#include "nodes/pg_list.h"
#include "nodes/value.h"
#include "parser/parse_func.h"
#include "utils/builtins.h"
#include "utils/fmgrprotos.h"
#include "utils/guc.h"
#include "utils/lsyscache.h"
#include "utils/memutils.h"
#include "utils/regproc.h"

PG_MODULE_MAGIC;

/* The first key of the fence's advisory locks ("FENC"), as in fence.go. */
#define FENCE_LOCK_KEY 1178946115

PG_FUNCTION_INFO_V1(fenceline_fence_check);

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

/* epoch returns the last value of sequence seq, false when it has none. */
static bool
epoch(Oid seq, int64 *value)
{
	bool		isnull;
	Datum		d = call1(pg_sequence_last_value, ObjectIdGetDatum(seq), &isnull);

	if (isnull)
		return false;
	*value = DatumGetInt64(d);
	return true;
}

/*
 * token_fence parses the fence of a token ("v3:" fence ":" ...); false when
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

/* token_mark returns the first 8 bytes of sha256(tok) as a big-endian int8. */
static int64
token_mark(const char *tok)
{
	uint8		digest[PG_SHA256_DIGEST_LENGTH];
	pg_cryptohash_ctx *ctx;
	uint64		mark = 0;

	if (hashed_tok != NULL && strcmp(hashed_tok, tok) == 0)
		return hashed_mark;
	ctx = pg_cryptohash_create(PG_SHA256);
	if (ctx == NULL ||
		pg_cryptohash_init(ctx) < 0 ||
		pg_cryptohash_update(ctx, (const uint8 *) tok, strlen(tok)) < 0 ||
		pg_cryptohash_final(ctx, digest, sizeof(digest)) < 0)
	{
		pg_cryptohash_free(ctx);
		elog(ERROR, "fenceline: could not hash the fence token");
	}
	pg_cryptohash_free(ctx);
	for (int i = 0; i < 8; i++)
		mark = (mark << 8) | digest[i];
	if (hashed_tok != NULL)
		pfree(hashed_tok);
	hashed_tok = MemoryContextStrdup(TopMemoryContext, tok);
	hashed_mark = (int64) mark;
	return hashed_mark;
}

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

	/* Until fence_slow sets the mark currval is undefined (RESET leaves ''). */
	if (mark == NULL || mark[0] == '\0')
		return false;
	nsp = get_namespace_oid("fenceline", true);
	seq = OidIsValid(nsp) ? get_relname_relid("verified", nsp) : InvalidOid;
	if (!OidIsValid(seq))
		return false;
	have = DatumGetInt64(call1(currval_oid, ObjectIdGetDatum(seq), &isnull));
	return !isnull && token_mark(tok) == have;
}

/*
 * fast is fence_fast(): true lets the statement write; false sends it to
 * fence_slow. args are the trigger's: the epoch sequence's name,
 * ",hex(schema).*," and ",hex(schema).hex(table),".
 */
static bool
fast(char **args, Oid rel)
{
	const char *tok = GetConfigOption("fenceline.token", true, false);
	Oid			seq;
	int64		fence;
	int64		cur;

	if (tok == NULL || !verified(tok))
		return false;
	if (strstr(tok, args[1]) == NULL && strstr(tok, args[2]) == NULL)
		return false;
	if (!token_fence(tok, &fence))
		return false;
	seq = RangeVarGetRelid(makeRangeVarFromNameList(stringToQualifiedNameList(args[0])), NoLock, true);
	if (!OidIsValid(seq) || !epoch(seq, &cur) || cur != fence)
		return false;
	/* Peek, lock shared, read again: a raise holds the lock exclusively. */
	DirectFunctionCall2(pg_advisory_xact_lock_shared_int4,
						Int32GetDatum(FENCE_LOCK_KEY),
						Int32GetDatum((int32) ((int64) rel - INT64CONST(2147483648))));
	return epoch(seq, &cur) && cur == fence;
}

/* slow calls fenceline.fence_slow(rel, op), which returns or raises. */
static void
slow(Oid rel, const char *op)
{
	Oid			argtypes[2] = {OIDOID, TEXTOID};
	Oid			fn = LookupFuncName(list_make2(makeString("fenceline"), makeString("fence_slow")),
									2, argtypes, false);
	FmgrInfo	flinfo;

	LOCAL_FCINFO(fcinfo, 2);

	fmgr_info(fn, &flinfo);
	InitFunctionCallInfoData(*fcinfo, &flinfo, 2, DEFAULT_COLLATION_OID, NULL, NULL);
	fcinfo->args[0].value = ObjectIdGetDatum(rel);
	fcinfo->args[0].isnull = false;
	fcinfo->args[1].value = CStringGetTextDatum(op);
	fcinfo->args[1].isnull = false;
	(void) FunctionCallInvoke(fcinfo);
}

Datum
fenceline_fence_check(PG_FUNCTION_ARGS)
{
	TriggerData *td = (TriggerData *) fcinfo->context;
	Trigger    *tg;
	const char *op;

	if (!CALLED_AS_TRIGGER(fcinfo))
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fenceline: fence_check_c() is a trigger function")));
	tg = td->tg_trigger;
	if (!TRIGGER_FIRED_BEFORE(td->tg_event) || !TRIGGER_FIRED_FOR_STATEMENT(td->tg_event) || tg->tgnargs != 3)
		ereport(ERROR,
				(errcode(ERRCODE_E_R_I_E_TRIGGER_PROTOCOL_VIOLATED),
				 errmsg("fenceline: trigger %s on %s is not one \"fenceline pg install\" made",
						tg->tgname, RelationGetRelationName(td->tg_relation)),
				 errhint("run \"fenceline pg install\" for this table again")));
	if (fast(tg->tgargs, RelationGetRelid(td->tg_relation)))
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
