package leasebus

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

const (
	recordDelta    = "delta"
	recordSnapshot = "snapshot"
)

// logRecord is one message of a repo's lease log. A delta carries the full
// records of the leases one batch changed and the batch's audit events; a
// snapshot carries the whole state, from which a load may start (the
// stream keeps the repo's last logKeep records: see logKeep).
type logRecord struct {
	Kind   string             `json:"kind"`
	Repo   string             `json:"repo"`
	Fence  uint64             `json:"fence"`
	Prev   uint64             `json:"prev"` // the subject sequence this record was written on top of
	Leases []*entry           `json:"leases"`
	Events []lease.AuditEvent `json:"events,omitempty"`
}

// encode writes the record as json.Marshal would, but from each entry's
// cached JSON: a snapshot re-encodes nothing it has written before.
func (rec *logRecord) encode() ([]byte, error) {
	n := 128 + 320*len(rec.Events)
	for _, e := range rec.Leases {
		n += len(e.storedJSON()) + 1
	}
	b := make([]byte, 0, n)
	b = append(b, `{"kind":`...)
	b = appendJSON(b, rec.Kind)
	b = append(b, `,"repo":`...)
	b = appendJSON(b, rec.Repo)
	b = append(b, `,"fence":`...)
	b = strconv.AppendUint(b, rec.Fence, 10)
	b = append(b, `,"prev":`...)
	b = strconv.AppendUint(b, rec.Prev, 10)
	b = append(b, `,"leases":`...)
	if rec.Leases == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i, e := range rec.Leases {
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, e.storedJSON()...)
		}
		b = append(b, ']')
	}
	if len(rec.Events) > 0 {
		var err error
		if b, err = appendEvents(append(b, `,"events":`...), rec.Events); err != nil {
			return nil, fmt.Errorf("encode audit events: %w", err)
		}
	}
	return append(b, '}'), nil
}

func appendJSON(b []byte, s string) []byte { return appendString(b, s) }

// errCAS means another writer appended to the repo's log first (see
// also errLogBusy).
var errCAS = errors.New("lease log moved on")

// errDamaged marks a lease log that cannot be folded into a state: an
// undecodable record, a foreign repo, or a gap in the chain.
var errDamaged = errors.New("lease log damaged")

// errBehind: the records after a state's sequence are gone from the
// stream (logKeep newer ones of the repo followed them): the state must
// be read afresh.
var errBehind = errors.New("lease log moved past this view")

// logKeep is how many records of each repo the log stream keeps
// (MaxMsgsPerSubject): a new record past it drops the repo's oldest, one
// removal found through the stream's per-subject index. The lease service
// writes a snapshot at least every logKeep/2 records, so what the stream
// keeps of a repo always starts at or before a snapshot, and it appends
// nothing that would drop a record whose audit events are not yet in the
// audit stream (actor.roomToAppend). (Purging the records before each
// snapshot instead made the server walk every message of every repo
// stored since the repo's first record, in the stream's one apply
// goroutine on every replica: at 10,000 leases, a third of each node's
// CPU, with every append waiting behind it.)
const logKeep = 256

// store is the durable side of the lease bus: the log stream, written with
// compare-and-swap on the repo subject's last sequence.
type store struct {
	js       jetstream.JetStream
	replicas int
	writer   string          // this instance's id, stamped on every append
	boxes    *mailboxes      // for appends' acknowledgements
	metrics  *ServiceMetrics // counts appends (nil: none)

	mu     sync.Mutex
	stream jetstream.Stream // the log stream's handle, once looked up; guarded by mu
}

// logStream returns the log stream's handle, looking it up once: each
// lookup is a round trip to JetStream, and reads need only the
// stream's name.
func (s *store) logStream(ctx context.Context) (jetstream.Stream, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stream != nil {
		return s.stream, nil
	}
	stream, err := s.js.Stream(ctx, LogStream)
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", LogStream, err)
	}
	s.stream = stream
	return stream, nil
}

