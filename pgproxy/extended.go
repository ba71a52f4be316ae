// The extended protocol: the messages of a segment (up to Sync or Flush)
// held, decided together, and forwarded with the fence's own messages.

package pgproxy

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"sync/atomic"
)

// segMsg is one held extended-protocol message, at buf[off:off+n] of its
// segment.
type segMsg struct {
	typ      byte
	replay   bool // sent again by the proxy (stallReplay): the answer is not the client's
	off, n   int
	st       *Statement // Execute: the statement it runs
	describe byte       // Describe: 'S' or 'P'
	reserved string     // why its name may not be named (badNameIn): refused
	bound    *Statement // Bind: what the statement it names held then (nil: none)
	parsed   *Statement // Parse: the statement it prepares; Describe of a statement: the statement
	portal   string     // Bind, Execute: the portal it names
	name     string     // Parse, Bind, Describe of a statement: the statement it names
	// analysis: for a Parse or Bind whose statement Postgres analyzes or
	// plans with calls that may write (judgeAnalysis), the opaque write it
	// is judged as; nil when none.
	analysis *Statement
	// changes: what it changed in the named statements and portals,
	// for its expectation (undone if the server refuses or skips it).
	changes []nameChange
}

// flushSegment decides the pending extended-protocol messages (up to a Sync
// or Flush) and forwards them, with the fence's own messages added.
func (s *session) flushSegment() error {
	if len(s.seg) == 0 {
		return nil
	}
	seg, buf := s.seg, s.segBuf
	defer s.resetSegment()
	if s.skipping {
		return s.skipToSync(seg, buf)
	}
	fresh := !s.pendingSync
	if fresh {
		// A new transaction may start here: know its state first.
		if err := s.beginUnit(); err != nil {
			if ce, ok := cancelled(err); ok {
				return s.cancelSegment(ce, seg, buf)
			}
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
	buf, execs, read, err := s.trackSegment(seg, buf, !fresh)
	if err != nil {
		return err
	}
	if stalled && decidesTxn(execs) {
		// The stalled prefix's implicit transaction started read-only; this
		// segment needs one the proxy decides (a write, or transaction
		// control): end that one first.
		replay := s.replayable(keptStmts)
		ok, err := s.endStalled()
		if err != nil {
			return err
		}
		if !ok {
			s.stmts, s.portals = keptStmts, keptPortals
			return s.skipToSync(seg, buf)
		}
		if err := s.beginUnit(); err != nil {
			if ce, ok := cancelled(err); ok {
				return s.cancelSegment(ce, seg, buf)
			}
			return err
		}
		fresh = true
		seg, buf = withReplay(replay, seg, buf)
	}
	s.pendingSync = seg[len(seg)-1].typ != 'S'
	if !s.pendingSync {
		s.stalled = false
		s.clearReplay()
	}
	li, err := s.judgeSegment(seg, buf, execs, read, fresh)
	if err == nil {
		s.noteCodeInSegment(seg)
	}
	if ce, ok := cancelled(err); ok {
		return s.cancelSegment(ce, seg, buf)
	}
	if err != nil {
		return err
	}
	return s.forwardSegment(seg, buf, li)
}

// resetSegment empties the held segment once flushSegment is done with it.
func (s *session) resetSegment() {
	s.seg, s.segExec, s.segBind = s.seg[:0], false, false
	if cap(s.segBuf) > 1<<20 {
		s.segBuf = nil
	} else {
		s.segBuf = s.segBuf[:0]
	}
}

// ownPrefix begins the name of every prepared statement and portal of the
// proxy's own (session.go). It runs them unjudged, as its own text, so no
// client may name one: a client that closed one and prepared its own text
// under the name, in the pipeline of a write the proxy had just prepared
// it for, would have that text run in the next transaction the proxy
// makes writable (TestOwnStatementNamesAreNotTheClients). Code the proxy
// does not parse could do the same with DEALLOCATE and PREPARE: see
// verifyNames.
const ownPrefix = "fenceline_"

// badNameIn says why a client message of type typ (its body) may not name
// the statement or portal it names, or "": a name of the proxy's own, one
// over maxNameLen bytes, or one not ASCII in a client encoding whose
// conversion to the server's may make two names one.
func (s *session) badNameIn(typ byte, body []byte) string {
	names, k := namesIn(typ, body)
	for _, n := range names[:k] {
		switch {
		case bytes.HasPrefix(n, ownPrefixBytes):
			return "prepared statements and portals named " + ownPrefix + "... are the fence's own, which it runs unjudged: " + string(n)
		case len(n) > maxNameLen:
			return fmt.Sprintf("a prepared statement or portal name of %d bytes: Postgres keeps %d, so names the fence tells apart would be one on the server", len(n), maxNameLen)
		case s.encUnsafe.Load() && !isASCII(n):
			return "a prepared statement or portal name not in ASCII, in a client encoding whose conversion may make two names one on the server"
		case s.srvEncCuts.Load() && mayBeCut(string(n)):
			return fmt.Sprintf("a prepared statement or portal name not in ASCII, long enough that the server, whose encoding is not UTF8, may cut it at %d bytes and make two names one", maxNameLen)
		}
	}
	return ""
}

var ownPrefixBytes = []byte(ownPrefix)

func isASCII(b []byte) bool {
	for _, c := range b {
		if c >= 0x80 {
			return false
		}
	}
	return true
}

// namesIn returns the statement and portal names a client message of type
// typ (its body) names: the first k of names, slices of body (no
// allocation: every message of a segment is looked at).
func namesIn(typ byte, body []byte) (names [2][]byte, k int) {
	first := func(b []byte) ([]byte, []byte, bool) {
		i := bytes.IndexByte(b, 0)
		if i < 0 {
			return nil, nil, false
		}
		return b[:i], b[i+1:], true
	}
	switch typ {
	case 'P', 'E':
		if n, _, ok := first(body); ok {
			names[0], k = n, 1
		}
	case 'B':
		if portal, rest, ok := first(body); ok {
			names[0], k = portal, 1
			if stmt, _, ok := first(rest); ok {
				names[1], k = stmt, 2
			}
		}
	case 'C', 'D':
		if len(body) >= 1 {
			if n, _, ok := first(body[1:]); ok {
				names[0], k = n, 1
			}
		}
	}
	return names, k
}

// protocolName names a client message type in a refusal.
func protocolName(typ byte) string {
	switch typ {
	case 'P':
		return "Parse"
	case 'B':
		return "Bind"
	case 'E':
		return "Execute"
	case 'C':
		return "Close"
	case 'D':
		return "Describe"
	}
	return string(typ)
}

// trackSegment is flushSegment's first pass: what each Execute runs (set
// on its message, and returned in order), with statements and portals
// tracked as the server will. read is the last Execute's statement as
// classified (before sequenceWrite). A Parse the proxy answers itself is
// replaced by its own, appended to buf (returned). changed: statements ran
// since Postgres last reported its settings. A malformed message is fatal.
func (s *session) trackSegment(seg []segMsg, buf []byte, changed bool) (_ []byte, execs []*Statement, read *Statement, err error) {
	for i := range seg {
		m := &seg[i]
		body := buf[m.off+5 : m.off+m.n]
		if m.reserved = s.badNameIn(m.typ, body); m.reserved != "" {
			continue // refused in its place (forwardSegment): it changes nothing
		}
		switch m.typ {
		case 'P':
			buf, err = s.trackParse(m, body, buf, changed)
		case 'B':
			m.bound, m.portal, m.name, err = s.trackBind(body)
		case 'E':
			if read, err = s.trackExecute(m, body); err == nil {
				execs = append(execs, m.st)
				changed = true
			}
		case 'C':
			err = s.trackClose(body)
		case 'D':
			if len(body) < 2 {
				err = fmt.Errorf("%w: short Describe", ErrProtocol)
			} else if m.describe = body[0]; m.describe == 'S' {
				// Postgres analyzes a prepared statement again when it
				// describes one whose path or dependencies changed: its
				// analysis is judged as a Parse's (analysisCalls).
				name, _, _ := cstring(body[1:])
				m.parsed, m.name = s.stmts[name], name
			}
		}
		if err != nil {
			return nil, nil, nil, s.fatal(err)
		}
		m.changes = s.takeChanged()
	}
	return buf, execs, read, nil
}

// trackParse classifies the statement a Parse (m, its body) prepares and
// names it; a statement the proxy answers itself (see replacement) is
// prepared in its place, a Parse of the proxy's appended to buf.
func (s *session) trackParse(m *segMsg, body, buf []byte, changed bool) ([]byte, error) {
	name, q, paramTypes, err := twoCStrings(body)
	if err != nil {
		return buf, err
	}
	st := extStatement(s.classify(q, changed))
	if calls, err := paramTypeCalls(paramTypes); err != nil {
		return buf, err
	} else if calls != nil {
		cp := *st
		cp.Calls = mergeCalls(st.Calls, calls)
		st = &cp
	}
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
	s.setName(statementNames, name, st)
	m.parsed, m.name = st, name
	return buf, nil
}

// trackBind binds a portal to its statement (an unknown statement is an
// opaque write), judging the pids a signalling statement takes from this
// Bind's parameters; it returns what the statement's name held (nil: none).
func (s *session) trackBind(body []byte) (*Statement, string, string, error) {
	portal, stmt, bindRest, err := twoCStrings(body)
	if err != nil {
		return nil, "", "", err
	}
	named := s.stmts[stmt]
	st := named
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
	s.setName(portalNames, portal, st)
	return named, portal, stmt, nil
}

// trackExecute sets on m the statement its portal runs (an unknown portal
// is an opaque write; an EXECUTE, the SQL-level statement it runs; a read
// that advances sequences, a write) and returns it as classified.
func (s *session) trackExecute(m *segMsg, body []byte) (read *Statement, err error) {
	portal, _, err := cstring(body)
	if err != nil {
		return nil, err
	}
	st := s.portals[portal]
	if st == nil {
		st = &Statement{Class: ClassWrite, Opaque: true, Tag: "UnknownPortal"}
	}
	st = s.resolveSQLPrepared(st)
	m.st = s.sequenceWrite(st)
	m.portal = portal
	return st, nil
}

// trackClose forgets the statement or portal a Close names.
func (s *session) trackClose(body []byte) error {
	if len(body) < 2 {
		return fmt.Errorf("%w: short Close", ErrProtocol)
	}
	name, _, _ := cstring(body[1:])
	if body[0] == 'S' {
		s.setName(statementNames, name, nil)
		s.forgetOwnStatements(name)
	} else {
		s.setName(portalNames, name, nil)
	}
	return nil
}

// judgeSegment decides what the segment's statements (execs, also set on
// their Execute messages) are before any of it goes out: the search path
// and catalogs they need, whether a lone write is checked (checkedWrite),
// the functions they call. It takes the lease when the segment may need it
// and, between transactions, prepares a statement that must run outside
// one and binds the fence's session.
func (s *session) judgeSegment(seg []segMsg, buf []byte, execs []*Statement, read *Statement, fresh bool) (leaseInfo, error) {
	lookup := fresh && !s.stalled && s.txStatus != 'E' // queries of the proxy's own disturb nothing
	if err := s.needSearchPath(execs, lookup); err != nil {
		return leaseInfo{}, err
	}
	check := s.segmentChecked(seg, buf, execs, read, fresh) // see checkedWrite
	writable := s.unitWritable(execs)
	// In a writable unit each Parse's and Bind's calls are judged, unless
	// an Execute later in its transaction runs the same statement (a
	// checked write's check counts what anything in its transaction
	// wrote); in any unit the calls not yet known builtin are learnt, for
	// the names' doubt.
	// (Where the set is not learnt yet, what judgeAnalysisPastTxn then
	// finds unlearnt is refused: learning every call here instead would
	// make every first unit of a session look its calls up.)
	fs, _ := s.foreignSet()
	mayConnect := fs != nil && fs.connects != ""
	analyzed := s.analyzedCalls(seg, writable && !check, mayConnect)
	if err := s.learnCatalog(append(execs[:len(execs):len(execs)], analyzed...), writable || check, lookup); err != nil {
		return leaseInfo{}, err
	}
	if check {
		var err error
		if execs[0], err = s.checkedWrite(execs[0]); err != nil {
			return leaseInfo{}, err
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
	if writable && !check {
		s.judgeAnalysis(seg)
	}
	if s.connectsVia() != "" {
		s.judgeAnalysisPastTxn(seg, writable)
	}
	li := s.segmentLease(execs, seg)
	if fresh && s.txStatus == 'I' && len(execs) == 1 && seg[len(seg)-1].typ == 'S' {
		if err := s.unwrapOutside(execs[0], li); err != nil {
			return leaseInfo{}, err
		}
	}
	if li.live() && fresh && s.txStatus == 'I' {
		if err := s.bindFence(); err != nil {
			return leaseInfo{}, err
		}
	}
	return li, nil
}

// analyzedCalls returns, for each Parse and Bind of seg whose statement
// Postgres may run code for before any Execute (analysisCalls), a read
// calling that code (Analyzed), in seg's order: when judge, every one an
// Execute later in its transaction does not judge (executedAfter), set on
// its message for judgeAnalysis; when wide (code may open a connection of
// its own: judgeAnalysisPastTxn judges them all), every one; else those
// with a call not yet known builtin, for the names' doubt. A Parse or
// Bind of a text the proxy is unsure of, or, when judged, a Bind of a
// write, is judged as that statement itself (analysisOf).
func (s *session) analyzedCalls(seg []segMsg, judge, wide bool) []*Statement {
	var out []*Statement
	for i := range seg {
		m := &seg[i]
		m.analysis = nil // a replayed message's is judged again
		if st := m.statement(); st != nil && st.Unsure != "" {
			// Text the parser may read otherwise than Postgres: nothing
			// of what its analysis runs is known.
			m.analysis = st // refused in its place, whatever the unit (authorizeWrite)
			continue
		}
		calls, st := analysisCalls(m, judge || wide)
		if len(calls) == 0 {
			continue
		}
		switch {
		case judge && !executedAfter(seg, i):
			m.analysis = s.analysisOf(m, calls, st) // judged in judgeAnalysis
			out = append(out, m.analysis)
		case wide: // learnt for judgeAnalysisPastTxn (a write's Bind: its reach)
			out = append(out, s.analysisOf(m, calls, st))
		case !judge && s.anyUnseen(calls): // learnt for the names' doubt
			out = append(out, &Statement{Class: ClassRead, Calls: calls, Analyzed: true, Tag: protocolName(m.typ) + "(" + st.Tag + ")"})
		}
	}
	return out
}

// analysisOf is what m's analysis or planning runs, judged in m's place: a
// read calling calls, or, for a Bind of a write, the write (planning it
// folds what its target's defaults and generated columns compute, which
// its relation's calls do not show).
func (s *session) analysisOf(m *segMsg, calls []Call, st *Statement) *Statement {
	if m.typ == 'B' && st.Class == ClassWrite {
		return st
	}
	return &Statement{Class: ClassRead, Calls: calls, Analyzed: true, Tag: protocolName(m.typ) + "(" + st.Tag + ")"}
}

// statement is the statement m, a Parse or Bind, prepares or binds (nil:
// none, or another message).
func (m *segMsg) statement() *Statement {
	switch m.typ {
	case 'P', 'D':
		return m.parsed
	case 'B':
		return m.bound
	}
	return nil
}

// analysisCalls returns the calls Postgres may run for m, a Parse or a
// Bind, with its statement. Analyzing a Parse's statement runs the input
// of the types its literals are cast or coerced to (a domain's check
// among them): the relations it names (their columns' types) and its
// types not in pg_catalog (ParseCalls: what the names' doubt counts), and,
// when judged, the functions and operators it calls too, whose parameter
// types a literal is coerced to. Planning a Bind's folds immutable
// functions and operators on constants, and its parameters' values pass
// their types' input: all its calls.
func analysisCalls(m *segMsg, judged bool) ([]Call, *Statement) {
	switch m.typ {
	case 'P', 'D':
		switch {
		case m.parsed == nil:
			return nil, nil
		case judged:
			return m.parsed.Calls, m.parsed
		}
		return m.parsed.ParseCalls, m.parsed
	case 'B':
		if m.bound == nil {
			return nil, nil
		}
		return m.bound.Calls, m.bound
	}
	return nil, nil
}

// executedAfter: seg's message i, a Parse or Bind, prepares or binds what
// an Execute later in seg runs, with no statement that ends or starts a
// transaction run between. Then the Execute, judged with the same calls in
// the same transaction, is refused when the analysis could write, and its
// refusal rolls that back: the message needs no judging of its own (a
// write's Parse and Bind, in every write, allocate nothing for it).
func executedAfter(seg []segMsg, i int) bool {
	portal, name := seg[i].portal, seg[i].name
	bound := seg[i].typ == 'B'
	for j := i + 1; j < len(seg); j++ {
		m := &seg[j]
		switch m.typ {
		case 'P':
			if !bound && m.name == name {
				return false // parsed again first
			}
		case 'B':
			switch {
			case bound && m.portal == portal:
				return false // bound again first
			case !bound && m.name == name:
				bound, portal = true, m.portal // the Parse's statement, bound: follow its portal
			}
		case 'E':
			if m.st == nil || m.st.Tx != TxNone {
				return false
			}
			if bound && m.portal == portal {
				return true
			}
		}
	}
	return false
}

// judgeAnalysis judges what analyzedCalls set on seg's messages as run in
// the unit's writable transaction (judgeCalls): one that may write there
// stays on its message (analysis) as the write it is, authorized in its
// place (TestAnalysisInAWritableUnitIsJudged).
func (s *session) judgeAnalysis(seg []segMsg) {
	for i := range seg {
		rd := seg[i].analysis
		if rd == nil || rd.Unsure != "" {
			continue
		}
		if j := s.judgeCalls(rd, true); j.Class == ClassWrite {
			seg[i].analysis = j
		} else {
			seg[i].analysis = nil
		}
	}
}

// judgeAnalysisPastTxn judges, where code may open a connection of its
// own (dblink, a foreign server: connectsVia), what every Parse's
// analysis and Bind's planning in seg may run (analysisCalls), in any
// unit: what such code writes over its own connection is neither stopped
// by a read-only transaction nor rolled back with a refused Execute after
// it, nor counted by a checked write's check (checkedWrite): so
// judgeAnalysis's leaving a message to its Execute (executedAfter) or to
// the check, and a read-only unit's leaving it unjudged, do not hold. No
// call is taken for builtin on an earlier lookup's word (seenBuiltin):
// analyzedCalls had each learnt for the unit. One that may write stays on
// its message as the write it is, authorized in its place
// (TestAnalysisThroughAConnectionOfItsOwn).
func (s *session) judgeAnalysisPastTxn(seg []segMsg, writable bool) {
	for i := range seg {
		m := &seg[i]
		if m.analysis != nil {
			continue // refused already (judgeAnalysis, or unsure)
		}
		calls, st := analysisCalls(m, true)
		if len(calls) == 0 {
			continue
		}
		rd := s.analysisOf(m, calls, st)
		if j := s.judgeCalls(rd, writable); j.Class == ClassWrite {
			m.analysis = j
		}
	}
}

// segmentChecked: the segment is a unit of its own whose one Execute (of
// all its rows) runs a read the proxy may check for writes (see
// mayCheckWrites and checkedWrite).
func (s *session) segmentChecked(seg []segMsg, buf []byte, execs []*Statement, read *Statement, fresh bool) bool {
	check := false
	if len(execs) == 1 && !s.pendingSync && !s.stalled && fresh && s.mayCheckWrites(read, 1, s.txStatus == 'I') {
		for i := range seg {
			if seg[i].typ == 'E' {
				check = executeAll(buf[seg[i].off+5 : seg[i].off+seg[i].n])
			}
		}
	}
	return check
}

// segmentLease is the lease as the segment sees it, taken only when the
// segment may need it: it writes or begins a block, or it may have to end
// a writable transaction, or a Parse's or Bind's analysis may write
// (judgeAnalysis). Reads alone never need the lease.
func (s *session) segmentLease(execs []*Statement, seg []segMsg) leaseInfo {
	needLease := s.sim.blockRW || s.sim.groupRW // may have to end a writable transaction
	for _, st := range execs {
		if st.Class == ClassWrite || st.Tx == TxBegin || st.Tx == TxChain {
			needLease = true // reads alone never need the lease
			break
		}
	}
	for i := 0; i < len(seg) && !needLease; i++ {
		needLease = seg[i].analysis != nil
	}
	if !needLease {
		return leaseInfo{}
	}
	return s.lease()
}

// segWriter builds what a decided segment sends Postgres: the client's
// messages with the fence's own among them, and what the relay is to
// expect back for each (items).
type segWriter struct {
	s     *session
	seg   []segMsg
	li    leaseInfo
	w     msgBuilder
	items []*expect
	// slab holds the segment's expectations (exp), allocated together.
	slab    []expect
	execBuf [8]*Statement // execsFrom's answer, when it fits
	refused bool          // a statement was refused: the server skips to Sync
	refusal *expect       // the refusal's Execute, which fails
	rwSeen  bool          // an Execute runs in a transaction made writable
}

// forwardSegment writes the decided segment (seg, its messages in buf) to
// the server under li, and queues what the relay is to expect.
func (s *session) forwardSegment(seg []segMsg, buf []byte, li leaseInfo) error {
	fw := &segWriter{s: s, seg: seg, li: li, items: s.itemsOut[:0]}
	s.itemsOut = nil // fw's until pushed
	fw.w.b = s.segOut[:0]
	if s.sim.inBlock && s.txStatus != 'E' && len(seg) > 0 && seg[0].typ != 'S' && seg[0].typ != 'H' {
		fw.pin(0) // (in a failed block it would fail, and the client's ROLLBACK TO after it be skipped)
	}
	for i := range seg {
		fw.message(i, buf[seg[i].off:seg[i].off+seg[i].n])
	}
	if fw.rwSeen && li.live() {
		s.rw.Store(true)
	}
	if s.pendingSync && (s.stalled || s.forwarding) {
		s.keepForReplay(seg, buf)
	}
	s.push(fw.items...)
	clear(fw.items) // the queue has them now
	if cap(fw.items) <= maxKeptQueue {
		s.itemsOut = fw.items[:0]
	}
	_, err := s.sw.Write(fw.w.b)
	if cap(fw.w.b) <= 1<<20 {
		s.segOut = fw.w.b[:0]
	}
	return err
}

// exp returns a new expectation of the segment, e, allocated with its
// others: one allocation for a segment's few rather than one each.
func (fw *segWriter) exp(e expect) *expect {
	if len(fw.slab) == cap(fw.slab) {
		fw.slab = make([]expect, 0, len(fw.seg)+4)
	}
	fw.slab = append(fw.slab, e)
	return &fw.slab[len(fw.slab)-1]
}

// message forwards the segment's message i (raw): it decides the implicit
// transaction the message starts and, for an Execute, its statement.
func (fw *segWriter) message(i int, raw []byte) {
	s, m := fw.s, &fw.seg[i]
	if fw.refused {
		// The server skips everything up to Sync after the error: what
		// the message changed is undone with the refusal.
		fw.refusal.changes = append(fw.refusal.changes, m.changes...)
		fw.w.b = append(fw.w.b, raw...)
		if m.typ == 'S' {
			fw.items = append(fw.items, fw.exp(expect{kind: expSync}))
			s.sim = txSim{}
		}
		return
	}
	if m.reserved != "" {
		fw.refuse(&refusal{code: ReasonFenceTamper, reason: m.reserved, hint: "name the prepared statement or portal otherwise"},
			&Statement{Class: ClassWrite, Tag: protocolName(m.typ)})
		return
	}
	if m.typ != 'S' && m.typ != 'H' && !s.sim.inBlock && !s.sim.decided {
		fw.startTxn(i)
	}
	if m.analysis != nil && m.analysis.Class == ClassWrite {
		r := s.authorizeInTxn(m.analysis, fw.li)
		if r == nil {
			r = s.authorizeWrite(m.analysis, fw.li, s.searchPath, "")
		}
		if r != nil && r.code != ReasonUnnamedTable && m.typ == 'B' && m.bound != nil && m.bound.Class == ClassWrite && m.analysis.Unsure == "" {
			// A write's Bind (analysisOf) is refused for what planning
			// it runs, the user code its tables' defaults and generated
			// columns call, wherever they are; the rest is its
			// Execute's to refuse, as Postgres binds a portal it will
			// not run.
			r = s.reachRunsCode(m.analysis, s.searchPath)
		}
		if r != nil {
			fw.refuse(r, m.analysis)
			fw.refusal.changes = m.changes
			return
		}
	}
	switch m.typ {
	case 'P', 'B', 'C':
		fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: m.replay, changes: m.changes}))
	case 'D':
		if m.describe == 'S' {
			fw.items = append(fw.items, fw.exp(expect{kind: expDescribeS}))
		} else {
			fw.items = append(fw.items, fw.exp(expect{kind: expDescribeP}))
		}
	case 'S':
		fw.items = append(fw.items, fw.exp(expect{kind: expSync}))
		// After Sync an implicit transaction is over; a block goes on.
		if !s.sim.inBlock {
			s.sim.decided, s.sim.groupRW, s.sim.spPinned = false, false, false
		}
	case 'E':
		if fw.execute(i, m.st, raw, m.changes) {
			return
		}
		if m.st != nil && m.st.RollbackTo {
			// Pinned again for the rest of the segment (see trackTx).
			fw.w.b = append(fw.w.b, raw...)
			fw.pin(i + 1)
			return
		}
	}
	fw.w.b = append(fw.w.b, raw...)
}

// startTxn decides the implicit transaction message i starts: writable,
// with the token, when what runs in it writes (groupWrites) under a live
// lease, unless it is one statement that must run outside a transaction;
// else read-only asserted again after a COMMIT or ROLLBACK in this unit.
// Its search path is pinned for the unqualified names it writes.
func (fw *segWriter) startTxn(i int) {
	s := fw.s
	s.sim.decided = true
	rest := fw.execsFrom(i)
	if groupWrites(rest, s.clientRO) && fw.li.live() && !(len(rest) == 1 && rest[0].Tx == TxOutside) {
		fw.injectRW(i)
		s.sim.groupRW = true
	} else if s.txEnded {
		fw.injectRO() // a new transaction after COMMIT/ROLLBACK in this unit
	}
	fw.pin(i)
}

// execute decides the statement st an Execute (raw) runs, in the
// transaction it runs in, and reports whether it wrote the message itself:
// refused (the refusal in its place), followed by its write check, or
// followed by a chained block's new token. Otherwise the caller forwards it.
func (fw *segWriter) execute(i int, st *Statement, raw []byte, changes []nameChange) bool {
	s, li := fw.s, fw.li
	if st.Session {
		s.sessionChanged(st)
	}
	fw.rwSeen = fw.rwSeen || s.sim.blockRW || s.sim.groupRW
	r := s.authorizeInTxn(st, li)
	if r == nil {
		r = s.authorizeWrite(st, li, s.searchPath, "Sync before the write, or start the transaction with BEGIN")
	}
	if r != nil {
		fw.refuse(r, st)
		fw.refusal.changes = changes
		return true
	}
	s.passedDDL(st)
	fw.items = append(fw.items, fw.exp(expect{kind: expExecute, changes: changes}))
	s.trackTx(st)
	if st.WriteCheck && s.sim.groupRW {
		// The check, in the same transaction, before the Sync that ends
		// it (in a portal of its own: the client's unnamed one stays).
		fw.w.b = append(fw.w.b, raw...)
		fw.writeCheck(st)
		return true
	}
	if st.Tx == TxChain && s.sim.blockRW && li.live() {
		fw.w.b = append(fw.w.b, raw...)
		fw.setToken(s.token(li))
		fw.pin(i + 1) // the chain ended the transaction the pin was set in (see trackTx)
		return true
	}
	return false
}

// refuse puts the refusal of st (r) where its Execute would have gone: a
// statement of the proxy's own that makes Postgres raise the error.
func (fw *segWriter) refuse(r *refusal, st *Statement) {
	sql := fw.s.refuse(r, st, fw.li, st.Tag)
	fw.w.close('S', refuseName)
	fw.w.parse(refuseName, sql)
	fw.w.bind("", refuseName)
	fw.w.execute("")
	fw.refusal = fw.exp(expect{kind: expExecute})
	fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expSingle, swallow: true, own: true}),
		fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.refusal)
	fw.refused = true
}

