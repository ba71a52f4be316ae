package pgproxy

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// session is one client connection and its backend.
//
// Two loops: the client loop (serve) reads the client, decides, and is
// the only writer to the server; the relay reads the server and is the only
// writer to the client once startup is over (under cmu, which the client
// loop takes only to send a fatal error). They share the expectation queue
// (under qmu), which says whose responses are coming next. They run as two
// goroutines, or, for a plain session on Linux, as two tasks of the proxy's
// event loop (loop_linux.go).
type session struct {
	p      *Proxy
	client net.Conn
	server net.Conn
	tls    bool
	// crw, srw: the client's and the server's raw reader-writers, under
	// the readers and writers below.
	crw, srw io.ReadWriter
	// lp: the session's place on the proxy's event loop, set once after
	// startup (under amu); nil while on goroutines.
	lp      *sessionLoop
	amu     sync.Mutex
	aborted bool // abort was called; guarded by amu

	cr  *msgReader    // client reader (client loop)
	sw  *bufio.Writer // server writer (client loop)
	sr  *msgReader    // server reader (relay)
	cmu sync.Mutex    // guards cw on goroutines (lockClient)
	cw  *bufio.Writer // client writer

	user, database string
	key            backendKey

	// Client-loop state.
	txStatus    byte                  // from the last ReadyForQuery (set by the relay, read after waitIdle)
	sim         txSim                 // what the proxy believes about the current transaction
	stmts       map[string]*Statement // prepared statements by name (Parse and PREPARE: one namespace, see names.go)
	portals     map[string]*Statement // portals by name
	changed     []nameChange          // changes to stmts and portals by the message being tracked (see setName)
	prepSeen    map[string]string     // the server's prepare_time of tracked statements, as last seen (see verifyNames)
	namesDoubt  bool                  // code the proxy does not parse may have prepared statements since (verifyNames)
	namesUnseen bool                  // a tracked named statement may have no prepare_time in prepSeen yet
	freshNames  map[string]bool       // names the client set after the last code that may have run (noteCode)
	searchPath  []string              // nil: unknown
	seg         []segMsg              // pending extended-protocol messages
	pendingSync bool                  // extended messages went out since the last Sync
	segBuf      []byte
	segOut      []byte       // flushSegment's output, reused
	rwStmt      atomic.Int32 // state of our prepared "SET transaction_read_only = off"
	roStmt      atomic.Int32 // state of our prepared "SET transaction_read_only = on"
	tokStmt     atomic.Int32 // state of our prepared set_config for the token
	spStmt      atomic.Int32 // state of our prepared set_config for search_path
	tokSpStmt   atomic.Int32 // state of our prepared set_config of both at once
	// clientRO is the client's own default_transaction_read_only, the one
	// it would have straight to Postgres (Postgres's is always on: the
	// proxy's). When on, the proxy makes no transaction writable unless the
	// client asks for one (BEGIN READ WRITE), so a write fails as it would
	// direct. clientROSaved keeps the value from before a SET inside a
	// block, which a ROLLBACK restores (0: none, 1: off, 2: on).
	clientRO      bool
	clientROSaved int8
	// txEnded: a statement of the unit being forwarded ended a
	// transaction, so what follows it in the same unit starts a new one,
	// whose read-only default the proxy no longer knows (a function may
	// have switched it off); it asserts read-only for it.
	txEnded bool
	// unwrapped: the proxy switched the read-only default off itself for
	// a statement that must run outside a transaction (unwrapOutside).
	unwrapped bool
	// segExec: the pending segment holds an Execute, so it is not a
	// prefix the proxy forwards when the client stalls (awaitClient);
	// segBind: it holds a Bind (see stallable).
	segExec, segBind bool
	// stalled: a prefix that runs nothing (Parse, Bind, Describe, Close)
	// went out without Sync because the client paused after it; the
	// implicit transaction it opened is still open (see forwardStalled).
	// stallReplay holds the prefix's Binds and portal Closes, to be sent
	// again if the proxy ends that transaction (which drops its portals).
	stalled     bool
	stallReplay []byte
	// stallBound: what the statement each Bind in stallReplay names held
	// when it was tracked, in their order (see replayable).
	stallBound []*Statement
	forwarding bool // forwardStalled is at work
	// skipping: Postgres refused a stalled prefix, so it would ignore the
	// client's messages up to its Sync; the proxy drops them and forwards
	// the Sync alone.
	skipping bool
	// unit is what the proxy learned from the catalogs for the unit being
	// decided (learnCatalog); ddlPending: DDL passed in the current
	// transaction, so the catalog cache is forgotten again when it ends,
	// and lookups until then are the session's own.
	unit       unitCatalog
	ddlPending bool

	qmu   sync.Mutex
	queue []*expect // guarded by qmu
	// qbuf is the array the queue last started at the front of, reused
	// once the queue is empty (pop advances queue through it); guarded
	// by qmu.
	qbuf []*expect
	// itemsOut is forwardSegment's list of expectations, reused (the
	// client loop's alone).
	itemsOut    []*expect
	outstanding int // ReadyForQuery-terminated items in queue; guarded by qmu
	idle        chan struct{}

	status atomic.Uint32 // txStatus as seen by the relay
	// failed: changes to the named statements and portals made by
	// requests the server refused or skipped, to be undone (undoFailed);
	// guarded by qmu.
	failed []nameChange
	// errSinceZ: the server sent an ErrorResponse since its last
	// ReadyForQuery (relay only).
	errSinceZ bool
	copyIn    atomic.Bool // the server is in COPY FROM STDIN
	tainted   atomic.Bool // the server reported default_transaction_read_only off
	// Parser settings as Postgres last reported them (ParameterStatus):
	// standard_conforming_strings off, and a client_encoding other than
	// UTF8 or SQL_ASCII. See classify.
	scsOff    atomic.Bool
	encUnsafe atomic.Bool
	// srvEncCuts: the server's encoding is not UTF8, so it may cut a long
	// name elsewhere than the parser (see cutElsewhere).
	srvEncCuts atomic.Bool
	// namesAlike: the names Postgres sends back come in the bytes the
	// parser reads them as (the client's encoding is UTF8, or nothing is
	// converted; see notASCIIClaim).
	namesAlike atomic.Bool
	// clientEnc and serverEnc are the encodings as Postgres last reported
	// them; written only by the one reading the server (parserSetting).
	clientEnc, serverEnc string
	// dbSlot is the catalog's slot of the session's database (slot).
	dbSlot *dbSlot
	// seenCalls notes the last calls allSeenBuiltin found all seen
	// builtin: the slice (a statement's, which no one changes) and the
	// catalog's builtinEpoch then.
	seenCalls struct {
		first *Call
		n     int
		epoch uint64
	}
	// resetMark: a DISCARD ran. DISCARD SEQUENCES forgets the currval the
	// storage fence's fast path reads, not the setting that says it is
	// there; RESET that before the next unit outside a transaction.
	resetMark bool
	// fenceSession is the server connection's session number, which its
	// tokens are bound to (fenceline.bind_session(), drawn before the first
	// token; DISCARD forgets it): 0 while unbound, -1 when binding failed
	// (tokens then carry 0, which Postgres refuses). Client loop only, as
	// is the token last made for it.
	fenceSession int64
	tokLease     string
	tokFence     uint64
	tokSession   int64
	tokStr       string
	// rw: what the server is running was sent under a live lease in a
	// transaction the proxy made writable (it carries the token). The
	// client loop sets it before such a unit goes out and clears it when
	// the next unit begins, everything before it answered; the lease
	// watcher cancels the running statement of a session with rw set once
	// the lease is not live. (Units the proxy decided with the lease lost
	// are refusals or run read-only: never cancelled.)
	rw       atomic.Bool
	done     chan struct{}
	doneOnce sync.Once
}

