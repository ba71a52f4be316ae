// Stalls and replay: a held extended-protocol prefix that runs nothing
// goes out ahead of its Sync when the client pauses, and the proxy ends its
// transaction (binding its portals again) when what follows needs one it
// decides.

package pgproxy

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"
)

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
	if s.lp != nil {
		return s.waitClientReadable(stallAfter)
	}
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
		if m.typ == 'B' {
			s.stallBound = append(s.stallBound, m.bound)
		}
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

// clearReplay forgets the Binds and Closes kept for a replay, and what
// each Bind's statement name held: the two lists are one record, cleared
// together (a stale entry of stallBound would be taken for a later Bind's).
func (s *session) clearReplay() {
	clear(s.stallBound) // (no statement kept alive by a spent replay)
	s.stallReplay, s.stallBound = s.stallReplay[:0], s.stallBound[:0]
}

// replayable is stallReplay without the Binds whose statement name holds,
// now (stmts: the server's names as of the replay, before the segment that
// ends the prefix), another statement than when the Bind was tracked (or
// none): replayed, such a Bind would bind the portal to that other
// statement, while the proxy judges an Execute of the portal as the first
// (a read bound before a pause, and a write parsed under its name after
// it, ran unjudged: TestReplayBindsWhatWasJudged). Left out, the portal is
// not there and its Execute fails.
func (s *session) replayable(stmts map[string]*Statement) []byte {
	out := make([]byte, 0, len(s.stallReplay))
	b := 0
	for off := 0; off+5 <= len(s.stallReplay); {
		n := 1 + int(binary.BigEndian.Uint32(s.stallReplay[off+1:]))
		raw := s.stallReplay[off : off+n]
		off += n
		if raw[0] == 'B' {
			if b >= len(s.stallBound) {
				continue // (cannot be: one entry a kept Bind) not known, not replayed
			}
			bound := s.stallBound[b]
			b++
			if _, stmt, _, err := twoCStrings(raw[5:]); err != nil || bound == nil || stmts[stmt] != bound {
				continue
			}
		}
		out = append(out, raw...)
	}
	return out
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
	defer s.clearReplay()
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
