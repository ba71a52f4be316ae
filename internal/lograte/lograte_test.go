package lograte

import (
	"bytes"
	"fmt"
	"log/slog"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time { return c.t }

func newLogger(o Options) (*slog.Logger, *bytes.Buffer, *clock) {
	var buf bytes.Buffer
	c := &clock{t: time.Unix(1_700_000_000, 0)}
	o.Now = c.now
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
