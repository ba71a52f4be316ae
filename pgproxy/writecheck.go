package pgproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"github.com/fenceline/fenceline/lease/scope"
)

// A read that calls user code (a function, an operator, a view or type that
// calls one) may write: direct, SELECT f() runs f's INSERTs. Outside a
// writable transaction the proxy used to run it read-only, so Postgres
// refused every such write, claimed tables' too. Under a live lease the
// proxy now runs it as direct and judges it by what it wrote, as the storage
// side does: it makes the transaction writable and puts a check after the
// statement, in the same transaction, that reads Postgres's own count of
// the rows this transaction inserted, updated and deleted per table
// (pg_stat_xact_all_tables) and raises the lease's refusal when one of them
// is outside the claim, so Postgres rolls everything back. No race: the
// check sees what the statement did, not what the text or the catalogs
// said it would do.
//
// Judged so: tables (partitions, and tables cascades or triggers reach,
// each by its own name). Temporary tables are the session's own; the
// fence's schema is written by the storage side's own trigger (the agent
// cannot write it: every statement and body naming it is refused). A write
// to the catalogs (DDL, TRUNCATE, large objects, a temporary table's
// creation) cannot be attributed to a table: it is refused as opaque
// unless the fence runs with --pg-allow-opaque. Not judged: sequences a
// function advances (Postgres counts no sequence writes), and code that
// writes over a connection of its own (dblink, foreign tables): in a
// database with those the read stays opaque (judgeCalls). Only a Query of
// one statement, or an extended-protocol unit of one Execute (all rows)
// ending in Sync, outside a transaction block: elsewhere the transaction's
// other statements would share the check's counts, and a read stays a
// read, as before.

// mayCheckWrites: st, the one statement of a unit about to start a new
// implicit transaction (between), is a read that calls something, under a
// live lease, so it may be run as a checked write (checkedWrite decides,
// once the calls are known). A read whose calls lookups have found builtin
// before is not: it needs no lookup, and takes the fast path as before.
// Nor is a DECLARE: a cursor WITH HOLD runs its query when the transaction
// commits, after any check (a plain one needs a block, which is never
// checked); it runs read-only, as the read it is.
func (s *session) mayCheckWrites(st *Statement, n int, between bool) bool {
	return n == 1 && between && !s.sim.inBlock && !s.clientRO && st != nil &&
		st.Class == ClassRead && len(st.Calls) > 0 && st.Tx == TxNone && !st.Session && st.Tag != "DeclareCursorStmt" &&
		st.Forbidden == "" && st.Unsure == "" && st.Prepare == "" && !s.seenBuiltin(st) && s.lease().live()
}

// seenBuiltin: every call of st (but sequences') was found builtin by a
// lookup at some time (catalog.seenBuiltin).
func (s *session) seenBuiltin(st *Statement) bool {
	return !s.anyUnseen(st.Calls)
}

// anyUnseen: a call of calls (but sequences' and pg_catalog's types) has
// not been found builtin by a lookup.
func (s *session) anyUnseen(calls []Call) bool {
	if len(calls) == 0 {
		return false
	}
	return !s.allSeenBuiltin(calls)
}

func (s *session) allSeenBuiltin(calls []Call) bool {
	if len(calls) == 0 {
		return true
	}
	cat := s.p.catalog
	// The same calls as last time, none forgotten since: a prepared
	// statement's executions ask this of one slice again and again.
	m := &s.seenCalls
	epoch := cat.builtinEpoch.Load()
	if m.first == &calls[0] && m.n == len(calls) && m.epoch == epoch {
		return true
	}
	cat.mu.Lock()
	defer cat.mu.Unlock()
	for _, c := range calls {
		if c.Kind != 'q' && !c.builtinType() && !cat.seenBuiltin[callKeyOf(s.database, c)] {
			return false
		}
	}
	// (epoch was read before the lock: a clear since then makes the note
	// stale at once, never wrongly fresh.)
	m.first, m.n, m.epoch = &calls[0], len(calls), epoch
	return true
}