// writerHeader names the service instance that appended a record.
const writerHeader = "Fenceline-Writer"

func logSubjectFor(key string) string { return logSubject + "." + key }

// serviceWrote reports whether a stored log message was appended by a
// lease service instance. The bus keeps clients off the log subjects, but
// not the server's own answers: whoever may make a JetStream API request
// (a publish to a bucket it writes, a direct get) names any reply subject,
// and the server publishes its answer there, into whichever stream stores
// that subject. Such an answer carries no headers (a publish ack, an API
// response) or the stored message's headers behind the server's own
// Nats-Stream and Nats-Sequence (a direct get, so a forged writer header
// comes with those). The log stream is read with STREAM.MSG.GET (no direct
// gets), so a service's record shows exactly the headers it was written
// with.
func serviceWrote(h nats.Header) bool { return ServiceWrote(h) }

// ServiceWrote reports whether a message stored on the lease log or the
// audit stream, with headers h, was written by the lease service (see
// serviceWrote); a reader of either stream counts no other.
func ServiceWrote(h nats.Header) bool {
	return h.Get(writerHeader) != "" && h.Get(jetstream.StreamHeader) == "" && h.Get(jetstream.SequenceHeader) == ""
}

// ensureStreams creates (or updates) the bus's streams: the lease log,
// the lease audit, the events, and the shard store's buckets, each within
// its budget (streamBudgets), the log first.
func ensureStreams(ctx context.Context, js jetstream.JetStream, replicas int) error {
	if replicas < 1 {
		replicas = 1
	}
	return ensureBounded(ctx, js, []jetstream.StreamConfig{{
		Name:              LogStream,
		Description:       "fenceline lease log: per-repo deltas and snapshots, written with compare-and-swap",
		Subjects:          []string{logSubject + ".>"},
		Storage:           jetstream.FileStorage,
		Replicas:          replicas,
		Retention:         jetstream.LimitsPolicy,
		MaxMsgsPerSubject: logKeep,
		DenyDelete:        true,
		// Reads go through the stream leader: a load must see every
		// acknowledged record, never a lagging follower's copy.
		AllowDirect: false,
	}, {
		Name:        AuditStream,
		Description: "fenceline lease audit: grants, releases, expiries, reclaims and revokes, written by the lease service alone",
		Subjects:    []string{AuditSubject + ".*." + lease.BoundaryLease},
		Storage:     jetstream.FileStorage,
		Replicas:    replicas,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      30 * 24 * time.Hour,
		DenyDelete:  true,
		DenyPurge:   true,
		AllowDirect: true,
	}, {
		Name:        EventsStream,
		Description: "fenceline events: the boundaries' refusals and denied writes, the bus's reads, sweeps and refusals; per repo, boundary and writer",
		Subjects:    []string{EventsSubject + ".*.*.*"},
		Storage:     jetstream.FileStorage,
		Replicas:    replicas,
		Retention:   jetstream.LimitsPolicy,
		MaxAge:      30 * 24 * time.Hour,
		DenyDelete:  true,
		DenyPurge:   true,
		AllowDirect: true,
	},
		shardBucket(shardPoolStream, "fenceline shard pools, one record per repo", replicas),
		shardBucket(shardAttemptStream, "fenceline attempts, one record per attempt", replicas),
		policyStreamConfig(replicas),
		primaryStreamConfig(replicas),
	})
}

// Bounds of the shard store's buckets: a record's size, and how many
// records each keeps (and, in streamBudgets, their bytes). Pools refuse a
// new repo past shardMaxPools or their size; attempts drop their oldest
// record past shardMaxAttempts or their size (each attempt's record is
// rewritten as it moves on, so the oldest are settled ones).
const (
	shardMaxValue    = 64 << 10
	shardMaxPools    = 4096
	shardMaxAttempts = 1 << 16
)

