package pgproxy

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// session is one client connection and its backend.
//
// Two goroutines: the client loop (serve) reads the client, decides, and is
// the only writer to the server; the relay reads the server and is the only
// writer to the client once startup is over (under cmu, which the client
// loop takes only to send a fatal error). They share the expectation queue
// (under qmu), which says whose responses are coming next.
type session struct {
	p      *Proxy
	client net.Conn
	server net.Conn
	tls    bool

	cr  *msgReader    // client reader (client loop)
	sw  *bufio.Writer // server writer (client loop)
	sr  *msgReader    // server reader (relay)
	cmu sync.Mutex    // guards cw
	cw  *bufio.Writer // client writer

	user, database string
	key            backendKey

	// Client-loop state.
	txStatus    byte                  // from the last ReadyForQuery (set by the relay, read after waitIdle)
	sim         txSim                 // what the proxy believes about the current transaction
	stmts       map[string]*Statement // protocol-level prepared statements by name
	portals     map[string]*Statement // portals by name
	sqlPrep     map[string]*Statement // SQL-level PREPARE by name
	searchPath  []string              // nil: unknown
	seg         []segMsg              // pending extended-protocol messages
	pendingSync bool                  // extended messages went out since the last Sync
	segBuf      []byte
	segOut      []byte       // flushSegment's output, reused
	rwStmt      atomic.Int32 // state of our prepared "SET transaction_read_only = off"
	roStmt      atomic.Int32 // state of our prepared "SET transaction_read_only = on"
	tokStmt     atomic.Int32 // state of our prepared set_config for the token
	spStmt      atomic.Int32 // state of our prepared set_config for search_path
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
	forwarding  bool // forwardStalled is at work
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

	qmu         sync.Mutex
	queue       []*expect // guarded by qmu
	outstanding int       // ReadyForQuery-terminated items in queue; guarded by qmu
	idle        chan struct{}

	status atomic.Uint32 // txStatus as seen by the relay
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
	refuseName       = "fenceline_refuse"
	checkName        = "fenceline_check"
	rwSQL            = "SET transaction_read_only = off"
	roSQL            = "SET transaction_read_only = on"
	tokSQL           = "SELECT pg_catalog.set_config('fenceline.token', $1, true)"
	spSQL            = "SELECT pg_catalog.set_config('search_path', $1, true)"
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
	}{{rwStmtName, &s.rwStmt}, {roStmtName, &s.roStmt}, {tokStmtName, &s.tokStmt}, {spStmtName, &s.spStmt}} {
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
	s.sim.track(st.Tx)
}

// classify classifies a query text as Postgres will parse it. The
// classifier parses as Postgres does with standard_conforming_strings on
// and the text in UTF-8; a text is parsed the same under every setting
// unless it holds a backslash (an escape in a string when
// standard_conforming_strings is off) or a byte >= 0x80 (in SJIS, BIG5,
// GBK, UHC, GB18030 and JOHAB a backslash may end a multibyte character,
// and Postgres converts the text before it parses it). Such a text is
// refused, reads included, when the session's settings (as Postgres last
// reported them) or unknown settings (changed may be true: a statement
// ran since they were reported) could make Postgres parse it otherwise.
func (s *session) classify(sql string, changed bool) *Classification {
	var why string
	if (changed || s.scsOff.Load()) && strings.IndexByte(sql, '\\') >= 0 {
		why = "the text has a backslash and standard_conforming_strings is off"
		if changed {
			why = "the text has a backslash and an earlier statement of this pipeline may have changed standard_conforming_strings"
		}
	} else if changed || s.encUnsafe.Load() {
		for i := 0; i < len(sql); i++ {
			if sql[i] >= 0x80 {
				why = "the text has non-ASCII bytes and the client encoding is not UTF8"
				if changed {
					why = "the text has non-ASCII bytes and an earlier statement of this pipeline may have changed client_encoding"
				}
				break
			}
		}
	}
	if why == "" {
		return s.p.classifier.Classify(sql)
	}
	return &Classification{Class: ClassWrite, Stmts: []Statement{{Class: ClassWrite, Opaque: true, Unsure: why,
		Start: 0, End: len(sql), Tag: "UnsureParse"}}}
}

// authorizeWrite decides a write statement (nil for reads): the lease and
// table scope, then the transaction it runs in — a block begun without the
// lease is read-only, and an implicit transaction that began with reads
// was not made writable. hint says how to send the write instead.
func (s *session) authorizeWrite(st *Statement, li leaseInfo, searchPath []string, hint string) *refusal {
	if st.Class != ClassWrite {
		return nil
	}
	if r := s.authorize(st, li, searchPath); r != nil {
		return r
	}
	if (s.sim.clientRO || s.clientRO) && !s.sim.blockRW && !s.sim.groupRW {
		return nil // read-only as the client asked: Postgres refuses it, as direct
	}
	if s.sim.inBlock && !s.sim.blockRW {
		return &refusal{code: ReasonReadOnlyTxn, reason: "the transaction block began while the lease was not held, so it is read-only",
			hint: "ROLLBACK, then BEGIN again while the lease is held"}
	}
	if !s.sim.inBlock && !s.sim.groupRW && st.Tx != TxOutside {
		return &refusal{code: ReasonReadOnlyTxn, reason: "this transaction began with reads before the write could be authorized", hint: hint}
	}
	return nil
}