// checkedWrite returns st as a write judged by what it writes (WriteCheck)
// when it calls user code, or a function or view the proxy could not
// learn; else st. A database whose code can write over a connection of its
// own (dblink, foreign tables), and the builtins that run SQL text, leave
// st as it was (judgeCalls decides them, as before).
//
// Postgres adds to pg_stat_xact_all_tables the counts of earlier
// transactions of the session it has not flushed yet (it flushes them when
// idle, at most once a second), so before the checked write's transaction
// starts the proxy has it flush them now (a query of its own:
// pg_stat_force_next_flush, done when the backend goes idle after it,
// before ReadyForQuery). The counts the check reads are then the checked
// transaction's own; nothing flushes them before it ends. When that query
// fails, st stays a read.
func (s *session) checkedWrite(st *Statement) (*Statement, error) {
	if s.connectsVia() != "" {
		return st, nil
	}
	user := false
	for _, c := range st.Calls {
		if c.Kind == 'f' && (runsSQL[c.Name] || otherConnection(c.Name)) {
			return st, nil
		}
		if c.Kind == 'q' {
			continue // judgeSequence, as sequenceWrite's
		}
		u, known := s.unit.calls[callKeyOf(s.database, c)]
		user = user || u || !known
	}
	if !user {
		return st, nil
	}
	if readsRelations(st) {
		if fs, _ := s.foreignSet(); readsForeign(st, fs) != "" {
			return st, nil
		}
	}
	if _, err := s.internalQuery("SELECT pg_catalog.pg_stat_force_next_flush()"); err != nil {
		var qe *queryError
		if errors.As(err, &qe) {
			s.p.log.Warn("statistics flush before a checked write failed; the read runs read-only", "user", s.user, "err", err)
			return st, nil
		}
		return nil, err
	}
	cp := *st
	cp.Class, cp.WriteCheck = ClassWrite, true
	return &cp, nil
}

// writeCheckHint is the hint of a checked write's refusal.
const writeCheckHint = "acquire a lease that claims every table the functions write (--table schema.table or schema.*)"

