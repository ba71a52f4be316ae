package leasebus

import (
	"strconv"
	"testing"
)

// TestCallQueueWakesForWhatIsLeft: an actor's queue hands its calls out
// oldest first, at most a batch at a time, and keeps its goroutine's
// wake-up pending while calls are left after a batch (a burst larger than
// MaxBatch is run at once, not at the next request or deadline); it
// refuses calls past maxQueued.
func TestCallQueueWakesForWhatIsLeft(t *testing.T) {
	q := callQueue{ready: make(chan struct{}, 1)}
	for i := range 10 {
		if !q.push(&call{op: strconv.Itoa(i)}) {
			t.Fatalf("call %d refused", i)
		}
	}
	<-q.ready // the pushes' wake-up
	next := 0
	for _, want := range []int{4, 4, 2} {
		got := q.take(nil, 4)
		if len(got) != want {
			t.Fatalf("took %d calls, want %d", len(got), want)
		}
		for _, c := range got {
			if c.op != strconv.Itoa(next) {
				t.Fatalf("took call %s, want %d (oldest first)", c.op, next)
			}
			next++
		}
		select {
		case <-q.ready:
			if q.len() == 0 {
				t.Fatal("a wake-up is pending with no call waiting")
			}
		default:
			if q.len() > 0 {
				t.Fatalf("%d calls wait and no wake-up is pending", q.len())
			}
		}
	}
	for range maxQueued {
		if !q.push(&call{}) {
			t.Fatalf("refused with %d queued, below maxQueued", q.len())
		}
	}
	if q.push(&call{}) {
		t.Fatalf("queued past maxQueued (%d)", maxQueued)
	}
	if got := q.take(nil, 2*maxQueued); len(got) != maxQueued || q.len() != 0 {
		t.Fatalf("took %d, %d left; want all %d", len(got), q.len(), maxQueued)
	}
}
