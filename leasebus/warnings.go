package leasebus

import (
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"
	"unicode"
)

// warnings holds back repeats of one kind of warning: a fault of the bus (a stream
// without a leader, JetStream's meta layer electing) fails every repo's
// batch alike, and at a thousand repos one line each per batch buries the
// rest of the log. A warning is written at most once per period per
// kind, naming how many like it were held back since the last; a rarer
// error (a log at its size limit) is a kind of its own, never hidden
// behind a flood of another.
type warnings struct {
	every time.Duration

	mu   sync.Mutex
	last map[string]time.Time // message -> when last written; guarded by mu
	held map[string]int       // message -> held back since; guarded by mu
}

// maxWarnKinds bounds the kinds remembered.
const maxWarnKinds = 1024

// warnEvery is the period of the service's warnings.
const warnEvery = time.Second

func newWarnings(every time.Duration) *warnings {
	return &warnings{every: every, last: map[string]time.Time{}, held: map[string]int{}}
}

// warn writes msg with args to log at now, unless a warning of the same
// kind (msg, and the shape of its "err": see kindOf) was written less
// than the period ago; then it is counted, and the next written says
// held_back=N. A nil w holds nothing back.
func (w *warnings) warn(log *slog.Logger, now time.Time, msg string, args ...any) {
	if w == nil {
		log.Warn(msg, args...)
		return
	}
	kind := kindOf(msg, args)
	w.mu.Lock()
	if last, ok := w.last[kind]; ok && now.Sub(last) < w.every {
		w.held[kind]++
		w.mu.Unlock()
		return
	}
	if len(w.last) >= maxWarnKinds {
		clear(w.last) // kinds are few; this bounds them should they not be
		clear(w.held)
	}
	held := w.held[kind]
	w.last[kind] = now
	delete(w.held, kind)
	w.mu.Unlock()
	if held > 0 {
		args = append(args, "held_back", held)
	}
	log.Warn(msg, args...)
}

// kindOf is msg with the text of its "err" argument's innermost error
// (errors.Unwrap), digits dropped (a
// sequence, a count, a duration differ from one repeat to the next) and
// cut at 80 bytes.
func kindOf(msg string, args []any) string {
	for i := 0; i+1 < len(args); i += 2 {
		if k, _ := args[i].(string); k != "err" {
			continue
		}
		e, ok := args[i+1].(error)
		if !ok || e == nil {
			break
		}
		// The innermost error: the wrapping names the repo, and a fault
		// fails every repo alike (one kind, not one per repo).
		for inner := errors.Unwrap(e); inner != nil; inner = errors.Unwrap(inner) {
			e = inner
		}
		text := strings.Map(func(r rune) rune {
			if unicode.IsDigit(r) {
				return -1
			}
			return r
		}, e.Error())
		if len(text) > 80 {
			text = text[:80]
		}
		return msg + "\x00" + text
	}
	return msg
}
