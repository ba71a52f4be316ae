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

// TestKindsAreCountedApart: another kind, or another level, is not held
// back by a flood of one; messages that differ only in their numbers (a
// NATS server's addresses and connection ids) are one kind.
func TestKindsAreCountedApart(t *testing.T) {
	log, buf, _ := newLogger(Options{Burst: 3, Interval: time.Second})
	for i := range 100 {
		log.Error(fmt.Sprintf("127.0.0.1:%d - cid:%d - authentication error", 40000+i, i))
	}
	log.Warn("write refused")
	log.Info("127.0.0.1:1 - cid:1 - authentication error")
	out := buf.String()
	if got := strings.Count(out, "level=ERROR"); got != 3 {
		t.Fatalf("%d of 100 authentication errors from different connections written, want 3:\n%s", got, out)
	}
	if !strings.Contains(out, `msg="write refused"`) || !strings.Contains(out, "level=INFO") {
		t.Fatalf("other kinds held back by a flood of one:\n%s", out)
	}
}

// TestKindsAreBounded: a flood of ever new kinds (a client name the
// stranger picks, in each line) is counted in one bucket beyond MaxKinds:
// the limiter keeps no more than that, and the flood stays bounded.
func TestKindsAreBounded(t *testing.T) {
	log, buf, c := newLogger(Options{Burst: 2, Interval: time.Second, MaxKinds: 10})
	h := log.Handler().(*Handler)
	for i := range 1000 {
		log.Error("connection from client " + strings.Repeat("x", i%50) + strconv.Itoa(i) + " refused")
	}
	if n := len(h.st.kinds); n > 10 {
		t.Fatalf("%d kinds kept, want at most 10", n)
	}
	if got := strings.Count(buf.String(), "level=ERROR"); got > 10*2 {
		t.Fatalf("%d records of 1,000 new kinds written, want at most %d", got, 10*2)
	}
	c.t = c.t.Add(2 * time.Second)
	log.Error("connection from client y refused")
	out := buf.String()
	if written, counted := strings.Count(out, `msg="connection from client`), suppressedIn(out); written+counted < 1000 {
		t.Fatalf("%d written and %d counted of 1,000 records", written, counted)
	}
}

// TestAttrsShareTheCount: loggers made With attributes (the sidecar adds the
// lease to its fences' loggers) count against the same kinds.
func TestAttrsShareTheCount(t *testing.T) {
	log, buf, _ := newLogger(Options{Burst: 4, Interval: time.Second})
	a, b := log.With("fence", "postgres"), log.WithGroup("git")
	for range 10 {
		a.Warn("write refused")
		b.Warn("write refused")
	}
	if got := strings.Count(buf.String(), `write refused`); got != 4 {
		t.Fatalf("%d records written through two derived loggers, want 4 in all", got)
	}
}
