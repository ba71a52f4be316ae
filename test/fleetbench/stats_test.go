package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

func TestHistQuantiles(t *testing.T) {
	var h Hist
	// 1..1000 ms, shuffled order does not matter: a histogram.
	for i := 1000; i >= 1; i-- {
		h.Add(time.Duration(i) * time.Millisecond)
	}
	for _, c := range []struct {
		q    float64
		want float64 // ms
	}{{.5, 500}, {.99, 990}, {.999, 999}, {1, 1000}, {0, 1}} {
		got := h.Quantile(c.q)
		if math.Abs(got-c.want)/c.want > 0.02 {
			t.Errorf("Quantile(%v) = %.2f ms, want %.0f ms within 2%%", c.q, got, c.want)
		}
	}
	if h.Count() != 1000 {
		t.Errorf("Count = %d, want 1000", h.Count())
	}
}

func TestHistSmallAndHuge(t *testing.T) {
	var h Hist
	h.Add(-time.Second) // counts as 0
	h.Add(40 * time.Microsecond)
	if got := h.Quantile(1); got != 0.04 {
		t.Errorf("Quantile(1) = %v ms, want 0.04 (exact below 64 µs)", got)
	}
	h.Add(time.Duration(math.MaxInt64)) // the last bucket, no panic
	if got := h.Quantile(1); got < 9e12 {
		t.Errorf("Quantile(1) after MaxInt64 = %v ms", got)
	}
	var empty Hist
	if got := empty.Quantile(.5); !math.IsNaN(got) {
		t.Errorf("empty Quantile = %v, want NaN", got)
	}
}

func TestBucketsCoverEveryValueInOrder(t *testing.T) {
	prev := -1
	for _, us := range []uint64{0, 1, 63, 64, 65, 127, 128, 129, 1 << 20, 1<<20 + 12345, 1 << 40, math.MaxUint64} {
		b := bucketOf(us)
		if b < prev || b >= nBuckets {
			t.Fatalf("bucketOf(%d) = %d (previous %d, buckets %d)", us, b, prev, nBuckets)
		}
		if mid := bucketMid(b); us < 1<<50 && math.Abs(mid-float64(us)) > float64(us)/subCount+1 {
			t.Errorf("bucketMid(bucketOf(%d)) = %.0f: further than 1/%d", us, mid, subCount)
		}
		prev = b
	}
}

func TestResultLine(t *testing.T) {
	var acq, renew Hist
	acq.Add(2 * time.Millisecond)
	r := &Result{Leases: 10000, Repos: 1000, Acquire: &acq, Renew: &renew, Errors: 3, Spurious: 1,
		RSSMBMax: 412.4, BytesPerLease: 321.6, Extra: []Field{{"held_end", "9999"}, {"errors_by_kind", "renew:timeout:3 x"}}}
	want := "RESULT leases=10000 repos=1000 acquire_p50_ms=2.00 acquire_p99_ms=2.00 acquire_p999_ms=2.00" +
		" renew_p50_ms=NaN renew_p99_ms=NaN renew_p999_ms=NaN errors=3 spurious_losses=1 rss_mb_max=412 bytes_per_lease=322" +
		" held_end=9999 errors_by_kind=renew:timeout:3_x"
	if got := r.Line(); got != want {
		t.Errorf("Line:\n got %s\nwant %s", got, want)
	}
}

func TestKinds(t *testing.T) {
	var k Kinds
	if k.String() != "none" {
		t.Errorf("empty Kinds = %q", k.String())
	}
	for _, err := range []error{
		fmt.Errorf("renew: %w: got no answer", lease.ErrUnavailable),
		fmt.Errorf("writing the lease log: lease log moved on: %w", lease.ErrUnavailable),
		fmt.Errorf("x: %w", lease.ErrLeaseLost),
		errors.New("strange"),
		fmt.Errorf("renew: %w", context.Canceled),
	} {
		k.Add("renew:" + kindOf(err))
	}
	k.Add("renew:timeout")
	if got, want := k.String(), "renew:canceled:1,renew:cas:1,renew:lost:1,renew:other:1,renew:timeout:2"; got != want {
		t.Errorf("Kinds = %q, want %q", got, want)
	}
	if k.Total() != 6 {
		t.Errorf("Total = %d, want 6", k.Total())
	}
}

func TestReadProcOfSelf(t *testing.T) {
	rss, ticks, err := readProc(os.Getpid())
	if err != nil || rss <= 0 {
		t.Fatalf("readProc(self) = %v MB, %d ticks, %v", rss, ticks, err)
	}
	if _, err := parseNodes("n0=1,n1"); err == nil || !strings.Contains(err.Error(), "name=pid") {
		t.Errorf("parseNodes of a bad list: %v", err)
	}
}

func TestDoubtOf(t *testing.T) {
	for msg, want := range map[string]string{
		"lease state unknown: lease_x (fence 3): no answer from the lease service for 812ms; writes wait until the lease is re-checked": "silence",
		"lease state unknown: lease_x (fence 3): disconnected from the bus (RECONNECTING); writes wait":                                 "disconnect",
		"lease state unknown: lease_x (fence 3): reconnected to the bus; re-checking the lease before the next write":                   "reconnect",
		"lease state unknown: lease_x (fence 3): the lease service did not answer the renewal: nats: timeout":                           "renew_unanswered",
		"lease state unknown: lease_x (fence 3): announced revoked (version 9: test); writes stop until the lease service confirms":     "notice",
		"something else": "other",
	} {
		if got := doubtOf(errors.New(msg)); got != want {
			t.Errorf("doubtOf(%q) = %s, want %s", msg, got, want)
		}
	}
}

func TestDisconnectOf(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{nats.ErrStaleConnection, "stale"},
		{fmt.Errorf("read: %w", io.EOF), "eof"},
		{errors.New("nats: slow consumer, messages dropped"), "slow"},
		{errors.New("read tcp 127.0.0.1:1->127.0.0.1:2: i/o timeout"), "timeout"},
		{fmt.Errorf("read: %w", os.ErrDeadlineExceeded), "timeout"},
		{errors.New("connection reset by peer"), "other"},
	} {
		if got := disconnectOf(c.err); got != c.want {
			t.Errorf("disconnectOf(%v) = %s, want %s", c.err, got, c.want)
		}
	}
}