// authorizeInTxn refuses what may not run in a transaction the proxy made
// writable: anything but ROLLBACK once the lease is not live (the
// transaction's token would still let a function that writes through, and
// COMMIT would land what it wrote before), and PREPARE TRANSACTION, whose
// writes would outlive the connection and the lease.
func (s *session) authorizeInTxn(st *Statement, li leaseInfo) *refusal {
	if !s.sim.blockRW && !s.sim.groupRW {
		return nil
	}
	if st.PrepareTx {
		return &refusal{code: ReasonFenceTamper, reason: "PREPARE TRANSACTION would keep this transaction's writes past its connection and its lease",
			hint: "COMMIT or ROLLBACK instead"}
	}
	if li.live() || st.Rollback || s.txStatus == 'E' {
		return nil // in a failed block, Postgres refuses all and COMMIT rolls back
	}
	why := "no lease"
	if li.err != nil {
		why = li.err.Error()
	}
	return &refusal{code: lease.LeaseReason(li.err), reason: "lease lost while this transaction was writable: " + why,
		hint: "ROLLBACK: nothing this transaction wrote may commit; reads work outside it"}
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

type segMsg struct {
	typ      byte
	replay   bool // sent again by the proxy (stallReplay): the answer is not the client's
	off, n   int
	st       *Statement // Execute: the statement it runs
	describe byte       // Describe: 'S' or 'P'
}

func newSession(p *Proxy, c net.Conn) *session {
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	return &session{
		p: p, client: c,
		stmts: map[string]*Statement{}, portals: map[string]*Statement{}, sqlPrep: map[string]*Statement{},
		idle: make(chan struct{}, 1), done: make(chan struct{}),
	}
}

// abort tears the session down from outside (Proxy.Close).
func (s *session) abort() {
	s.doneOnce.Do(func() { close(s.done) })
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
	relayDone := make(chan error, 1)
	go func() { relayDone <- s.relay() }()
	err = s.clientLoop()
	// Whatever ended the client loop, the backend must not stay in a
	// transaction or in COPY: fail a COPY, then terminate the session.
	s.qmu.Lock()
	busy := len(s.queue) > 0 // not outstanding: an Execute sent with Flush, no Sync, runs too
	s.qmu.Unlock()
	if err != nil && busy && !s.copyIn.Load() && s.p.ctx.Err() == nil {
		// The client vanished with a statement running. Postgres would not
		// notice until the statement ends (and the client's own
		// CancelRequest, sent on a new connection, can arrive after this
		// session is gone): cancel it here. (Not when the proxy itself is
		// closing: Terminate below ends the session.)
		if cerr := s.p.cancelUpstream(s.key); cerr != nil {
			s.p.log.Warn("running statement of a vanished client not cancelled", "pid", s.key.pid, "err", cerr)
		}
	}
	if s.copyIn.Load() {
		var w msgBuilder
		at := w.begin('f')
		w.str("fenceline: the client went away during COPY")
		w.end(at)
		s.sw.Write(w.b)
	}
	s.sw.Write([]byte{'X', 0, 0, 0, 4})
	s.sw.Flush()
	s.server.SetReadDeadline(time.Now().Add(5 * time.Second))
	if cw, ok := s.server.(interface{ CloseWrite() error }); ok {
		cw.CloseWrite() //nolint:errcheck
	}
	s.doneOnce.Do(func() { close(s.done) })
	rerr := <-relayDone
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) {
		s.p.log.Info("session ended", "client", s.client.RemoteAddr().String(), "user", s.user, "err", err)
	} else if rerr != nil && !errors.Is(rerr, io.EOF) && !errors.Is(rerr, net.ErrClosed) {
		s.p.log.Debug("relay ended", "err", rerr)
	}
}

