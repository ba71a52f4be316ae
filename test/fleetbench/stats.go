package main

// The pure parts of the driver: a latency histogram of bounded size, error
// counts by kind, and the one RESULT line per level.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/bits"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// subBits sets the histogram's precision: 2^subBits buckets per power of
// two of microseconds, so a quantile is within 1/2^subBits (1.6 %) of the
// sample it stands for.
const subBits = 6

const (
	subCount = 1 << subBits
	nBuckets = (64 - subBits + 1) * subCount // shift reaches 64-subBits-1
)

// Hist is a log-linear histogram of durations at microsecond resolution:
// a fixed array of counts, however many samples it takes. Safe for
// concurrent use.
type Hist struct {
	mu     sync.Mutex
	counts [nBuckets]uint64 // guarded by mu
	n      uint64           // guarded by mu
	max    time.Duration    // guarded by mu
}

// bucketOf is the bucket of us microseconds: exact below 2^subBits, then
// the top subBits+1 bits of us.
func bucketOf(us uint64) int {
	if us < subCount {
		return int(us)
	}
	shift := bits.Len64(us) - subBits - 1
	return (shift+1)*subCount + int(us>>shift) - subCount
}

// bucketMid is the middle of bucket b, in microseconds.
func bucketMid(b int) float64 {
	if b < subCount {
		return float64(b)
	}
	shift := b/subCount - 1
	lo := uint64(b%subCount+subCount) << shift
	return float64(lo) + float64(uint64(1)<<shift-1)/2
}

// Add records one sample (negative ones count as 0).
func (h *Hist) Add(d time.Duration) {
	us := uint64(max(d, 0) / time.Microsecond)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.counts[bucketOf(us)]++
	h.n++
	h.max = max(h.max, d)
}

// Count is the number of samples.
func (h *Hist) Count() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.n
}

// Quantile is the q-quantile (0..1) in milliseconds, NaN when empty. It is
// never above the largest sample.
func (h *Hist) Quantile(q float64) float64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.n == 0 {
		return math.NaN()
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	rank = min(max(rank, 1), h.n)
	var seen uint64
	for b, c := range h.counts {
		seen += c
		if seen >= rank {
			return min(bucketMid(b)/1000, float64(h.max)/float64(time.Millisecond))
		}
	}
	return float64(h.max) / float64(time.Millisecond)
}

// Kinds counts events by kind ("renew:timeout"). Safe for concurrent use.
type Kinds struct {
	mu      sync.Mutex
	m       map[string]int64  // guarded by mu
	example map[string]string // the first error of each kind; guarded by mu
}

// AddErr counts one error of kind and keeps the first one of each kind as
// its example.
func (k *Kinds) AddErr(kind string, err error) {
	k.Add(kind)
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.example == nil {
		k.example = map[string]string{}
	}
	if _, ok := k.example[kind]; !ok {
		k.example[kind] = err.Error()
	}
}

// Examples is "kind: first error" for each kind that has one, sorted.
func (k *Kinds) Examples() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for kind, msg := range k.example {
		out = append(out, kind+": "+msg)
	}
	slices.Sort(out)
	return out
}

// Add counts one event of kind.
func (k *Kinds) Add(kind string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.m == nil {
		k.m = map[string]int64{}
	}
	k.m[kind]++
}

// Total is the number of events of every kind.
func (k *Kinds) Total() int64 {
	k.mu.Lock()
	defer k.mu.Unlock()
	var n int64
	for _, v := range k.m {
		n += v
	}
	return n
}

// String is "kind:n,kind:n" sorted by kind, or "none".
func (k *Kinds) String() string {
	k.mu.Lock()
	defer k.mu.Unlock()
	if len(k.m) == 0 {
		return "none"
	}
	keys := make([]string, 0, len(k.m))
	for key := range k.m {
		keys = append(keys, key)
	}
	slices.Sort(keys)
	parts := make([]string, len(keys))
	for i, key := range keys {
		parts[i] = fmt.Sprintf("%s:%d", key, k.m[key])
	}
	return strings.Join(parts, ",")
}

