package leasebus

import (
	"slices"
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

// TestCallQueueTakesTurns: a repo's queue is shared by identities in
// turns. A runner that floods a repo fills its own share (maxQueued) and
// is refused past it, while another runner's calls still queue; each
// batch takes one call of every identity waiting in turn, each
// identity's oldest first, so the other runner's call is in the next
// batch, not behind the flood. The service's own calls (identity "")
// take turns too, and pushAlways queues them past any share.
func TestCallQueueTakesTurns(t *testing.T) {
	q := callQueue{ready: make(chan struct{}, 1)}
	for i := range maxQueued {
		if !q.push(&call{by: "flooder", op: strconv.Itoa(i)}) {
			t.Fatalf("the flooder's call %d refused below its share", i)
		}
	}
	if q.push(&call{by: "flooder"}) {
		t.Fatalf("the flooder queued past its share (%d)", maxQueued)
	}
	for i := range 3 {
		if !q.push(&call{by: "victim", op: strconv.Itoa(i)}) {
			t.Fatalf("the victim's call %d refused while the flooder's share is full", i)
		}
	}
	q.pushAlways(&call{op: "reap"})
	if n, f, v := q.len(), q.lenOf("flooder"), q.lenOf("victim"); n != maxQueued+4 || f != maxQueued || v != 3 {
		t.Fatalf("queued %d (flooder %d, victim %d), want %d (%d, 3)", n, f, v, maxQueued+4, maxQueued)
	}

	got := q.take(nil, 5)
	want := []string{"flooder/0", "victim/0", "/reap", "flooder/1", "victim/1"}
	for i, c := range got {
		if k := c.by + "/" + c.op; i >= len(want) || k != want[i] {
			t.Fatalf("batch %d is %s, want %v", i, k, want)
		}
	}
	if len(got) != len(want) {
		t.Fatalf("took %d calls, want %d", len(got), len(want))
	}
	// The victim's last call and the flooder's next, then the flooder
	// alone, in its order.
	got = q.take(nil, 3)
	if k := got[0].by + "/" + got[0].op; k != "flooder/2" {
		t.Fatalf("next batch starts with %s, want flooder/2 (its turn comes after victim/1)", k)
	}
	if k := got[1].by + "/" + got[1].op; k != "victim/2" {
		t.Fatalf("next batch's second call is %s, want victim/2", k)
	}
	if k := got[2].by + "/" + got[2].op; k != "flooder/3" {
		t.Fatalf("next batch's third call is %s, want flooder/3 (the victim has none left)", k)
	}
	next := 4
	for q.len() > 0 {
		for _, c := range q.take(nil, 100) {
			if c.by != "flooder" || c.op != strconv.Itoa(next) {
				t.Fatalf("took %s/%s, want flooder/%d (its own order)", c.by, c.op, next)
			}
			next++
		}
	}
	if next != maxQueued {
		t.Fatalf("the flooder's calls ran to %d, want %d", next, maxQueued)
	}
	if q.q.byID != nil || q.q.order != nil || q.lenOf("flooder") != 0 {
		t.Fatal("an empty queue keeps its identities' arrays")
	}
}

// TestCallQueueManyIdentities: thousands of runners with a call each at
// one repo (a monorepo's fleet) are taken in the order they came.
func TestCallQueueManyIdentities(t *testing.T) {
	q := callQueue{ready: make(chan struct{}, 1)}
	const n = 20_000
	for i := range n {
		if !q.push(&call{by: "runner-" + strconv.Itoa(i), op: strconv.Itoa(i)}) {
			t.Fatalf("runner %d's call refused", i)
		}
	}
	next := 0
	for q.len() > 0 {
		for _, c := range q.take(nil, 256) {
			if c.op != strconv.Itoa(next) {
				t.Fatalf("took runner %s's call, want %d's (the order they came)", c.op, next)
			}
			next++
		}
	}
	if next != n {
		t.Fatalf("took %d calls, want %d", next, n)
	}
}

// TestTurnsPutBackGoesFirst: values taken for a batch that had no room
// for them go back ahead of their identity's others, and their identity's
// turn comes first again.
func TestTurnsPutBackGoesFirst(t *testing.T) {
	var q turns[string]
	q.push("a", "a1", 1)
	q.push("a", "a2", 1)
	q.push("b", "b1", 1)
	q.push("c", "c1", 1)
	a1, _ := q.pop()
	b1, _ := q.pop()
	q.pushFront("b", 1, b1) // b had nothing else waiting: its turn first
	q.pushFront("a", 1, a1) // a's turn, ahead of a2
	var got []string
	for {
		v, ok := q.pop()
		if !ok {
			break
		}
		got = append(got, v)
	}
	if want := []string{"a1", "b1", "c1", "a2"}; !slices.Equal(got, want) {
		t.Fatalf("taken %v, want %v", got, want)
	}
	if q.len() != 0 || q.total() != 0 {
		t.Fatalf("%d values of %d bytes left", q.len(), q.total())
	}
}

// TestTurnsKeepSizes: an identity's waiting size is the sum of what it
// has waiting, through pushes and pops in turns, and an identity whose
// values are all taken holds nothing, its size with it (else a runner's
// share of an intake would shrink for good with each burst).
func TestTurnsKeepSizes(t *testing.T) {
	var q turns[int]
	q.push("a", 1, 100)
	q.push("b", 2, 7)
	q.push("a", 3, 50)
	if n, size := q.lenOf("a"), q.sizeOf("a"); n != 2 || size != 150 {
		t.Fatalf("a has %d waiting of %d bytes, want 2 of 150", n, size)
	}
	if q.total() != 157 || q.identities() != 2 {
		t.Fatalf("%d bytes of %d identities wait, want 157 of 2", q.total(), q.identities())
	}
	var got []int
	for {
		v, ok := q.pop()
		if !ok {
			break
		}
		got = append(got, v)
		if v == 1 && q.sizeOf("a") != 50 {
			t.Fatalf("a's size after its first was taken: %d, want 50", q.sizeOf("a"))
		}
	}
	if want := []int{1, 2, 3}; !slices.Equal(got, want) {
		t.Fatalf("taken %v, want %v (a, then b, then a again)", got, want)
	}
	if q.len() != 0 || q.sizeOf("a") != 0 || q.total() != 0 || q.byID != nil || q.order != nil {
		t.Fatalf("an empty queue keeps %d values, a's size %d, or its identities", q.len(), q.sizeOf("a"))
	}
	q.push("a", 4, 10) // an identity back after it emptied starts from nothing
	if q.sizeOf("a") != 10 || q.lenOf("a") != 1 {
		t.Fatalf("a back with one of 10 bytes: %d waiting of %d bytes", q.lenOf("a"), q.sizeOf("a"))
	}
}

// BenchmarkTurns: a push and a pop cost the same with a handful of
// identities waiting as with a monorepo's fleet of them (O(1) each, not
// a walk of the identities waiting).
//
//	go test -run '^$' -bench BenchmarkTurns ./leasebus/
func BenchmarkTurns(b *testing.B) {
	for _, ids := range []int{8, 20_000} {
		b.Run(strconv.Itoa(ids)+"-identities", func(b *testing.B) {
			names := make([]string, ids)
			for i := range names {
				names[i] = "runner-" + strconv.Itoa(i)
			}
			var q turns[int]
			for i, name := range names { // every identity has one waiting
				q.push(name, i, 1)
			}
			b.ResetTimer()
			for i := range b.N {
				q.push(names[i%ids], i, 1)
				q.pop()
			}
		})
	}
}
