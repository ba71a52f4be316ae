package lograte

import (
	"bytes"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

// newLogger is a logger on a clock the test moves. Its interval's timer
// never fires unless o.After is given: the real one, on a machine slow
// enough, fired during the test and read the clock and the buffer the test
// was writing (a data race under -race).
func newLogger(o Options) (*slog.Logger, *bytes.Buffer, *clock) {
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	o.Now = c.now
	if o.After == nil {
		o.After = func(time.Duration, func()) func() bool { return func() bool { return true } }
	}
	return slog.New(New(slog.NewTextHandler(&buf, nil), o)), &buf, c
}

var suppressedRe = regexp.MustCompile(`suppressed=(\d+)`)

func suppressedIn(out string) int {
	n := 0
	for _, m := range suppressedRe.FindAllStringSubmatch(out, -1) {
		v, _ := strconv.Atoi(m[1])
		n += v
	}
	return n
}

// TestFloodOfOneKind: a thousand refusals in one interval write Burst
// records; the next one after the interval is preceded by the count of the
// rest, and every record is either written or counted.
func TestFloodOfOneKind(t *testing.T) {
	log, buf, c := newLogger(Options{Burst: 5, Interval: time.Second})
	for i := range 1000 {
		log.Warn("write refused", "lease", "lease_x", "n", i)
	}
	if got := strings.Count(buf.String(), `msg="write refused"`); got != 5 {
		t.Fatalf("%d of 1,000 records of one kind written in one interval, want 5:\n%s", got, buf)
	}
	c.t = c.t.Add(time.Second)
	log.Warn("write refused", "lease", "lease_x", "n", 1000)
	out := buf.String()
	if n := suppressedIn(out); n != 995 {
		t.Fatalf("the log says %d suppressed, want 995:\n%s", n, out)
	}
	if !strings.Contains(out, `like="write refused"`) {
		t.Fatalf("the count does not say which records:\n%s", out)
	}
	if got := strings.Count(out, `msg="write refused"`); got != 6 {
		t.Fatalf("%d records written after the interval, want 6", got)
	}
}

// TestKindsAreCallSites: text in a message (a URL someone chose, a NATS
// line's addresses) makes no new kind: a flood of ever new messages from
// one call site is limited as one kind, and records of other call sites go
// through beside it, an ERROR among them.
func TestKindsAreCallSites(t *testing.T) {
	log, buf, _ := newLogger(Options{Burst: 3, Interval: time.Second})
	for i := range 1000 {
		log.Warn("egress refused " + strings.Repeat("x", i%300) + strconv.Itoa(i))
	}
	log.Error("audit event for a refused write not recorded")
	log.Info("127.0.0.1:1 - cid:1 - authentication error")
	out := buf.String()
	if got := strings.Count(out, "egress refused"); got != 3 {
		t.Fatalf("%d of 1,000 records of one call site with ever new text written, want 3", got)
	}
	if !strings.Contains(out, `level=ERROR msg="audit event for a refused write not recorded"`) || !strings.Contains(out, "level=INFO") {
		t.Fatalf("other call sites held back by a flood of one:\n%s", out)
	}
}

// TestKindKeyNamesTheKind: a logger passing on another's lines (all from
// one call site) names their kinds; the attribute is not written.
func TestKindKeyNamesTheKind(t *testing.T) {
	log, buf, _ := newLogger(Options{Burst: 2, Interval: time.Second})
	for i := range 10 {
		log.Error(fmt.Sprintf("conn %d: authentication error", i), KindKey, "authentication error")
		log.Error(fmt.Sprintf("conn %d: out of storage", i), KindKey, "out of storage")
	}
	out := buf.String()
	if a, o := strings.Count(out, "authentication error"), strings.Count(out, "out of storage"); a != 2 || o != 2 {
		t.Fatalf("%d and %d records of two named kinds written, want 2 of each:\n%s", a, o, out)
	}
	if strings.Contains(out, KindKey) {
		t.Fatalf("the kind's attribute was written:\n%s", out)
	}
}

// TestKindsAreBounded: ever new kinds named by text from one call site (a
// NATS server line carrying a stranger's malformed JSON) are counted in
// that site's own bucket beyond MaxKinds: the limiter keeps no more than
// that, every record is written or counted, and another call site's record
// still goes through.
func TestKindsAreBounded(t *testing.T) {
	log, buf, c := newLogger(Options{Burst: 2, Interval: time.Second, MaxKinds: 10})
	h := log.Handler().(*Handler)
	for i := range 1000 {
		log.Error("connection refused", KindKey, "client "+strings.Repeat("x", i%50)+strconv.Itoa(i))
	}
	if n := len(h.st.kinds); n > 10+1 {
		t.Fatalf("%d kinds kept, want at most 10 and the site's overflow", n)
	}
	if got := strings.Count(buf.String(), "level=ERROR"); got > (10+1)*2 {
		t.Fatalf("%d records of 1,000 new kinds written, want at most %d", got, (10+1)*2)
	}
	log.Error("audit event for a refused write not recorded")
	if !strings.Contains(buf.String(), "audit event for a refused write not recorded") {
		t.Fatal("another call site's record was crowded out by one site's named kinds")
	}
	c.t = c.t.Add(2 * time.Second)
	log.Error("connection refused", KindKey, "client y")
	out := buf.String()
	if written, counted := strings.Count(out, `msg="connection refused"`), suppressedIn(out); written+counted < 1000 {
		t.Fatalf("%d written and %d counted of 1,000 records", written, counted)
	}
}

// TestAttrsShareTheCount: loggers made With attributes (the sidecar adds the
// lease to its fences' loggers) count against the same kinds, and a count
// is said through the logger its records came to, with its attributes.
func TestAttrsShareTheCount(t *testing.T) {
	log, buf, c := newLogger(Options{Burst: 4, Interval: time.Second})
	a, b := log.With("fence", "postgres"), log.WithGroup("git")
	for range 10 {
		refuseOnce(a)
	}
	refuseOnce(b)
	if got := strings.Count(buf.String(), `write refused`); got != 4 {
		t.Fatalf("%d records written through two derived loggers, want 4 in all", got)
	}
	c.t = c.t.Add(time.Second)
	log.Info("next")
	if !regexp.MustCompile(`level=WARN msg="log records suppressed[^\n]*" fence=postgres suppressed=6 like="write refused"`).MatchString(buf.String()) &&
		!regexp.MustCompile(`level=WARN msg="log records suppressed[^\n]*" git\.suppressed=7`).MatchString(buf.String()) {
		t.Fatalf("the count is not said through a logger its records came to:\n%s", buf)
	}
}

// refuseOnce logs from one call site, whoever calls it (a PC is per inlined
// copy: not inlined).
//
//go:noinline
func refuseOnce(l *slog.Logger) { l.Warn("write refused") }

// TestFloodThatStopsIsToldByTheTimer: a flood followed by silence is still
// counted in the log: once its interval is over a timer says how many were
// suppressed, once, and a record after that says nothing of them again.
func TestFloodThatStopsIsToldByTheTimer(t *testing.T) {
	var armed []time.Duration
	var fire []func()
	log, buf, c := newLogger(Options{Burst: 5, Interval: time.Second, After: func(d time.Duration, f func()) func() bool {
		armed = append(armed, d)
		fire = append(fire, f)
		return func() bool { return true }
	}})
	c.t = c.t.Add(300 * time.Millisecond)
	for i := range 1000 {
		log.Warn("write refused", "n", i)
		if i == 500 {
			c.t = c.t.Add(200 * time.Millisecond)
		}
	}
	if n := suppressedIn(buf.String()); n != 0 || len(fire) != 1 {
		t.Fatalf("during the flood: %d said suppressed and %d timers armed, want 0 and 1", n, len(fire))
	}
	if armed[0] != time.Second {
		t.Fatalf("timer armed for %s after the first suppressed record, want the rest of its interval, 1s", armed[0])
	}
	c.t = c.t.Add(800 * time.Millisecond) // the interval's end
	fire[0]()
	if n := suppressedIn(buf.String()); n != 995 {
		t.Fatalf("after the interval, with no record since, the log says %d suppressed, want 995:\n%s", n, buf)
	}
	if len(fire) != 1 {
		t.Fatalf("a timer armed again with nothing left to say (%d)", len(fire))
	}
	c.t = c.t.Add(time.Second)
	log.Warn("write refused", "n", 1000)
	if n := suppressedIn(buf.String()); n != 995 {
		t.Fatalf("the count was said again: %d in all, want 995", n)
	}
}

// TestTimerWaitsForLaterKinds: a kind that began suppressing after the
// armed timer's interval is not over when it fires; the timer is armed
// again for its end, and its count said then.
func TestTimerWaitsForLaterKinds(t *testing.T) {
	var fire []func()
	var armed []time.Duration
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	log := slog.New(New(slog.NewTextHandler(&buf, nil), Options{Burst: 1, Interval: time.Second, Now: c.now, After: func(d time.Duration, f func()) func() bool {
		armed = append(armed, d)
		fire = append(fire, f)
		return func() bool { return true }
	}}))
	for range 2 {
		log.Warn("first kind")
	}
	c.t = c.t.Add(600 * time.Millisecond)
	for range 3 {
		log.Info("second kind")
	}
	c.t = c.t.Add(400 * time.Millisecond)
	fire[0]()
	if n := suppressedIn(buf.String()); n != 1 {
		t.Fatalf("at the first interval's end %d said suppressed, want 1 (the first kind's):\n%s", n, buf.String())
	}
	if len(fire) != 2 || armed[1] != 600*time.Millisecond {
		t.Fatalf("timers armed %v, want a second one for the rest of the second kind's interval (600ms)", armed)
	}
	c.t = c.t.Add(600 * time.Millisecond)
	fire[1]()
	if n := suppressedIn(buf.String()); n != 3 {
		t.Fatalf("at the second kind's interval's end %d said suppressed in all, want 3 (1 + 2):\n%s", n, buf.String())
	}
}

// TestTimerWithRealClock: the default timer says the count with no record
// after the flood (run with -race: the timer's flush and Handle share the
// counts).
func TestTimerWithRealClock(t *testing.T) {
	w := &countWriter{said: make(chan int, 1)}
	log := slog.New(New(slog.NewTextHandler(w, nil), Options{Burst: 2, Interval: 20 * time.Millisecond}))
	for i := range 100 {
		log.Warn("refused", "n", i)
	}
	select {
	case n := <-w.said:
		if n != 98 {
			t.Fatalf("the timer said %d suppressed, want 98", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no count of the 98 suppressed records 10 s after the flood")
	}
}

// countWriter hands on the count of the first line that says one.
type countWriter struct {
	mu   sync.Mutex
	said chan int
	done bool
}

func (w *countWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if n := suppressedIn(string(p)); n > 0 && !w.done {
		w.done = true
		w.said <- n
	}
	return len(p), nil
}

// TestCloseSaysTheRestAndStopsTheTimer: Close says the counts of intervals
// not over yet, stops the timer armed for them, and a flush that fires
// after Close writes nothing: whoever reads the log after Close (a run's
// stderr) sees every count and no late line.
func TestCloseSaysTheRestAndStopsTheTimer(t *testing.T) {
	var fire []func()
	stopped := 0
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	h := New(slog.NewTextHandler(&buf, nil), Options{Burst: 2, Interval: time.Second, Now: c.now, After: func(d time.Duration, f func()) func() bool {
		fire = append(fire, f)
		return func() bool { stopped++; return true }
	}})
	log := slog.New(h)
	for i := range 10 {
		log.Error("refused", "n", i)
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if n := suppressedIn(buf.String()); n != 8 || stopped != 1 {
		t.Fatalf("Close said %d suppressed and stopped %d timers, want 8 and 1:\n%s", n, stopped, buf.String())
	}
	before := buf.Len()
	c.t = c.t.Add(time.Second)
	fire[0]() // fired as Close stopped it
	if buf.Len() != before {
		t.Fatalf("a flush after Close wrote: %q", buf.String()[before:])
	}
	for range 5 {
		log.Error("refused")
	}
	if len(fire) != 1 {
		t.Fatalf("a timer armed after Close")
	}
}
