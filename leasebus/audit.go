package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// serviceAuditSubject carries the lease service's own events of a repo
// (see AuditStream).
func serviceAuditSubject(key string) string {
	return AuditSubject + "." + key + "." + lease.BoundaryLease
}

// serviceWriter is the writer token of events no identity caused.
const serviceWriter = "service"

// eventsSubjectFor carries the events of repo at boundary that identity
// writer sent or caused (see EventsStream): the events stream keeps at
// most eventsPerWriter of each, so one writer's flood drops its own.
func eventsSubjectFor(repo, boundary, writer string) string {
	if !validIdentity(writer) {
		writer = serviceWriter
	}
	return EventsSubject + "." + RepoKey(repo) + "." + boundary + "." + writer
}

// AuditSource is one stream of the audit and the subjects of it that
// hold a repo's events.
type AuditSource struct {
	Stream, Filter string
}

// AuditSources are where the audit of repo (every repo when empty) is:
// the lease service's lease events, then every other event. Readers merge
// them by the time each message was stored.
func AuditSources(repo string) []AuditSource {
	key := "*"
	if repo != "" {
		key = RepoKey(repo)
	}
	return []AuditSource{
		{Stream: AuditStream, Filter: AuditSubject + "." + key + "." + lease.BoundaryLease},
		{Stream: EventsStream, Filter: EventsSubject + "." + key + ".*.*"},
	}
}

// auditDelay is how long the service gathers audit events before writing
// them: one fsync for every event of that window. The events are already
// durable in the lease log (each record carries its batch's events), so a
// crash in the window loses nothing: whoever next loads the log writes them.
const auditDelay = 20 * time.Millisecond

// maxAuditEvents bounds the events of one audit message, so a backlog
// (after an outage) never makes a message too large to publish; a log
// record's events always travel together.
const maxAuditEvents = 512

// auditCatchUpEvery is how often a service checks that no lease log record
// escaped it: one written by an instance killed before it wrote the
// record's audit events and before it announced the record.
const auditCatchUpEvery = 2 * time.Second

// auditWriter writes the lease service's audit events: per repo, a chain
// of messages on AuditSubject.<repoKey>.lease, each covering the lease
// log records after the previous message's up to its own LogSeq, each
// appended with compare-and-swap on the subject's last sequence. See
// "Audit" in the package documentation for why this is complete and
// writes every event exactly once.
type auditWriter struct {
	js    jetstream.JetStream
	log   *slog.Logger
	warns *warnings // a fault fails every repo's flush alike: repeats held back
	// writer is the service instance's id, stamped on its chain messages
	// (see serviceWrote).
	writer string

	mu     sync.Mutex
	chains map[string]*auditChain // by repo key; guarded by mu
	wake   chan struct{}
	// progress is closed when a chain's mark moves on (progressed);
	// guarded by mu.
	progress chan struct{}

	// seen holds the lease log sequences (of every repo) handed to record
	// above floor, every sequence up to which the catch-up has accounted
	// for: each log stream sequence is one record, so the catch-up can
	// tell whether any record escaped this instance.
	seenMu sync.Mutex
	seen   map[uint64]struct{} // guarded by seenMu
	floor  uint64              // guarded by seenMu
	// killed makes the writer write nothing, not even on Stop: tests use
	// it to play an instance killed with its events unwritten.
	killed atomic.Bool
}

// auditChain is where one repo's audit chain stands, as far as this
// instance knows. The actor of the repo hands it every log record in log
// order (its own appends and every record it loads), so the records
// between mark and tip are all known here.
type auditChain struct {
	// mark is the log sequence up to which every record's events are in
	// the audit stream; last is the audit stream sequence of the message
	// that says so (0: none), the expectation of the next message.
	mark, last uint64
	// ready: mark and last were read from the stream (or set since by our
	// own acknowledged message); reread: the stream moved on without us,
	// or an outcome is unknown.
	ready, reread bool
	// tip is the newest log record handed to record; recs are the records
	// in (mark, tip] that carry events, oldest first.
	tip  uint64
	recs []auditRec
}

type auditRec struct {
	seq    uint64
	events []lease.AuditEvent
}

// auditBatch is one message on the audit stream.
type auditBatch struct {
	Events []lease.AuditEvent `json:"events"`
	// LogSeq: the events of every lease-log record of this repo up to
	// this sequence are in the audit stream, in this message or an
	// earlier one (absent on boundary events).
	LogSeq uint64 `json:"logSeq,omitempty"`
	// From is the previous message's LogSeq: this message carries the
	// events of the records in (From, LogSeq].
	From uint64 `json:"from,omitempty"`
}

