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
// that says how many were suppressed, and like which; when no record comes,
// a timer says it once the interval is over, so a flood that stopped is
// told all the same. Close says what is still unsaid and arms no more
// timers: a handler that writes to something the caller will close or
// read (a run's stderr) is closed first.
//
// A record's kind is its level and where it was logged (the call site, from
// the record's PC): text a caller puts into a message (a URL the egress
// proxy refused) makes no new kind, so whoever chose the text can neither
// escape the limit with ever new texts nor crowd out the records of other
// call sites, which keep their own counts. A logger that passes on lines
// of someone else's (the NATS server's, all from one call site) names each
// line's kind with the attribute KindKey, which is dropped before the
// record goes on. Records with neither (PC 0) are kinds by their message,
// every run of digits taken as one. (A call site inlined into several
// callers is a kind per copy: more kinds, all of them the code's.) Kinds
// named by text are kept per call site, at most MaxKinds of one site at a
// time; that site's further kinds share one count, its own: however much of
// the text an outsider picks (a NATS server line can carry a client's
// malformed JSON), it never takes the place of another call site's kinds.
package lograte

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"time"
)

// KindKey is the key of the attribute that names a record's kind in place
// of its call site (a string; see the package comment).
const KindKey = "lograte.kind"

// maxText bounds the text of a kind's key and of its example: a message
// can carry a megabyte of someone else's URL.
const maxText = 200

// Defaults of Options.
const (
	DefaultBurst    = 20
	DefaultInterval = time.Second
	DefaultMaxKinds = 64
)

// Options says how much of each kind goes through.
type Options struct {
	Burst    int           // records of a kind let through per Interval (DefaultBurst when 0)
	Interval time.Duration // DefaultInterval when 0
	MaxKinds int           // kinds named by text kept per call site (DefaultMaxKinds when 0)
	// Now is the clock (time.Now when nil).
	Now func() time.Time
	// After runs f once d has passed and returns what stops that
	// (time.AfterFunc and its Timer's Stop when nil): how a count is said
	// when no record comes.
	After func(d time.Duration, f func()) (stop func() bool)
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
	after    func(time.Duration, func()) func() bool

	// wmu is held by a timer's flush while it writes, so Close outlasts
	// a flush under way.
	wmu sync.Mutex

	mu     sync.Mutex
	stop   func() bool // stops the flush scheduled (nil: none)
	closed bool        // Close was called: no more flushes
	kinds  map[string]*kind
	named  map[string]int // kinds named by text kept, by call site
	swept  time.Time      // the last sweep: at most one an interval
}

// kind is one kind's count in its current interval.
type kind struct {
	start      time.Time
	passed     int
	suppressed int
	level      slog.Level
	like       string       // the last suppressed record's message (at most maxText)
	h          slog.Handler // the handler that record came through: its count goes there
	site       string       // a kind named by text: its call site's key (counted in named)
}

// report is what a kind's interval suppressed, to be said.
type report struct {
	n     int
	level slog.Level
	like  string
	h     slog.Handler
}

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
	if o.Now == nil {
		o.Now = time.Now
	}
	if o.After == nil {
		o.After = func(d time.Duration, f func()) func() bool { return time.AfterFunc(d, f).Stop }
	}
	return &Handler{next: next, st: &limiter{
		burst: o.Burst, interval: o.Interval, maxKinds: o.MaxKinds, now: o.Now, after: o.After,
		kinds: map[string]*kind{}, named: map[string]int{},
	}}
}

// Enabled reports whether the next handler handles records of level l.
func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

// Handle passes r on, or counts it suppressed; first it says how many
// records were suppressed in the intervals that ended since the last
// record (of any kind: a flood that stopped is told at the next record),
// each count at its records' level, through the handler they came to.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	key, site, r := kindKey(r)
	pass, reports := h.st.admit(key, site, r.Level, r.Message, h.next)
	errs := []error{say(ctx, r.Time, reports)}
	if pass {
		errs = append(errs, h.next.Handle(ctx, r))
	}
	return errors.Join(errs...)
}

// say writes each report, at its records' level through the handler they
// came to.
func say(ctx context.Context, at time.Time, reports []report) error {
	var errs []error
	for _, rp := range reports {
		if !rp.h.Enabled(ctx, rp.level) {
			continue
		}
		s := slog.NewRecord(at, rp.level, "log records suppressed: too many of one kind", 0)
		s.AddAttrs(slog.Int("suppressed", rp.n), slog.String("like", rp.like))
		errs = append(errs, rp.h.Handle(ctx, s))
	}
	return errors.Join(errs...)
}