// shardBucket is the stream of a shard store bucket (a JetStream KV
// bucket, History 1), made by the lease service so that nobody else needs
// the right to create streams: an operator who may create a stream may
// give it any subjects, the lease requests' included. Unlike a bucket
// nats.go would make, it takes no rollups and no purges (a holder's one
// Nats-Rollup: all publish once wiped a whole bucket), and its values, its
// record count and its bytes are bounded.
func shardBucket(stream, desc string, replicas int) jetstream.StreamConfig {
	maxMsgs := int64(shardMaxPools)
	if stream == shardAttemptStream {
		maxMsgs = shardMaxAttempts
	}
	return jetstream.StreamConfig{
		Name:              stream,
		Description:       desc,
		Subjects:          []string{"$KV." + strings.TrimPrefix(stream, "KV_") + ".>"},
		Storage:           jetstream.FileStorage,
		Replicas:          replicas,
		Retention:         jetstream.LimitsPolicy,
		MaxMsgsPerSubject: 1,
		MaxMsgs:           maxMsgs,
		Duplicates:        2 * time.Minute,
		DenyDelete:        true,
		DenyPurge:         true,
		AllowRollup:       false,
		AllowDirect:       true,
	}
}

// errLogBusy means the log stream's leader refused an append because
// another write of the repo's log is still in flight there (inFlightMismatch):
// nothing says another writer appended first.
var errLogBusy = errors.New("another write of the repo's lease log is still in flight at the log stream's leader")

// casOr is errLogBusy or errCAS when err is a compare-and-swap refusal of
// that kind, else err.
func casOr(err error) error {
	switch {
	case err == nil:
		return nil
	case inFlightMismatch(err):
		return errLogBusy
	case isCASMismatch(err):
		return errCAS
	}
	return err
}

// append writes rec to the repo's log if the log's last sequence is still
// expect, and returns the record's sequence and its encoding (what
// standbys are sent: see Service.announceAppend).
func (s *store) append(ctx context.Context, key string, expect uint64, rec *logRecord) (uint64, []byte, error) {
	rec.Prev = expect
	data, err := rec.encode()
	if err != nil {
		return 0, nil, fmt.Errorf("encode lease log record: %w", err)
	}
	msg := nats.NewMsg(logSubjectFor(key))
	msg.Data = data
	msg.Header.Set(writerHeader, s.writer)
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(expect, 10))
	start := time.Now()
	seq, err := s.publish(ctx, msg)
	err = streamFull(LogStream, err)
	if s.metrics != nil {
		s.metrics.appended(time.Since(start), casOr(err))
	}
	if err != nil {
		if kind := casOr(err); kind == errCAS || kind == errLogBusy {
			return 0, nil, kind
		}
		return 0, nil, fmt.Errorf("append to lease log of %s: %w", rec.Repo, err)
	}
	return seq, data, nil
}

// publish writes msg to its stream and returns the sequence it was stored
// at once the stream acknowledged it (after its fsync), as jetstream's
// PublishMsg does — the same default timeout, the same retries while no
// stream answers (a leader election) — but through a mailbox.
func (s *store) publish(ctx context.Context, msg *nats.Msg) (uint64, error) {
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, publishTimeout)
		defer cancel()
	}
	resp, err := s.boxes.request(ctx, msg)
	for r := 0; errors.Is(err, nats.ErrNoResponders) && r < jetstream.DefaultPubRetryAttempts; r++ {
		select {
		case <-ctx.Done():
		case <-time.After(jetstream.DefaultPubRetryWait):
		}
		resp, err = s.boxes.request(ctx, msg)
	}
	if errors.Is(err, nats.ErrNoResponders) {
		return 0, jetstream.ErrNoStreamResponse
	}
	if err != nil {
		return 0, err
	}
	return parsePubAck(resp.Data)
}

// publishTimeout bounds an append whose context has no deadline (as
// jetstream's default API timeout does).
const publishTimeout = 5 * time.Second

