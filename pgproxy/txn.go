// The transaction model: what the proxy believes about the transaction the
// next statement runs in (txSim), the read-only default it keeps on, the
// fence token and the session number it is bound to, and the session-level
// state (prepared statements, settings) a statement may change.

package pgproxy

import (
	"errors"
	"slices"
	"strconv"
	"sync/atomic"
)

// txSim is the proxy's view of the transaction the next statement runs in.
type txSim struct {
	inBlock  bool // inside BEGIN ... COMMIT
	blockRW  bool // the block is writable and carries the token
	clientRO bool // the client asked for READ ONLY
	decided  bool // the current implicit transaction's mode is fixed
	groupRW  bool // the current implicit transaction is writable and carries the token
	// spPinned: the proxy set search_path for this transaction (SET
	// LOCAL) to the path it checks unqualified names with.
	spPinned bool
	// snapOld: the block's isolation keeps the snapshot of its first
	// statement (snapshotOld): 0 not asked yet, 1 no, 2 yes.
	snapOld int8
}

// track follows a statement's effect on the transaction block (both
// protocols; a chained block's new token is the caller's to inject).
func (sim *txSim) track(tx TxEffect) {
	switch tx {
	case TxBegin, TxBeginRW:
		if !sim.inBlock {
			sim.inBlock, sim.blockRW, sim.clientRO = true, sim.groupRW, false
		}
	case TxBeginRO:
		if !sim.inBlock {
			sim.inBlock, sim.blockRW, sim.clientRO = true, false, true
		}
	case TxEnd:
		*sim = txSim{}
	}
}

// sessionChanged forgets what a session-level statement (SET, RESET,
// DISCARD…) may have changed: the search path and our prepared statements,
// and after a DISCARD the storage fence's session mark.
func (s *session) sessionChanged(st *Statement) {
	if st.Tag == "DiscardStmt" {
		s.resetMark = true
		s.fenceSession = 0 // DISCARD SEQUENCES and ALL forget its currval
	}
	s.searchPath = nil
	if st.Tag == "DiscardStmt" || st.Tag == "DeallocateStmt" && st.Deallocate == "" {
		// DISCARD ALL and DEALLOCATE ALL drop the proxy's prepared
		// statements too; SET, RESET ALL and set_config do not.
		s.forgetOwnStatements("")
	}
}

// forgetOwnStatements: Postgres no longer has the proxy's prepared
// statement name ("" for all of them); it is prepared again before its
// next use (after a Close, so a statement Postgres still has is no error).
func (s *session) forgetOwnStatements(name string) {
	for _, o := range []struct {
		name  string
		state *atomic.Int32
	}{{rwStmtName, &s.rwStmt}, {roStmtName, &s.roStmt}, {tokStmtName, &s.tokStmt}, {spStmtName, &s.spStmt}, {tokSpStmtName, &s.tokSpStmt}} {
		if name == "" || name == o.name {
			o.state.Store(stmtNone)
		}
	}
}

// trackTx follows st's effect on the transaction block and on the
// client's read-only default (SET inside a block is undone by its
// ROLLBACK, and by a COMMIT of a failed block).
func (s *session) trackTx(st *Statement) {
	if st.ClientRO != 0 {
		if s.sim.inBlock && s.clientROSaved == 0 {
			s.clientROSaved = 1
			if s.clientRO {
				s.clientROSaved = 2
			}
		}
		s.clientRO = st.ClientRO > 0
	}
	if (st.Tx == TxEnd || st.Tx == TxChain) && s.sim.inBlock {
		if s.clientROSaved != 0 && (st.Rollback || s.txStatus == 'E') {
			s.clientRO = s.clientROSaved == 2
		}
		s.clientROSaved = 0
	}
	if st.Tx == TxEnd || st.Tx == TxChain {
		s.txEnded = true
	}
	if st.RollbackTo || st.Tx == TxChain {
		// The pin (SET LOCAL search_path) may have come after the
		// savepoint, and is gone then; a chain ends the transaction it
		// was set in: the next write to an unqualified name pins it
		// again (TestPinSurvivesRollbackTo).
		s.sim.spPinned = false
	}
	if st.Tx == TxChain {
		s.sim.snapOld = 0 // a new transaction, perhaps of another isolation
	}
	s.sim.track(st.Tx)
}

// rwLost: the transaction the next unit runs in was made writable under the
// lease, and the lease is not live now.
func (s *session) rwLost() bool {
	return (s.sim.blockRW || s.sim.groupRW) && !s.lease().live()
}

