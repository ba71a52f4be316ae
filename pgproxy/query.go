// The simple-query path: a Query decided statement by statement and
// forwarded, rewritten when the fence puts statements of its own into it;
// and the fast-path FunctionCall.

package pgproxy

import (
	"encoding/binary"
	"strconv"
	"strings"
)

// handleQuery decides a simple-protocol Query and forwards it, rewritten
// when the fence needs statements of its own in the same message.
func (s *session) handleQuery(raw []byte) error {
	sql, _, err := cstring(raw[5:])
	if err != nil {
		return s.fatal(err)
	}
	between := !s.pendingSync && s.txStatus == 'I' // no transaction open on the server
	lookup := !s.pendingSync && s.txStatus != 'E'  // queries of the proxy's own disturb nothing
	cls := s.classify(sql, s.pendingSync)
	s.pendingSync = false
	check := len(cls.Stmts) == 1 && s.mayCheckWrites(&cls.Stmts[0], 1, between) // see checkedWrite
	if fastPathOK(cls, s.sim) && !s.rwLost() && !s.callsToJudge(cls) && !(check && !s.callsKnownHarmless(&cls.Stmts[0])) {
		if s.sim.blockRW || s.sim.groupRW {
			s.rw.Store(true) // a read that calls a function may write
		}
		return s.forwardQuery(raw)
	}
	stmts, changes, li, err := s.judgeQuery(cls, check, lookup)
	if ce, ok := cancelled(err); ok {
		return s.cancelQuery(ce, changes)
	}
	if err != nil {
		return err
	}
	if cls.ParseError != "" {
		// Text the classifier's parser rejects: let Postgres's parser say
		// why (42601 and its message) without running anything.
		st := stmts[0]
		r := s.authorizeInTxn(st, li)
		if r == nil {
			r = s.authorize(st, li, nil)
		}
		if r != nil {
			return s.parseOrRefuse(sql, r, st, li)
		}
	}
	s.noteCode(stmts, changes)
	if between && len(stmts) == 1 {
		if err := s.unwrapOutside(stmts[0], li); err != nil {
			return s.cancelOr(err, changes)
		}
	}
	if li.live() && between {
		if err := s.bindFence(); err != nil {
			return s.cancelOr(err, changes)
		}
	}
	return s.rewriteQuery(raw, sql, stmts, changes, li)
}

// forwardQuery forwards a Query as the client sent it.
func (s *session) forwardQuery(raw []byte) error {
	s.push(&expect{kind: expQuery})
	_, err := s.sw.Write(raw)
	return err
}

// judgeQuery decides what a Query's statements are (an EXECUTE, the
// statement it runs; a read that advances sequences, a write) and learns
// what they need: the search path, the catalogs, a check of a lone write
// (checkedWrite), the functions they call; then takes the lease. lookup:
// the proxy may run queries of its own first. changes[i] is what statement
// i changed in the prepared statements and portals (nil when none did),
// returned with an error too (a cancel undoes them).
func (s *session) judgeQuery(cls *Classification, check, lookup bool) (stmts []*Statement, changes [][]nameChange, li leaseInfo, err error) {
	stmts = make([]*Statement, len(cls.Stmts))
	for i := range cls.Stmts {
		stmts[i] = s.sequenceWrite(s.resolveSQLPrepared(&cls.Stmts[i]))
		if c := s.takeChanged(); c != nil {
			if changes == nil {
				changes = make([][]nameChange, len(stmts))
			}
			changes[i] = c
		}
	}
	if err := s.needSearchPath(stmts, lookup); err != nil {
		return nil, changes, leaseInfo{}, err
	}
	writable := s.unitWritable(stmts)
	if err := s.learnCatalog(stmts, writable || check, lookup); err != nil {
		return nil, changes, leaseInfo{}, err
	}
	if check {
		if stmts[0], err = s.checkedWrite(stmts[0]); err != nil {
			return nil, changes, leaseInfo{}, err
		}
		writable = s.unitWritable(stmts)
	}
	for i := range stmts {
		stmts[i] = s.judgeCalls(stmts[i], writable)
	}
	return stmts, changes, s.lease(), nil
}

