package leasebus

import "slices"

// turns holds values waiting for one goroutine, one FIFO per identity,
// taken in turns: one value of each identity with values waiting per
// turn, each identity's oldest first. A push and a pop are O(1) however
// many identities wait (a monorepo's thousands of runners). It has no
// lock of its own: its owner's guards it.
//
// The queues are slices that grow with what waits, not buffered
// channels, which would be carried at full size whether anything waits
// or not; with nothing waiting a turns holds nothing.
type turns[T any] struct {
	// byID holds the queue of each identity with values waiting, and
	// order those queues in the order they take their turns, each once.
	// Both nil while nothing waits.
	byID  map[string]*turn[T]
	order []*turn[T]
	n     int // values waiting, over every identity
	size  int // their size, over every identity
}

// turn is what one identity has waiting, oldest first, and their size
// (as push was told it).
type turn[T any] struct {
	by   string
	vals []sized[T]
	size int
}

// sized is a value and its size.
type sized[T any] struct {
	v    T
	size int
}

// push queues v, of size bytes, behind by's other values. An identity
// with nothing waiting takes its first turn after every identity waiting
// now.
func (q *turns[T]) push(by string, v T, size int) {
	t := q.turnOf(by, false)
	t.vals = append(t.vals, sized[T]{v, size})
	q.added(t, size)
}

// pushFront queues vs, of size bytes each, ahead of by's other values,
// in their order, and by's turn first (they were taken in its turns and
// go back): one copy of by's queue however many go back.
func (q *turns[T]) pushFront(by string, size int, vs ...T) {
	t := q.turnOf(by, true)
	front := make([]sized[T], len(vs), len(vs)+len(t.vals))
	for i, v := range vs {
		front[i] = sized[T]{v, size}
		q.added(t, size)
	}
	t.vals = append(front, t.vals...)
}

// turnOf is by's turn, made if by has nothing waiting: last in the order
// of turns, or first when front (an existing turn is moved first: the
// value going back had its turn already; rare, so its O(identities) is
// no matter).
func (q *turns[T]) turnOf(by string, front bool) *turn[T] {
	if t := q.byID[by]; t != nil {
		if front {
			i := slices.Index(q.order, t)
			copy(q.order[1:i+1], q.order[:i])
			q.order[0] = t
		}
		return t
	}
	if q.byID == nil {
		q.byID = map[string]*turn[T]{}
	}
	t := &turn[T]{by: by}
	q.byID[by] = t
	if front {
		q.order = append([]*turn[T]{t}, q.order...)
	} else {
		q.order = append(q.order, t)
	}
	return t
}

// added counts a value of size bytes just queued in t.
func (q *turns[T]) added(t *turn[T], size int) {
	t.size += size
	q.n++
	q.size += size
}

// pop takes the oldest value of the identity whose turn it is; false
// when nothing waits.
func (q *turns[T]) pop() (v T, ok bool) {
	if q.n == 0 {
		return v, false
	}
	t := q.order[0]
	q.order[0] = nil
	q.order = q.order[1:]
	v = t.vals[0].v
	t.size -= t.vals[0].size
	q.size -= t.vals[0].size
	t.vals[0] = sized[T]{}
	t.vals = t.vals[1:]
	q.n--
	if len(t.vals) > 0 {
		q.order = append(q.order, t) // its next turn after the others'
	} else {
		delete(q.byID, t.by) // its array with it
	}
	if q.n == 0 {
		q.byID, q.order = nil, nil // a burst's room goes back
	}
	return v, true
}

// len is how many values wait.
func (q *turns[T]) len() int { return q.n }

// total is the size of every value waiting.
func (q *turns[T]) total() int { return q.size }

// identities is how many identities have values waiting.
func (q *turns[T]) identities() int { return len(q.order) }

// lenOf is how many values identity by has waiting.
func (q *turns[T]) lenOf(by string) int {
	if t := q.byID[by]; t != nil {
		return len(t.vals)
	}
	return 0
}

// sizeOf is the size of what identity by has waiting.
func (q *turns[T]) sizeOf(by string) int {
	if t := q.byID[by]; t != nil {
		return t.size
	}
	return 0
}