// kindOf names the kind of a lease operation's error for the counts.
func kindOf(err error) string {
	var ce *lease.ConflictError
	msg := err.Error()
	switch {
	case strings.Contains(msg, "moved on"):
		return "cas" // the lease log moved on: another writer appended first
	case errors.As(err, &ce):
		return "conflict"
	case errors.Is(err, lease.ErrLeaseLost):
		return "lost"
	case errors.Is(err, lease.ErrNotOwner):
		return "not_owner"
	case errors.Is(err, lease.ErrNotFound):
		return "not_found"
	case errors.Is(err, leasebus.ErrStoreFull), errors.Is(err, leasebus.ErrLogFull):
		return "full"
	case errors.Is(err, context.Canceled):
		return "canceled" // the holder gave up the request (its connection changed, or it stopped)
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, nats.ErrTimeout), strings.Contains(msg, "no answer"), strings.Contains(msg, "i/o timeout"):
		return "timeout"
	case errors.Is(err, nats.ErrConnectionClosed), errors.Is(err, nats.ErrConnectionReconnecting), errors.Is(err, nats.ErrNoResponders):
		return "conn"
	case errors.Is(err, lease.ErrUnavailable):
		return "unavailable"
	}
	return "other"
}

// disconnectOf names why one of the driver's connections dropped: stale
// (its PINGs went unanswered: nats.go gave up on the server), eof (the
// server closed it), timeout (a read or the reconnect's handshake timed
// out), slow (the server found it a slow consumer), else other.
func disconnectOf(err error) string {
	msg := strings.ToLower(err.Error())
	switch {
	case errors.Is(err, nats.ErrStaleConnection):
		return "stale"
	case errors.Is(err, io.EOF):
		return "eof"
	case strings.Contains(msg, "slow consumer"):
		return "slow"
	case strings.Contains(msg, "i/o timeout"), errors.Is(err, os.ErrDeadlineExceeded):
		return "timeout"
	}
	return "other"
}

// doubtOf names why a holder fell Unknown, from its error: the service
// silent past the holder's bound, its connection dropping or coming back,
// a renewal unanswered, a notice that the lease ended, the service not
// knowing the lease, or the check a new holder makes.
func doubtOf(err error) string {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	for _, k := range []struct{ phrase, kind string }{
		{"no answer from the lease service", "silence"},
		{"disconnected from the bus", "disconnect"},
		{"reconnected to the bus", "reconnect"},
		{"connection to the bus is closed", "closed"},
		{"did not answer the renewal", "renew_unanswered"},
		{"announced", "notice"},
		{"does not know the lease", "missing"},
		{"could not confirm", "confirm"},
	} {
		if strings.Contains(msg, k.phrase) {
			return k.kind
		}
	}
	return "other"
}

// Result is what one level measured: the fixed fields of its RESULT line,
// then the extra ones in order.
type Result struct {
	Leases, Repos    int
	Acquire, Renew   *Hist
	Errors, Spurious int64
	RSSMBMax         float64
	BytesPerLease    float64
	Extra            []Field
}

// Field is one extra key=value of a RESULT line.
type Field struct {
	Key   string
	Value string
}

// ms formats a millisecond figure for a RESULT line ("NaN" when there was
// no sample).
func ms(v float64) string {
	if math.IsNaN(v) {
		return "NaN"
	}
	return fmt.Sprintf("%.2f", v)
}

// Line is the level's RESULT line:
//
//	RESULT leases=N repos=R acquire_p50_ms=… acquire_p99_ms=… acquire_p999_ms=… renew_p50_ms=… renew_p99_ms=… renew_p999_ms=… errors=… spurious_losses=… rss_mb_max=… bytes_per_lease=… [extra…]
func (r *Result) Line() string {
	var b strings.Builder
	fmt.Fprintf(&b, "RESULT leases=%d repos=%d", r.Leases, r.Repos)
	for _, h := range []struct {
		name string
		h    *Hist
	}{{"acquire", r.Acquire}, {"renew", r.Renew}} {
		fmt.Fprintf(&b, " %s_p50_ms=%s %s_p99_ms=%s %s_p999_ms=%s", h.name, ms(h.h.Quantile(.5)), h.name, ms(h.h.Quantile(.99)), h.name, ms(h.h.Quantile(.999)))
	}
	fmt.Fprintf(&b, " errors=%d spurious_losses=%d rss_mb_max=%.0f bytes_per_lease=%.0f", r.Errors, r.Spurious, r.RSSMBMax, r.BytesPerLease)
	for _, f := range r.Extra {
		v := strings.Map(func(c rune) rune {
			if c == ' ' || c == '\t' || c == '\n' {
				return '_'
			}
			return c
		}, f.Value)
		fmt.Fprintf(&b, " %s=%s", f.Key, v)
	}
	return b.String()
}
