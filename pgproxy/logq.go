package pgproxy

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// logQueue writes the proxy's operational log from a goroutine of its own.
// A session on the event loop logs from the loop's thread (a refused write,
// a prepared statement changed behind the fence): a handler that writes
// there, synchronously, would hold every session of the loop for as long
// as its writer waits (a pipe nobody reads, a log collector that stalls).
// Records wait in a bounded queue instead; when it is full they are dropped
// and counted, and the log says how many (through the logger's own
// handler, without any With's attributes). Once the queue is closed
// records are written at once, by whoever logs them. The audit stream, not
// this log, is the record of refusals: it is published off the loop and
// never dropped.
type logQueue struct {
	ch      chan queuedRecord
	root    slog.Handler // the logger's handler, for the counts of dropped records
	dropped atomic.Int64
	stop    chan struct{}
	done    chan struct{}
	// mu: Handle holds it shared while it queues (never while it
	// writes), close exclusively while it marks the queue closed, so no
	// record is queued after the writer's last look.
	mu     sync.RWMutex
	closed atomic.Bool
}

type queuedRecord struct {
	ctx context.Context
	h   slog.Handler
	r   slog.Record
}

// logQueueSize bounds the records waiting to be written.
const logQueueSize = 1024

// queuedLogger returns a logger whose records reach l's handler through a
// logQueue, and the queue (nil, with l itself, when l discards everything).
func queuedLogger(l *slog.Logger) (*slog.Logger, *logQueue) {
	if l.Handler() == slog.DiscardHandler {
		return l, nil
	}
	q := &logQueue{ch: make(chan queuedRecord, logQueueSize), root: l.Handler(), stop: make(chan struct{}), done: make(chan struct{})}
	go q.run()
	return slog.New(&queuedHandler{q: q, h: l.Handler()}), q
}

func (q *logQueue) run() {
	defer close(q.done)
	for {
		select {
		case it := <-q.ch:
			q.write(it)
		case <-q.stop:
			for {
				select {
				case it := <-q.ch:
					q.write(it)
				default:
					return
				}
			}
		}
	}
}

// write writes it, and says how many records were dropped before it, or
// since, when the queue is empty after it (the last records may be the
// dropped ones).
func (q *logQueue) write(it queuedRecord) {
	q.reportDropped(it.ctx)
	_ = it.h.Handle(it.ctx, it.r) // a handler's error has nowhere to go
	if len(q.ch) == 0 {
		q.reportDropped(it.ctx)
	}
}

func (q *logQueue) reportDropped(ctx context.Context) {
	if n := q.dropped.Swap(0); n > 0 && q.root.Enabled(ctx, slog.LevelWarn) {
		r := slog.NewRecord(time.Now(), slog.LevelWarn, "log records dropped: the log's writer fell behind", 0)
		r.AddAttrs(slog.Int64("dropped", n))
		_ = q.root.Handle(ctx, r)
	}
}

// close writes what is queued and stops the writer, waiting at most wait
// for it: a writer that never returns (its pipe never read again) is left
// to it. Records logged after close are written at once.
func (q *logQueue) close(wait time.Duration) {
	if q == nil {
		return
	}
	q.mu.Lock()
	if q.closed.Load() {
		q.mu.Unlock()
		return
	}
	q.closed.Store(true)
	close(q.stop)
	q.mu.Unlock()
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-q.done:
	case <-t.C:
	}
}

// queuedHandler is the slog.Handler of a queuedLogger.
type queuedHandler struct {
	q *logQueue
	h slog.Handler
}

func (h *queuedHandler) Enabled(ctx context.Context, l slog.Level) bool { return h.h.Enabled(ctx, l) }

// Handle queues r, or counts it dropped when the queue is full; it never
// waits (but once the queue is closed, when it writes r itself). Values
// that resolve themselves (slog.LogValuer) are resolved now, on the
// caller's goroutine, not later on the writer's.
func (h *queuedHandler) Handle(ctx context.Context, r slog.Record) error {
	if !h.q.closed.Load() {
		h.q.mu.RLock()
		if !h.q.closed.Load() {
			select {
			case h.q.ch <- queuedRecord{ctx: context.WithoutCancel(ctx), h: h.h, r: resolved(r)}:
			default:
				h.q.dropped.Add(1)
			}
			h.q.mu.RUnlock()
			return nil
		}
		h.q.mu.RUnlock()
	}
	return h.h.Handle(ctx, r)
}

// resolved is a copy of r whose attributes' values are resolved.
func resolved(r slog.Record) slog.Record {
	out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
	r.Attrs(func(a slog.Attr) bool {
		a.Value = a.Value.Resolve()
		out.AddAttrs(a)
		return true
	})
	return out
}

func (h *queuedHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &queuedHandler{q: h.q, h: h.h.WithAttrs(as)}
}

func (h *queuedHandler) WithGroup(name string) slog.Handler {
	return &queuedHandler{q: h.q, h: h.h.WithGroup(name)}
}