// bindFence draws the server connection's session number, which its
// tokens are bound to, once (again after a DISCARD). It must run between
// transactions: drawing one writes. A database without the fence (or with
// an older one) has no fenceline.bind_session(): the session stays unbound,
// and Postgres refuses its writes to fenced tables, if it has any.
func (s *session) bindFence() error {
	if s.fenceSession != 0 || len(s.p.grantKey()) == 0 {
		return nil
	}
	rows, err := s.internalQuery(rwSQL, bindSessionSQL)
	var qe *queryError
	switch {
	case errors.As(err, &qe):
		s.fenceSession = -1
		log := s.p.log.Debug
		if !s.p.noBindWarned.Swap(true) {
			log = s.p.log.Warn // once per proxy: a database without the fence is no fault
		}
		log("server connection not bound to a fence session: writes to fenced tables will fail (if the database has any, run \"fenceline pg install\" of this version)",
			"user", s.user, "database", s.database, "err", err)
		return nil
	case err != nil:
		return err
	}
	var n int64
	if len(rows) == 1 && len(rows[0]) == 1 {
		n, err = strconv.ParseInt(rows[0][0], 10, 64)
	}
	if n <= 0 || err != nil {
		s.fenceSession = -1
		s.p.log.Warn("fenceline.bind_session() gave no session number", "rows", rows, "err", err)
		return nil
	}
	s.fenceSession = n
	return nil
}

// token is the fence token for li bound to this connection ("" when none
// can be made: Postgres then refuses writes to fenced tables).
func (s *session) token(li leaseInfo) string {
	sess := max(s.fenceSession, 0)
	if s.tokStr != "" && s.tokLease == li.id && s.tokFence == li.fence && s.tokSession == sess {
		return s.tokStr
	}
	tok, err := s.p.token(li, sess)
	if err != nil {
		return ""
	}
	s.tokLease, s.tokFence, s.tokSession, s.tokStr = li.id, li.fence, sess, tok
	return tok
}

// beginUnit waits until the server has answered every earlier unit, so the
// proxy knows the transaction state the next one starts in, then restores
// the session's read-only default if something switched it off.
func (s *session) beginUnit() error {
	if err := s.waitIdle(); err != nil {
		return err
	}
	if s.pendingSync {
		return nil // an extended-protocol transaction is still open
	}
	s.undoFailed()    // everything before is answered
	s.rw.Store(false) // nothing in flight
	s.txEnded = false // the next unit starts where Postgres reported
	s.txStatus = byte(s.status.Load())
	if s.txStatus == 'I' && s.clientROSaved != 0 {
		// A block ended in a way the proxy did not see (an error in a
		// multi-statement Query): it rolled back.
		s.clientRO, s.clientROSaved = s.clientROSaved == 2, 0
	}
	if s.txStatus == 'I' {
		s.sim = txSim{}
		if s.ddlPending {
			s.ddlPending = false
			s.p.catalog.invalidate() // other sessions may have learned the catalogs before it committed
		}
	} else {
		s.sim.inBlock = true
		s.sim.decided = true
	}
	if s.tainted.Load() && s.txStatus != 'E' { // (in a failed block nothing runs; after it, again)
		if !s.unwrapped {
			s.p.log.Warn("default_transaction_read_only was switched off behind the proxy; switching it on again",
				"user", s.user, "client", s.client.RemoteAddr().String())
		}
		// Marked done only once it is: a cancel landing on it leaves the
		// default off, and the next unit tries again.
		if _, err := s.internalQuery("SET default_transaction_read_only = on"); err != nil {
			return err
		}
		s.tainted.Store(false)
		s.unwrapped = false
	}
	if s.txStatus != 'E' {
		if err := s.verifyNames(); err != nil {
			return err
		}
	}
	if s.resetMark && s.txStatus == 'I' {
		if _, err := s.internalQuery("RESET fenceline.verified"); err != nil {
			return err
		}
		s.resetMark = false
	}
	return nil
}