func newAuditWriter(js jetstream.JetStream, log *slog.Logger, writer string) *auditWriter {
	return &auditWriter{js: js, log: log, warns: newWarnings(warnEvery), writer: writer, chains: map[string]*auditChain{}, wake: make(chan struct{}, 1), seen: map[uint64]struct{}{},
		progress: make(chan struct{})}
}

// progressed is closed the next time a chain's mark moves on (covered
// grows): what a repo waiting for room in its log waits on.
func (w *auditWriter) progressed() <-chan struct{} {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.progress
}

// advanced wakes whoever waits on progressed; w.mu is held.
func (w *auditWriter) advanced() {
	close(w.progress)
	w.progress = make(chan struct{})
}

// poke has the writer flush soon (without waiting for a new event).
func (w *auditWriter) poke() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *auditWriter) chain(key string) *auditChain {
	c := w.chains[key]
	if c == nil {
		c = &auditChain{}
		w.chains[key] = c
	}
	return c
}

// record takes the lease log record seq of a repo with its audit events
// (none for renewals and snapshots). Records must come in log order and
// without gaps, from the start of the log as loaded: records at or before
// what is already known are ignored.
func (w *auditWriter) record(key string, seq uint64, evs []lease.AuditEvent) {
	w.seenMu.Lock()
	if seq > w.floor {
		w.seen[seq] = struct{}{}
	}
	w.seenMu.Unlock()
	w.mu.Lock()
	c := w.chain(key)
	if seq <= c.tip || seq <= c.mark {
		w.mu.Unlock()
		return
	}
	c.tip = seq
	if len(evs) > 0 {
		c.recs = append(c.recs, auditRec{seq: seq, events: evs})
	}
	w.mu.Unlock()
	if len(evs) > 0 {
		select {
		case w.wake <- struct{}{}:
		default:
		}
	}
}

// markSeen accounts for log sequence seq (a record of no repo) for the
// catch-up.
func (w *auditWriter) markSeen(seq uint64) {
	w.seenMu.Lock()
	defer w.seenMu.Unlock()
	if seq > w.floor {
		w.seen[seq] = struct{}{}
	}
}

// forget drops the chain of key, a log of no repo, unless it has events
// to write.
func (w *auditWriter) forget(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if c := w.chains[key]; c != nil && len(c.recs) == 0 {
		delete(w.chains, key)
	}
}

// auditedTo is the log sequence up to which the repo's events are in the
// audit stream: the chain's mark, as this instance knows it or else read
// from the stream (0 when it cannot be read: a load then reads every
// record the log keeps of the repo).
func (w *auditWriter) auditedTo(ctx context.Context, key string) uint64 {
	w.mu.Lock()
	if c := w.chains[key]; c != nil && c.ready && !c.reread {
		defer w.mu.Unlock()
		return c.mark
	}
	w.mu.Unlock()
	mark, _, err := w.readMark(ctx, key, 0)
	if err != nil {
		w.log.Debug("read the audit chain's mark before loading a lease log", "repo_key", key, "err", err)
		return 0
	}
	return mark
}

// covered reports the log sequence up to which a repo's events are in the
// audit stream as far as this instance knows (0: nothing known): the log
// must not drop records beyond it (actor.roomToAppend). Records without events need
// nothing written, so a repo that only renews is covered to its last
// record.
func (w *auditWriter) covered(key string) uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	c := w.chains[key]
	switch {
	case c == nil:
		return 0
	case len(c.recs) > 0:
		return c.recs[0].seq - 1
	}
	return c.tip
}