// writeCheck runs the write check of st (see writeCheckSQL) after it, in a
// portal of the proxy's own; a check that fails is audited.
func (fw *segWriter) writeCheck(st *Statement) {
	s, li := fw.s, fw.li
	fw.w.close('S', checkName)
	fw.w.parse(checkName, s.writeCheckSQL(st, li))
	fw.w.bind(checkName, checkName)
	fw.w.execute(checkName)
	fw.w.close('P', checkName)
	fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expSingle, swallow: true, own: true}),
		fw.exp(expect{kind: expExecute, swallow: true, own: true, onError: func(f map[byte]string) { s.auditCheck(f, st, li, st.Tag) }}),
		fw.exp(expect{kind: expSingle, swallow: true, own: true}))
}

// prepareOwn prepares the proxy's statement name (sql) on this connection
// unless it is prepared already (state says).
func (fw *segWriter) prepareOwn(state *atomic.Int32, name, sql string) {
	// While the proxy doubts its names (code it does not parse may have
	// run since it last learned them, verifyNames), even in this segment,
	// before this message: that code can DEALLOCATE and PREPARE the
	// proxy's own names too.
	if state.Load() == stmtNone || fw.s.namesDoubt {
		fw.w.close('S', name)
		fw.w.parse(name, sql)
		fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expSingle, swallow: true, own: true, stmtState: state}))
		state.Store(stmtPending)
	}
}