// queryRewriter builds the text a decided Query sends Postgres: the
// client's, with the fence's statements inserted and refused statements
// replaced, and what the relay is to expect back for each.
type queryRewriter struct {
	s     *session
	sql   string // the client's text
	stmts []*Statement
	li    leaseInfo
	// sp is the search path unqualified names are checked with; nil once a
	// session-level statement may have changed it.
	sp      []string
	out     strings.Builder
	items   []*expect
	inserts []insertion // where out holds text the proxy put in
	pos     int         // next byte of sql not yet copied
	changed bool        // out is not the client's text
	rwSeen  bool        // a statement runs in a transaction made writable
	own     *expect     // the answer of the statement last decided (or its refusal)
}

// rewriteQuery decides each of a Query's statements in the transaction it
// runs in, up to the first refused, and forwards the Query: rewritten when
// the fence put anything into it, or when a statement changes the prepared
// statements or portals (changes, see judgeQuery): each statement then has
// an answer of its own, and what one the server refused or skipped changed
// is undone.
func (s *session) rewriteQuery(raw []byte, sql string, stmts []*Statement, changes [][]nameChange, li leaseInfo) error {
	q := &queryRewriter{s: s, sql: sql, stmts: stmts, li: li, sp: s.searchPath}
	for i := range stmts {
		ok := q.statement(i)
		if changes == nil {
			if !ok {
				break
			}
			continue
		}
		q.changed = true
		if ok {
			q.own.changes = changes[i]
			continue
		}
		for _, c := range changes[i:] { // refused: nothing from here on runs
			q.own.changes = append(q.own.changes, c...)
		}
		break
	}
	if q.rwSeen && li.live() {
		s.rw.Store(true)
	}
	if !q.changed {
		return s.forwardQuery(raw)
	}
	q.out.WriteString(sql[q.pos:])
	q.items = append(q.items, &expect{kind: expQueryEnd, inserts: q.inserts})
	s.push(q.items...)
	var w msgBuilder
	w.query(q.out.String())
	_, err := s.sw.Write(w.b)
	return err
}

// copyTo copies the client's text up to byte at.
func (q *queryRewriter) copyTo(at int) {
	q.out.WriteString(q.sql[q.pos:at])
	q.pos = at
}

// inject puts statements of the proxy's own at this point of the text;
// their answers are swallowed.
func (q *queryRewriter) inject(stmtsSQL ...string) {
	at := q.out.Len()
	n := 0
	for _, sql := range stmtsSQL {
		q.out.WriteString(sql)
		q.out.WriteString(";")
		n += len(sql) + 1
		q.items = append(q.items, &expect{kind: expStmt, swallow: true})
	}
	q.inserts = append(q.inserts, insertion{at: at, n: n})
	q.changed = true
}

// statement decides statement i and reports whether the rest of the Query
// goes on (false: i was refused, and nothing after it runs).
func (q *queryRewriter) statement(i int) bool {
	s, st, li := q.s, q.stmts[i], q.li
	if !s.sim.inBlock && !s.sim.decided {
		q.copyTo(st.Start)
		q.authorizeGroup(i)
	}
	if st.Session {
		q.sp = nil
		s.sessionChanged(st)
	}
	q.rwSeen = q.rwSeen || s.sim.blockRW || s.sim.groupRW
	r := s.authorizeInTxn(st, li)
	if r == nil {
		r = s.authorizeWrite(st, li, spIfKnown(q.sp, s.searchPath), "send the write in its own query or start the transaction with BEGIN")
	}
	var guard *refusal
	if s.dropGuard(st, r, li, len(q.stmts)) {
		guard, r = r, nil
	}
	if r != nil {
		q.refuse(r, st)
		return false
	}
	q.pinPath(st)
	s.passedDDL(st)
	q.own = &expect{kind: expStmt}
	q.items = append(q.items, q.own)
	if guard != nil {
		q.dropGuard(guard, st)
	}
	if st.WriteCheck && s.sim.groupRW {
		q.writeCheck(st)
	}
	if show := s.replacement(st); show != "" {
		q.replace(st, show)
	}
	s.trackTx(st)
	if st.Tx == TxChain && s.sim.blockRW && i+1 < len(q.stmts) {
		// A chained block's new transaction gets the token too.
		q.copyTo(q.stmts[i+1].Start)
		if li.live() {
			q.inject(setLocalToken(s.token(li)))
		}
	}
	return true
}

