// Package lograte bounds how many log records of one kind a process writes.
//
// Much of what fenceline logs, something outside it can cause at will: a
// refused write or push, a denied request through the egress proxy, a
// connection to the bus with credentials it does not take. An agent or a
// stranger on the network that repeats one of those thousands of times a
// second must not fill the disk or bury the log, and the audit stream (not
// this log) is the record of every refusal. Handler lets the first Burst
// records of a kind through in each Interval and counts the rest; the
// first record written after the interval (of any kind) is preceded by one
// that says how many were suppressed, and like which. A count is said only
// when another record comes.
//
// A record's kind is its level and its message with every run of digits
// taken as one (the Postgres fence's "write refused"; a NATS server line's
// addresses, connection ids and ports differ from one connection to the
// next, its words do not). At most MaxKinds kinds are told apart; records
// of further kinds share one count.
package lograte

import (
	"context"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Defaults of Options.
const (
	DefaultBurst    = 20
	DefaultInterval = time.Second
	DefaultMaxKinds = 512
)

// Options says how much of each kind goes through.
type Options struct {
	Burst    int           // records of a kind let through per Interval (DefaultBurst when 0)
	Interval time.Duration // DefaultInterval when 0
	MaxKinds int           // kinds kept, the one of all further kinds among them (DefaultMaxKinds when 0)
	// Now is the clock (time.Now when nil).
	Now func() time.Time
}

// Handler is a slog.Handler that passes records on to another at a bounded
// rate per kind.
type Handler struct {
	next slog.Handler
	st   *limiter // shared by the handlers WithAttrs and WithGroup make
}

type limiter struct {
	burst    int
	interval time.Duration
	maxKinds int
	now      func() time.Time

	mu    sync.Mutex
	kinds map[string]*kind
	swept time.Time // the last sweep: at most one an interval
}

// kind is one kind's count in its current interval.
type kind struct {
	start      time.Time
	passed     int
	suppressed int
	level      slog.Level
	like       string // the last suppressed record's message
}

// report is what a kind's interval suppressed, to be said.
type report struct {
	n     int
	level slog.Level
	like  string
}

// otherKinds is the key of the records of kinds beyond MaxKinds.
const otherKinds = "\x00other"

// New returns a Handler passing records on to next.
func New(next slog.Handler, o Options) *Handler {
	if o.Burst <= 0 {
		o.Burst = DefaultBurst
	}
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.MaxKinds <= 0 {
		o.MaxKinds = DefaultMaxKinds
	}
	o.MaxKinds = max(o.MaxKinds, 2)
	if o.Now == nil {
		o.Now = time.Now
	}
	return &Handler{next: next, st: &limiter{
		burst: o.Burst, interval: o.Interval, maxKinds: o.MaxKinds, now: o.Now,
		kinds: map[string]*kind{},
	}}
}

// Enabled reports whether the next handler handles records of level l.
func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

// Handle passes r on, or counts it suppressed; first it says how many
// records were suppressed in the intervals that ended since the last
// record (of any kind: a flood that stopped is told at the next record).
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	pass, reports := h.st.admit(r.Level, r.Message)
	for _, rp := range reports {
		s := slog.NewRecord(r.Time, rp.level, "log records suppressed: too many of one kind", 0)
		s.AddAttrs(slog.Int("suppressed", rp.n), slog.String("like", rp.like))
		if err := h.next.Handle(ctx, s); err != nil {
			return err
		}
	}
	if !pass {
		return nil
	}
	return h.next.Handle(ctx, r)
}

// WithAttrs returns a Handler sharing h's counts.
func (h *Handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &Handler{next: h.next.WithAttrs(as), st: h.st}
}

// WithGroup returns a Handler sharing h's counts.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{next: h.next.WithGroup(name), st: h.st}
}

// admit counts one record of msg at level: pass says whether it goes
// through, reports what the intervals that ended suppressed (to be said
// first).
func (l *limiter) admit(level slog.Level, msg string) (pass bool, reports []report) {
	key := kindOf(level, msg)
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.swept) >= l.interval {
		reports = l.sweep(now)
	}
	k, ok := l.kinds[key]
	if !ok {
		if len(l.kinds) >= l.maxKinds-1 { // one place kept for otherKinds
			key = otherKinds
			k = l.kinds[key]
		}
		if k == nil {
			k = &kind{start: now}
			l.kinds[key] = k
		}
	}
	if now.Sub(k.start) >= l.interval { // over since the last sweep
		if k.suppressed > 0 {
			reports = append(reports, report{n: k.suppressed, level: k.level, like: k.like})
		}
		*k = kind{start: now}
	}
	if k.passed < l.burst {
		k.passed++
		return true, reports
	}
	k.suppressed++
	k.level, k.like = level, msg
	return false, reports
}

// sweep forgets the kinds whose interval is over, and returns what they
// suppressed; at most once an interval, so the kinds kept are those of
// about the last two.
func (l *limiter) sweep(now time.Time) []report {
	l.swept = now
	var reports []report
	for key, k := range l.kinds {
		if now.Sub(k.start) < l.interval {
			continue
		}
		if k.suppressed > 0 {
			reports = append(reports, report{n: k.suppressed, level: k.level, like: k.like})
		}
		delete(l.kinds, key)
	}
	return reports
}

// kindOf is a record's kind: its level and its message, every run of
// digits one '#'.
func kindOf(level slog.Level, msg string) string {
	var b strings.Builder
	b.Grow(len(msg) + 8)
	b.WriteString(level.String())
	b.WriteByte(' ')
	digits := false
	for i := 0; i < len(msg); i++ {
		c := msg[i]
		if c >= '0' && c <= '9' {
			if !digits {
				b.WriteByte('#')
			}
			digits = true
			continue
		}
		digits = false
		b.WriteByte(c)
	}
	return b.String()
}