const (
	stmtNone int32 = iota
	stmtPending
	stmtReady
)

const (
	internalStmtName = "fenceline_internal_" // + the statement's index
	rwStmtName       = "fenceline_rw"
	roStmtName       = "fenceline_ro"
	tokStmtName      = "fenceline_tok"
	spStmtName       = "fenceline_sp"
	tokSpStmtName    = "fenceline_toksp"
	refuseName       = "fenceline_refuse"
	checkName        = "fenceline_check"
	rwSQL            = "SET transaction_read_only = off"
	roSQL            = "SET transaction_read_only = on"
	// The token's statements return booleans, not the token. Each is a
	// plan of one Result node, every column of its target list evaluated,
	// rather than function scans in FROM (materialized, joined): within a
	// few µs of each other straight to Postgres (docs/benchmarks.md, stop
	// 74).
	// The search path goes as hex of its UTF8 text (pinnedPathHex):
	// Postgres converts a Bind's text parameters from the client encoding
	// in force when the Bind runs, which a SET client_encoding earlier in
	// the pipeline may have changed (found by a review: the path "é" was
	// pinned as "Ã©" after a switch to LATIN1).
	tokSQL   = "SELECT pg_catalog.set_config('fenceline.token', $1, true) IS NULL"
	spSQL    = "SELECT pg_catalog.set_config('search_path', pg_catalog.convert_from(pg_catalog.decode($1, 'hex'), 'UTF8'), true) IS NULL"
	tokSpSQL = "SELECT pg_catalog.set_config('fenceline.token', $1, true) IS NULL, pg_catalog.set_config('search_path', pg_catalog.convert_from(pg_catalog.decode($2, 'hex'), 'UTF8'), true) IS NULL"
)