// writeClientRaw writes one message to the client and flushes.
func (s *session) writeClientRaw(b []byte) error {
	s.cmu.Lock()
	defer s.cmu.Unlock()
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
		if len(s.seg) > 0 && !s.segExec && s.cr.buffered() == 0 && !s.copyIn.Load() && s.stallable() {
			stalled, err := s.awaitClient()
			if err != nil {
				return err
			}
			if stalled {
				if err := s.forwardStalled(); err != nil {
					return err
				}
			}
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
			if _, err := s.sw.Write(raw); err != nil {
				return err
			}
		case 'Q':
			if err := s.flushSegment(); err != nil {
				return err
			}
			if err := s.endStalledFor("Query"); err != nil {
				return err
			}
			if err := s.beginUnit(); err != nil {
				return err
			}
			if err := s.handleQuery(raw); err != nil {
				return err
			}
		case 'F':
			if err := s.flushSegment(); err != nil {
				return err
			}
			if err := s.endStalledFor("FunctionCall"); err != nil {
				return err
			}
			if err := s.beginUnit(); err != nil {
				return err
			}
			if err := s.handleFunctionCall(raw); err != nil {
				return err
			}
		case 'P', 'B', 'E', 'D', 'C':
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
		case 'S', 'H':
			if t == 'S' && s.copyIn.Load() && len(s.seg) == 0 {
				// Postgres ignores Sync during COPY FROM STDIN.
				if _, err := s.sw.Write(raw); err != nil {
					return err
				}
				break
			}
			s.seg = append(s.seg, segMsg{typ: t, off: len(s.segBuf), n: len(raw)})
			s.segBuf = append(s.segBuf, raw...)
			if err := s.flushSegment(); err != nil {
				return err
			}
		case 'X':
			return nil
		default:
			return s.fatal(fmt.Errorf("%w: unknown message type %q", ErrProtocol, t))
		}
		if s.cr.buffered() == 0 {
			if err := s.flushServer(); err != nil {
				return err
			}
		}
	}
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
		s.tainted.Store(false)
		if !s.unwrapped {
			s.p.log.Warn("default_transaction_read_only was switched off behind the proxy; switching it on again",
				"user", s.user, "client", s.client.RemoteAddr().String())
		}
		s.unwrapped = false
		if _, err := s.internalQuery("SET default_transaction_read_only = on"); err != nil {
			return err
		}
	}
	if s.resetMark && s.txStatus == 'I' {
		s.resetMark = false
		if _, err := s.internalQuery("RESET fenceline.verified"); err != nil {
			return err
		}
	}
	return nil
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
		select {
		case <-s.idle:
		case <-s.done:
			return net.ErrClosed
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
		w.close('S', name) // not an error when there is none
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
	f, err := src.Fence()
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

// refusal is why a write does not go through.
type refusal struct {
	code   string // the audit event's reason: one of the Reason constants
	reason string
	hint   string
}

// Audit reason codes of refused writes (the git fence's vocabulary where
// the two meet).
const (
	ReasonFenceTamper  = "fence-tamper"           // a statement that would switch the fence off, or writes its schema
	ReasonLeaseLost    = lease.ReasonLeaseLost    // the lease is lost or was never held
	ReasonLeaseUnknown = lease.ReasonLeaseUnknown // the bus cannot be reached: fail closed
	ReasonUnnamedTable = "unnamed-table"          // the tables a write touches cannot be named
	ReasonOutsideLease = lease.ReasonOutsideLease // a table outside the lease's table scope
	ReasonReadOnlyTxn  = "read-only-transaction"  // the transaction was not made writable under the lease
	ReasonUnsureParse  = "unsure-parse"           // Postgres may parse the text otherwise than the classifier
	ReasonOtherSession = "other-session"          // a statement that signals a backend not the session's own
)

// authorize decides one write statement against the lease.
func (s *session) authorize(st *Statement, li leaseInfo, searchPath []string) *refusal {
	if st.Unsure != "" {
		return &refusal{code: ReasonUnsureParse, reason: "Postgres may parse this text otherwise than fenceline did: " + st.Unsure,
			hint: "fenceline refuses it whatever the lease: send it with standard_conforming_strings on and client_encoding UTF8, or after a Sync"}
	}
	if st.TxRW && (s.sim.blockRW || s.sim.groupRW) && li.live() {
		return nil // READ WRITE in a transaction the proxy made writable: as it is
	}
	if st.Forbidden != "" {
		code := ReasonFenceTamper
		if st.Tag == signalTag {
			code = ReasonOtherSession
		}
		return &refusal{code: code, reason: "statement refused whatever the lease: " + st.Forbidden,
			hint: "fenceline refuses this statement whatever the lease"}
	}
	if !li.live() {
		why := "no lease"
		if li.err != nil {
			why = li.err.Error()
		}
		return &refusal{code: lease.LeaseReason(li.err), reason: "lease not held: " + why,
			hint: "reads still work; writes need a live lease: acquire a new lease and reconnect through its sidecar"}
	}
	if st.Opaque || st.WriteCheck {
		// (A checked write's tables are known only after it ran: a
		// policy on opaque writes decides it.)
		if r := s.policyRefusal(policy.ActionSQLOpaque, ""); r != nil {
			return r
		}
	}
	if st.Opaque && !s.p.cfg.AllowOpaque {
		what := st.Tag
		if st.Tag == "ParseError" {
			what = "text the parser rejected"
		}
		reason := fmt.Sprintf("cannot tell which tables %s writes; when in doubt fenceline refuses", what)
		if st.OpaqueWhy != "" {
			reason = fmt.Sprintf("cannot tell which tables %s writes: %s", what, st.OpaqueWhy)
		}
		return &refusal{code: ReasonUnnamedTable, reason: reason,
			hint: "writes whose tables cannot be named pass only when the fence runs with --pg-allow-opaque (fenceline run/sidecar; Config.AllowOpaque), under a live lease; otherwise write with INSERT/UPDATE/DELETE/MERGE/COPY on tables the lease claims"}
	}
	for _, t := range st.Targets {
		if r := s.checkTarget(t, li, searchPath); r != nil {
			return r
		}
		if st.Opaque {
			continue // (allowed as opaque: nothing more to follow)
		}
		if r := s.checkReach(st, t, li, searchPath); r != nil {
			return r
		}
	}
	return nil
}

func (s *session) checkTarget(t Target, li leaseInfo, searchPath []string) *refusal {
	if t.Temp || isTempSchema(t.Schema) {
		return nil // session-private
	}
	var cands []string
	if t.Schema != "" {
		cands = []string{t.Schema}
	} else {
		if searchPath == nil {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot resolve unqualified %q: search_path changed earlier in this query", t.Name),
				hint: "schema-qualify the table, or send the write as its own query"}
		}
		for _, sp := range searchPath {
			if isTempSchema(sp) || sp == "pg_catalog" {
				continue
			}
			cands = append(cands, sp)
		}
		if len(cands) == 0 {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("unqualified %q resolves to no schema the lease can claim", t.Name),
				hint: "schema-qualify the table"}
		}
	}
	for _, sch := range cands {
		if sch == Schema {
			return &refusal{code: ReasonFenceTamper, reason: "the fenceline schema holds the fence; nobody writes it through the proxy"}
		}
		name, err := joinTable(sch, t.Name)
		if err != nil {
			return &refusal{code: ReasonUnnamedTable, reason: fmt.Sprintf("cannot name table %s.%s: %v", sch, t.Name, err)}
		}
		if !li.claim.ContainsTable(name) {
			why := fmt.Sprintf("table %s is outside the lease's table scope %v", name, li.tables)
			if t.Schema == "" {
				why = fmt.Sprintf("unqualified %q may resolve to %s (search_path %s), outside the lease's table scope %v",
					t.Name, name, strings.Join(searchPath, ", "), li.tables)
			}
			return &refusal{code: ReasonOutsideLease, reason: why, hint: "acquire a lease that claims the table (--table schema.table or schema.*)"}
		}
		if r := s.policyRefusal(policy.ActionSQLWrite, name); r != nil {
			return r
		}
	}
	return nil
}

