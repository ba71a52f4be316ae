package pgproxy

import (
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestLogQueueCountsWhatItDrops: with the writer stalled, logging never
// waits; what does not fit in the queue is dropped, and once the writer goes
// on the log says how many: every record is either written or counted.
func TestLogQueueCountsWhatItDrops(t *testing.T) {
	w := &stallingWriter{}
	log, q := queuedLogger(slog.New(slog.NewTextHandler(w, nil)))
	defer q.close(time.Second)
	log = log.With("fence", "postgres") // the counts come without it
	w.stall()
	const n = logQueueSize + 10
	start := time.Now()
	for i := range n {
		log.Info("r", "i", i)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("logging %d records with the writer stalled took %v", n, d)
	}
	w.release()
	dropped := regexp.MustCompile(`dropped=(\d+)`)
	testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		out := w.String()
		written, counted := strings.Count(out, "msg=r "), 0
		for _, m := range dropped.FindAllStringSubmatch(out, -1) {
			c, _ := strconv.Atoi(m[1])
			counted += c
		}
		if counted == 0 || written+counted != n {
			return fmt.Errorf("%d records written and %d counted dropped, want %d in all with some dropped", written, counted, n)
		}
		return nil
	})
	log.Info("last")
	testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if !strings.Contains(w.String(), "msg=last") {
			return fmt.Errorf("a record logged after the queue emptied is not written")
		}
		return nil
	})
	if !regexp.MustCompile(`level=WARN msg="log records dropped[^"]*" dropped=\d+\n`).MatchString(w.String()) {
		t.Fatalf("the count of dropped records is not the queue's own line:\n%s", w.String())
	}
	// Once the queue is closed a record is written at once, not queued
	// for a writer that is gone.
	q.close(time.Second)
	log.Info("after close")
	if !strings.Contains(w.String(), "msg=\"after close\"") {
		t.Fatal("a record logged after the queue closed was not written")
	}
	// With the writer stalled after the close, a second close and a
	// record logged meanwhile do not wait for it (the record's own write
	// does, on its goroutine).
	w.stall()
	wrote := make(chan struct{})
	go func() { log.Info("stalled after close"); close(wrote) }()
	testutil.CheckFor(t, 10*time.Second, time.Millisecond, func() error {
		if w.waiting.Load() == 0 {
			return fmt.Errorf("the record logged after the close is not waiting for the writer yet")
		}
		return nil
	})
	closed := make(chan struct{})
	go func() { q.close(time.Second); close(closed) }()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		w.release()
		t.Fatal("a second close waited for a stalled writer")
	}
	w.release()
	<-wrote
	// A logger that discards everything gets no queue.
	if l, q := queuedLogger(slog.New(slog.DiscardHandler)); q != nil || l.Handler() != slog.DiscardHandler {
		t.Fatal("a discarding logger got a queue")
	}
}

// stallingWriter keeps what is written to it; between stall and release
// every write waits.
type stallingWriter struct {
	mu      sync.Mutex
	buf     strings.Builder
	hold    chan struct{} // non-nil: stalled
	waiting atomic.Int32  // writes waiting for release
}

func (w *stallingWriter) Write(b []byte) (int, error) {
	w.mu.Lock()
	hold := w.hold
	w.mu.Unlock()
	if hold != nil {
		w.waiting.Add(1)
		<-hold
		w.waiting.Add(-1)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(b)
}

func (w *stallingWriter) stall() {
	w.mu.Lock()
	w.hold = make(chan struct{})
	w.mu.Unlock()
}

func (w *stallingWriter) release() {
	w.mu.Lock()
	if w.hold != nil {
		close(w.hold)
		w.hold = nil
	}
	w.mu.Unlock()
}

func (w *stallingWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}