func newSession(p *Proxy, c net.Conn) *session {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	s := &session{
		p: p, client: c,
		stmts: map[string]*Statement{}, portals: map[string]*Statement{},
		idle: make(chan struct{}, 1), done: make(chan struct{}),
	}
	s.srvEncCuts.Store(true) // until the server reports UTF8
	s.encUnsafe.Store(true)  // until the client's encoding is reported
	return s
}

// abort tears the session down from outside (Proxy.Close), and at its
// end.
func (s *session) abort() {
	s.doneOnce.Do(func() { close(s.done) })
	s.amu.Lock()
	s.aborted = true
	lp := s.lp
	s.amu.Unlock()
	if lp != nil {
		lp.abort()
		return
	}
	s.client.Close()
	if s.server != nil {
		s.server.Close()
	}
}

func (s *session) serve() {
	defer s.abort()
	ok, err := s.startup()
	if err != nil {
		s.p.log.Info("session ended during startup", "client", s.client.RemoteAddr().String(), "err", err)
	}
	if !ok {
		return
	}
	s.status.Store(uint32(s.txStatus))
	s.sim = txSim{}
	var rerr error
	if s.moveToLoop() {
		err, rerr = s.serveOnLoop()
	} else {
		relayDone := make(chan error, 1)
		go func() { relayDone <- s.relay() }()
		err = s.clientLoop()
		s.endBackend(err)
		rerr = <-relayDone
	}
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		s.p.log.Info("session ended", "client", s.client.RemoteAddr().String(), "user", s.user, "err", err)
	} else if rerr != nil && !errors.Is(rerr, io.EOF) && !errors.Is(rerr, net.ErrClosed) {
		s.p.log.Debug("relay ended", "err", rerr)
	}
}

// relayGrace bounds how long the relay reads what the server still sends
// once the client loop has ended the session.
const relayGrace = 5 * time.Second