// runOwn runs the proxy's prepared statement name (sql) with params in the
// unnamed portal, preparing it first if needed; its answers are swallowed.
func (fw *segWriter) runOwn(state *atomic.Int32, name, sql string, params ...string) {
	fw.prepareOwn(state, name, sql)
	fw.w.bind("", name, params...)
	fw.w.execute("")
	fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expExecute, swallow: true, own: true}))
}

// setToken sets the transaction's fence token with our prepared
// set_config, preparing it first on this connection.
func (fw *segWriter) setToken(tok string) {
	fw.runOwn(&fw.s.tokStmt, tokStmtName, tokSQL, tok)
}

// injectRO makes the transaction read-only.
func (fw *segWriter) injectRO() {
	fw.runOwn(&fw.s.roStmt, roStmtName, roSQL)
}

// injectRW makes the transaction writable and sets its token, before
// message from; with the search path when the writes from there on need it
// pinned (pin): one statement of the proxy's own instead of two, in every
// autocommit write.
func (fw *segWriter) injectRW(from int) {
	s := fw.s
	tok := s.token(fw.li) // "" without one: Postgres refuses fenced writes
	// "SET transaction_read_only = off" must come before anything that
	// takes a snapshot, including the Parse of a SELECT.
	fw.runOwn(&s.rwStmt, rwStmtName, rwSQL)
	if fw.pinNeeded(from) {
		fw.runOwn(&s.tokSpStmt, tokSpStmtName, tokSpSQL, tok, s.pinnedPathHex())
		s.sim.spPinned = true
		return
	}
	fw.setToken(tok)
}