// parsePubAck reads a stream's acknowledgement. The server writes
// {"stream":"NAME","seq":N} (a domain may come between); anything else —
// an error, a duplicate — is decoded by encoding/json.
func parsePubAck(data []byte) (uint64, error) {
	if b, ok := bytes.CutPrefix(data, []byte(`{"stream":"`)); ok {
		if i := bytes.IndexByte(b, '"'); i > 0 && bytes.IndexByte(b[:i], '\\') < 0 {
			if rest, ok := bytes.CutPrefix(b[i+1:], []byte(`,"seq":`)); ok && len(rest) > 1 && rest[len(rest)-1] == '}' {
				if seq, err := strconv.ParseUint(string(rest[:len(rest)-1]), 10, 64); err == nil && seq > 0 && rest[0] != '0' {
					return seq, nil
				}
			}
		}
	}
	var ack struct {
		Error  *jetstream.APIError `json:"error,omitempty"`
		Stream string              `json:"stream"`
		Seq    uint64              `json:"seq"`
	}
	if err := json.Unmarshal(data, &ack); err != nil {
		return 0, jetstream.ErrInvalidJSAck
	}
	if ack.Error != nil {
		return 0, fmt.Errorf("nats: %w", ack.Error)
	}
	if ack.Stream == "" {
		return 0, jetstream.ErrInvalidJSAck
	}
	return ack.Seq, nil
}

// inFlightMismatch reports whether err is the stream leader's refusal of
// a compare-and-swap because another write of the same subject is still
// in flight there (proposed, not yet applied: JetStream error code 10164,
// "wrong last sequence" with no sequence). The subject's last sequence may
// be the one expected: the refusal says nothing of who wrote last.
func inFlightMismatch(err error) bool {
	var apiErr *jetstream.APIError
	return errors.As(err, &apiErr) && apiErr.ErrorCode == jetstream.JSErrCodeStreamWrongLastSequenceConstant
}

func isCASMismatch(err error) bool {
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) {
		switch apiErr.ErrorCode {
		case jetstream.JSErrCodeStreamWrongLastSequence, jetstream.JSErrCodeStreamWrongLastSequenceConstant:
			return true
		}
	}
	return strings.Contains(err.Error(), "wrong last sequence")
}

// load applies every record of the repo's log after st.seq to st, and hands
// each record's sequence and audit events (none for most) to onRecord, in
// log order. A first load (st.seq 0) starts at the repo's newest snapshot
// and hands on, for their audit events only, the records before it after
// audited (the log sequence up to which the repo's events are known to be
// in the audit stream; 0: not known, every record the stream keeps). It
// returns how many records it applied.
//
// The records are read from the repo's last back along each one's Prev,
// the subject sequence it was written on top of, each by its sequence:
// the server finds the last in its per-subject index and every other in
// its sequence index. (Reading forward instead, "the next record of the
// repo after n", has the server walk every message stored since n, of
// every repo, to find the few of this one: a new primary loading 1,000
// repos at 10,000 leases spent over 20 s so.) Where the chain does not
// lead to st.seq or to a snapshot — a message the service did not write,
// a record that cannot be decoded, one the stream dropped before a
// snapshot was reached — the log is read forward (walk), which says
// what is wrong with it.
func (s *store) load(ctx context.Context, key string, st *repoState, audited uint64, now func() time.Time, onRecord func(seq uint64, evs []lease.AuditEvent)) (int, error) {
	stream, err := s.logStream(ctx)
	if err != nil {
		return 0, err
	}
	subj := logSubjectFor(key)
	m, err := stream.GetLastMsgForSubject(ctx, subj)
	s.metrics.read("last")
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil
	case err != nil:
		return 0, fmt.Errorf("read lease log of %s: %w", st.repo, err)
	case m.Sequence <= st.seq:
		return 0, nil
	}
	chain, err := s.chainBack(ctx, stream, subj, m, st, audited)
	if err != nil {
		return 0, fmt.Errorf("read lease log of %s: %w", st.repo, err)
	}
	if chain == nil {
		return s.walk(ctx, stream, subj, st, now, onRecord)
	}
	slices.Reverse(chain) // oldest first
	from := 0
	if st.seq == 0 {
		for i, r := range chain {
			if r.rec.Kind == recordSnapshot {
				from = i
			}
		}
		if st.repo == "" {
			st.repo = chain[0].rec.Repo
		}
	}
	for _, r := range chain[:from] { // before the snapshot: audit only
		if onRecord != nil {
			r.rec.fillEvents()
			onRecord(r.seq, r.rec.Events)
		}
	}
	applied := 0
	for _, r := range chain[from:] {
		if err := s.fold(st, r, now, onRecord); err != nil {
			return applied, err
		}
		applied++
	}
	return applied, nil
}