// endBackend ends the server's side once the client loop ended with err:
// whatever ended it, the backend must not stay in a transaction or in
// COPY, so it fails a COPY, then terminates the session; the relay then
// reads what the server still sends, for relayGrace at most.
func (s *session) endBackend(err error) {
	s.qmu.Lock()
	busy := len(s.queue) > 0 // not outstanding: an Execute sent with Flush, no Sync, runs too
	s.qmu.Unlock()
	if err != nil && busy && !s.copyIn.Load() && s.p.ctx.Err() == nil {
		// The client vanished with a statement running. Postgres would not
		// notice until the statement ends (and the client's own
		// CancelRequest, sent on a new connection, can arrive after this
		// session is gone): cancel it here. (Not when the proxy itself is
		// closing: Terminate below ends the session.)
		s.blocking(func() {
			if cerr := s.p.cancelUpstream(s.key); cerr != nil {
				s.p.log.Warn("running statement of a vanished client not cancelled", "pid", s.key.pid, "err", cerr)
			}
		})
	}
	s.setServerDeadline(time.Now().Add(relayGrace))
	if s.copyIn.Load() {
		var w msgBuilder
		at := w.begin('f')
		w.str("fenceline: the client went away during COPY")
		w.end(at)
		s.sw.Write(w.b)
	}
	s.sw.Write([]byte{'X', 0, 0, 0, 4})
	s.sw.Flush()
	s.closeServerWrite()
	s.doneOnce.Do(func() { close(s.done) })
}

// writeClientRaw writes one message to the client and flushes.
func (s *session) writeClientRaw(b []byte) error {
	s.lockClient()
	defer s.unlockClient()
	if s.cw == nil {
		_, err := s.client.Write(b)
		return err
	}
	if _, err := s.cw.Write(b); err != nil {
		return err
	}
	return s.cw.Flush()
}

// fatal sends a FATAL error to the client and returns err.
func (s *session) fatal(err error) error {
	s.writeClientRaw(errorResponse('E', "FATAL", "08P01", "fenceline: "+err.Error(), "",
		"the connection is closed; the server rolled back any open transaction"))
	return err
}

// copyFail records the refusal of a COPY FROM STDIN whose lease was lost
// and returns the CopyFail message that ends it in Postgres.
func (s *session) copyFail(li leaseInfo) []byte {
	st := &Statement{Class: ClassWrite, Tag: "CopyStmt"}
	why := "no lease"
	if li.err != nil {
		why = li.err.Error()
	}
	r := &refusal{code: lease.LeaseReason(li.err), reason: "lease lost while this transaction was writable: " + why,
		hint: "nothing this COPY sent lands; ROLLBACK, and copy again under a live lease"}
	msg, _ := s.record(r, st, li, "COPY FROM STDIN")
	var w msgBuilder
	at := w.begin('f')
	w.str(msg)
	w.end(at)
	return w.b
}

// flushServer sends what the client loop has buffered.
func (s *session) flushServer() error { return s.sw.Flush() }

// clientLoop reads client messages and forwards them, fenced.
func (s *session) clientLoop() error {
	for {
		s.yieldIfLong(s.cr)
		if err := s.forwardIfStalled(); err != nil {
			return err
		}
		t, raw, err := s.cr.next()
		if err != nil {
			if errors.Is(err, ErrProtocol) {
				return s.fatal(err)
			}
			return err
		}
		switch t {
		case 'd', 'c', 'f': // COPY sub-protocol: straight through
			err = s.copyMessage(t, raw)
		case 'Q':
			err = s.unitMessage("Query", raw, s.handleQuery)
		case 'F':
			err = s.unitMessage("FunctionCall", raw, s.handleFunctionCall)
		case 'P', 'B', 'E', 'D', 'C':
			err = s.holdMessage(t, raw)
		case 'S', 'H':
			err = s.syncMessage(t, raw)
		case 'X':
			return nil
		default:
			return s.fatal(fmt.Errorf("%w: unknown message type %q", ErrProtocol, t))
		}
		if err != nil {
			return err
		}
		if s.cr.buffered() == 0 {
			if err := s.flushServer(); err != nil {
				return err
			}
		}
	}
}

// forwardIfStalled forwards a held prefix that runs nothing when the
// client pauses after it (see awaitClient, forwardStalled).
func (s *session) forwardIfStalled() error {
	if len(s.seg) > 0 && !s.segExec && s.cr.buffered() == 0 && !s.copyIn.Load() && s.stallable() {
		stalled, err := s.awaitClient()
		if err != nil {
			return err
		}
		if stalled {
			return s.forwardStalled()
		}
	}
	return nil
}

