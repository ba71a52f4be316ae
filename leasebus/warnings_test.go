package leasebus

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// TestWarningsHoldBackRepeats: a warning repeated within the period is
// held back and counted, and the next one written says how many; another
// message, or the same with another error, is written at once.
func TestWarningsHoldBackRepeats(t *testing.T) {
	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	w := newWarnings(time.Second)
	at := time.Date(2026, 12, 5, 0, 0, 0, 0, time.UTC)
	for i := range 40 {
		w.warn(log, at.Add(time.Duration(i)*10*time.Millisecond), "reload lease log", "repo", "r")
	}
	w.warn(log, at.Add(500*time.Millisecond), "append lease log", "repo", "r")
	w.warn(log, at.Add(510*time.Millisecond), "reload lease log", "repo", "q", "err", errors.New("the lease log is full"))
	w.warn(log, at.Add(520*time.Millisecond), "reload lease log", "repo", "q", "err", errors.New("the lease log is full"))
	// The same root error wrapped with another repo's name is the same kind.
	w.warn(log, at.Add(530*time.Millisecond), "reload lease log", "repo", "p", "err", fmt.Errorf("read lease log of p: %w", errors.New("the lease log is full")))
	w.warn(log, at.Add(1200*time.Millisecond), "reload lease log", "repo", "r")
	lines := strings.Split(strings.TrimSpace(buf.String()), "\n")
	if len(lines) != 4 {
		t.Fatalf("wrote %d lines, want 4:\n%s", len(lines), buf.String())
	}
	if !strings.Contains(lines[0], `msg="reload lease log"`) || strings.Contains(lines[0], "held_back") {
		t.Errorf("first line %q: want the warning, nothing held back yet", lines[0])
	}
	if !strings.Contains(lines[1], `msg="append lease log"`) {
		t.Errorf("second line %q: want another message written at once", lines[1])
	}
	if !strings.Contains(lines[2], "lease log is full") {
		t.Errorf("third line %q: want another error of the same message written at once", lines[2])
	}
	if !strings.Contains(lines[3], "held_back=39") {
		t.Errorf("fourth line %q: want held_back=39", lines[3])
	}
}