// authorizeGroup decides the implicit transaction statement i starts:
// writable, with the token, when what runs in it writes (groupWrites)
// under a live lease.
func (q *queryRewriter) authorizeGroup(i int) {
	s, li := q.s, q.li
	s.sim.decided = true
	if !groupWrites(q.stmts[i:], s.clientRO) || !li.live() || len(q.stmts) == 1 && q.stmts[0].Tx == TxOutside {
		// (A statement that must run alone runs in the session's
		// read-only default; Postgres decides whether it may.)
		if s.txEnded {
			// A new transaction after a COMMIT or ROLLBACK in this
			// Query: read-only whatever a function did to the default.
			q.inject(roSQL)
		}
		return
	}
	q.inject(rwSQL, setLocalToken(s.token(li)))
	s.sim.groupRW = true
}

// refuse puts the refusal of st (r) in its place; Postgres skips the
// rest of the text after the error it raises.
func (q *queryRewriter) refuse(r *refusal, st *Statement) {
	q.out.WriteString(q.sql[q.pos:st.Start])
	q.out.WriteString(q.s.refuse(r, st, q.li, q.sql[st.Start:st.End]))
	q.own = &expect{kind: expStmt}
	q.items = append(q.items, q.own)
	q.pos = len(q.sql)
	q.changed = true
}

// pinPath pins search_path before a write of st's to an unqualified name.
func (q *queryRewriter) pinPath(st *Statement) {
	s := q.s
	if unqualified(st) && !s.sim.spPinned && s.searchPath != nil && q.sp != nil {
		// Postgres 15 does not report search_path, and a function may
		// have changed it since the proxy learned it: the write
		// resolves its names with the path the proxy checked them
		// with, for the rest of its transaction (a writable block:
		// what a function in it does is the block's, see Known limits).
		q.copyTo(st.Start)
		q.inject("SET LOCAL search_path = " + s.pinnedPathSQL())
		s.sim.spPinned = true
	}
}

// dropGuard puts the guard of a DROP ... IF EXISTS (see dropGuard) after
// st; the refusal it stands for is recorded if it fires.
func (q *queryRewriter) dropGuard(guard *refusal, st *Statement) {
	s, li := q.s, q.li
	// The client's text, then the guard (after a newline: the
	// text may end in a comment).
	q.copyTo(len(q.sql))
	msg, detail := refusalText(guard, st, li)
	text := q.sql[st.Start:st.End]
	q.inject("\n;" + dropGuardSQL(msg, detail, "the tables and schemas a DROP ... IF EXISTS names outside the lease's claim must not exist: acquire a lease that claims them"))
	q.items[len(q.items)-1].onError = func(map[byte]string) { s.record(guard, st, li, text) }
	q.changed = true
}

// writeCheck puts the write check of st (see writeCheckSQL) last in its
// transaction; a check that fails is audited.
func (q *queryRewriter) writeCheck(st *Statement) {
	s, li := q.s, q.li
	// The check, last in the transaction (after a newline: the
	// text may end in a comment).
	q.copyTo(len(q.sql))
	text := q.sql[st.Start:st.End]
	q.inject("\n;" + s.writeCheckSQL(st, li))
	q.items[len(q.items)-1].onError = func(f map[byte]string) { s.auditCheck(f, st, li, text) }
}

// replace puts the proxy's answer (show) in st's place: the client's own
// value, as a one-row SELECT of the same column (the tag says SELECT 1,
// not SHOW); or the client's own default set, Postgres's kept (see
// Statement.ClientRW).
func (q *queryRewriter) replace(st *Statement, show string) {
	q.out.WriteString(q.sql[q.pos:st.Start])
	if d := len(show) - (st.End - st.Start); d > 0 {
		q.inserts = append(q.inserts, insertion{at: q.out.Len(), n: d})
	}
	q.out.WriteString(show)
	q.pos = st.End
	if q.pos < len(q.sql) && q.sql[q.pos] == ';' {
		q.pos++
		q.out.WriteString(";")
	}
	q.changed = true
}

// parseOrRefuse answers a Query whose text the classifier's parser
// rejected and which may not run as an opaque write: Postgres parses the
// text (a Parse into a statement of the proxy's own: nothing runs, and the
// client's unnamed statement stays), so the client gets Postgres's own
// syntax error (42601, its message and position); should Postgres accept
// the text, the refusal runs instead.
func (s *session) parseOrRefuse(sql string, r *refusal, st *Statement, li leaseInfo) error {
	const name = "fenceline_syntax"
	var w msgBuilder
	w.close('S', name)
	w.parse(name, sql)
	w.close('S', name)
	w.close('S', refuseName)
	w.parse(refuseName, s.refuse(r, st, li, sql))
	w.bind("", refuseName)
	w.execute("")
	w.sync()
	items := make([]*expect, 0, 8)
	for range 6 {
		items = append(items, &expect{kind: expSingle, swallow: true})
	}
	items = append(items, &expect{kind: expExecute}, &expect{kind: expSync})
	s.push(items...)
	_, err := s.sw.Write(w.b)
	return err
}

