package pgproxy

import (
	"bytes"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync/atomic"
)

// expKind says which server messages answer one forwarded request.
type expKind uint8

const (
	expSingle    expKind = iota // ParseComplete, BindComplete or CloseComplete
	expDescribeS                // ParameterDescription, then RowDescription or NoData
	expDescribeP                // RowDescription or NoData
	expExecute                  // rows and copy data until CommandComplete, EmptyQuery or PortalSuspended
	expSync                     // ReadyForQuery
	expQuery                    // a Query passed through: everything up to ReadyForQuery
	expStmt                     // one statement of a rewritten Query: up to CommandComplete
	expQueryEnd                 // the end of a rewritten Query: ReadyForQuery
	expFunc                     // FunctionCall: FunctionCallResponse, then ReadyForQuery
)

// expect is one pending answer. The client loop pushes them in the order it
// writes requests; the relay pops them as answers complete.
type expect struct {
	kind    expKind
	swallow bool // the proxy's own request: the client never sees the answer
	// own: the request is of the proxy's own text (its statements, a
	// write's check, a refusal): an error of it reaches the client without
	// what places it in that text (ownQueryFields).
	own      bool
	internal *internalResult // a query of the proxy's own between units
	// stmtState, for the Parse of one of the proxy's prepared statements,
	// becomes ready on ParseComplete and none when the Parse is skipped.
	stmtState *atomic.Int32
	inserts   []insertion // expQueryEnd: to map error positions back
	// failed, on a ReadyForQuery item, is set when an error came before it.
	failed *atomic.Bool
	// onError, when set, is called when the request fails (a guard of the
	// proxy's raised: it audits the refusal), with the error's fields.
	onError func(fields map[byte]string)
	// changes: what the client's request changed in the named statements
	// and portals the proxy tracks, undone if the server refuses or skips
	// it (see names.go).
	changes []nameChange
}

func (e *expect) endsWithZ() bool {
	return e.kind == expSync || e.kind == expQuery || e.kind == expQueryEnd || e.kind == expFunc
}

func (s *session) push(items ...*expect) {
	s.qmu.Lock()
	for _, e := range items {
		if e.endsWithZ() {
			s.outstanding++
		}
	}
	empty := len(s.queue) == 0
	if empty {
		s.queue = s.qbuf[:0]
	}
	s.queue = append(s.queue, items...)
	if empty {
		s.qbuf = s.queue[:0]
	}
	s.qmu.Unlock()
}

// maxKeptQueue bounds the array an empty queue keeps for the next
// requests: a pipeline of thousands does not pin its array for good.
const maxKeptQueue = 256

func (s *session) head() *expect {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	if len(s.queue) == 0 {
		return nil
	}
	return s.queue[0]
}

// pop removes the head; ok says whether its request succeeded.
func (s *session) pop(ok bool) {
	s.qmu.Lock()
	e := s.queue[0]
	s.queue[0] = nil
	s.queue = s.queue[1:]
	if len(s.queue) == 0 {
		s.queue = nil
		if cap(s.qbuf) > maxKeptQueue {
			s.qbuf = nil
		}
	}
	if e.endsWithZ() {
		s.outstanding--
	}
	if !ok && len(e.changes) > 0 {
		s.noteFailed(e)
	}
	s.qmu.Unlock()
	if e.stmtState != nil {
		if ok {
			e.stmtState.Store(stmtReady)
		} else {
			e.stmtState.Store(stmtNone)
		}
	}
	if e.endsWithZ() {
		if e.internal != nil {
			close(e.internal.done)
		}
		s.wakeClient()
	}
}

// skipToZ drops the answers the server will not send after an error: every
// pending item up to the next one that ends with ReadyForQuery.
func (s *session) skipToZ() {
	for {
		h := s.head()
		if h == nil || h.endsWithZ() {
			return
		}
		s.pop(false)
	}
}

// dropQueuedSyncs: the server ignores Syncs that arrive during COPY FROM
// STDIN (libpq sends one right after Execute); they will get no answer.
func (s *session) dropQueuedSyncs() {
	s.qmu.Lock()
	kept := s.queue[:0]
	for i, e := range s.queue {
		if i > 0 && e.kind == expSync {
			s.outstanding--
			continue
		}
		kept = append(kept, e)
	}
	s.queue = kept
	s.qmu.Unlock()
}

