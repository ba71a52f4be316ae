// Named server objects as the server holds them: prepared statements
// (protocol Parse and SQL PREPARE share one namespace on the server, and
// so here) and portals. The client loop changes its copy as it forwards
// each message, so a segment's later messages see its earlier ones; a
// change the server did not make — its message failed (PREPARE or Parse
// of a name that exists, a Bind to a portal that exists) or came after an
// error and was skipped — is undone before the next unit is decided, so a
// name is always judged by what the server will run under it.

package pgproxy

import "strings"

// nameSpace says which of the session's maps a change is in.
type nameSpace uint8

const (
	statementNames nameSpace = iota // s.stmts
	portalNames                     // s.portals
)

// nameChange is one change to a name's statement: prev is what the name
// held before (nil: nothing).
type nameChange struct {
	space nameSpace
	name  string
	prev  *Statement
	// seen, had: the name's prepare_time as the proxy last saw it, which
	// an undo restores (see verifyNames).
	seen string
	had  bool
}

func (s *session) names(space nameSpace) map[string]*Statement {
	if space == portalNames {
		return s.portals
	}
	return s.stmts
}

// setName makes name (in space) run st, nil removing it, and records the
// change in s.changed for the message being tracked.
func (s *session) setName(space nameSpace, name string, st *Statement) {
	m := s.names(space)
	c := nameChange{space: space, name: name, prev: m[name]}
	if space == statementNames {
		c.seen, c.had = s.prepSeen[name]
		delete(s.prepSeen, name) // the client's own: its time is learnt when the next unit begins
		s.namesUnseen = s.namesUnseen || st != nil && tracksTime(name)
	}
	s.changed = append(s.changed, c)
	if st == nil {
		delete(m, name)
	} else {
		m[name] = st
	}
}

// clearNames removes every name in space (DEALLOCATE ALL, DISCARD ALL,
// CLOSE ALL), recording each change.
func (s *session) clearNames(space nameSpace) {
	for name := range s.names(space) {
		s.setName(space, name, nil)
	}
}

// takeChanged returns the changes recorded since the last call, for the
// expectation of the message that made them.
func (s *session) takeChanged() []nameChange {
	if len(s.changed) == 0 {
		return nil
	}
	c := append([]nameChange(nil), s.changed...)
	s.changed = s.changed[:0]
	return c
}

// noteFailed keeps the changes of a request the server refused or skipped
// (relay, under qmu) for undoFailed.
func (s *session) noteFailed(e *expect) {
	s.failed = append(s.failed, e.changes...)
}

// undoFailed undoes, newest first, the changes of every request the
// server refused or skipped. The client loop calls it when a unit begins
// with everything before it answered: the failed requests of a unit are a
// suffix of it (the server skips to Sync after an error), so undoing them
// newest first leaves each name as the server holds it.
func (s *session) undoFailed() {
	s.qmu.Lock()
	failed := s.failed
	s.failed = nil
	s.qmu.Unlock()
	s.undo(failed)
}

// undo undoes changes, newest first.
func (s *session) undo(changes []nameChange) {
	for i := len(changes) - 1; i >= 0; i-- {
		c := changes[i]
		// A PREPARE or Parse the server refused set nothing: its name is
		// not the client's fresh one (code may have taken it first, which
		// is why it failed).
		delete(s.freshNames, c.name)
		if c.prev == nil {
			delete(s.names(c.space), c.name)
		} else {
			s.names(c.space)[c.name] = c.prev
		}
		switch {
		case c.had:
			s.prepSeen[c.name] = c.seen
		case c.space == statementNames && c.prev != nil && tracksTime(c.name):
			s.namesUnseen = true
		}
	}
}

// Code the proxy does not parse — a function a statement calls, a DO
// block, a procedure — can PREPARE and DEALLOCATE too (EXECUTE 'DEALLOCATE
// n; PREPARE n AS ...' in plpgsql), behind the proxy's back, and prepared
// statements outlive the transaction that made them (read-only or rolled
// back). So the proxy keeps the server's prepare_time of each named
// statement it tracks (prepSeen), learnt when a unit begins after the
// client named a new one (once per name), and a unit that may run such
// code makes it doubt its names (namesDoubt): when the next unit begins it
// compares them with the server's, and a name whose prepare_time changed
// (or that it had no time for) is one it no longer knows, judged as an
// opaque write if bound; one gone is dropped (TestNamesChangedByCode). The
// proxy's own statements, which it runs unjudged, are prepared again (Close
// first) before each use for as long as it doubts, from the segment the
// code ran in on (TestOwnStatementsPreparedAgainInTheSameUnit).
// Such code runs only in read-only transactions or in a checked read's
// own (judgeCalls refuses it in a writable one, and a unit is writable
// when any of its transactions is). Known limit: a client's name the code
// changed is not checked again before a later segment of the same unit
// (after a Flush) binds it; writes in such a unit were refused when tried
// (stop 60), but by the catalog lookup's caution, not by this check. The
// unnamed statement is out of it: PREPARE cannot make it, and Postgres
// does not list it.