func (w *auditWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			// Last flush with a fresh deadline on a clean stop.
			fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			w.flush(fctx)
			cancel()
			return
		case <-w.wake:
		}
		select {
		case <-ctx.Done():
			continue // the final flush above
		case <-time.After(auditDelay):
		}
		if !w.flush(ctx) {
			// Keep the events and try again after a pause.
			select {
			case w.wake <- struct{}{}:
			default:
			}
			select {
			case <-ctx.Done():
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
}

// flush writes the pending events of every repo; it returns false if some
// could not be written (they stay pending).
func (w *auditWriter) flush(ctx context.Context) bool {
	if w.killed.Load() {
		return false
	}
	w.mu.Lock()
	var keys []string
	for key, c := range w.chains {
		if len(c.recs) > 0 {
			keys = append(keys, key)
		}
	}
	w.mu.Unlock()
	ok := true
	for _, key := range keys {
		if err := w.flushRepo(ctx, key); err != nil {
			w.warns.warn(w.log, time.Now(), "audit events not yet written; will retry", "repo_key", key, "err", err)
			ok = false
			if errors.Is(err, errAuditBusy) {
				break // the stream's leader refuses every chain alike
			}
		}
	}
	return ok
}

// errAuditBusy marks a flush the audit stream's leader refused twice
// because another write of the chain was still in flight there.
var errAuditBusy = errors.New("another write of the audit chain is still in flight at the audit stream's leader")

// flushRepo extends a repo's chain until every event it knew of when
// called is in the audit stream (those recorded meanwhile wait for the next
// flush: a repo appended to as fast as its messages are written would
// otherwise keep one flush to itself). A message lands only on top of the
// message it was built after; when another instance extended the chain
// first (or an earlier try whose answer was lost did), the chain is read
// again and only what it does not cover yet is sent. Only such a loss
// counts against the attempts: a backlog takes as many messages as it
// needs.
func (w *auditWriter) flushRepo(ctx context.Context, key string) error {
	const attempts = 8
	w.mu.Lock()
	target := uint64(0)
	if c := w.chain(key); len(c.recs) > 0 {
		target = c.recs[len(c.recs)-1].seq
	}
	w.mu.Unlock()
	busy := 0 // refusals while another write was in flight at the leader
	for lost := 0; lost < attempts; {
		w.mu.Lock()
		c := w.chain(key)
		need := !c.ready || c.reread
		w.mu.Unlock()
		if need {
			w.mu.Lock()
			from := c.last
			w.mu.Unlock()
			mark, last, err := w.readMark(ctx, key, from)
			if err != nil {
				return err
			}
			w.mu.Lock()
			c.ready, c.reread = true, false
			c.mark, c.last = max(c.mark, mark), last
			w.advanced()
			w.mu.Unlock()
		}

		w.mu.Lock()
		n := 0
		for n < len(c.recs) && c.recs[n].seq <= c.mark {
			n++
		}
		c.recs = c.recs[n:]
		c.tip = max(c.tip, c.mark)
		if len(c.recs) == 0 || c.mark >= target {
			w.mu.Unlock()
			return nil
		}
		b := auditBatch{From: c.mark}
		n = 0
		for n < len(c.recs) && (n == 0 || len(b.Events)+len(c.recs[n].events) <= maxAuditEvents) {
			b.Events = append(b.Events, c.recs[n].events...)
			b.LogSeq = c.recs[n].seq
			n++
		}
		if n == len(c.recs) {
			b.LogSeq = c.tip // the records after the last with events carry none
		}
		expect := c.last
		w.mu.Unlock()

		data, err := b.encode()
		if err != nil {
			return fmt.Errorf("encode audit events: %w", err)
		}
		msg := nats.NewMsg(serviceAuditSubject(key))
		msg.Header.Set(writerHeader, w.writer)
		msg.Data = data
		pctx, cancel := context.WithTimeout(ctx, publishTimeout)
		ack, err := w.js.PublishMsg(pctx, msg, jetstream.WithExpectLastSequencePerSubject(expect))
		cancel()
		w.mu.Lock()
		switch {
		case err == nil:
			c.mark, c.last = b.LogSeq, ack.Sequence
			w.advanced()
		case inFlightMismatch(err) && busy > 0:
			// Refused again while another write of the chain is in
			// flight at the stream's leader: a leader cut off from its
			// followers answers so at once for as long as the cut
			// lasts, and every repo's chain alike; asking again at once
			// would spin. The flush ends here and is tried again later.
			c.reread = true
			w.mu.Unlock()
			return fmt.Errorf("%w: write %d audit events of log records %d to %d: %w", errAuditBusy, len(b.Events), b.From+1, b.LogSeq, err)
		case isCASMismatch(err):
			// Another writer extended the chain (or, in flight at the
			// stream's leader, a write of it may be about to: read once
			// more): read it, send the rest.
			lost++
			if inFlightMismatch(err) {
				busy++
			}
			c.reread = true
		default:
			c.reread = true // it may have landed: the chain will tell
			w.mu.Unlock()
			return fmt.Errorf("write %d audit events of log records %d to %d: %w", len(b.Events), b.From+1, b.LogSeq, err)
		}
		w.mu.Unlock()
	}
	return fmt.Errorf("audit chain of %s: another writer extended it first %d times in one flush", key, attempts)
}

// readMark reads a repo's audit chain from the audit stream's leader (not
// a follower, which may lag): the LogSeq of the last message the service
// wrote on the repo's service subject, and the stream sequence of the last
// message there of any kind (the next message is written on top of it);
// zeros if none. A message the service did not write (a server's answer a
// client sent there, see serviceWrote) is passed over: when it is the
// last, the chain is read on from after from (the last message this
// writer knew, 0 for the whole chain).
func (w *auditWriter) readMark(ctx context.Context, key string, from uint64) (mark, last uint64, err error) {
	subj := serviceAuditSubject(key)
	m, err := storedMsg(ctx, w.js.Conn(), "$JS.API", AuditStream, msgGetRequest{LastBySubject: subj})
	if err != nil {
		return 0, 0, fmt.Errorf("read the audit chain of %s: %w", key, err)
	}
	if m == nil {
		return 0, 0, nil
	}
	last = m.Seq
	markOf := func(m *storedMessage) (uint64, error) {
		var b auditBatch
		if err := json.Unmarshal(m.Data, &b); err != nil {
			return 0, fmt.Errorf("decode audit message %d: %w", m.Seq, err)
		}
		return b.LogSeq, nil
	}
	if serviceWrote(m.Header) {
		mark, err = markOf(m)
		return mark, last, err
	}
	for seq := from + 1; seq < last; {
		m, err = storedMsg(ctx, w.js.Conn(), "$JS.API", AuditStream, msgGetRequest{Seq: seq, NextBySubject: subj})
		if err != nil {
			return 0, 0, fmt.Errorf("read the audit chain of %s: %w", key, err)
		}
		if m == nil || m.Seq >= last {
			break
		}
		if serviceWrote(m.Header) {
			if mark, err = markOf(m); err != nil {
				return 0, 0, err
			}
		}
		seq = m.Seq + 1
	}
	return mark, last, nil
}

// msgGetRequest is a JetStream STREAM.MSG.GET request.
type msgGetRequest struct {
	Seq           uint64 `json:"seq,omitempty"`
	LastBySubject string `json:"last_by_subj,omitempty"`
	NextBySubject string `json:"next_by_subj,omitempty"`
}

// storedMessage is a stream message as stored: its own headers, none of a
// direct get's.
type storedMessage struct {
	Subject string
	Seq     uint64
	Time    time.Time // when the stream stored it
	Data    []byte
	Header  nats.Header
}

// storedMsg reads one message of stream from its leader with the
// JetStream API (never a direct get, whose answer mixes the server's
// headers with the stored ones); nil when there is none.
func storedMsg(ctx context.Context, nc *nats.Conn, api, stream string, get msgGetRequest) (*storedMessage, error) {
	req, err := json.Marshal(get)
	if err != nil {
		return nil, fmt.Errorf("encode request: %w", err)
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, publishTimeout)
		defer cancel()
	}
	resp, err := nc.RequestWithContext(ctx, api+".STREAM.MSG.GET."+stream, req)
	if err != nil {
		return nil, err
	}
	var r struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Subject string    `json:"subject"`
			Seq     uint64    `json:"seq"`
			Time    time.Time `json:"time"`
			Hdrs    []byte    `json:"hdrs"`
			Data    []byte    `json:"data"`
		} `json:"message"`
	}
	if err := json.Unmarshal(resp.Data, &r); err != nil {
		return nil, fmt.Errorf("decode answer: %w", err)
	}
	if r.Error != nil {
		if r.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound {
			return nil, nil
		}
		return nil, r.Error
	}
	if r.Message == nil {
		return nil, errors.New("the answer carries no message")
	}
	m := &storedMessage{Subject: r.Message.Subject, Seq: r.Message.Seq, Time: r.Message.Time, Data: r.Message.Data, Header: nats.Header{}}
	if len(r.Message.Hdrs) > 0 {
		if m.Header, err = nats.DecodeHeadersMsg(r.Message.Hdrs); err != nil {
			return nil, fmt.Errorf("decode headers of message %d: %w", m.Seq, err)
		}
	}
	return m, nil
}