// relay copies server messages to the client, dropping the answers to the
// proxy's own requests, until the server connection ends.
func (s *session) relay() error {
	defer func() {
		// Wake a client loop waiting for answers that will never come.
		s.doneOnce.Do(func() { close(s.done) })
		s.closeClient()
	}()
	for {
		s.yieldIfLong(s.sr)
		t, raw, err := s.sr.next()
		if err != nil {
			s.lockClient()
			s.cw.Flush()
			s.unlockClient()
			if errors.Is(err, ErrProtocol) {
				s.writeClientRaw(errorResponse('E', "FATAL", "08P01", "fenceline: the server sent a malformed message", err.Error(), ""))
			}
			return err
		}
		if err := s.relayOne(t, raw); err != nil {
			return err
		}
		if s.sr.buffered() == 0 {
			s.lockClient()
			err := s.cw.Flush()
			s.unlockClient()
			if err != nil {
				return err
			}
		}
	}
}

func (s *session) toClient(raw []byte) error {
	s.lockClient()
	_, err := s.cw.Write(raw)
	s.unlockClient()
	return err
}

// relayOne relays one server message (type t) to the client, or keeps it
// when it answers a request of the proxy's own, and pops the expectation
// it completes.
func (s *session) relayOne(t byte, raw []byte) error {
	h := s.head()
	switch t {
	case 'N': // NoticeResponse
		return s.relayNotice(h, raw)
	case 'A': // NotificationResponse
		return s.toClient(raw)
	case 'S': // ParameterStatus
		return s.relayParameterStatus(raw)
	case 'E': // ErrorResponse
		return s.relayError(h, raw)
	case 'Z': // ReadyForQuery
		return s.relayReady(raw)
	}
	if h == nil {
		// Nothing expected: pass it on rather than lose it.
		return s.toClient(raw)
	}
	return s.relayAnswer(h, t, raw)
}

// relayNotice relays a NoticeResponse (h: the expectation at the head).
func (s *session) relayNotice(h *expect, raw []byte) error {
	// Only the answers to the proxy's own queries between units are
	// the proxy's: a notice while a statement the proxy put into the
	// client's message is at the head comes from parsing the client's
	// text (Postgres parses a whole Query first), so it goes on, its
	// position mapped back as an error's is. A notice of class 57
	// (operator intervention: the server shutting down or crashing,
	// its warning before it closes the connection) is about the
	// client's session, whatever query it came during.
	if h != nil && h.internal != nil {
		if !strings.HasPrefix(errorFields(raw)['C'], "57") {
			return nil
		}
		return s.toClient(dropFields(raw, ownQueryFields))
	}
	if q := s.queryEnd(); q != nil && len(q.inserts) > 0 {
		raw = mapErrorPosition(raw, q.inserts)
	}
	return s.toClient(raw)
}

// relayParameterStatus relays a ParameterStatus, but for
// default_transaction_read_only, which the proxy owns, and notes the
// parser settings (see classify).
func (s *session) relayParameterStatus(raw []byte) error {
	name, rest, err := cstring(raw[5:])
	if err != nil {
		return fmt.Errorf("%w: ParameterStatus", ErrProtocol)
	}
	if name == "default_transaction_read_only" {
		if v, _, _ := cstring(rest); v != "on" {
			s.tainted.Store(true)
		}
		return nil // the client was told "off" at startup; the proxy owns it
	}
	s.parserSetting(name, rest)
	return s.toClient(raw)
}