// joinTable is scope.JoinTable, with name "*" (a whole schema) giving
// "schema.*".
func joinTable(schema, name string) (string, error) {
	if name != "*" {
		return scope.JoinTable(schema, name)
	}
	n, err := scope.JoinTable(schema, "x")
	if err != nil {
		return "", err
	}
	return n[:len(n)-1] + "*", nil
}

func isTempSchema(s string) bool {
	return s == "pg_temp" || strings.HasPrefix(s, "pg_temp_")
}

// refuse records the refusal (log and audit) and returns SQL that makes the
// server itself raise the error, so the transaction state stays the one
// Postgres would have: a failed block stays failed, an implicit one rolls back.
func (s *session) refuse(r *refusal, st *Statement, li leaseInfo, text string) string {
	msg, detail := s.record(r, st, li, text)
	return refuseSQL(msg, detail, r.hint)
}

// record logs and audits a refusal and returns the message and detail the
// client is told.
func (s *session) record(r *refusal, st *Statement, li leaseInfo, text string) (msg, detail string) {
	owner := li.owner.String()
	msg, detail = refusalText(r, st, li)
	s.p.log.Warn("write refused", "lease", li.id, "owner", owner, "fence", li.fence, "reason", r.reason,
		"statement", st.Tag, "user", s.user)
	if s.p.cfg.Audit != nil {
		ev := lease.AuditEvent{
			Time: time.Now().UTC(), Type: lease.EventDenied, Boundary: lease.BoundaryPostgres,
			Repo: li.repo, LeaseID: li.id, Owner: li.owner, Scope: li.claim, Fence: li.fence,
			Reason: r.code, Message: fmt.Sprintf("postgres %s refused: %s; statement: %s", st.Tag, r.reason, truncate(text, 200)),
		}
		ctx, cancel := context.WithTimeout(s.p.ctx, s.p.cfg.AuditTimeout)
		if err := s.p.cfg.Audit.Record(ctx, ev); err != nil {
			s.p.log.Error("audit event for a refused write not recorded", "lease", li.id, "err", err)
		}
		cancel()
	}
	return msg, detail
}

// refusalText is the message and detail a refusal tells the client.
func refusalText(r *refusal, st *Statement, li leaseInfo) (msg, detail string) {
	msg = fmt.Sprintf("fenceline: write refused for lease %s (fence %d): %s", orNone(li.id), li.fence, r.reason)
	detail = fmt.Sprintf("lease %s, owner %s, fence %d; statement %s", orNone(li.id), orNone(li.owner.String()), li.fence, st.Tag)
	return msg, detail
}