// chainBack reads the repo's records from m, its last, back along Prev
// (see load): to the record written on top of st.seq when st holds a
// view; on a first load, to the newest snapshot and on to audited, or to
// the repo's first record, or to where the stream dropped the older ones
// past a snapshot (it drops only records whose events were audited: see
// actor.roomToAppend). It returns the records newest first, or nil where
// the chain leads elsewhere.
func (s *store) chainBack(ctx context.Context, stream jetstream.Stream, subj string, m *jetstream.RawStreamMsg, st *repoState, audited uint64) ([]loaded, error) {
	var chain []loaded
	repo, snapshot := st.repo, false
	for {
		if m.Subject != subj || !serviceWrote(m.Header) {
			return nil, nil
		}
		rec := new(logRecord)
		if err := json.Unmarshal(m.Data, rec); err != nil || rec.Prev >= m.Sequence || repo != "" && rec.Repo != repo {
			return nil, nil
		}
		repo = rec.Repo
		chain = append(chain, loaded{seq: m.Sequence, rec: rec})
		snapshot = snapshot || rec.Kind == recordSnapshot
		switch {
		case st.seq > 0 && rec.Prev == st.seq:
			return chain, nil
		case st.seq > 0 && rec.Prev < st.seq:
			return nil, nil
		case st.seq == 0 && (rec.Prev == 0 || snapshot && rec.Prev <= audited):
			return chain, nil
		}
		next, err := stream.GetMsg(ctx, rec.Prev)
		s.metrics.read("record")
		switch {
		case errors.Is(err, jetstream.ErrMsgNotFound) && st.seq == 0 && snapshot:
			return chain, nil
		case errors.Is(err, jetstream.ErrMsgNotFound):
			return nil, nil
		case err != nil:
			return nil, err
		}
		m = next
	}
}

// walk reads the repo's log forward from st.seq, record after record:
// what load falls back on where the chain back does not lead to the
// view or to a snapshot.
func (s *store) walk(ctx context.Context, stream jetstream.Stream, subj string, st *repoState, now func() time.Time, onRecord func(seq uint64, evs []lease.AuditEvent)) (int, error) {
	applied := 0
	// A first read starts at the oldest record the stream keeps of the
	// repo: its own first, or one after records the stream dropped (see
	// logKeep). Records up to the first snapshot are held back: once one
	// comes, the state starts from it, and those before it are handed on
	// for their audit events only; if none comes, they are applied in
	// order, as they chain from the repo's first record.
	var held []loaded
	fresh := st.seq == 0
	flush := func() error {
		for _, r := range held {
			if err := s.fold(st, r, now, onRecord); err != nil {
				return err
			}
			applied++
		}
		held = nil
		return nil
	}
	for next := st.seq + 1; ; {
		m, err := stream.GetMsg(ctx, next, jetstream.WithGetMsgSubject(subj))
		s.metrics.read("record")
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return applied, flush()
		}
		if err != nil {
			return applied, fmt.Errorf("read lease log of %s at %d: %w", st.repo, next, err)
		}
		next = m.Sequence + 1
		r := loaded{seq: m.Sequence}
		if serviceWrote(m.Header) {
			r.rec = new(logRecord)
			if err := json.Unmarshal(m.Data, r.rec); err != nil {
				return applied, fmt.Errorf("%w: decode record %d of %s: %v", errDamaged, m.Sequence, st.repo, err)
			}
			if st.repo == "" {
				st.repo = r.rec.Repo
			}
			if r.rec.Repo != st.repo {
				return applied, fmt.Errorf("%w: subject %s holds repo %q, expected %q", errDamaged, subj, r.rec.Repo, st.repo)
			}
		}
		if fresh {
			if r.rec == nil || r.rec.Kind != recordSnapshot {
				held = append(held, r)
				continue
			}
			fresh = false
			for _, h := range held { // before the snapshot: audit only
				if onRecord != nil && h.rec != nil {
					h.rec.fillEvents()
					onRecord(h.seq, h.rec.Events)
				} else if onRecord != nil {
					onRecord(h.seq, nil)
				}
			}
			held = nil
		}
		if err := s.fold(st, r, now, onRecord); err != nil {
			if errors.Is(err, errBehind) && applied > 0 {
				err = fmt.Errorf("%w: %v", errDamaged, err) // a gap after what it read: not a dropped prefix
			}
			return applied, err
		}
		applied++
	}
}

