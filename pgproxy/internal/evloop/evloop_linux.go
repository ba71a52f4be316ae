package evloop

import (
	"container/heap"
	"errors"
	"fmt"
	"iter"
	"os"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ErrClosed is what a wait returns once the loop is closing, or once its
// descriptor was forgotten.
var ErrClosed = errors.New("evloop: closed")

// Loop is one event loop. Make it with New, run it with Run.
type Loop struct {
	ep, wake int

	mu     sync.Mutex
	inbox  []func()
	closed bool

	closing bool       // the loop's copy of closed
	fds     []*fdState // by descriptor (nil: not watched)
	tasks   map[*Task]struct{}
	runq    []*Task
	timers  timerHeap
	done    chan struct{}
	turns   uint64    // epoll waits so far
	current *Task     // the task running now
	resumed time.Time // when the loop resumed the task running now
	err     error     // why epoll failed, once it has
}

type fdState struct {
	fd             int
	reader, writer *Task
	armed          uint32 // the events epoll watches for fd
	// forgotten: Forget was called. A task woken for fd before that but
	// not yet run then gets ErrClosed, not a readiness that may by now
	// belong to another file with the same number.
	forgotten bool
}

type waitKind uint8

const (
	notWaiting waitKind = iota
	waitRead
	waitWrite
	waitPark
	waitLock // for a Mutex: only its Unlock ends it (or Close)
	waitYield
)

// Task is one coroutine of the loop.
type Task struct {
	l     *Loop
	f     func(*Task) // until it first runs
	next  func() (struct{}, bool)
	stop  func()
	yield func(struct{}) bool

	kind     waitKind
	fd       *fdState
	deadline time.Time
	tindex   int   // in l.timers, -1 when not there
	result   error // why the wait ended: nil, os.ErrDeadlineExceeded, ErrClosed
	queued   bool  // in l.runq
	unparked bool  // Unpark came while not parked: the next Park returns at once
}

// New makes a loop; Run runs it.
func New() (*Loop, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("epoll_create1: %w", err)
	}
	wake, err := unix.Eventfd(0, unix.EFD_CLOEXEC|unix.EFD_NONBLOCK)
	if err != nil {
		unix.Close(ep)
		return nil, fmt.Errorf("eventfd: %w", err)
	}
	if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, wake, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(wake)}); err != nil {
		unix.Close(ep)
		unix.Close(wake)
		return nil, fmt.Errorf("epoll_ctl: %w", err)
	}
	return &Loop{ep: ep, wake: wake, tasks: map[*Task]struct{}{}, done: make(chan struct{})}, nil
}

// Post runs f on the loop's thread, after what the loop is doing now; it
// is how other goroutines reach the loop's tasks. ErrClosed once Close was
// called.
func (l *Loop) Post(f func()) error {
	l.mu.Lock()
	if l.closed {
		l.mu.Unlock()
		return ErrClosed
	}
	l.inbox = append(l.inbox, f)
	if len(l.inbox) == 1 {
		l.signal()
	}
	l.mu.Unlock()
	return nil
}

// signal wakes the loop. Called with mu held: Run's end closes the eventfd
// only after its own Close took mu, so no write can land on the number
// once it is closed (and perhaps reused).
func (l *Loop) signal() {
	one := uint64(1)
	unix.Write(l.wake, (*[8]byte)(unsafe.Pointer(&one))[:]) //nolint:errcheck // EAGAIN: the counter is already set
}

// Close asks the loop to end: every wait, now and later, returns
// ErrClosed, and Run returns once every task has returned. Functions
// already posted still run. Safe from any goroutine, more than once.
func (l *Loop) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.closed {
		l.closed = true
		l.signal()
	}
}

// Done is closed when Run has returned.
func (l *Loop) Done() <-chan struct{} { return l.done }

// Go starts f as a task of the loop; it first runs on the loop's next turn.
// Call it on the loop's thread, or before Run.
func (l *Loop) Go(f func(t *Task)) *Task {
	t := &Task{l: l, tindex: -1, f: f}
	l.tasks[t] = struct{}{}
	l.ready(t)
	return t
}

// fdState is what the loop keeps of fd, nil when it does not watch it.
func (l *Loop) fdState(fd int) *fdState {
	if fd < 0 || fd >= len(l.fds) {
		return nil
	}
	return l.fds[fd]
}

