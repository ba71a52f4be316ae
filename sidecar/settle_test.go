package sidecar

import (
	"net/http"
	"strings"
	"testing"
	"time"
)

// waitSettledWithin runs a.WaitSettled(timeout) and fails t when it has
// not returned within bound.
func waitSettledWithin(t *testing.T, a *Admin, timeout, bound time.Duration) Settlement {
	t.Helper()
	done := make(chan Settlement, 1)
	go func() { done <- a.WaitSettled(timeout) }()
	select {
	case s := <-done:
		return s
	case <-time.After(bound):
		t.Fatalf("WaitSettled(%s) still waiting after %s", timeout, bound)
		return 0
	}
}

func postSettled(t *testing.T, a *Admin) {
	t.Helper()
	resp, err := http.Post(a.URL()+PathSettled, "application/json", strings.NewReader(`{"exitCode":0}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("settled: %s", resp.Status)
	}
}

// TestWaitSettled: with no agent wrapper ever connected there is nothing
// to wait for; a connected wrapper that reports nothing is waited for up
// to the timeout, and lets go at once when it reports, before or during
// the wait.
func TestWaitSettled(t *testing.T) {
	t.Parallel()
	t.Run("no agent", func(t *testing.T) {
		a := startAdmin(t, AdminConfig{})
		if s := waitSettledWithin(t, a, time.Hour, 5*time.Second); s != SettleNoAgent || !s.Settled() {
			t.Fatalf("WaitSettled = %d, want SettleNoAgent", s)
		}
	})
	t.Run("agent silent", func(t *testing.T) {
		a := startAdmin(t, AdminConfig{})
		openEvents(t, a.URL(), "").next(t, 5*time.Second) // connected: the stream has its first view
		start := time.Now()
		s := waitSettledWithin(t, a, 100*time.Millisecond, 5*time.Second)
		if s != SettleTimedOut || s.Settled() {
			t.Fatalf("WaitSettled = %d, want SettleTimedOut", s)
		}
		if waited := time.Since(start); waited < 100*time.Millisecond {
			t.Fatalf("timed out after %s, before the 100ms timeout", waited)
		}
	})
	t.Run("reported before", func(t *testing.T) {
		a := startAdmin(t, AdminConfig{})
		openEvents(t, a.URL(), "").next(t, 5*time.Second)
		postSettled(t, a)
		if s := waitSettledWithin(t, a, time.Hour, 5*time.Second); s != SettleReported || !s.Settled() {
			t.Fatalf("WaitSettled = %d, want SettleReported", s)
		}
	})
	t.Run("reported while waiting", func(t *testing.T) {
		a := startAdmin(t, AdminConfig{})
		openEvents(t, a.URL(), "").next(t, 5*time.Second)
		done := make(chan Settlement, 1)
		go func() { done <- a.WaitSettled(time.Hour) }()
		postSettled(t, a)
		select {
		case s := <-done:
			if s != SettleReported {
				t.Fatalf("WaitSettled = %d, want SettleReported", s)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("WaitSettled still waiting after the report")
		}
	})
}
