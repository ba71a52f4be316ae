package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func auditSubjectFor(repo string) string { return AuditSubject + "." + RepoKey(repo) }

// serviceAuditSubject carries the lease service's own events of a repo;
// boundaries write to fenceline.audit.<repoKey>.<boundary>.
func serviceAuditSubject(key string) string { return AuditSubject + "." + key + "." + BoundaryLease }

// auditDelay is how long the service gathers audit events before writing
// them: one fsync for every event of that window. The events are already
// durable in the lease log (each record carries its batch's events), so a
// crash in the window loses nothing; the next service start re-writes them.
const auditDelay = 20 * time.Millisecond

// auditWriter publishes the service's audit events off the request path,
// one message per repo per flush, each stamped with the log sequence it
// covers so a restarted service knows which logged events still need
// writing.
type auditWriter struct {
	js  jetstream.JetStream
	log *slog.Logger

	mu      sync.Mutex
	pending map[string]*auditPending // by repo key; guarded by mu
	durable map[string]uint64        // repo key -> log seq whose events are written; guarded by mu
	queued  map[string]uint64        // repo key -> newest log seq whose events were queued; guarded by mu
	wake    chan struct{}
}

type auditPending struct {
	events []AuditEvent
	seq    uint64 // the log record the newest of events came with
}

// auditBatch is one message on the audit stream.
type auditBatch struct {
	Events []AuditEvent `json:"events"`
	// LogSeq is the lease-log sequence up to which the service's events of
	// this repo are written (absent on boundary events).
	LogSeq uint64 `json:"logSeq,omitempty"`
}

func newAuditWriter(js jetstream.JetStream, log *slog.Logger) *auditWriter {
	return &auditWriter{js: js, log: log, pending: map[string]*auditPending{},
		durable: map[string]uint64{}, queued: map[string]uint64{}, wake: make(chan struct{}, 1)}
}

// add queues the events that came with log record seq of a repo.
func (w *auditWriter) add(key string, seq uint64, evs []AuditEvent) {
	if len(evs) == 0 {
		return
	}
	w.mu.Lock()
	p := w.pending[key]
	if p == nil {
		p = &auditPending{}
		w.pending[key] = p
	}
	p.events = append(p.events, evs...)
	p.seq = max(p.seq, seq)
	w.queued[key] = max(w.queued[key], seq)
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// written reports the log sequence up to which a repo's events are in the
// audit stream; a snapshot must not roll up records beyond it. Once every
// event queued for the repo is written, that covers every record so far
// (records without events, e.g. renewals, need nothing written): without
// this a repo that only renews would never purge its log after a snapshot.
func (w *auditWriter) written(key string) uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.durable[key] >= w.queued[key] {
		return math.MaxUint64
	}
	return w.durable[key]
}

func (w *auditWriter) setWritten(key string, seq uint64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.durable[key] = max(w.durable[key], seq)
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

// flush writes every pending batch; it returns false if one failed (its
// events stay pending).
func (w *auditWriter) flush(ctx context.Context) bool {
	w.mu.Lock()
	batch := w.pending
	w.pending = map[string]*auditPending{}
	w.mu.Unlock()
	ok := true
	for key, p := range batch {
		data, err := (&auditBatch{Events: p.events, LogSeq: p.seq}).encode()
		if err == nil {
			_, err = w.js.Publish(ctx, serviceAuditSubject(key), data)
		}
		if err != nil {
			w.log.Warn("audit events not yet written; will retry", "events", len(p.events), "repo_key", key, "err", err)
			w.mu.Lock()
			if q := w.pending[key]; q != nil {
				p.events = append(p.events, q.events...)
				p.seq = max(p.seq, q.seq)
			}
			w.pending[key] = p
			w.mu.Unlock()
			ok = false
			continue
		}
		w.setWritten(key, p.seq)
	}
	return ok
}

// lastWritten reads, from the audit stream, the log sequence up to which a
// repo's service events were written before this service started.
func lastWritten(ctx context.Context, js jetstream.JetStream, key string) (uint64, error) {
	stream, err := js.Stream(ctx, AuditStream)
	if err != nil {
		return 0, fmt.Errorf("open stream %s: %w", AuditStream, err)
	}
	m, err := stream.GetLastMsgForSubject(ctx, serviceAuditSubject(key))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read last audit message of %s: %w", key, err)
	}
	var b auditBatch
	if err := json.Unmarshal(m.Data, &b); err != nil {
		return 0, fmt.Errorf("decode audit message %d: %w", m.Sequence, err)
	}
	return b.LogSeq, nil
}

// Auditor writes audit events from a boundary (a sidecar's git, Postgres or
// file fence) straight to the audit stream, one acknowledged message each.
type Auditor struct {
	js jetstream.JetStream
}

// NewAuditor returns an Auditor publishing on nc's JetStream.
func NewAuditor(nc *nats.Conn) (*Auditor, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	return &Auditor{js: js}, nil
}

// Record durably writes one event; it returns once the stream acknowledged it.
func (a *Auditor) Record(ctx context.Context, ev AuditEvent) error {
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	if ev.Repo == "" {
		return fmt.Errorf("audit event %q: %w: repo is empty", ev.Type, ErrInvalid)
	}
	data, err := (&auditBatch{Events: []AuditEvent{ev}}).encode()
	if err != nil {
		return fmt.Errorf("encode audit event: %w", err)
	}
	boundary := ev.Boundary
	if boundary == "" || boundary == BoundaryLease {
		return fmt.Errorf("audit event %q: %w: boundary must be git, postgres or file", ev.Type, ErrInvalid)
	}
	if _, err := a.js.Publish(ctx, auditSubjectFor(ev.Repo)+"."+boundary, data); err != nil {
		return fmt.Errorf("write audit event %s for %s: %w", ev.Type, ev.Repo, err)
	}
	return nil
}

// ReadAudit returns the audit events of one repo (every repo when repo is
// empty) in the order they were written, starting at stream sequence from.
func ReadAudit(ctx context.Context, nc *nats.Conn, repo string, from uint64) ([]AuditEvent, error) {
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("jetstream: %w", err)
	}
	filter := AuditSubject + ".>"
	if repo != "" {
		filter = auditSubjectFor(repo) + ".*"
	}
	stream, err := js.Stream(ctx, AuditStream)
	if err != nil {
		return nil, fmt.Errorf("open stream %s: %w", AuditStream, err)
	}
	var out []AuditEvent
	for seq := max(from, 1); ; {
		m, err := stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(filter))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("read audit stream at %d: %w", seq, err)
		}
		var b auditBatch
		if err := json.Unmarshal(m.Data, &b); err != nil {
			return out, fmt.Errorf("decode audit message %d: %w", m.Sequence, err)
		}
		out = append(out, b.Events...)
		seq = m.Sequence + 1
	}
}