// noteCode makes the proxy doubt its names when any of stmts (a Query's,
// in order; changes[i] what statement i changed in the names) may run code
// it does not parse (runsCode). A name the client set after the last such
// statement (or by it: a PREPARE's own name is stored after its analysis
// ran, and code that took the name meanwhile makes the PREPARE fail) is
// fresh: its prepare_time is learnt, not compared (verifyNames).
func (s *session) noteCode(stmts []*Statement, changes [][]nameChange) {
	last := -1
	for i, st := range stmts {
		if s.runsCode(st) {
			last = i
		}
	}
	if last < 0 {
		return
	}
	s.doubtNames()
	for i := last; i < len(changes); i++ {
		s.markFresh(changes[i])
	}
}

// noteCodeInSegment is noteCode for an extended-protocol segment: Postgres
// analyzes a Parse's statement (a typed literal's input runs, and with it
// a domain's check) and plans a Bind's (planning folds immutable
// functions), so those run code too (analysisCalls), not only an Execute.
func (s *session) noteCodeInSegment(seg []segMsg) {
	last := -1
	for i := range seg {
		m := &seg[i]
		switch m.typ {
		case 'P', 'B':
			if calls, _ := analysisCalls(m, false); s.anyUnseen(calls) {
				last = i
			}
		case 'E':
			if s.runsCode(m.st) {
				last = i
			}
		}
	}
	if last < 0 {
		return
	}
	s.doubtNames()
	for i := last; i < len(seg); i++ {
		if seg[i].typ == 'P' {
			s.markFresh(seg[i].changes)
		}
	}
}

// runsCode: Postgres may run code the proxy does not parse for st, run: a
// call it has not seen to be builtin, or an opaque statement.
func (s *session) runsCode(st *Statement) bool {
	return st != nil && (st.Opaque || s.analysisRunsCode(st))
}

// analysisRunsCode: running st may run code the proxy does not parse (a
// call, a type, it has not seen to be builtin). A PREPARE's calls are its
// statement's and its parameters' types.
func (s *session) analysisRunsCode(st *Statement) bool {
	return st != nil && s.anyUnseen(st.Calls)
}

// doubtNames starts doubting the names: none the client set so far is
// fresh any more.
func (s *session) doubtNames() {
	s.namesDoubt = true
	clear(s.freshNames)
}

// markFresh marks the statement names changes set (to a statement) fresh.
func (s *session) markFresh(changes []nameChange) {
	for _, c := range changes {
		if c.space == statementNames && s.stmts[c.name] != nil && tracksTime(c.name) {
			if s.freshNames == nil {
				s.freshNames = map[string]bool{}
			}
			s.freshNames[c.name] = true
		}
	}
}

// preparedSQL lists the server's prepared statements with their
// prepare_time, as text (the proxy only compares them).
const preparedSQL = "SELECT name, prepare_time::pg_catalog.text FROM pg_catalog.pg_prepared_statements"

// verifyNames learns the server's prepared statements when a tracked name
// has no prepare_time yet, or when the last units may have run code the
// proxy does not parse; then a tracked name that is gone is dropped, and
// one whose prepare_time changed (or that had none) is judged as an opaque
// write from now on. Called when a unit begins, everything before it
// answered, outside a failed block.
func (s *session) verifyNames() error {
	if s.namesDoubt {
		// The proxy's own statements, which it runs unjudged, may have
		// been prepared again too: each is prepared again, its Close
		// first, before its next use.
		s.forgetOwnStatements("")
	}
	if !s.namesDoubt && !s.namesUnseen {
		return nil // every unit: nothing to learn, nothing to compare
	}
	named, unseen := s.trackedNames()
	s.namesUnseen = unseen
	if named == 0 {
		s.namesDoubt = false // nothing to doubt: a name code makes is one the proxy does not know
		return nil
	}
	if !s.namesDoubt && !unseen {
		return nil
	}
	rows, err := s.internalQuery(preparedSQL)
	if err != nil {
		return err
	}
	now := make(map[string]string, len(rows))
	for _, r := range rows {
		if len(r) == 2 {
			now[r[0]] = r[1]
		}
	}
	if s.namesDoubt {
		for name := range s.stmts {
			if !tracksTime(name) {
				continue
			}
			at, there := now[name]
			switch {
			case !there:
				delete(s.stmts, name)
			case s.prepSeen[name] != at && !s.freshNames[name]:
				s.stmts[name] = &Statement{Class: ClassWrite, Opaque: true, Tag: "PreparedByCode",
					OpaqueWhy: "prepared statement " + name + " was prepared again by code the fence does not parse (a function, DO block or procedure)"}
				s.p.log.Warn("prepared statement changed behind the fence; it is judged as an opaque write", "user", s.user, "name", name)
			}
		}
	}
	s.prepSeen, s.namesDoubt, s.namesUnseen = now, false, false
	clear(s.freshNames)
	return nil
}

// trackedNames counts the tracked statements whose prepare_time the proxy
// keeps, and says whether one has none yet.
func (s *session) trackedNames() (n int, unseen bool) {
	for name := range s.stmts {
		if tracksTime(name) {
			n++
			if _, ok := s.prepSeen[name]; !ok {
				unseen = true
			}
		}
	}
	return n, unseen
}

// tracksTime: name is a client's named statement (not the unnamed one,
// not the proxy's own), whose prepare_time the proxy keeps.
func tracksTime(name string) bool {
	return name != "" && !strings.HasPrefix(name, "fenceline_")
}