// loaded is one message read from a repo's log: the service's record, or
// (rec nil) a message someone else had stored there (see serviceWrote).
type loaded struct {
	seq uint64
	rec *logRecord
}

// fold applies one message of the repo's log to st, checking that a delta
// follows the state's sequence.
func (s *store) fold(st *repoState, r loaded, now func() time.Time, onRecord func(seq uint64, evs []lease.AuditEvent)) error {
	if r.rec == nil {
		// Not the service's: a server's answer (a publish ack, a direct
		// get carrying someone's bytes) sent to a reply subject a client
		// named. It holds nothing of the repo's state; the service's next
		// append goes on top of it.
		st.seq = r.seq
		if onRecord != nil {
			onRecord(r.seq, nil)
		}
		return nil
	}
	if r.rec.Kind == recordDelta && r.rec.Prev != st.seq {
		if r.rec.Prev > st.seq && st.seq > 0 {
			// The records between are gone: the stream dropped them.
			return fmt.Errorf("%w: %s: record %d follows %d, state is at %d", errBehind, st.repo, r.seq, r.rec.Prev, st.seq)
		}
		return fmt.Errorf("%w: %s has a gap: record %d follows %d, state is at %d; refusing to serve this repo", errDamaged, st.repo, r.seq, r.rec.Prev, st.seq)
	}
	apply(st, r.rec, r.seq, now, onRecord)
	return nil
}

// apply folds one record of the repo's log, stored at seq, into st.
func apply(st *repoState, rec *logRecord, seq uint64, now func() time.Time, onRecord func(seq uint64, evs []lease.AuditEvent)) {
	st.observe(rec, seq, now())
	if onRecord != nil {
		rec.fillEvents()
		onRecord(seq, rec.Events)
	}
}

// hasLog reports whether the repo of key has a lease log (one record at
// least), asking the stream's leader.
func (s *store) hasLog(ctx context.Context, key string) (bool, error) {
	stream, err := s.logStream(ctx)
	if err != nil {
		return false, err
	}
	_, err = stream.GetLastMsgForSubject(ctx, logSubjectFor(key))
	s.metrics.read("record")
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return false, nil
	case err != nil:
		return false, fmt.Errorf("look up lease log %s: %w", key, err)
	}
	return true, nil
}

// repoKeys lists the repos that have a lease log.
func (s *store) repoKeys(ctx context.Context) ([]string, error) {
	stream, err := s.logStream(ctx)
	if err != nil {
		return nil, err
	}
	info, err := stream.Info(ctx, jetstream.WithSubjectFilter(logSubject+".>"))
	s.metrics.read("subjects")
	if err != nil {
		return nil, fmt.Errorf("list lease logs: %w", err)
	}
	keys := make([]string, 0, len(info.State.Subjects))
	for subj := range info.State.Subjects {
		keys = append(keys, strings.TrimPrefix(subj, logSubject+"."))
	}
	return keys, nil
}