// copyMessage forwards a message of the COPY sub-protocol (CopyData,
// CopyDone, CopyFail).
func (s *session) copyMessage(t byte, raw []byte) error {
	if t == 'c' && (s.sim.blockRW || s.sim.groupRW) {
		// The lease was lost during COPY FROM STDIN into a
		// writable transaction: fail it rather than let it land.
		// (Not only when the relay has seen CopyInResponse: a
		// client may send its data and CopyDone before that.
		// Postgres ignores CopyFail outside COPY.)
		if li := s.lease(); !li.live() {
			raw = s.copyFail(li)
		}
	}
	if t != 'd' {
		s.copyIn.Store(false)
	}
	_, err := s.sw.Write(raw)
	return err
}

// unitMessage decides a message that is a unit of its own (what: a Query
// or a FunctionCall) with handle, once the held segment is decided, a
// stalled prefix's transaction ended, and the server has answered every
// earlier unit.
func (s *session) unitMessage(what string, raw []byte, handle func([]byte) error) error {
	if err := s.flushSegment(); err != nil {
		return err
	}
	if err := s.endStalledFor(what); err != nil {
		return err
	}
	if err := s.beginUnit(); err != nil {
		return s.cancelOr(err, nil)
	}
	return handle(raw)
}

// holdMessage holds an extended-protocol message (Parse, Bind, Execute,
// Describe, Close) until its Sync or Flush.
func (s *session) holdMessage(t byte, raw []byte) error {
	if len(s.seg) > 4096 || len(s.segBuf) > s.p.cfg.MaxMessageSize {
		// A pipeline this long without Sync or Flush: decide what we have.
		if err := s.flushSegment(); err != nil {
			return err
		}
	}
	s.seg = append(s.seg, segMsg{typ: t, off: len(s.segBuf), n: len(raw)})
	s.segBuf = append(s.segBuf, raw...)
	s.segExec = s.segExec || t == 'E'
	s.segBind = s.segBind || t == 'B'
	return nil
}

// syncMessage ends the held segment with a Sync or Flush and decides it.
func (s *session) syncMessage(t byte, raw []byte) error {
	if t == 'S' && s.copyIn.Load() && len(s.seg) == 0 {
		// Postgres ignores Sync during COPY FROM STDIN.
		_, err := s.sw.Write(raw)
		return err
	}
	s.seg = append(s.seg, segMsg{typ: t, off: len(s.segBuf), n: len(raw)})
	s.segBuf = append(s.segBuf, raw...)
	return s.flushSegment()
}

// busy: the server has not answered everything sent to it (a statement may
// be running).
func (s *session) busy() bool {
	s.qmu.Lock()
	defer s.qmu.Unlock()
	return len(s.queue) > 0
}

func (s *session) waitIdle() error {
	if err := s.flushServer(); err != nil {
		return err
	}
	for {
		s.qmu.Lock()
		n := s.outstanding
		s.qmu.Unlock()
		if n == 0 {
			return nil
		}
		if err := s.waitWake(); err != nil {
			return err
		}
	}
}

// internalResult collects the answer to a query the proxy sends itself.
type internalResult struct {
	rows [][]string
	err  error
	done chan struct{}
}

