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
	s.changed = append(s.changed, nameChange{space: space, name: name, prev: m[name]})
	if space == statementNames {
		delete(s.prepSeen, name) // the client's own: its time is learnt again before code runs
	}
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

// Code the proxy does not parse — a function a statement calls, a DO
// block, a procedure — can PREPARE and DEALLOCATE too (EXECUTE 'DEALLOCATE
// n; PREPARE n AS ...' in plpgsql), behind the proxy's back, and prepared
// statements outlive the transaction that made them (a rollback keeps
// them). So the proxy keeps, per prepared statement it tracks, the server's
// prepare_time as last seen (prepSeen); before a unit that may run such
// code it learns the times of the names it has none for, and after it it
// doubts its names (namesDoubt) until the next unit begins and compares
// them again: a name whose prepare_time changed, or that is gone, is one
// the proxy no longer knows (an opaque write if bound; TestNamesChangedByCode).

// mayRunCode reports whether any of stmts may run code the proxy does not
// parse: a call it has not seen to be builtin, or an opaque statement.
func (s *session) mayRunCode(stmts []*Statement) bool {
	for _, st := range stmts {
		if st != nil && (st.Opaque || len(st.Calls) > 0 && !s.seenBuiltin(st)) {
			return true
		}
	}
	return false
}

// preparedSQL lists the server's prepared statements with their
// prepare_time, as text (the proxy only compares them).
const preparedSQL = "SELECT name, prepare_time::pg_catalog.text FROM pg_catalog.pg_prepared_statements"

// beforeCode is called before a unit that may run code the proxy does not
// parse goes out (lookup: the proxy may send a query of its own now): it
// learns the prepare_time of every tracked name it has none for, and
// doubts its names once the unit has run.
func (s *session) beforeCode(stmts []*Statement, lookup bool) error {
	if !s.mayRunCode(stmts) {
		return nil
	}
	s.namesDoubt = true
	if !lookup {
		return nil
	}
	for name := range s.stmts {
		if _, ok := s.prepSeen[name]; !ok && !ownStatement(name) {
			return s.learnPrepared(func(string, string) {})
		}
	}
	return nil
}

// verifyNames, when the last unit may have run code the proxy does not
// parse, compares the server's prepared statements with what it saw
// before: a tracked name that is gone is dropped, one whose prepare_time
// changed (or that it never saw) is judged as an opaque write from now on.
// Called when a unit begins, everything before it answered, outside a
// failed block.
func (s *session) verifyNames() error {
	if !s.namesDoubt || len(s.stmts) == 0 {
		s.namesDoubt = false
		return nil
	}
	before := s.prepSeen
	s.prepSeen = nil
	now := map[string]string{}
	if err := s.learnPrepared(func(name, at string) { now[name] = at }); err != nil {
		s.prepSeen = before
		return err
	}
	s.namesDoubt = false
	for name := range s.stmts {
		if ownStatement(name) {
			continue
		}
		at, there := now[name]
		switch {
		case !there:
			delete(s.stmts, name)
		case before[name] != at:
			s.stmts[name] = &Statement{Class: ClassWrite, Opaque: true, Tag: "PreparedByCode",
				OpaqueWhy: "prepared statement " + name + " was prepared again by code the fence does not parse (a function, DO block or procedure)"}
			s.p.log.Warn("prepared statement changed behind the fence; it is judged as an opaque write", "user", s.user, "name", name)
		}
	}
	return nil
}

// learnPrepared reads the server's prepared statements into prepSeen and
// hands each to seen.
func (s *session) learnPrepared(seen func(name, at string)) error {
	rows, err := s.internalQuery(preparedSQL)
	if err != nil {
		return err
	}
	s.prepSeen = make(map[string]string, len(rows))
	for _, r := range rows {
		if len(r) == 2 {
			s.prepSeen[r[0]] = r[1]
			seen(r[0], r[1])
		}
	}
	return nil
}

// ownStatement: name is one of the proxy's own prepared statements.
func ownStatement(name string) bool {
	return strings.HasPrefix(name, "fenceline_")
}