// execsFrom returns the statements Executes run from message i on (in
// fw's buffer when they fit: valid until the next call).
func (fw *segWriter) execsFrom(i int) []*Statement {
	out := fw.execBuf[:0]
	for j := i; j < len(fw.seg); j++ {
		if fw.seg[j].st != nil {
			out = append(out, fw.seg[j].st)
		}
	}
	return out
}

// pin sets search_path for the transaction to the path the proxy checks
// unqualified names with (see queryRewriter.pinPath for why), before the
// messages from message from on, whose statements Postgres resolves with it.
func (fw *segWriter) pin(from int) {
	s := fw.s
	if !fw.pinNeeded(from) {
		return
	}
	fw.prepareOwn(&s.spStmt, spStmtName, spSQL)
	fw.w.bind(spStmtName, spStmtName, s.pinnedPathHex())
	fw.w.execute(spStmtName)
	fw.w.close('P', spStmtName)
	fw.items = append(fw.items, fw.exp(expect{kind: expSingle, swallow: true, own: true}), fw.exp(expect{kind: expExecute, swallow: true, own: true}), fw.exp(expect{kind: expSingle, swallow: true, own: true}))
	s.sim.spPinned = true
}

// pinNeeded reports whether the statements from message from on need the
// search path pinned (pin) and it is not yet.
func (fw *segWriter) pinNeeded(from int) bool {
	s := fw.s
	if s.sim.spPinned || s.searchPath == nil {
		return false
	}
	for j := from; j < len(fw.seg); j++ {
		// A Bind too: Postgres plans the portal there, its tables fixed
		// by the path at that moment, whenever its Execute comes.
		if m := &fw.seg[j]; unqualified(m.st) || m.typ == 'B' && unqualified(m.bound) {
			return true
		}
	}
	return false
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

// paramTypeCalls returns a call of kind 'y' for each parameter type a
// Parse gives by oid that a user created: binding a value runs its input
// function and, a domain's, its checks, which may call functions a user
// defined, and the statement's text never names it. Builtin types (oids
// below firstUserOID) run only builtins.
func paramTypeCalls(b []byte) ([]Call, error) {
	if len(b) < 2 {
		return nil, fmt.Errorf("%w: short Parse", ErrProtocol)
	}
	n := int(binary.BigEndian.Uint16(b))
	if len(b) < 2+4*n {
		return nil, fmt.Errorf("%w: Parse with %d parameter types in %d bytes", ErrProtocol, n, len(b)-2)
	}
	var calls []Call
	for i := range n {
		oid := binary.BigEndian.Uint32(b[2+4*i:])
		if oid < firstUserOID {
			continue
		}
		name := strconv.FormatUint(uint64(oid), 10)
		c := Call{Name: name, Kind: 'y', Shown: "parameter type " + name, Key: "y" + name}
		if !slices.Contains(calls, c) {
			calls = append(calls, c)
		}
	}
	return calls, nil
}