// relayError relays an ErrorResponse (h: the expectation at the head): to
// a query of the proxy's own it is that query's error, unless it ends the
// session; the server skips what follows up to its ReadyForQuery.
func (s *session) relayError(h *expect, raw []byte) error {
	if h == nil {
		return s.toClient(raw) // FATAL from the server (shutdown, terminate)
	}
	if s.copyIn.Load() {
		s.copyIn.Store(false)
	}
	f := errorFields(raw)
	if h.onError != nil {
		h.onError(f)
	}
	ended := endsSession(f)
	switch {
	case h.internal != nil && !ended && f['C'] == sqlstateCanceled:
		// The client's cancel (or its statement_timeout) landed on the
		// proxy's query: it is the client's (see cancel.go).
		h.internal.err = &canceledError{raw: dropFields(raw, ownQueryFields), msg: f['M']}
	case h.internal != nil && !ended:
		h.internal.err = fmt.Errorf("%s (SQLSTATE %s)", f['M'], f['C'])
	case ended && (h.internal != nil || h.swallow):
		// The server ends the client's session (pg_terminate_backend,
		// a shutdown, an idle-session timeout) during a query or a
		// statement of the proxy's own: the error is the client's, as
		// it would be direct, every field as the server sent it but
		// those that place it in the proxy's text (position, context,
		// internal query), which the client never sent. The server
		// then closes the connection, and the relay ends the client's;
		// the query of the proxy's own fails with sessionEndedError,
		// which ends the client loop.
		if h.internal != nil {
			h.internal.err = &sessionEndedError{code: f['C'], msg: f['M']}
		}
		if err := s.toClient(dropFields(raw, ownQueryFields)); err != nil {
			return err
		}
	default:
		if q := s.queryEnd(); q != nil && len(q.inserts) > 0 {
			raw = mapErrorPosition(raw, q.inserts)
		}
		if h.own {
			// A message of the proxy's own text (the token's Bind or
			// Execute, a write's check) failed, a cancel or the client's
			// statement_timeout on it, say: its position, query and
			// context are of text the client never sent, and the context
			// can show its parameters (log_parameter_max_length_on_error),
			// the token among them (found by a review). (Not every
			// swallowed answer is: the Parse of the client's text that
			// fetches Postgres's syntax error, a statement put into the
			// client's Query when Postgres fails to parse the whole text.)
			raw = dropFields(raw, ownQueryFields)
		}
		raw = dropRefusalContext(raw)
		if err := s.toClient(raw); err != nil {
			return err
		}
	}
	if !h.endsWithZ() {
		s.pop(false)
		s.skipToZ()
	}
	s.errSinceZ = true
	return nil
}

// relayReady takes a ReadyForQuery's transaction status and pops what it
// ends (and what the server skipped); it reaches the client unless it
// answers the proxy's own.
func (s *session) relayReady(raw []byte) error {
	if len(raw) >= 6 {
		s.status.Store(uint32(raw[5]))
	}
	for h := s.head(); h != nil; h = s.head() {
		if !h.endsWithZ() {
			s.pop(false) // skipped by the server
			continue
		}
		hide := h.internal != nil || h.swallow
		if h.failed != nil && s.errSinceZ {
			h.failed.Store(true)
		}
		s.errSinceZ = false
		s.pop(true)
		if hide {
			return nil
		}
		break
	}
	return s.toClient(raw)
}

// relayAnswer relays a message (type t) of the answer h expects, keeping
// the rows of a query of the proxy's own and hiding what answers the
// proxy's requests; it pops h once the answer is complete, and follows
// COPY FROM STDIN.
func (s *session) relayAnswer(h *expect, t byte, raw []byte) error {
	if h.internal != nil && t == 'D' {
		h.internal.rows = append(h.internal.rows, dataRow(raw))
	}
	if hidden := h.swallow || h.internal != nil; !hidden {
		if err := s.toClient(raw); err != nil {
			return err
		}
	}
	complete := false
	switch h.kind {
	case expSingle:
		complete = t == '1' || t == '2' || t == '3'
	case expDescribeS:
		complete = t == 'T' || t == 'n'
	case expDescribeP:
		complete = t == 'T' || t == 'n'
	case expExecute, expStmt:
		switch t {
		case 'C', 'I', 's':
			complete = true
		case 'G':
			s.copyIn.Store(true)
			if h.kind == expExecute {
				s.dropQueuedSyncs()
			}
		}
	case expQuery:
		if t == 'G' {
			s.copyIn.Store(true)
		}
	}
	if t == 'C' && s.copyIn.Load() {
		s.copyIn.Store(false)
	}
	if complete {
		s.pop(true)
	}
	return nil
}

// ownQueryFields are the fields of an ErrorResponse or NoticeResponse that
// place it in the query that ran (position, internal position and query,
// context): of a query of the proxy's own, they mean nothing to the client.
const ownQueryFields = "PpqW"

// endsSession: an ErrorResponse's fields f say the server ends the session
// after it (severity FATAL or PANIC).
func endsSession(f map[byte]string) bool {
	sev, ok := f['V'] // not localized (Postgres 9.6 and later)
	if !ok {
		sev = f['S']
	}
	return sev == "FATAL" || sev == "PANIC"
}

// sessionEndedError: the server ended the session during a query of the
// proxy's own (its FATAL went on to the client). Never a *queryError: the
// session ends, whatever the query was for.
type sessionEndedError struct{ code, msg string }

func (e *sessionEndedError) Error() string {
	return fmt.Sprintf("the server ended the session: %s (SQLSTATE %s)", e.msg, e.code)
}

