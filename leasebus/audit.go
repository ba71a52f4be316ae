package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

func auditSubjectFor(repo string) string { return AuditSubject + "." + RepoKey(repo) }

// auditWriter publishes the service's audit events off the request path.
// Events that pile up while a publish is in flight go out together, one
// message per repo, so the audit stream costs one fsync per batch, not per
// event.
type auditWriter struct {
	js  jetstream.JetStream
	log *slog.Logger

	mu      sync.Mutex
	pending map[string][]AuditEvent // by repo key; guarded by mu
	wake    chan struct{}
}

func newAuditWriter(js jetstream.JetStream, log *slog.Logger) *auditWriter {
	return &auditWriter{js: js, log: log, pending: map[string][]AuditEvent{}, wake: make(chan struct{}, 1)}
}

func (w *auditWriter) add(key string, evs []AuditEvent) {
	if len(evs) == 0 {
		return
	}
	w.mu.Lock()
	w.pending[key] = append(w.pending[key], evs...)
	w.mu.Unlock()
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

func (w *auditWriter) run(ctx context.Context) {
	for {
		select {
		case <-ctx.Done():
			// Last flush with a fresh deadline: events of committed
			// batches must not be dropped on a clean stop.
			fctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			w.flush(fctx)
			cancel()
			return
		case <-w.wake:
			w.flush(ctx)
		}
	}
}

func (w *auditWriter) flush(ctx context.Context) {
	w.mu.Lock()
	batch := w.pending
	w.pending = map[string][]AuditEvent{}
	w.mu.Unlock()
	for key, evs := range batch {
		data, err := json.Marshal(auditBatch{Events: evs})
		if err == nil {
			_, err = w.js.Publish(ctx, AuditSubject+"."+key, data)
		}
		if err != nil {
			w.log.Error("audit events not written", "events", len(evs), "repo_key", key, "err", err)
		}
	}
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
	data, err := json.Marshal(auditBatch{Events: []AuditEvent{ev}})
	if err != nil {
		return fmt.Errorf("encode audit event: %w", err)
	}
	if _, err := a.js.Publish(ctx, auditSubjectFor(ev.Repo), data); err != nil {
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
		filter = auditSubjectFor(repo)
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
