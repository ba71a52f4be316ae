// The extended protocol: the messages of a segment (up to Sync or Flush)
// held, decided together, and forwarded with the fence's own messages.

package pgproxy

import (
	"fmt"
	"maps"
)

type segMsg struct {
	typ      byte
	replay   bool // sent again by the proxy (stallReplay): the answer is not the client's
	off, n   int
	st       *Statement // Execute: the statement it runs
	describe byte       // Describe: 'S' or 'P'
}

// flushSegment decides the pending extended-protocol messages (up to a Sync
// or Flush) and forwards them, with the fence's own messages added.
func (s *session) flushSegment() error {
	if len(s.seg) == 0 {
		return nil
	}
	seg, buf := s.seg, s.segBuf
	defer func() {
		s.seg, s.segExec, s.segBind = s.seg[:0], false, false
		if cap(s.segBuf) > 1<<20 {
			s.segBuf = nil
		} else {
			s.segBuf = s.segBuf[:0]
		}
	}()
	if s.skipping {
		return s.skipToSync(seg, buf)
	}
	fresh := !s.pendingSync
	if fresh {
		// A new transaction may start here: know its state first.
		if err := s.beginUnit(); err != nil {
			return err
		}
	}
	// After a stalled prefix, the statements and portals as they were, in
	// case Postgres refused the prefix and so skips this segment.
	var keptStmts, keptPortals map[string]*Statement
	stalled := s.stalled && !s.sim.inBlock
	if stalled {
		keptStmts, keptPortals = maps.Clone(s.stmts), maps.Clone(s.portals)
	}
	// Pass 1: what each Execute runs; track statements and portals as the
	// server will.
	var execs []*Statement
	var read *Statement // the last Execute's statement, as classified (before sequenceWrite)
	changed := !fresh   // statements ran since Postgres last reported its settings
	for i := range seg {
		m := &seg[i]
		body := buf[m.off+5 : m.off+m.n]
		switch m.typ {
		case 'P':
			name, q, paramTypes, err := twoCStrings(body)
			if err != nil {
				return s.fatal(err)
			}
			st := extStatement(s.classify(q, changed))
			if rep := s.replacement(st); rep != "" {
				// Prepare the proxy's answer instead (see replacement).
				var pw msgBuilder
				at := pw.begin('P')
				pw.str(name)
				pw.str(rep)
				pw.b = append(pw.b, paramTypes...) // the client's
				pw.end(at)
				m.off, m.n = len(buf), len(pw.b)
				buf = append(buf, pw.b...)
			}
			s.stmts[name] = st
		case 'B':
			portal, stmt, bindRest, err := twoCStrings(body)
			if err != nil {
				return s.fatal(err)
			}
			st := s.stmts[stmt]
			if st == nil {
				st = &Statement{Class: ClassWrite, Opaque: true, Tag: "UnknownStatement"}
			}
			if len(st.SignalParams) > 0 {
				// The pids it signals are this Bind's parameters.
				if cp := s.judgeSignals(st, bindRest); cp != nil {
					st = cp
				} else {
					cp := *st
					cp.SignalParams = nil
					st = &cp
				}
			}
			s.portals[portal] = st
		case 'E':
			portal, _, err := cstring(body)
			if err != nil {
				return s.fatal(err)
			}
			st := s.portals[portal]
			if st == nil {
				st = &Statement{Class: ClassWrite, Opaque: true, Tag: "UnknownPortal"}
			}
			st = s.resolveSQLPrepared(st)
			read = st
			st = s.sequenceWrite(st)
			m.st = st
			execs = append(execs, st)
			changed = true
		case 'C':
			if len(body) < 2 {
				return s.fatal(fmt.Errorf("%w: short Close", ErrProtocol))
			}
			name, _, _ := cstring(body[1:])
			if body[0] == 'S' {
				delete(s.stmts, name)
				s.forgetOwnStatements(name)
			} else {
				delete(s.portals, name)
			}
		case 'D':
			if len(body) < 2 {
				return s.fatal(fmt.Errorf("%w: short Describe", ErrProtocol))
			}
			m.describe = body[0]
		}
	}
	if stalled && decidesTxn(execs) {
		// The stalled prefix's implicit transaction started read-only; this
		// segment needs one the proxy decides (a write, or transaction
		// control): end that one first.
		replay := append([]byte(nil), s.stallReplay...)
		ok, err := s.endStalled()
		if err != nil {
			return err
		}
		if !ok {
			s.stmts, s.portals = keptStmts, keptPortals
			return s.skipToSync(seg, buf)
		}
		if err := s.beginUnit(); err != nil {
			return err
		}
		fresh = true
		seg, buf = withReplay(replay, seg, buf)
	}
	s.pendingSync = seg[len(seg)-1].typ != 'S'
	if !s.pendingSync {
		s.stalled, s.stallReplay = false, s.stallReplay[:0]
	}
	if err := s.needSearchPath(execs); err != nil {
		return err
	}
	check := false // see checkedWrite
	if len(execs) == 1 && !s.pendingSync && !s.stalled && fresh && s.mayCheckWrites(read, 1, s.txStatus == 'I') {
		for i := range seg {
			if seg[i].typ == 'E' {
				check = executeAll(buf[seg[i].off+5 : seg[i].off+seg[i].n])
			}
		}
	}
	writable := s.unitWritable(execs)
	if err := s.learnCatalog(execs, writable || check, fresh && !s.stalled && s.txStatus != 'E'); err != nil {
		return err
	}
	if check {
		var err error
		if execs[0], err = s.checkedWrite(execs[0]); err != nil {
			return err
		}
		for i := range seg {
			if seg[i].st != nil {
				seg[i].st = execs[0]
			}
		}
		writable = s.unitWritable(execs)
	}
	for i := range seg {
		if seg[i].st != nil {
			seg[i].st = s.judgeCalls(seg[i].st, writable)
		}
	}
	for i := range execs {
		execs[i] = s.judgeCalls(execs[i], writable)
	}
	var li leaseInfo
	needLease := s.sim.blockRW || s.sim.groupRW // may have to end a writable transaction
	for _, st := range execs {
		if st.Class == ClassWrite || st.Tx == TxBegin || st.Tx == TxChain {
			needLease = true // reads alone never need the lease
			break
		}
	}
	if needLease {
		li = s.lease()
	}
	if fresh && s.txStatus == 'I' && len(execs) == 1 && seg[len(seg)-1].typ == 'S' {
		if err := s.unwrapOutside(execs[0], li); err != nil {
			return err
		}
	}
	if li.live() && fresh && s.txStatus == 'I' {
		if err := s.bindFence(); err != nil {
			return err
		}
	}
	var (
		w       msgBuilder
		items   []*expect
		refused bool
		rwSeen  bool // an Execute runs in a transaction made writable
	)
	w.b = s.segOut[:0]
	// setToken sets the transaction's fence token with our prepared
	// set_config, preparing it first on this connection.
	setToken := func(tok string) {
		if s.tokStmt.Load() == stmtNone {
			w.close('S', tokStmtName)
			w.parse(tokStmtName, tokSQL)
			items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true, stmtState: &s.tokStmt})
			s.tokStmt.Store(stmtPending)
		}
		w.bind("", tokStmtName, tok)
		w.execute("")
		items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expExecute, swallow: true})
	}
	injectRO := func() {
		if s.roStmt.Load() == stmtNone {
			w.close('S', roStmtName)
			w.parse(roStmtName, roSQL)
			items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true, stmtState: &s.roStmt})
			s.roStmt.Store(stmtPending)
		}
		w.bind("", roStmtName)
		w.execute("")
		items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expExecute, swallow: true})
	}
	injectRW := func() {
		tok := s.token(li) // "" without one: Postgres refuses fenced writes
		// "SET transaction_read_only = off" must come before anything that
		// takes a snapshot, including the Parse of a SELECT.
		if s.rwStmt.Load() == stmtNone {
			w.close('S', rwStmtName)
			w.parse(rwStmtName, rwSQL)
			items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true, stmtState: &s.rwStmt})
			s.rwStmt.Store(stmtPending)
		}
		w.bind("", rwStmtName)
		w.execute("")
		items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expExecute, swallow: true})
		setToken(tok)
	}
	// execsFrom returns the statements Executes run from message i on.
	execsFrom := func(i int) []*Statement {
		var out []*Statement
		for j := i; j < len(seg); j++ {
			if seg[j].st != nil {
				out = append(out, seg[j].st)
			}
		}
		return out
	}
	// pin sets search_path for the transaction to the path the proxy
	// checks unqualified names with (see handleQuery), before the
	// messages whose statements Postgres resolves with it.
	pin := func(from int) {
		if s.sim.spPinned || s.searchPath == nil {
			return
		}
		need := false
		for _, st := range execsFrom(from) {
			need = need || unqualified(st)
		}
		if !need {
			return
		}
		if s.spStmt.Load() == stmtNone {
			w.close('S', spStmtName)
			w.parse(spStmtName, spSQL)
			items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true, stmtState: &s.spStmt})
			s.spStmt.Store(stmtPending)
		}
		w.bind(spStmtName, spStmtName, s.pinnedPath())
		w.execute(spStmtName)
		w.close('P', spStmtName)
		items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expExecute, swallow: true}, &expect{kind: expSingle, swallow: true})
		s.sim.spPinned = true
	}
	if s.sim.inBlock && len(seg) > 0 && seg[0].typ != 'S' && seg[0].typ != 'H' {
		pin(0)
	}
	for i := range seg {
		m := &seg[i]
		raw := buf[m.off : m.off+m.n]
		if refused {
			// The server skips everything up to Sync after the error.
			w.b = append(w.b, raw...)
			if m.typ == 'S' {
				items = append(items, &expect{kind: expSync})
				s.sim = txSim{}
			}
			continue
		}
		if m.typ != 'S' && m.typ != 'H' && !s.sim.inBlock && !s.sim.decided {
			s.sim.decided = true
			rest := execsFrom(i)
			if groupWrites(rest, s.clientRO) && li.live() && !(len(rest) == 1 && rest[0].Tx == TxOutside) {
				injectRW()
				s.sim.groupRW = true
			} else if s.txEnded {
				injectRO() // a new transaction after COMMIT/ROLLBACK in this unit
			}
			pin(i)
		}
		switch m.typ {
		case 'P', 'B', 'C':
			items = append(items, &expect{kind: expSingle, swallow: m.replay})
		case 'D':
			if m.describe == 'S' {
				items = append(items, &expect{kind: expDescribeS})
			} else {
				items = append(items, &expect{kind: expDescribeP})
			}
		case 'S':
			items = append(items, &expect{kind: expSync})
			// After Sync an implicit transaction is over; a block goes on.
			if !s.sim.inBlock {
				s.sim.decided, s.sim.groupRW, s.sim.spPinned = false, false, false
			}
		case 'E':
			st := m.st
			if st.Session {
				s.sessionChanged(st)
			}
			rwSeen = rwSeen || s.sim.blockRW || s.sim.groupRW
			r := s.authorizeInTxn(st, li)
			if r == nil {
				r = s.authorizeWrite(st, li, s.searchPath, "Sync before the write, or start the transaction with BEGIN")
			}
			if r != nil {
				sql := s.refuse(r, st, li, st.Tag)
				w.close('S', refuseName)
				w.parse(refuseName, sql)
				w.bind("", refuseName)
				w.execute("")
				items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true},
					&expect{kind: expSingle, swallow: true}, &expect{kind: expExecute})
				refused = true
				continue
			}
			s.passedDDL(st)
			items = append(items, &expect{kind: expExecute})
			s.trackTx(st)
			if st.WriteCheck && s.sim.groupRW {
				// The check, in the same transaction, before the Sync
				// that ends it (in a portal of its own: the client's
				// unnamed one stays).
				w.b = append(w.b, raw...)
				w.close('S', checkName)
				w.parse(checkName, s.writeCheckSQL(st, li))
				w.bind(checkName, checkName)
				w.execute(checkName)
				w.close('P', checkName)
				cst := st
				items = append(items, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true}, &expect{kind: expSingle, swallow: true},
					&expect{kind: expExecute, swallow: true, onError: func(f map[byte]string) { s.auditCheck(f, cst, li, cst.Tag) }},
					&expect{kind: expSingle, swallow: true})
				continue
			}
			if st.Tx == TxChain {
				if s.sim.blockRW && li.live() {
					w.b = append(w.b, raw...)
					setToken(s.token(li))
					continue
				}
			}
		}
		w.b = append(w.b, raw...)
	}
	if rwSeen && li.live() {
		s.rw.Store(true)
	}
	if s.pendingSync && (s.stalled || s.forwarding) {
		s.keepForReplay(seg, buf)
	}
	s.push(items...)
	_, err := s.sw.Write(w.b)
	if cap(w.b) <= 1<<20 {
		s.segOut = w.b[:0]
	}
	return err
}

// extStatement is what a Parse'd statement runs: one statement, or an opaque
// write when the text is not exactly one statement the parser accepts.
func extStatement(cls *Classification) *Statement {
	switch {
	case cls.ParseError != "":
		return &cls.Stmts[0]
	case len(cls.Stmts) == 0:
		return &Statement{Class: ClassControl, Tag: "Empty"}
	case len(cls.Stmts) == 1:
		return &cls.Stmts[0]
	}
	return &Statement{Class: ClassWrite, Opaque: true, Tag: "MultipleStatements"}
}