// dropGuard decides a DROP ... IF EXISTS whose targets are all outside the
// claim (r says so): direct, Postgres answers a notice for each that does
// not exist, and so does the proxy — it forwards the DROP in a transaction
// it made writable, followed by a guard in the same transaction that
// raises r when the DROP wrote anything (the transaction got an xid: it
// dropped something that existed, or came to exist after any look the
// proxy could take), so Postgres rolls it back. No race: the guard sees
// what the DROP did. Only a Query of this one statement outside a block,
// under a live lease, where the proxy made the transaction writable
// (groupRW); everywhere else the refusal stands.
func (s *session) dropGuard(st *Statement, r *refusal, li leaseInfo, n int) bool {
	if r == nil || r.code != ReasonOutsideLease || !st.MissingOK || n != 1 || s.sim.inBlock || !s.sim.groupRW || !li.live() {
		return false
	}
	if st.Opaque && !s.p.cfg.AllowOpaque {
		return false
	}
	for _, t := range st.Targets {
		if s.checkTarget(t, li, s.searchPath) == nil {
			return false // a claimed target would write: the guard would refuse it
		}
	}
	return true
}

// dropGuardSQL is the guard dropGuard puts after the DROP, on one line (a
// refusal's CONTEXT, dropped like refuseSQL's).
func dropGuardSQL(msg, detail, hint string) string {
	q := func(s string) string { return "$fl_m$" + strings.ReplaceAll(s, "$", "") + "$fl_m$" }
	return "DO $fl_do$BEGIN IF pg_catalog.txid_current_if_assigned() IS NOT NULL THEN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = " +
		q(msg) + ", DETAIL = " + q(detail) + ", HINT = " + q(hint) + "; END IF; END$fl_do$"
}