// unseen reports whether a log stream sequence up to last was never
// handed to record, and accounts for every sequence up to last.
func (w *auditWriter) unseen(last uint64) bool {
	w.seenMu.Lock()
	defer w.seenMu.Unlock()
	if last <= w.floor {
		return false
	}
	n := uint64(0)
	for seq := range w.seen {
		if seq <= last {
			n++
			delete(w.seen, seq)
		}
	}
	missing := last-w.floor > n
	w.floor = last
	return missing
}

// accountedTo accounts for every log sequence up to last (loadEvery read
// every repo's log to beyond it; records the stream dropped before were
// covered by the audit chain before they were dropped).
func (w *auditWriter) accountedTo(last uint64) {
	w.seenMu.Lock()
	defer w.seenMu.Unlock()
	if last <= w.floor {
		return
	}
	for seq := range w.seen {
		if seq <= last {
			delete(w.seen, seq)
		}
	}
	w.floor = last
}

// catchUp makes sure no lease log record escapes the audit: an instance
// killed after its append was acknowledged, but before it wrote the
// record's events and before it announced the record, leaves a record no
// other instance has loaded. Every sequence of the log stream is one
// record, so every auditCatchUpEvery it reads the stream's last sequence
// (one request) and checks that this instance has seen every record up to
// the last sequence of the period before; if one escaped it, every repo's
// actor reloads its log, which hands the record to the audit chain. It
// runs after loadEvery, which accounts for every record up to the stream's
// last sequence when it began (when a repo's log could not be read then,
// the first period accounts for the rest, at one reload of every repo).
func (s *Service) catchUp(ctx context.Context) {
	var prevLast uint64
	for {
		select {
		case <-ctx.Done():
			return
		case <-time.After(auditCatchUpEvery):
		}
		if !s.Primary() {
			continue // a standby reads no repo's log (primary.go)
		}
		if s.audit.unseen(prevLast) {
			s.syncAll(ctx)
		}
		stream, err := s.store.logStream(ctx)
		if err != nil {
			continue
		}
		ictx, cancel := context.WithTimeout(ctx, publishTimeout)
		info, err := stream.Info(ictx)
		cancel()
		if err != nil {
			continue
		}
		prevLast = info.State.LastSeq
	}
}