// Forget ends every wait on fd with ErrClosed and stops watching it; call
// it before closing fd, and wait on fd no more after it.
func (l *Loop) Forget(fd int) {
	s := l.fdState(fd)
	if s == nil {
		return
	}
	l.fds[fd] = nil
	s.forgotten = true
	if s.armed != 0 {
		unix.EpollCtl(l.ep, unix.EPOLL_CTL_DEL, fd, nil) //nolint:errcheck // being closed anyway
	}
	for _, t := range []*Task{s.reader, s.writer} {
		if t != nil {
			l.finish(t, ErrClosed)
		}
	}
}

// Run runs the loop on the calling goroutine, locked to its thread, until
// Close and the end of every task.
func (l *Loop) Run() error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	defer close(l.done)
	defer unix.Close(l.ep)
	defer unix.Close(l.wake)
	defer l.Close() // Post refuses from now on, however Run ends
	events := make([]unix.EpollEvent, 256)
	for {
		l.runTasks()
		if l.closing && len(l.tasks) == 0 {
			return l.err
		}
		timeout := -1
		if len(l.runq) > 0 {
			timeout = 0
		} else if len(l.timers) > 0 {
			// Bounded: epoll reads an int of milliseconds, and a far
			// deadline would overflow it (the loop just waits again).
			d := min(time.Until(l.timers[0].deadline), time.Hour)
			timeout = max(0, int((d+time.Millisecond-1)/time.Millisecond))
		}
		if l.err != nil {
			// epoll failed: no descriptor is watched any more, and every
			// wait ends with ErrClosed; the tasks run to their end.
			if len(l.runq) == 0 {
				time.Sleep(time.Millisecond) // a task waits for a Mutex its holder has not let go yet
			}
			continue
		}
		l.turns++
		n, err := wait(l.ep, events, timeout)
		if err != nil && err != unix.EINTR {
			l.fail(fmt.Errorf("epoll_pwait: %w", err))
			continue
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == l.wake {
				l.drainInbox()
				continue
			}
			s := l.fdState(fd)
			if s == nil {
				continue
			}
			idle := false // fd reported what no task waits for
			if ev.Events&(unix.EPOLLIN|unix.EPOLLHUP|unix.EPOLLERR|unix.EPOLLRDHUP) != 0 {
				if s.reader != nil {
					l.finish(s.reader, nil)
				} else if s.writer == nil || ev.Events&(unix.EPOLLHUP|unix.EPOLLERR) == 0 {
					idle = true
				}
			}
			if ev.Events&(unix.EPOLLOUT|unix.EPOLLHUP|unix.EPOLLERR) != 0 {
				if s.writer != nil {
					l.finish(s.writer, nil)
				} else if ev.Events&unix.EPOLLOUT != 0 {
					idle = true
				}
			}
			if idle {
				l.rearm(s) //nolint:errcheck // only stops watching: fails only for a descriptor closed under us, which epoll dropped already
			}
		}
		if len(l.timers) > 0 {
			now := time.Now()
			for len(l.timers) > 0 && !l.timers[0].deadline.After(now) {
				l.finish(l.timers[0], os.ErrDeadlineExceeded)
			}
		}
	}
}

// fail closes the loop after epoll failed: posted functions run, every
// wait ends with ErrClosed, and Run returns err once the tasks have ended.
func (l *Loop) fail(err error) {
	l.err = err
	l.Close()
	l.drainInbox()
}

func (l *Loop) drainInbox() {
	var c [8]byte
	unix.Read(l.wake, c[:]) //nolint:errcheck // EAGAIN: nothing to take
	l.mu.Lock()
	inbox := l.inbox
	l.inbox = nil
	closing := l.closed
	l.mu.Unlock()
	for _, f := range inbox {
		f()
	}
	if closing && !l.closing {
		l.closing = true
		for t := range l.tasks {
			if t.kind != notWaiting {
				l.finish(t, ErrClosed)
			}
		}
	}
}