// resolveSQLPrepared maps EXECUTE of a prepared statement, and FETCH or
// MOVE of a portal, to the statement it runs, and tracks PREPARE and
// DEALLOCATE, DECLARE and CLOSE in the namespaces Parse, Bind and Close
// use (the server has one of statements and one of portals: EXECUTE runs
// a statement a Parse prepared, a Bind binds one PREPARE made, FETCH runs
// a portal a Bind made).
func (s *session) resolveSQLPrepared(st *Statement) *Statement {
	switch {
	case st.Prepare != "":
		in := st.Inner
		if in == nil {
			in = &Statement{Class: ClassWrite, Opaque: true, Tag: "PrepareStmt"}
		}
		s.setName(statementNames, st.Prepare, in)
	case st.Deallocate != "":
		s.setName(statementNames, st.Deallocate, nil)
		s.forgetOwnStatements(st.Deallocate)
	case st.Tag == "DeallocateStmt": // DEALLOCATE ALL
		s.clearNames(statementNames)
	case st.Tag == "DiscardStmt" && st.ClientRO == -1: // DISCARD ALL: statements and portals
		s.clearNames(statementNames)
		s.clearNames(portalNames)
	case st.Execute != "":
		if in, ok := s.stmts[st.Execute]; ok && in != nil {
			c := *in
			c.Start, c.End, c.Tag = st.Start, st.End, "ExecuteStmt("+in.Tag+")"
			// The EXECUTE's arguments are expressions Postgres evaluates
			// before the statement runs: their calls are the EXECUTE's too.
			c.Calls = mergeCalls(in.Calls, st.Calls)
			return &c
		}
	case st.Declare != "":
		s.setName(portalNames, st.Declare, st)
	case st.ClosePortal && st.Portal == "": // CLOSE ALL
		s.clearNames(portalNames)
	case st.ClosePortal:
		s.setName(portalNames, st.Portal, nil)
	case st.Portal != "":
		// FETCH and MOVE run the portal's statement, a cursor's or one a
		// Bind made (an INSERT ... RETURNING, say): judged as it. A portal
		// the proxy does not know (a function opened it) stays a read.
		if in, ok := s.portals[st.Portal]; ok && in != nil {
			c := *in
			c.Start, c.End, c.Tag, c.Declare = st.Start, st.End, "FetchStmt("+in.Tag+")", ""
			return &c
		}
	}
	return st
}

// groupWrites reports whether the implicit transaction starting at stmts[0]
// needs to be writable: a write, or a BEGIN (the block may write later),
// before the first COMMIT/ROLLBACK.
//
// When the client's own default is read-only (clientRO), only BEGIN READ
// WRITE asks for a writable transaction; a write elsewhere runs read-only
// and Postgres refuses it, as it would direct.
func groupWrites(stmts []*Statement, clientRO bool) bool {
	for _, st := range stmts {
		if st == nil {
			continue
		}
		switch st.Tx {
		case TxEnd, TxChain:
			return false
		case TxBeginRW:
			return true
		case TxBegin:
			return !clientRO
		case TxBeginRO:
			return false
		}
		if st.Class == ClassWrite && !clientRO {
			return true
		}
		if st.ClientRO != 0 {
			clientRO = st.ClientRO > 0
		}
	}
	return false
}

// clientRWSQL is what Postgres gets for a statement that switches the
// client's own read-only default off: Postgres's default, the proxy's,
// stays on, and the client gets the tag SET as direct.
const clientRWSQL = "SET default_transaction_read_only = on"

// replacement is the text the proxy sends Postgres instead of st's, or ""
// when st goes as the client wrote it.
func (s *session) replacement(st *Statement) string {
	switch {
	case st.ShowDefaultRO:
		return s.showDefaultRO()
	case st.ClientRW:
		return clientRWSQL
	}
	return ""
}

// showDefaultRO is the query that answers SHOW default_transaction_read_only
// with the client's own value.
func (s *session) showDefaultRO() string {
	v := "off"
	if s.clientRO {
		v = "on"
	}
	return "SELECT '" + v + "'::pg_catalog.text AS default_transaction_read_only"
}

// unwrapOutside prepares a statement that must run outside a transaction
// block (CREATE INDEX CONCURRENTLY, VACUUM, REINDEX SCHEMA, CREATE
// DATABASE...), sent alone between transactions, so that it may write:
// when the lease allows it, the session's read-only default is switched
// off for it (the proxy's own query, before it) and on again before the
// next unit (beginUnit, as after a change behind the proxy's back). It
// carries no token: Postgres runs it outside any transaction the proxy
// could set one in, and none of these fire the fence's DML trigger.
func (s *session) unwrapOutside(st *Statement, li leaseInfo) error {
	if st.Tx != TxOutside || st.Class != ClassWrite || s.clientRO || !li.live() ||
		s.authorize(st, li, s.searchPath) != nil {
		return nil
	}
	if _, err := s.internalQuery("SET default_transaction_read_only = off"); err != nil {
		return err
	}
	s.unwrapped = true
	s.tainted.Store(true) // on again before the next unit
	s.rw.Store(true)      // cancelled should the lease be lost while it runs
	return nil
}

// setLocalToken is the statement that hands tok (hex and punctuation only:
// nothing to quote) to the storage-side fence for this transaction.
func setLocalToken(tok string) string { return "SET LOCAL fenceline.token = '" + tok + "'" }

// mergeCalls returns the calls of a and of b, each once (a fresh slice
// when both have some).
func mergeCalls(a, b []Call) []Call {
	if len(b) == 0 {
		return a
	}
	if len(a) == 0 {
		return b
	}
	out := append(make([]Call, 0, len(a)+len(b)), a...)
	for _, c := range b {
		if !slices.ContainsFunc(a, func(x Call) bool { return x.Kind == c.Kind && x.Name == c.Name && x.Schema == c.Schema }) {
			out = append(out, c)
		}
	}
	return out
}