// queryEnd returns the expQueryEnd item of the rewritten query in flight.
func (s *session) queryEnd() *expect {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	for _, e := range s.queue {
		if e.kind == expQueryEnd {
			return e
		}
		if e.endsWithZ() {
			return nil
		}
	}
	return nil
}

// refusalContext is the CONTEXT Postgres adds to the error of a refusal
// (refuseSQL's DO block), which direct would not show.
const refusalContext = "PL/pgSQL function inline_code_block line 1 at RAISE"

// dropRefusalContext drops the W (where) field of an ErrorResponse that is
// a refusal of the proxy's (its message starts "fenceline: write refused"
// and its context is refusalContext): the client sees the refusal alone.
// Other errors go as they are.
func dropRefusalContext(raw []byte) []byte {
	if !bytes.Contains(raw, []byte(refusalContext)) {
		return raw
	}
	f := errorFields(raw)
	if f['W'] != refusalContext || !strings.HasPrefix(f['M'], "fenceline: write refused") {
		return raw
	}
	return dropFields(raw, "W")
}

// dropFields returns the ErrorResponse or NoticeResponse raw without the
// fields whose codes are in codes.
func dropFields(raw []byte, codes string) []byte {
	var w msgBuilder
	at := w.begin(raw[0])
	b := raw[5:]
	for len(b) > 0 && b[0] != 0 {
		code := b[0]
		v, rest, err := cstring(b[1:])
		if err != nil {
			return raw
		}
		if strings.IndexByte(codes, code) < 0 {
			w.b = append(w.b, code)
			w.str(v)
		}
		b = rest
	}
	w.b = append(w.b, 0)
	w.end(at)
	return w.b
}

// mapErrorPosition rewrites the P (position) field of an ErrorResponse so it
// points into the text the client sent.
func mapErrorPosition(raw []byte, ins []insertion) []byte {
	f := errorFields(raw)
	p, ok := f['P']
	if !ok {
		return raw
	}
	pos := atoiOr(p, 0)
	if pos <= 0 {
		return raw
	}
	var w msgBuilder
	at := w.begin(raw[0])
	b := raw[5:]
	for len(b) > 0 && b[0] != 0 {
		code := b[0]
		v, rest, err := cstring(b[1:])
		if err != nil {
			return raw
		}
		if code == 'P' {
			v = strconv.Itoa(max(1, originalPosition(pos, ins)))
		}
		w.b = append(w.b, code)
		w.str(v)
		b = rest
	}
	w.b = append(w.b, 0)
	w.end(at)
	return w.b
}

// dataRow decodes a DataRow as text columns.
func dataRow(raw []byte) []string {
	b := raw[5:]
	if len(b) < 2 {
		return nil
	}
	n := int(b[0])<<8 | int(b[1])
	b = b[2:]
	out := make([]string, 0, n)
	for i := 0; i < n && len(b) >= 4; i++ {
		l := int(int32(uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])))
		b = b[4:]
		if l < 0 {
			out = append(out, "")
			continue
		}
		if l > len(b) {
			break
		}
		out = append(out, string(b[:l]))
		b = b[l:]
	}
	return out
}

// parserSetting records a reported setting that changes how Postgres
// parses a query text (see session.classify).
func (s *session) parserSetting(name string, value []byte) {
	v, _, _ := cstring(value)
	switch name {
	case "standard_conforming_strings":
		s.scsOff.Store(v != "on")
		return
	case "client_encoding":
		s.clientEnc = v
	case "server_encoding":
		s.serverEnc = v
	default:
		return
	}
	// SQL_ASCII as the client's encoding means no conversion: the text's
	// bytes are the server's. In a UTF8 (or SQL_ASCII) database they are
	// what the parser reads; in another, the server reads them in its
	// own encoding, and the proxy's lookups, which name what they look up
	// in UTF8, would name other bytes (found by a review: a function
	// "Ã©f" in LATIN1, called as "éf" by a SQL_ASCII client, was looked up
	// as "éf" and taken for no function).
	c, sv := s.clientEnc, s.serverEnc
	alike := c == "UTF8" || c == "SQL_ASCII" && (sv == "UTF8" || sv == "SQL_ASCII")
	s.encUnsafe.Store(!alike)
	s.srvEncCuts.Store(sv != "UTF8")
	// Names come back as the server holds them: converted to UTF8, or
	// with no conversion at all (SQL_ASCII on either side), the bytes
	// the parser reads (psql in a C locale asks for SQL_ASCII).
	s.namesAlike.Store(alike || sv == "SQL_ASCII")
}