// runTasks resumes the tasks that are ready now. Those they make ready run
// on the next turn, after the loop has looked at its descriptors, posted
// functions and Close: two tasks that keep handing over to each other must
// not keep the loop from the rest.
func (l *Loop) runTasks() {
	n := len(l.runq)
	for i := range n {
		t := l.runq[i]
		l.runq[i] = nil
		t.queued = false
		if t.f != nil {
			// Made here, on the loop's locked thread: a coroutine runs
			// only on the thread state it was made on.
			f := t.f
			t.f = nil
			t.next, t.stop = iter.Pull(func(yield func(struct{}) bool) {
				t.yield = yield
				f(t)
			})
		}
		l.current = t
		l.resumed = time.Now()
		_, ok := t.next()
		l.current = nil
		if !ok {
			delete(l.tasks, t)
			t.stop()
		}
	}
	rest := copy(l.runq, l.runq[n:])
	clear(l.runq[rest:])
	l.runq = l.runq[:rest]
}

func (l *Loop) ready(t *Task) {
	if !t.queued {
		t.queued = true
		l.runq = append(l.runq, t)
	}
}

// finish ends t's wait with result and queues it to run.
func (l *Loop) finish(t *Task, result error) {
	if t.kind == notWaiting {
		return
	}
	if t.fd != nil {
		if t.fd.reader == t {
			t.fd.reader = nil
		}
		if t.fd.writer == t {
			t.fd.writer = nil
		}
		t.fd = nil
	}
	if t.tindex >= 0 {
		heap.Remove(&l.timers, t.tindex)
	}
	t.kind = notWaiting
	t.result = result
	l.ready(t)
}

// rearm makes epoll watch fd for exactly what its tasks wait for now.
// The loop is level-triggered, so a descriptor watched for what no task
// waits for (unread bytes, room to write) would be reported on every turn.
// Watching stops lazily: a task that was woken usually waits again on the
// same descriptor before it is reported again, and then no epoll_ctl is
// made; only a report nobody waits for brings the loop here (and a
// descriptor nobody waits for at all is taken out of the set).
func (l *Loop) rearm(s *fdState) error {
	want := s.wants()
	if want == s.armed {
		return nil
	}
	op := unix.EPOLL_CTL_MOD
	if s.armed == 0 {
		op = unix.EPOLL_CTL_ADD
	}
	if want == 0 {
		op = unix.EPOLL_CTL_DEL
	}
	if err := unix.EpollCtl(l.ep, op, s.fd, &unix.EpollEvent{Events: want, Fd: int32(s.fd)}); err != nil {
		return fmt.Errorf("evloop: watch descriptor %d: %w", s.fd, err)
	}
	s.armed = want
	return nil
}

// wants is what epoll must report for fd's waiting tasks.
func (s *fdState) wants() uint32 {
	var want uint32
	if s.reader != nil {
		want |= unix.EPOLLIN | unix.EPOLLRDHUP
	}
	if s.writer != nil {
		want |= unix.EPOLLOUT
	}
	return want
}

// WaitRead waits until fd is readable (or at its end, or in error), the
// deadline passes (os.ErrDeadlineExceeded; zero: none), or the loop
// closes (ErrClosed).
func (t *Task) WaitRead(fd int, deadline time.Time) error { return t.waitFD(fd, waitRead, deadline) }

// WaitWrite waits until fd has room to write, as WaitRead.
func (t *Task) WaitWrite(fd int, deadline time.Time) error { return t.waitFD(fd, waitWrite, deadline) }

func (t *Task) waitFD(fd int, kind waitKind, deadline time.Time) error {
	l := t.l
	if l.closing {
		return ErrClosed
	}
	s := l.fdState(fd)
	if s == nil {
		if fd < 0 {
			return fmt.Errorf("evloop: wait on descriptor %d", fd)
		}
		if fd >= len(l.fds) {
			l.fds = append(l.fds, make([]*fdState, fd+1-len(l.fds))...)
		}
		s = &fdState{fd: fd}
		l.fds[fd] = s
	}
	if kind == waitRead {
		if s.reader != nil {
			return fmt.Errorf("evloop: two tasks wait to read descriptor %d", fd)
		}
		s.reader = t
	} else {
		if s.writer != nil {
			return fmt.Errorf("evloop: two tasks wait to write descriptor %d", fd)
		}
		s.writer = t
	}
	if s.wants()&^s.armed != 0 {
		if err := l.rearm(s); err != nil {
			// Not a descriptor epoll can watch (closed under us).
			if kind == waitRead {
				s.reader = nil
			} else {
				s.writer = nil
			}
			return err
		}
	}
	t.fd = s
	if err := t.suspend(kind, deadline); err != nil {
		return err
	}
	if s.forgotten {
		return ErrClosed
	}
	return nil
}

