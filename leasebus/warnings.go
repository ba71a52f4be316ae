package leasebus

import (
	"log/slog"
	"sync"
	"time"
)

// warnings holds back repeats of one warning: a fault of the bus (a stream
// without a leader, JetStream's meta layer electing) fails every repo's
// batch alike, and at a thousand repos one line each per batch buries the
// rest of the log. A warning is written at most once per period per
// message, naming how many like it were held back since the last.
type warnings struct {
	every time.Duration

	mu   sync.Mutex
	last map[string]time.Time // message -> when last written; guarded by mu
	held map[string]int       // message -> held back since; guarded by mu
}

// warnEvery is the period of the service's warnings.
const warnEvery = time.Second

func newWarnings(every time.Duration) *warnings {
	return &warnings{every: every, last: map[string]time.Time{}, held: map[string]int{}}
}

// warn writes msg with args to log at now, unless msg was written less
// than the period ago; then it is counted, and the next written says
// held_back=N.
func (w *warnings) warn(log *slog.Logger, now time.Time, msg string, args ...any) {
	w.mu.Lock()
	if last, ok := w.last[msg]; ok && now.Sub(last) < w.every {
		w.held[msg]++
		w.mu.Unlock()
		return
	}
	held := w.held[msg]
	w.last[msg] = now
	delete(w.held, msg)
	w.mu.Unlock()
	if held > 0 {
		args = append(args, "held_back", held)
	}
	log.Warn(msg, args...)
}