// flush says what the intervals that ended suppressed, when no record came
// to say it (see schedule); errors writing are the next handler's to report.
func (l *limiter) flush() {
	l.wmu.Lock()
	defer l.wmu.Unlock()
	now := l.now()
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return
	}
	l.stop = nil
	reports := l.sweep(now)
	l.schedule(now)
	l.mu.Unlock()
	say(context.Background(), now, reports) //nolint:errcheck // no caller to tell
}

// schedule arms a flush for the end of the earliest interval still
// counting suppressed records, unless one is armed or the handler is
// closed. Called with mu held.
func (l *limiter) schedule(now time.Time) {
	if l.stop != nil || l.closed {
		return
	}
	var due time.Time
	for _, k := range l.kinds {
		if end := k.start.Add(l.interval); k.suppressed > 0 && (due.IsZero() || end.Before(due)) {
			due = end
		}
	}
	if due.IsZero() {
		return
	}
	l.stop = l.after(max(due.Sub(now), 0), l.flush)
}

// Close says every count not said yet, whatever its interval, and stops
// the timer: nothing is written by a timer once it returns. Records after
// it go on as before, their counts said by the next record only.
func (h *Handler) Close() error {
	l := h.st
	now := l.now()
	l.mu.Lock()
	l.closed = true
	if l.stop != nil {
		l.stop()
		l.stop = nil
	}
	var reports []report
	for _, k := range l.kinds {
		if k.suppressed > 0 {
			reports = append(reports, report{n: k.suppressed, level: k.level, like: k.like, h: k.h})
			k.suppressed = 0
		}
	}
	l.mu.Unlock()
	l.wmu.Lock() // a flush under way has written
	l.wmu.Unlock()
	return say(context.Background(), now, reports)
}

// kindKey is r's kind and its call site's (see the package comment; the
// same for a kind that is its call site), and r without a KindKey
// attribute.
func kindKey(r slog.Record) (key, site string, _ slog.Record) {
	var named string
	r.Attrs(func(a slog.Attr) bool {
		if a.Key == KindKey {
			named = a.Value.String()
			return false
		}
		return true
	})
	level := r.Level.String()
	site = level + " pc " + strconv.FormatUint(uint64(r.PC), 16)
	switch {
	case named != "":
		out := slog.NewRecord(r.Time, r.Level, r.Message, r.PC)
		r.Attrs(func(a slog.Attr) bool {
			if a.Key != KindKey {
				out.AddAttrs(a)
			}
			return true
		})
		return site + " kind " + clip(named), site, out
	case r.PC != 0:
		return site, site, r
	}
	return site + " msg " + Normalize(r.Message), site, r
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
func (l *limiter) admit(key, site string, level slog.Level, msg string, h slog.Handler) (pass bool, reports []report) {
	now := l.now()
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.Sub(l.swept) >= l.interval {
		reports = l.sweep(now)
	}
	k, ok := l.kinds[key]
	if !ok {
		counted := ""
		if key != site { // named by text
			if l.named[site] >= l.maxKinds {
				key = site + " other"
				k = l.kinds[key]
			} else {
				counted = site
				l.named[site]++
			}
		}
		if k == nil {
			k = &kind{start: now, site: counted}
			l.kinds[key] = k
		}
	}
	if now.Sub(k.start) >= l.interval { // over since the last sweep
		if k.suppressed > 0 {
			reports = append(reports, report{n: k.suppressed, level: k.level, like: k.like, h: k.h})
		}
		*k = kind{start: now, site: k.site}
	}
	if k.passed < l.burst {
		k.passed++
		return true, reports
	}
	k.suppressed++
	k.level, k.like, k.h = level, clip(msg), h
	l.schedule(now)
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
			reports = append(reports, report{n: k.suppressed, level: k.level, like: k.like, h: k.h})
		}
		delete(l.kinds, key)
		if k.site != "" {
			if l.named[k.site]--; l.named[k.site] == 0 {
				delete(l.named, k.site)
			}
		}
	}
	return reports
}

// Normalize is msg with every run of digits one '#', at most 200 bytes of
// it: a kind for lines whose numbers (ports, connection ids) vary.
func Normalize(msg string) string {
	msg = clip(msg)
	var b strings.Builder
	b.Grow(len(msg))
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

// clip is at most maxText bytes of s.
func clip(s string) string {
	if len(s) > maxText {
		return s[:maxText]
	}
	return s
}