// Park waits until Unpark (nil), the deadline (os.ErrDeadlineExceeded) or
// the loop's close (ErrClosed). An Unpark that came while the task was not
// parked makes the next Park return at once.
func (t *Task) Park(deadline time.Time) error {
	if t.l.closing {
		return ErrClosed
	}
	if t.unparked {
		t.unparked = false
		return nil
	}
	return t.suspend(waitPark, deadline)
}

// Unpark ends t's Park, or makes its next one return at once.
func (t *Task) Unpark() {
	if t.kind == waitPark {
		t.l.finish(t, nil)
		return
	}
	t.unparked = true
}

// Yield lets the loop's other tasks, descriptors and posted functions go
// first: t runs again on the loop's next turn. A task with much to do
// between waits yields now and then, so the others wait for it a bounded
// time. ErrClosed once the loop is closing.
func (t *Task) Yield() error {
	if t.l.closing {
		return ErrClosed
	}
	t.l.ready(t) // after this pass: runTasks runs only the tasks ready at its start
	err := t.suspend(waitYield, time.Time{})
	t.kind = notWaiting
	return err
}

// Running is how long t has run since the loop last resumed it (t must be
// the running task).
func (t *Task) Running() time.Duration { return time.Since(t.l.resumed) }

// Current is the task running now: nil in a function given to Post, or
// off the loop's thread. Code shared by several tasks (a writer two tasks
// use) waits as the task that called it.
func (l *Loop) Current() *Task { return l.current }

// Mutex is a lock between the tasks of one loop, held across waits: a
// task that finds it held parks until it is its turn, in the order they
// came, and the loop goes on with other tasks meanwhile. (A sync.Mutex
// held by a task that waits would block the loop's thread itself when
// another task asks for it.) Lock and Unlock run in tasks of the loop.
type Mutex struct {
	held    *Task
	waiters []*Task
}

// Lock takes m for the current task, waiting for its turn.
func (m *Mutex) Lock(t *Task) {
	if m.held == nil {
		m.held = t
		return
	}
	if m.held == t {
		panic("evloop: Mutex locked twice by one task")
	}
	m.waiters = append(m.waiters, t)
	for m.held != t {
		// Ended by Unlock's hand-over; by Close too, and then it waits
		// again, for its holder to let go.
		t.suspend(waitLock, time.Time{}) //nolint:errcheck // the condition is checked
	}
}

// Unlock hands m to the task that waited longest, if any.
func (m *Mutex) Unlock(t *Task) {
	if m.held != t {
		panic("evloop: Mutex unlocked by a task that does not hold it")
	}
	m.held = nil
	if len(m.waiters) > 0 {
		next := m.waiters[0]
		m.waiters[0] = nil
		m.waiters = m.waiters[1:]
		m.held = next
		next.l.finish(next, nil)
	}
}

// Loop is the loop t runs on.
func (t *Task) Loop() *Loop { return t.l }

func (t *Task) suspend(kind waitKind, deadline time.Time) error {
	t.kind = kind
	t.result = nil
	t.deadline = time.Time{}
	if !deadline.IsZero() {
		t.deadline = deadline
		heap.Push(&t.l.timers, t)
	}
	if !t.yield(struct{}{}) {
		return ErrClosed // stopped, not resumed (the loop never does this)
	}
	return t.result
}

// wait is epoll_pwait as a raw call (see the package comment).
func wait(ep int, events []unix.EpollEvent, msec int) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), uintptr(msec), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), nil
}

type timerHeap []*Task

func (h timerHeap) Len() int           { return len(h) }
func (h timerHeap) Less(i, j int) bool { return h[i].deadline.Before(h[j].deadline) }
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].tindex = i
	h[j].tindex = j
}
func (h *timerHeap) Push(x any) {
	t := x.(*Task)
	t.tindex = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	*h = old[:len(old)-1]
	t.tindex = -1
	return t
}