// writeCheckSQL is the check that follows a checked write in its
// transaction: a DO block (one line) that raises the lease's refusal when
// the transaction wrote a table outside the claim, or the catalogs (unless
// opaque writes are allowed). It first fires what the statement deferred
// to COMMIT (SET CONSTRAINTS ALL IMMEDIATE: deferred constraint triggers
// and foreign-key actions), so their writes are counted too, and refuses a
// cursor WITH HOLD declared in the transaction (a function may declare
// one: its query runs at COMMIT, after the check). It pins search_path to pg_catalog for the
// rest of the transaction (it is its last statement), so what the checked
// statement did to the path or the session's objects does not change what
// the check reads.
func (s *session) writeCheckSQL(st *Statement, li leaseInfo) string {
	var claimed []string
	for _, t := range li.tables {
		sch, rel, wild, err := scope.SplitTable(t)
		switch {
		case err != nil:
		case wild:
			claimed = append(claimed, "s.schemaname::pg_catalog.text = "+sqlText(sch))
		default:
			claimed = append(claimed, "(s.schemaname::pg_catalog.text = "+sqlText(sch)+" AND s.relname::pg_catalog.text = "+sqlText(rel)+")")
		}
	}
	inClaim := "false"
	if len(claimed) > 0 {
		inClaim = strings.Join(claimed, " OR ")
	}
	// With track_counts off Postgres counts nothing, so the check could
	// not see a write: refused as unnamed in either mode (opaque writes
	// allowed or not), never passed.
	catalogs, counts := "", "IF pg_catalog.current_setting('track_counts') <> 'on' THEN t := 'track_counts is off, so Postgres does not count what it wrote'; unnamed := true; ELSE "
	if s.p.cfg.AllowOpaque {
		catalogs = " AND s.schemaname <> 'pg_catalog'"
	}
	q := func(s string) string { return "$fl_m$" + strings.ReplaceAll(s, "$", "") + "$fl_m$" }
	msgT, detail := refusalText(&refusal{reason: fmt.Sprintf("a function it calls wrote table @T@, outside the lease's table scope %v", li.tables)}, st, li)
	msgO, _ := refusalText(&refusal{reason: "cannot tell which tables a function it calls wrote: @T@"}, st, li)
	msgH, _ := refusalText(&refusal{reason: "cannot tell which tables a function it calls writes: it declared a cursor WITH HOLD (@T@), whose query runs when the transaction commits, after this check"}, st, li)
	return "DO $fl_do$DECLARE t pg_catalog.text; unnamed pg_catalog.bool; sp pg_catalog.text; BEGIN " +
		"SET CONSTRAINTS ALL IMMEDIATE; " +
		// Before any operator: the checked code (and the constraint
		// triggers just run) may have left a path in which an operator of
		// the same name comes before pg_catalog's
		// (TestWriteCheckPinsItsPathFirst). The path is put back when the
		// check passes: a Parse after the checked Execute, before its
		// Sync, resolves its names with it.
		"sp := pg_catalog.current_setting('search_path'); " +
		"PERFORM pg_catalog.set_config('search_path', 'pg_catalog', true); " +
		// A cursor WITH HOLD runs its query at COMMIT, after the check: one
		// declared in this transaction (by a function) is refused.
		"SELECT c.name INTO t FROM pg_catalog.pg_cursors c WHERE c.is_holdable AND c.creation_time >= pg_catalog.transaction_timestamp() LIMIT 1; " +
		"IF t IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = pg_catalog.replace(" + q(msgH) + ", '@T@', pg_catalog.quote_ident(t)), DETAIL = " + q(detail) +
		", HINT = " + q("declare the cursor yourself (DECLARE ... WITH HOLD of a query the lease allows), not from a function a read calls") + "; END IF; " +
		"IF pg_catalog.txid_current_if_assigned() IS NULL THEN PERFORM pg_catalog.set_config('search_path', sp, true); RETURN; END IF; " + counts +
		"SELECT CASE WHEN s.schemaname = 'pg_catalog' THEN pg_catalog.format('it changed the catalogs (%s: DDL, TRUNCATE, large objects or temporary tables)', s.relname) " +
		"ELSE pg_catalog.format('%I.%I', s.schemaname, s.relname) END, s.schemaname = 'pg_catalog' INTO t, unnamed " +
		"FROM pg_catalog.pg_stat_xact_all_tables s WHERE s.n_tup_ins + s.n_tup_upd + s.n_tup_del > 0 " +
		"AND NOT pg_catalog.starts_with(s.schemaname::pg_catalog.text, 'pg_toast') AND NOT pg_catalog.starts_with(s.schemaname::pg_catalog.text, 'pg_temp_') " +
		"AND s.schemaname <> '" + Schema + "' AND NOT (" + inClaim + ")" + catalogs + " ORDER BY 2, 1 LIMIT 1; END IF; " +
		"IF t IS NULL THEN PERFORM pg_catalog.set_config('search_path', sp, true); RETURN; END IF; " +
		"IF unnamed THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = pg_catalog.replace(" + q(msgO) + ", '@T@', t), DETAIL = " + q(detail) +
		", HINT = " + q("writes whose tables cannot be named pass only when the fence runs with --pg-allow-opaque, under a live lease") + "; END IF; " +
		"RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = pg_catalog.replace(" + q(msgT) + ", '@T@', t), DETAIL = " + q(detail) +
		", HINT = " + q(writeCheckHint) + "; END$fl_do$"
}

// auditCheck records the refusal a checked write's check raised (its
// error's fields f); any other error of the check (a timeout, a cancel)
// is not a refusal.
func (s *session) auditCheck(f map[byte]string, st *Statement, li leaseInfo, text string) {
	prefix := fmt.Sprintf("fenceline: write refused for lease %s (fence %d): ", orNone(li.id), li.fence)
	reason, ok := strings.CutPrefix(f['M'], prefix)
	if f['C'] != "42501" || !ok {
		return
	}
	r := &refusal{code: ReasonOutsideLease, reason: reason, hint: f['H']}
	if strings.HasPrefix(reason, "cannot tell") {
		r.code = ReasonUnnamedTable
	}
	s.record(r, st, li, text)
}

// executeAll: an Execute message body asks for all the portal's rows.
func executeAll(body []byte) bool {
	_, rest, err := cstring(body)
	return err == nil && len(rest) >= 4 && binary.BigEndian.Uint32(rest) == 0
}
