// A cancel that lands on a query of the proxy's own. The client's unit
// waits while the proxy asks its backend something (a catalog lookup, the
// search path, a statistics flush, binding the fence session); a
// CancelRequest the client sends then (or its statement_timeout) cancels
// that query instead of the client's statement. The cancel was meant for
// the unit: it is answered as Postgres answers a statement cancelled
// before it ran, with the server's own error and ReadyForQuery, and
// nothing of it runs. (Swallowed, as it was, the unit went on to run in
// full: a cancelled pg_sleep(60) slept its 60 s.)

package pgproxy

import (
	"errors"
	"fmt"
)

// sqlstateCanceled is query_canceled: a cancel request or a timeout.
const sqlstateCanceled = "57014"

// canceledError: a query of the proxy's own was cancelled. raw is the
// server's ErrorResponse without the fields that place it in the proxy's
// text.
type canceledError struct {
	raw []byte
	msg string
}

func (e *canceledError) Error() string {
	return fmt.Sprintf("fenceline's own query was cancelled: %s (SQLSTATE %s)", e.msg, sqlstateCanceled)
}

// cancelled reports whether err is a cancel that landed on a query of the
// proxy's own.
func cancelled(err error) (*canceledError, bool) {
	if err == nil {
		return nil, false
	}
	var ce *canceledError
	return ce, errors.As(err, &ce)
}

// cancelQuery answers a Query whose decision a cancel interrupted: the
// server's error, then the server's ReadyForQuery (a Sync of the proxy's
// own: the server says what state its transaction is in). changes, what
// its statements changed in the names the proxy tracks, are undone.
func (s *session) cancelQuery(ce *canceledError, changes [][]nameChange) error {
	for i := len(changes) - 1; i >= 0; i-- {
		s.undo(changes[i])
	}
	if err := s.writeClientRaw(ce.raw); err != nil {
		return err
	}
	var w msgBuilder
	w.sync()
	s.push(&expect{kind: expSync})
	_, err := s.sw.Write(w.b)
	return err
}

// cancelOr answers the Query with cancelQuery when err is a cancel, and
// returns any other error as it is.
func (s *session) cancelOr(err error, changes [][]nameChange) error {
	if ce, ok := cancelled(err); ok {
		return s.cancelQuery(ce, changes)
	}
	return err
}

// cancelSegment answers an extended-protocol segment whose decision a
// cancel interrupted: the server's error, then, as after any error, the
// client's messages up to its Sync are dropped and the Sync alone goes to
// the server (skipToSync). What the segment's messages changed in the
// names the proxy tracks is undone.
func (s *session) cancelSegment(ce *canceledError, seg []segMsg, buf []byte) error {
	for i := len(seg) - 1; i >= 0; i-- {
		s.undo(seg[i].changes)
	}
	if err := s.writeClientRaw(ce.raw); err != nil {
		return err
	}
	s.pendingSync = seg[len(seg)-1].typ != 'S'
	return s.skipToSync(seg, buf)
}