// fastPathOK: a query of reads and harmless control statements that
// changes nothing the proxy tracks goes through byte for byte.
func fastPathOK(cls *Classification, sim txSim) bool {
	if cls.Class == ClassWrite {
		return false
	}
	for i := range cls.Stmts {
		st := &cls.Stmts[i]
		if advancesSequence(st) {
			return false // see sequenceWrite
		}
		if st.Tx != TxNone && st.Tx != TxInBlock || st.RollbackTo || st.Session || st.ClientRO != 0 || st.ShowDefaultRO || st.ClientRW || st.Prepare != "" || st.Deallocate != "" || st.Declare != "" || st.Portal != "" || st.ClosePortal || len(st.Signals) > 0 || len(st.SignalParams) > 0 ||
			st.Tag == "DeallocateStmt" || st.Tag == "DiscardStmt" {
			return false
		}
	}
	return true
}

// handleFunctionCall: the fast-path FunctionCall (large objects and the
// like) runs as its own statement, so the proxy cannot put the token next to
// it; it passes only inside a transaction block the proxy made writable,
// and, a call of any function by its oid, only as the opaque write it is
// (with Config.AllowOpaque; before, it passed in any writable block, and a
// call of a function writing outside the claim wrote there:
// TestFastPathCallIsOpaque).
func (s *session) handleFunctionCall(raw []byte) error {
	st := &Statement{Class: ClassWrite, Opaque: true, Tag: "FunctionCall"}
	li := s.lease()
	var oid uint32
	if len(raw) >= 9 {
		oid = binary.BigEndian.Uint32(raw[5:9])
	}
	var r *refusal
	switch {
	case fastPathRefused[oid] != "":
		st.Forbidden = fastPathRefused[oid]
		r = s.authorize(st, li, s.searchPath)
	case s.sim.inBlock && s.sim.blockRW:
		r = s.authorize(st, li, s.searchPath)
	default:
		r = s.authorize(st, li, s.searchPath)
		if r == nil {
			r = &refusal{code: ReasonReadOnlyTxn, reason: "a fast-path function call runs outside any transaction the proxy made writable",
				hint: "call it inside BEGIN ... COMMIT"}
		}
	}
	if r == nil {
		s.noteCode([]*Statement{st}, nil) // a function of any oid: code the proxy does not parse
		s.rw.Store(true)                  // in a block made writable, the lease live
		s.push(&expect{kind: expFunc})
		_, err := s.sw.Write(raw)
		return err
	}
	var w msgBuilder
	w.query(s.refuse(r, st, li, "FunctionCall"))
	s.push(&expect{kind: expQuery})
	_, err := s.sw.Write(w.b)
	return err
}

// fastPathRefused are the builtin functions (by their fixed oids) a
// fast-path FunctionCall may not call, why: the calls fenceGuard refuses in
// a query, whose arguments a FunctionCall carries as data.
var fastPathRefused = map[uint32]string{
	2096: "a fast-path call of pg_terminate_backend may end another agent's session",
	2171: "a fast-path call of pg_cancel_backend may cancel another agent's statement",
	4543: "a fast-path call of pg_log_backend_memory_contexts signals a backend it names by data",
	4032: "a fast-path call of pg_sequence_last_value may read (and hold) a fence gate, which stalls another lease's epoch raise",
}

// insertion is text the proxy put into a client's query: at byte at of the
// rewritten text, n bytes.
type insertion struct{ at, n int }

// originalPosition maps a 1-based error position in the rewritten text back
// to the client's text.
func originalPosition(pos int, ins []insertion) int {
	shift := 0
	for _, in := range ins {
		if pos-1 >= in.at+in.n {
			shift += in.n
		}
	}
	return pos - shift
}

func atoiOr(s string, d int) int {
	n, err := strconv.Atoi(s)
	if err != nil {
		return d
	}
	return n
}