func orNone(s string) string {
	if s == "" {
		return "(none)"
	}
	return s
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

// refuseSQL is a DO block raising SQLSTATE 42501 with msg.
func refuseSQL(msg, detail, hint string) string {
	q := func(s string) string { return "$fl_m$" + strings.ReplaceAll(s, "$", "") + "$fl_m$" }
	return "DO $fl_do$BEGIN RAISE EXCEPTION USING ERRCODE = '42501', MESSAGE = " + q(msg) +
		", DETAIL = " + q(detail) + ", HINT = " + q(hint) + "; END$fl_do$"
}

// needSearchPath learns search_path when a write in stmts names a table
// without a schema and the proxy does not know it.
func (s *session) needSearchPath(stmts []*Statement) error {
	if s.searchPath != nil {
		return nil
	}
	need := false
	for _, st := range stmts {
		if st == nil || st.Class != ClassWrite {
			continue
		}
		for _, t := range st.Targets {
			if t.Schema == "" && !t.Temp {
				need = true
			}
		}
	}
	if !need {
		return nil
	}
	// The schemas unqualified names resolve in, as Postgres sees them now:
	// search_path with $user expanded and schemas that do not exist left out.
	rows, err := s.internalQuery("SELECT pg_catalog.unnest(pg_catalog.current_schemas(false))")
	if err != nil {
		return err
	}
	s.searchPath = make([]string, 0, len(rows))
	for _, r := range rows {
		if len(r) == 1 {
			s.searchPath = append(s.searchPath, r[0])
		}
	}
	return nil
}

func parseSearchPath(v string) []string {
	out := []string{}
	for _, part := range strings.Split(v, ",") {
		part = strings.TrimSpace(part)
		if strings.HasPrefix(part, `"`) && strings.HasSuffix(part, `"`) && len(part) >= 2 {
			part = strings.ReplaceAll(part[1:len(part)-1], `""`, `"`)
		} else {
			part = strings.ToLower(part)
		}
		if part != "" {
			out = append(out, part)
		}
	}
	return out
}

// resolveSQLPrepared maps EXECUTE of a SQL-level prepared statement to the
// statement it runs, and tracks PREPARE and DEALLOCATE.
func (s *session) resolveSQLPrepared(st *Statement) *Statement {
	switch {
	case st.Prepare != "":
		s.sqlPrep[st.Prepare] = st.Inner
	case st.Deallocate != "":
		delete(s.sqlPrep, st.Deallocate)
		s.forgetOwnStatements(st.Deallocate)
	case st.Tag == "DeallocateStmt" || st.Tag == "DiscardStmt":
		clear(s.sqlPrep)
	case st.Execute != "":
		if in, ok := s.sqlPrep[st.Execute]; ok && in != nil {
			c := *in
			c.Start, c.End, c.Tag = st.Start, st.End, "ExecuteStmt("+in.Tag+")"
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
		s.push(&expect{kind: expQuery})
		_, err := s.sw.Write(raw)
		return err
	}
	stmts := make([]*Statement, len(cls.Stmts))
	for i := range cls.Stmts {
		stmts[i] = s.sequenceWrite(s.resolveSQLPrepared(&cls.Stmts[i]))
	}
	if err := s.needSearchPath(stmts); err != nil {
		return err
	}
	writable := s.unitWritable(stmts)
	if err := s.learnCatalog(stmts, writable || check, lookup); err != nil {
		return err
	}
	if check {
		if stmts[0], err = s.checkedWrite(stmts[0]); err != nil {
			return err
		}
		writable = s.unitWritable(stmts)
	}
	for i := range stmts {
		stmts[i] = s.judgeCalls(stmts[i], writable)
	}
	li := s.lease()
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
	if between && len(stmts) == 1 {
		if err := s.unwrapOutside(stmts[0], li); err != nil {
			return err
		}
	}
	if li.live() && between {
		if err := s.bindFence(); err != nil {
			return err
		}
	}
	sp := s.searchPath
	var (
		out     strings.Builder
		items   []*expect
		inserts []insertion
		pos     int // next byte of sql not yet copied
		changed bool
		rwSeen  bool // a statement runs in a transaction made writable
	)
	inject := func(stmtsSQL ...string) {
		at := out.Len()
		n := 0
		for _, q := range stmtsSQL {
			out.WriteString(q)
			out.WriteString(";")
			n += len(q) + 1
			items = append(items, &expect{kind: expStmt, swallow: true})
		}
		inserts = append(inserts, insertion{at: at, n: n})
		changed = true
	}
	authorizeGroup := func(i int) {
		s.sim.decided = true
		if !groupWrites(stmts[i:], s.clientRO) || !li.live() || len(stmts) == 1 && stmts[0].Tx == TxOutside {
			// (A statement that must run alone runs in the session's
			// read-only default; Postgres decides whether it may.)
			if s.txEnded {
				// A new transaction after a COMMIT or ROLLBACK in this
				// Query: read-only whatever a function did to the default.
				inject(roSQL)
			}
			return
		}
		inject(rwSQL, setLocalToken(s.token(li)))
		s.sim.groupRW = true
	}
	for i, st := range stmts {
		if !s.sim.inBlock && !s.sim.decided {
			out.WriteString(sql[pos:st.Start])
			pos = st.Start
			authorizeGroup(i)
		}
		if st.Session {
			sp = nil
			s.sessionChanged(st)
		}
		rwSeen = rwSeen || s.sim.blockRW || s.sim.groupRW
		r := s.authorizeInTxn(st, li)
		if r == nil {
			r = s.authorizeWrite(st, li, spIfKnown(sp, s.searchPath), "send the write in its own query or start the transaction with BEGIN")
		}
		var guard *refusal
		if s.dropGuard(st, r, li, len(stmts)) {
			guard, r = r, nil
		}
		if r != nil {
			out.WriteString(sql[pos:st.Start])
			out.WriteString(s.refuse(r, st, li, sql[st.Start:st.End]))
			items = append(items, &expect{kind: expStmt})
			pos = len(sql)
			changed = true
			break
		}
		if unqualified(st) && !s.sim.spPinned && s.searchPath != nil && sp != nil {
			// Postgres 15 does not report search_path, and a function may
			// have changed it since the proxy learned it: the write
			// resolves its names with the path the proxy checked them
			// with, for the rest of its transaction (a writable block:
			// what a function in it does is the block's, see Known limits).
			out.WriteString(sql[pos:st.Start])
			pos = st.Start
			inject("SET LOCAL search_path = " + s.pinnedPath())
			s.sim.spPinned = true
		}
		s.passedDDL(st)
		items = append(items, &expect{kind: expStmt})
		if guard != nil {
			// The client's text, then the guard (after a newline: the
			// text may end in a comment).
			out.WriteString(sql[pos:])
			pos = len(sql)
			msg, detail := refusalText(guard, st, li)
			gst, text := st, sql[st.Start:st.End]
			inject("\n;" + dropGuardSQL(msg, detail, "the tables and schemas a DROP ... IF EXISTS names outside the lease's claim must not exist: acquire a lease that claims them"))
			items[len(items)-1].onError = func(map[byte]string) { s.record(guard, gst, li, text) }
			changed = true
		}
		if st.WriteCheck && s.sim.groupRW {
			// The check, last in the transaction (after a newline: the
			// text may end in a comment).
			out.WriteString(sql[pos:])
			pos = len(sql)
			cst, text := st, sql[st.Start:st.End]
			inject("\n;" + s.writeCheckSQL(st, li))
			items[len(items)-1].onError = func(f map[byte]string) { s.auditCheck(f, cst, li, text) }
		}
		if show := s.replacement(st); show != "" {
			// The client's own value, as a one-row SELECT of the same
			// column (the tag says SELECT 1, not SHOW); or the client's
			// own default set, Postgres's kept (see Statement.ClientRW).
			out.WriteString(sql[pos:st.Start])
			if d := len(show) - (st.End - st.Start); d > 0 {
				inserts = append(inserts, insertion{at: out.Len(), n: d})
			}
			out.WriteString(show)
			pos = st.End
			if pos < len(sql) && sql[pos] == ';' {
				pos++
				out.WriteString(";")
			}
			changed = true
		}
		s.trackTx(st)
		if st.Tx == TxChain {
			if s.sim.blockRW && i+1 < len(stmts) {
				out.WriteString(sql[pos:stmts[i+1].Start])
				pos = stmts[i+1].Start
				if li.live() {
					inject(setLocalToken(s.token(li)))
				}
			}
		}
	}
	if rwSeen && li.live() {
		s.rw.Store(true)
	}
	if !changed {
		s.push(&expect{kind: expQuery})
		_, err := s.sw.Write(raw)
		return err
	}
	out.WriteString(sql[pos:])
	items = append(items, &expect{kind: expQueryEnd, inserts: inserts})
	s.push(items...)
	var w msgBuilder
	w.query(out.String())
	_, err = s.sw.Write(w.b)
	return err
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

// unqualified reports whether st writes a table named without a schema.
func unqualified(st *Statement) bool {
	if st == nil || st.Class != ClassWrite || st.Tx == TxOutside {
		return false
	}
	for _, t := range st.Targets {
		if t.Schema == "" && !t.Temp {
			return true
		}
	}
	return false
}

// pinnedPath is the search path the proxy checked unqualified names with,
// as a search_path value: each schema quoted (” for none).
func (s *session) pinnedPath() string {
	if len(s.searchPath) == 0 {
		return "''"
	}
	var b strings.Builder
	for i, sch := range s.searchPath {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString(`"` + strings.ReplaceAll(sch, `"`, `""`) + `"`)
	}
	return b.String()
}

// setLocalToken is the statement that hands tok (hex and punctuation only:
// nothing to quote) to the storage-side fence for this transaction.
func setLocalToken(tok string) string { return "SET LOCAL fenceline.token = '" + tok + "'" }

func spIfKnown(sp, cur []string) []string {
	if sp == nil {
		return nil
	}
	return cur
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
		if st.Tx != TxNone && st.Tx != TxInBlock || st.Session || st.ClientRO != 0 || st.ShowDefaultRO || st.ClientRW || st.Prepare != "" || st.Deallocate != "" || len(st.Signals) > 0 || len(st.SignalParams) > 0 ||
			st.Tag == "DeallocateStmt" || st.Tag == "DiscardStmt" {
			return false
		}
	}
	return true
}

// sequenceWrite: a read that advances or sets sequences it names by
// constants (SELECT nextval('s'), how ORMs fetch ids) writes them. Outside
// a transaction block and under a live lease it is a write, so the proxy
// makes its transaction writable and it runs as direct, judged by what it
// writes: each sequence's tables, and every function it calls, as in a
// writable block (judgeCalls, judgeSequence). Without a live lease, or in
// a block (writable or not, the block decided), it stays a read: Postgres
// refuses its write in a read-only transaction, as before.
func (s *session) sequenceWrite(st *Statement) *Statement {
	if st == nil || st.Class != ClassRead || s.sim.inBlock || s.pendingSync || !advancesSequence(st) {
		return st
	}
	if !s.lease().live() {
		return st
	}
	cp := *st
	cp.Class = ClassWrite
	return &cp
}

// advancesSequence: st calls nextval or setval on a sequence it names by a
// constant (one it does not name, "?", judgeSequence refuses: left a read).
func advancesSequence(st *Statement) bool {
	named := false
	for _, c := range st.Calls {
		if c.Kind == 'q' {
			if c.Name == "?" {
				return false
			}
			named = true
		}
	}
	return named
}

// callsToJudge: a query the fast path would forward calls functions or
// operators that may write where the proxy does not look: in a transaction
// made writable, or dblink's anywhere (see judgeCalls).
func (s *session) callsToJudge(cls *Classification) bool {
	for i := range cls.Stmts {
		st := &cls.Stmts[i]
		if len(st.Calls) == 0 {
			continue
		}
		if s.foreignToJudge(st) || callsOtherConnection(st) || (s.sim.blockRW || s.sim.groupRW) && !s.callsKnownHarmless(st) {
			return true
		}
	}
	return false
}

// handleFunctionCall: the fast-path FunctionCall (large objects and the
// like) runs as its own statement, so the proxy cannot put the token next to
// it; it passes only inside a transaction block the proxy made writable.
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
		if !li.live() {
			r = s.authorize(st, li, s.searchPath)
		}
	default:
		r = s.authorize(st, li, s.searchPath)
		if r == nil {
			r = &refusal{code: ReasonReadOnlyTxn, reason: "a fast-path function call runs outside any transaction the proxy made writable",
				hint: "call it inside BEGIN ... COMMIT"}
		}
	}
	if r == nil {
		s.rw.Store(true) // in a block made writable, the lease live
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

// stallAfter is how long the proxy waits for the rest of an
// extended-protocol unit after a prefix that runs nothing (see stallable)
// before it forwards that prefix alone.
const stallAfter = 20 * time.Millisecond

// awaitClient waits up to stallAfter for the client's next message and
// reports whether none came. Held messages normally wait for Sync, so the
// proxy can decide the unit as a whole; but Postgres runs statement_timeout
// from the first message of a unit, and a client that pauses between Parse
// and Describe (pgx's tests do, on purpose) expects the timeout to fire
// during the pause, as it would direct.
func (s *session) awaitClient() (bool, error) {
	if err := s.client.SetReadDeadline(time.Now().Add(stallAfter)); err != nil {
		return false, err
	}
	_, err := s.cr.peek()
	if derr := s.client.SetReadDeadline(time.Time{}); derr != nil {
		return false, derr
	}
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true, nil
	}
	return false, err
}

// forwardStalled forwards a held prefix (Parse, Describe, Close, Binds of
// reads: nothing that runs a statement) as if the client had sent Flush. Its implicit
// transaction starts read-only, as every one does; reads that follow run
// in it as they would direct, and a write or transaction control that
// follows ends it first (flushSegment, endStalled).
func (s *session) forwardStalled() error {
	open := s.pendingSync // the client's Flush left its transaction open
	s.forwarding = !open || s.stalled
	err := s.flushSegment()
	if err != nil {
		s.forwarding = false
		return err
	}
	// Stalled only when the prefix opened the transaction (not when it was
	// skipped: see skipToSync). One the client opened and left open with
	// Flush may hold writes the proxy made writable for it: ending it with
	// a Sync of the proxy's own would commit them, where the client's own
	// Sync, after a later error, would roll them back.
	s.stalled = s.pendingSync && s.forwarding
	s.forwarding = false
	return s.flushServer()
}

// maxReplay bounds stallReplay: past it, a pipeline that paused keeps
// binding and never syncs, and the portals it bound before the proxy ends
// its transaction are not bound again (their Execute fails, as after a
// Sync).
const maxReplay = 1 << 20

// keepForReplay records the Binds and portal Closes of a segment sent into
// a stalled prefix's transaction, to bind its portals again if the proxy
// ends that transaction (endStalled).
func (s *session) keepForReplay(seg []segMsg, buf []byte) {
	for _, m := range seg {
		raw := buf[m.off : m.off+m.n]
		if m.replay || !(m.typ == 'B' || m.typ == 'C' && len(raw) > 5 && raw[5] == 'P') {
			continue
		}
		if len(s.stallReplay)+len(raw) > maxReplay {
			return
		}
		s.stallReplay = append(s.stallReplay, raw...)
	}
}

// stallable: the held segment runs nothing and binds no statement that
// would need a transaction the proxy decides (decidesTxn), so it may go
// out ahead of its Sync.
func (s *session) stallable() bool {
	if !s.segBind {
		return true
	}
	local := map[string]*Statement{}
	for _, m := range s.seg {
		body := s.segBuf[m.off+5 : m.off+m.n]
		switch m.typ {
		case 'P':
			name, q, _, err := twoCStrings(body)
			if err != nil {
				return false // flushSegment reports it
			}
			local[name] = extStatement(s.classify(q, true))
		case 'B':
			_, name, _, err := twoCStrings(body)
			if err != nil {
				return false
			}
			st, ok := local[name]
			if !ok {
				st = s.stmts[name]
			}
			if st == nil || decidesTxn([]*Statement{st}) {
				return false
			}
		}
	}
	return true
}

// withReplay puts the messages of replay (whole Bind and Close messages)
// in front of the segment, marked as the proxy's own.
func withReplay(replay []byte, seg []segMsg, buf []byte) ([]segMsg, []byte) {
	if len(replay) == 0 {
		return seg, buf
	}
	var out []segMsg
	for off := 0; off+5 <= len(replay); {
		n := 1 + int(binary.BigEndian.Uint32(replay[off+1:]))
		out = append(out, segMsg{typ: replay[off], off: off, n: n, replay: true})
		off += n
	}
	for _, m := range seg {
		m.off += len(replay)
		out = append(out, m)
	}
	return out, append(replay, buf...)
}

// decidesTxn: a statement in stmts needs a transaction the proxy decides
// from its start (made writable, or begun as a block).
func decidesTxn(stmts []*Statement) bool {
	for _, st := range stmts {
		if st != nil && (st.Class == ClassWrite || st.Tx != TxNone) {
			return true
		}
	}
	return false
}

// endStalled ends the implicit transaction a stalled prefix opened with a
// Sync of the proxy's own and reports whether Postgres accepted the prefix
// (the prefix's answers go to the client; the ReadyForQuery does not).
func (s *session) endStalled() (bool, error) {
	failed := new(atomic.Bool)
	var w msgBuilder
	w.sync()
	s.push(&expect{kind: expSync, swallow: true, failed: failed})
	if _, err := s.sw.Write(w.b); err != nil {
		return false, err
	}
	s.pendingSync, s.stalled = false, false
	defer func() { s.stallReplay = s.stallReplay[:0] }()
	if err := s.waitIdle(); err != nil {
		return false, err
	}
	return !failed.Load(), nil
}

// endStalledFor ends a stalled prefix's transaction before a message that
// is not part of the extended unit (what), whatever Postgres said to the
// prefix: its error has reached the client.
func (s *session) endStalledFor(what string) error {
	if !s.stalled || s.sim.inBlock {
		return nil
	}
	if _, err := s.endStalled(); err != nil {
		return fmt.Errorf("end a stalled extended-protocol unit before a %s: %w", what, err)
	}
	return s.beginUnit()
}

// skipToSync stands in for Postgres skipping messages after an error:
// Postgres refused a stalled prefix, but the proxy's Sync ended that, so
// it drops the client's messages up to its Sync and forwards the Sync
// alone (its ReadyForQuery is the client's).
func (s *session) skipToSync(seg []segMsg, buf []byte) error {
	last := seg[len(seg)-1]
	s.skipping = last.typ != 'S'
	if s.skipping {
		return nil
	}
	s.sim = txSim{}
	s.push(&expect{kind: expSync})
	_, err := s.sw.Write(buf[last.off : last.off+last.n])
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