// syncAll has the actor of every repo with a lease log read its log to the
// end (starting actors for repos this instance has not served).
func (s *Service) syncAll(ctx context.Context) {
	keys, err := s.store.repoKeys(ctx)
	if err != nil {
		s.log.Warn("audit catch-up: list lease logs", "err", err)
		return
	}
	for _, key := range keys {
		if _, ok := s.existing(key); !ok {
			// A log this instance does not serve: a repo another instance
			// made, or only answers someone had the server send onto the
			// log (see serviceWrote), which start no actor.
			st := newRepoState("")
			_, err := s.store.load(ctx, key, st, 0, s.cfg.Now, func(seq uint64, _ []lease.AuditEvent) { s.audit.markSeen(seq) })
			if err == nil && st.repo == "" {
				continue
			}
		}
		if r := s.actor(key, "").ask(ctx, &call{op: "sync", req: &syncRequest{}}); r.Error != nil && ctx.Err() == nil {
			s.warns.warn(s.log, s.cfg.Now(), "audit catch-up: reload lease log", "repo_key", key, "err", r.Error.err())
		}
	}
}

// ReadAudit returns the audit events of one repo (every repo when repo is
// empty) in the order they were stored, starting at sequence from of each
// of its streams (AuditSources: the lease audit and the events). It reads
// the streams' leaders. Only the lease service writes them (boundaries'
// events reach them through the service, see Auditor), so only messages
// it wrote count, and an event on a boundary's subject counts only as
// that boundary's.
func ReadAudit(ctx context.Context, nc *nats.Conn, repo string, from uint64) ([]lease.AuditEvent, error) {
	type batch struct {
		at  time.Time
		evs []lease.AuditEvent
	}
	var all []batch
	api, err := jsAPI(ctx, nc)
	if err != nil {
		return nil, fmt.Errorf("read audit: %w", err)
	}
	for _, src := range AuditSources(repo) {
		for seq := max(from, 1); ; {
			m, err := storedMsg(ctx, nc, api, src.Stream, msgGetRequest{Seq: seq, NextBySubject: src.Filter})
			if err != nil {
				return nil, fmt.Errorf("read audit stream %s at %d: %w", src.Stream, seq, err)
			}
			if m == nil {
				break
			}
			seq = m.Seq + 1
			if !serviceWrote(m.Header) {
				continue // not the service's (see serviceWrote)
			}
			boundary := lease.BoundaryLease
			if src.Stream == EventsStream {
				toks := strings.Split(m.Subject, ".")
				boundary = toks[len(toks)-2]
			}
			var b auditBatch
			if err := json.Unmarshal(m.Data, &b); err != nil {
				return nil, fmt.Errorf("decode audit message %d of %s: %w", m.Seq, src.Stream, err)
			}
			kept := b.Events[:0]
			for _, ev := range b.Events {
				if ev.Boundary == boundary || (boundary == lease.BoundaryLease && ev.Boundary == "") {
					kept = append(kept, ev)
				}
			}
			all = append(all, batch{at: m.Time, evs: kept})
		}
	}
	slices.SortStableFunc(all, func(a, b batch) int { return a.at.Compare(b.at) })
	var out []lease.AuditEvent
	for _, b := range all {
		out = append(out, b.evs...)
	}
	return out, nil
}
