// Named server objects as the server holds them: prepared statements
// (protocol Parse and SQL PREPARE share one namespace on the server, and
// so here) and portals. The client loop changes its copy as it forwards
// each message, so a segment's later messages see its earlier ones; a
// change the server did not make — its message failed (PREPARE or Parse
// of a name that exists, a Bind to a portal that exists) or came after an
// error and was skipped — is undone before the next unit is decided, so a
// name is always judged by what the server will run under it.

package pgproxy

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