// internalQuery runs statements on the backend between client units, in
// one implicit transaction, and returns their rows as text. It speaks the
// extended protocol with a statement and a portal of its own names (closed
// before and after): a simple Query would destroy the client's unnamed
// prepared statement, which may still be due for a Bind (pgx's
// describe-exec mode prepares it, Syncs, then binds it), and its unnamed
// portal.
func (s *session) internalQuery(stmts ...string) ([][]string, error) {
	var w msgBuilder
	res := &internalResult{done: make(chan struct{})}
	var items []*expect
	single := func() { items = append(items, &expect{kind: expSingle, internal: res}) }
	for i, q := range stmts {
		name := internalStmtName + strconv.Itoa(i)
		// Not an error when there is none. A portal of that name is left
		// when an internal query failed in the client's block (its
		// Execute failed, so its Close was skipped): a Bind to it would
		// fail.
		w.close('P', name)
		single()
		w.close('S', name)
		single()
		w.parse(name, q)
		single()
		w.bind(name, name)
		single()
		w.execute(name)
		items = append(items, &expect{kind: expExecute, internal: res})
		w.close('P', name)
		single()
		w.close('S', name)
		single()
	}
	w.sync()
	items = append(items, &expect{kind: expSync, internal: res})
	s.push(items...)
	sql := strings.Join(stmts, "; ")
	if _, err := s.sw.Write(w.b); err != nil {
		return nil, err
	}
	if err := s.waitIdle(); err != nil {
		return nil, err
	}
	<-res.done
	var ended *sessionEndedError
	if errors.As(res.err, &ended) {
		return nil, ended
	}
	if ce, ok := cancelled(res.err); ok {
		return nil, ce // the client's: never a *queryError, which callers may pass over
	}
	if res.err != nil {
		return nil, &queryError{sql: sql, err: res.err}
	}
	return res.rows, nil
}

// queryError: the server refused a query of the proxy's own.
type queryError struct {
	sql string
	err error
}

func (e *queryError) Error() string { return fmt.Sprintf("fenceline's own query %q: %v", e.sql, e.err) }

func (e *queryError) Unwrap() error { return e.err }

// leaseInfo is the lease as one unit sees it.
type leaseInfo struct {
	id     string
	repo   string
	owner  lease.Owner
	claim  scope.Claim
	tables []string
	fence  uint64 // 0 when not live
	err    error  // why not live
	known  bool
}

func (s *session) lease() leaseInfo {
	src := s.p.cfg.Lease
	if src == nil {
		return leaseInfo{err: errors.New("this proxy has no lease")}
	}
	var (
		f   uint64
		err error
	)
	if nw, ok := src.(noWaitFencer); ok && s.lp != nil {
		f, err = nw.FenceNoWait() // on the loop: see noWaitFencer
	} else {
		f, err = src.Fence()
	}
	l := src.Lease()
	li := leaseInfo{id: l.LeaseID, repo: l.Repo, owner: l.Owner, claim: l.Scope, tables: l.Scope.Tables, known: true}
	if err != nil {
		li.err = err
		li.fence = l.Fence
		return li
	}
	li.fence = f
	return li
}

func (li leaseInfo) live() bool { return li.err == nil && li.fence > 0 }

// How a session on goroutines waits and ends (a session on the proxy's
// event loop does the same on the loop: loop_linux.go).

// goWakeClient tells the client loop the relay popped a ReadyForQuery.
func (s *session) goWakeClient() {
	select {
	case s.idle <- struct{}{}:
	default:
	}
}

// goWaitWake waits for goWakeClient or the session's end.
func (s *session) goWaitWake() error {
	select {
	case <-s.idle:
		return nil
	case <-s.done:
		return net.ErrClosed
	}
}

// goWaitChan waits for ch to close, up to timeout; false when it did not.
func goWaitChan(ch <-chan struct{}, timeout time.Duration) bool {
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	select {
	case <-ch:
		return true
	case <-timer.C:
		return false
	}
}

func (s *session) goSetServerDeadline(d time.Time) {
	s.server.SetReadDeadline(d) //nolint:errcheck // a closed socket fails the read anyway
}

func (s *session) goCloseServerWrite() {
	if cw, ok := s.server.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite() //nolint:errcheck // the relay sees how the server ends
	}
}

// noWaitFencer is a lease source whose fence can be read without waiting
// (*leasebus.Holder's Fence asks nats.go whether the connection is up,
// which waits while a reconnect dials). A session on the event loop reads
// it so: a wait there would hold every session on the loop.
type noWaitFencer interface {
	FenceNoWait() (uint64, error)
}
