package evloop

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// recv returns the next value from ch, failing the test when none comes
// within 20 s (what: what did not happen).
func recv[T any](t *testing.T, ch <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(20 * time.Second):
		t.Fatal(what)
		panic("unreachable")
	}
}

// start runs a new loop on its own goroutine and stops it at the test's
// end, failing the test if Run does not return.
func start(t *testing.T) *Loop {
	t.Helper()
	l, err := New()
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- l.Run() }()
	t.Cleanup(func() {
		l.Close()
		select {
		case err := <-ran:
			if err != nil {
				t.Errorf("Run: %v", err)
			}
		case <-time.After(10 * time.Second):
			t.Error("Run did not return after Close")
		}
	})
	return l
}

// on runs f on the loop's thread and waits for it.
func on(t *testing.T, l *Loop, f func()) {
	t.Helper()
	done := make(chan struct{}, 1)
	if err := l.Post(func() { f(); done <- struct{}{} }); err != nil {
		t.Fatal(err)
	}
	recv(t, done, "the loop did not run a posted function")
}

func socketpair(t *testing.T) (a, b int) {
	t.Helper()
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fds[0]); unix.Close(fds[1]) })
	return fds[0], fds[1]
}

// TestEcho: a task reads what another goroutine writes, waiting for each
// readiness, and answers it; 2,000 round trips, then the peer's close is
// seen as the end of the stream.
func TestEcho(t *testing.T) {
	l := start(t)
	a, b := socketpair(t)
	ended := make(chan error, 1)
	on(t, l, func() {
		l.Go(func(tk *Task) {
			buf := make([]byte, 64)
			for {
				if err := tk.WaitRead(a, time.Time{}); err != nil {
					ended <- err
					return
				}
				n, err := unix.Read(a, buf)
				if err == unix.EAGAIN {
					ended <- errors.New("woken to read, but nothing to read (EAGAIN)")
					return
				}
				if err != nil || n == 0 {
					ended <- err // nil: the end of the stream
					return
				}
				for p := buf[:n]; len(p) > 0; {
					if err := tk.WaitWrite(a, time.Time{}); err != nil {
						ended <- err
						return
					}
					m, err := unix.Write(a, p)
					if err != nil {
						ended <- err
						return
					}
					p = p[m:]
				}
			}
		})
	})
	if err := unix.SetNonblock(b, false); err != nil {
		t.Fatal(err)
	}
	bf := os.NewFile(uintptr(dup(t, b)), "b")
	defer bf.Close()
	got := make([]byte, 8)
	for i := range 2000 {
		msg := []byte{byte(i), byte(i >> 8), 1, 2, 3, 4, 5, 6}
		if _, err := bf.Write(msg); err != nil {
			t.Fatal(err)
		}
		if _, err := readFull(bf, got); err != nil {
			t.Fatalf("round trip %d: %v", i, err)
		}
		if string(got) != string(msg) {
			t.Fatalf("round trip %d: got %v, want %v", i, got, msg)
		}
	}
	unix.Shutdown(int(bf.Fd()), unix.SHUT_WR)
	err := recv(t, ended, "the task did not see the end of the stream")
	if err != nil {
		t.Fatalf("the task ended with %v, want the end of the stream", err)
	}
}

// TestDeadline: a wait on a descriptor that stays quiet ends at its
// deadline, not before, with os.ErrDeadlineExceeded; a Park too.
func TestDeadline(t *testing.T) {
	l := start(t)
	a, _ := socketpair(t)
	type res struct {
		err     error
		elapsed time.Duration
	}
	got := make(chan res, 2)
	on(t, l, func() {
		l.Go(func(tk *Task) {
			t0 := time.Now()
			err := tk.WaitRead(a, t0.Add(30*time.Millisecond))
			got <- res{err, time.Since(t0)}
			t0 = time.Now()
			err = tk.Park(t0.Add(20 * time.Millisecond))
			got <- res{err, time.Since(t0)}
		})
	})
	for i, want := range []time.Duration{30 * time.Millisecond, 20 * time.Millisecond} {
		select {
		case r := <-got:
			if !errors.Is(r.err, os.ErrDeadlineExceeded) {
				t.Fatalf("wait %d ended with %v, want os.ErrDeadlineExceeded", i, r.err)
			}
			if r.elapsed < want {
				t.Fatalf("wait %d ended after %v, before its deadline (%v)", i, r.elapsed, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("wait %d did not end at its deadline", i)
		}
	}
}

// TestParkUnpark: two tasks hand a counter back and forth 10,000 times by
// Park and Unpark, strictly in turn (each sees every value the other
// made), and an Unpark that comes before its Park is kept (pong's first).
func TestParkUnpark(t *testing.T) {
	l := start(t)
	const rounds = 10000
	var ping, pong *Task
	count, seen := 0, 0
	done := make(chan int, 1)
	on(t, l, func() {
		ping = l.Go(func(tk *Task) {
			for count < rounds {
				count++
				pong.Unpark()
				if err := tk.Park(time.Time{}); err != nil {
					done <- -1
					return
				}
				if seen != count {
					done <- -2 // Park returned before pong had its turn
					return
				}
			}
			done <- count
		})
		pong = l.Go(func(tk *Task) {
			for {
				if err := tk.Park(time.Time{}); err != nil {
					return
				}
				seen = count
				ping.Unpark()
			}
		})
	})
	select {
	case n := <-done:
		if n != rounds {
			t.Fatalf("counted %d, want %d", n, rounds)
		}
	case <-time.After(10 * time.Second):
		t.Fatalf("the tasks stopped handing over (count %d)", count)
	}
}

// TestPostUnparks: another goroutine reaches a parked task through Post.
func TestPostUnparks(t *testing.T) {
	l := start(t)
	var tk *Task
	woke := make(chan error, 1)
	on(t, l, func() {
		l.Go(func(x *Task) {
			tk = x
			woke <- x.Park(time.Time{})
		})
	})
	on(t, l, func() {
		if tk.kind != waitPark {
			t.Error("the task is not parked before its Unpark")
		}
		tk.Unpark()
	})
	err := recv(t, woke, "the parked task was not woken")
	if err != nil {
		t.Fatal(err)
	}
}

// TestCloseEndsWaits: Close ends every wait with ErrClosed, a task that
// waits again gets ErrClosed at once, Run returns once all tasks returned,
// and Post refuses afterwards.
func TestCloseEndsWaits(t *testing.T) {
	l, err := New()
	if err != nil {
		t.Fatal(err)
	}
	a, _ := socketpair(t)
	errs := make(chan error, 3)
	l.Go(func(tk *Task) { errs <- tk.WaitRead(a, time.Time{}) })
	l.Go(func(tk *Task) { errs <- tk.Park(time.Time{}) })
	l.Go(func(tk *Task) {
		tk.Park(time.Time{}) //nolint:errcheck // the second wait is the one checked
		errs <- tk.WaitWrite(a, time.Time{})
	})
	ran := make(chan error, 1)
	go func() { ran <- l.Run() }()
	l.Close()
	for range 3 {
		err := recv(t, errs, "a wait did not end on Close")
		if !errors.Is(err, ErrClosed) {
			t.Fatalf("a wait ended with %v, want ErrClosed", err)
		}
	}
	if err := recv(t, ran, "Run did not return"); err != nil {
		t.Fatal(err)
	}
	<-l.Done()
	if err := l.Post(func() {}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Post after Close: %v, want ErrClosed", err)
	}
}

// TestForgetAfterWake: a task woken for a descriptor, not yet run when
// the descriptor is forgotten (and may be closed, and its number reused),
// gets ErrClosed rather than a readiness that is not its file's.
func TestForgetAfterWake(t *testing.T) {
	l := start(t)
	a, _ := socketpair(t)
	var tk *Task
	got := make(chan error, 1)
	on(t, l, func() { tk = l.Go(func(x *Task) { got <- x.WaitRead(a, time.Time{}) }) })
	on(t, l, func() {
		if tk.kind != waitRead {
			t.Error("the task is not waiting to read")
		}
		l.finish(tk, nil) // woken, as by a readiness in this turn
		l.Forget(a)       // by a task that runs before it
	})
	err := recv(t, got, "the wait did not end")
	if !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
}

// TestMutexKeepsUnpark: a Mutex's waits are its own. An Unpark given while
// a task waits for the lock does not end that wait, and is kept for the
// task's next Park.
func TestMutexKeepsUnpark(t *testing.T) {
	l := start(t)
	var m Mutex
	var holder, a *Task
	res := make(chan string, 2)
	on(t, l, func() {
		holder = l.Go(func(x *Task) {
			m.Lock(x)
			x.Park(time.Time{}) //nolint:errcheck // until the test lets go
			m.Unlock(x)
		})
		a = l.Go(func(x *Task) {
			m.Lock(x)
			if m.held != x {
				res <- "Lock returned without the lock"
				return
			}
			if err := x.Park(time.Now().Add(10 * time.Second)); err != nil {
				res <- "an Unpark given while waiting for the lock was lost: " + err.Error()
				return
			}
			m.Unlock(x)
			res <- "ok"
		})
	})
	on(t, l, func() {
		if a.kind != waitLock {
			t.Errorf("a is not waiting for the lock (kind %d)", a.kind)
		}
		a.Unpark()
	})
	on(t, l, func() {
		if a.kind != waitLock {
			t.Error("an Unpark ended a wait for the lock")
		}
		holder.Unpark()
	})
	r := recv(t, res, "the second task never got the lock")
	if r != "ok" {
		t.Fatal(r)
	}
}

// TestHandOffDoesNotStarve: two tasks that hand over to each other without
// end leave the loop its turns: a posted function runs, and Close ends
// them.
func TestHandOffDoesNotStarve(t *testing.T) {
	l, err := New()
	if err != nil {
		t.Fatal(err)
	}
	var p1, p2 *Task
	p1 = l.Go(func(x *Task) {
		for x.Park(time.Time{}) == nil {
			p2.Unpark()
		}
	})
	p2 = l.Go(func(x *Task) {
		p1.Unpark()
		for x.Park(time.Time{}) == nil {
			p1.Unpark()
		}
	})
	ran := make(chan error, 1)
	go func() { ran <- l.Run() }()
	on(t, l, func() {})
	l.Close()
	if err := recv(t, ran, "Close did not end two tasks handing over"); err != nil {
		t.Fatal(err)
	}
}

// TestForget: forgetting a descriptor ends the waits on it.
func TestForget(t *testing.T) {
	l := start(t)
	a, _ := socketpair(t)
	got := make(chan error, 1)
	on(t, l, func() { l.Go(func(tk *Task) { got <- tk.WaitRead(a, time.Time{}) }) })
	on(t, l, func() { l.Forget(a) })
	err := recv(t, got, "the wait did not end")
	if !errors.Is(err, ErrClosed) {
		t.Fatalf("got %v, want ErrClosed", err)
	}
}

// TestUnreadBytesDoNotSpin: bytes arrive on a descriptor while its reader
// is parked elsewhere. The loop is level-triggered, so unless it stops
// watching the descriptor it would be woken on every turn; it must stop
// (lazily, at the first report nobody waits for), stay quiet, and hand the
// bytes to the reader when it waits again.
func TestUnreadBytesDoNotSpin(t *testing.T) {
	l := start(t)
	a, b := socketpair(t)
	var tk *Task
	read := make(chan string, 1)
	woke := make(chan struct{}, 1)
	on(t, l, func() {
		l.Go(func(x *Task) {
			tk = x
			// One wait on a, so it is watched, then park without reading.
			x.WaitRead(a, time.Time{}) //nolint:errcheck // checked by the read below
			woke <- struct{}{}
			x.Park(time.Time{}) //nolint:errcheck // until the test unparks it
			if err := x.WaitRead(a, time.Time{}); err != nil {
				read <- err.Error()
				return
			}
			buf := make([]byte, 16)
			n, _ := unix.Read(a, buf)
			read <- string(buf[:max(n, 0)])
		})
	})
	unix.Write(b, []byte("first"))
	<-woke
	unix.Write(b, []byte("second")) // arrives while the reader is parked
	var armed uint32 = unix.EPOLLIN
	for deadline := time.Now().Add(10 * time.Second); armed&unix.EPOLLIN != 0; {
		if time.Now().After(deadline) {
			t.Fatal("the loop kept watching a descriptor nobody reads")
		}
		on(t, l, func() { armed = l.fds[a].armed })
	}
	var turns0, turns1 uint64
	on(t, l, func() { turns0 = l.turns })
	for range 100 {
		on(t, l, func() {})
	}
	on(t, l, func() { turns1 = l.turns })
	if d := turns1 - turns0; d > 400 {
		t.Fatalf("the loop turned %d times for 100 posted functions: it spins on the unread bytes", d)
	}
	on(t, l, func() { tk.Unpark() })
	got := recv(t, read, "the reader was not woken for the bytes it had not read")
	if got != "firstsecond" {
		t.Fatalf("the reader got %q, want %q", got, "firstsecond")
	}
}

func dup(t *testing.T, fd int) int {
	t.Helper()
	d, err := unix.Dup(fd)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func readFull(f *os.File, p []byte) (int, error) {
	n := 0
	for n < len(p) {
		m, err := f.Read(p[n:])
		n += m
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// TestCurrent: the loop knows which task runs, and none in a posted
// function.
func TestCurrent(t *testing.T) {
	l := start(t)
	got := make(chan bool, 1)
	on(t, l, func() {
		if l.Current() != nil {
			t.Error("Current is a task in a posted function")
		}
		var tk *Task
		tk = l.Go(func(x *Task) { got <- l.Current() == x && x == tk })
	})
	ok := recv(t, got, "the task did not run")
	if !ok {
		t.Fatal("Current is not the running task")
	}
}

// TestMutexAcrossWaits: a task holds a Mutex across a wait; three others
// ask for it meanwhile and get it in the order they asked, while the loop
// goes on running what else there is (a posted function completes while
// they wait).
func TestMutexAcrossWaits(t *testing.T) {
	l := start(t)
	var m Mutex
	order := make(chan int, 4)
	release := make(chan struct{})
	var holder *Task
	on(t, l, func() {
		holder = l.Go(func(x *Task) {
			m.Lock(x)
			order <- 0
			x.Park(time.Time{}) //nolint:errcheck // until the test lets go
			m.Unlock(x)
		})
		for i := 1; i <= 3; i++ {
			l.Go(func(x *Task) {
				m.Lock(x)
				order <- i
				x.Park(time.Now().Add(time.Millisecond)) //nolint:errcheck // holds it across a wait too
				if m.held != x {
					order <- -i // another task took it meanwhile
				}
				m.Unlock(x)
			})
		}
	})
	go func() { <-release; l.Post(func() { holder.Unpark() }) }() //nolint:errcheck // the loop runs until cleanup
	if first := <-order; first != 0 {
		t.Fatalf("task %d took the lock first, want 0", first)
	}
	on(t, l, func() {
		if m.held != holder || len(m.waiters) != 3 {
			t.Errorf("held by %p with %d waiting, want the first task with 3", m.held, len(m.waiters))
		}
	}) // the loop runs while they wait
	close(release)
	for want := 1; want <= 3; want++ {
		select {
		case got := <-order:
			if got != want {
				t.Fatalf("task %d took the lock, want %d", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("task %d never took the lock", want)
		}
	}
}

// TestYieldTakesTurns: two tasks that only compute and Yield take strict
// turns, and Running starts again from zero at each resume.
func TestYieldTakesTurns(t *testing.T) {
	l := start(t)
	const rounds = 1000
	var order []byte
	done := make(chan error, 2)
	worker := func(name byte) func(*Task) {
		return func(tk *Task) {
			for range rounds {
				order = append(order, name)
				if r := tk.Running(); r < 0 || r > 5*time.Second {
					done <- fmt.Errorf("Running says %s", r)
					return
				}
				if err := tk.Yield(); err != nil {
					done <- err
					return
				}
			}
			done <- nil
		}
	}
	on(t, l, func() {
		l.Go(worker('a'))
		l.Go(worker('b'))
	})
	for range 2 {
		if err := recv(t, done, "the yielding tasks did not finish"); err != nil {
			t.Fatal(err)
		}
	}
	for i := 1; i < len(order); i++ {
		if order[i] == order[i-1] {
			t.Fatalf("task %c ran twice in a row at step %d: a Yield did not let the other go first", order[i], i)
		}
	}
	// Close during a Yield: it returns ErrClosed.
	got := make(chan error, 1)
	on(t, l, func() {
		l.Go(func(tk *Task) {
			for {
				if err := tk.Yield(); err != nil {
					got <- err
					return
				}
			}
		})
	})
	l.Close()
	if err := recv(t, got, "a yielding task never heard Close"); !errors.Is(err, ErrClosed) {
		t.Fatalf("Yield after Close: %v, want ErrClosed", err)
	}
}

// TestEpollFailureEndsTasks: when epoll fails under the loop, the loop
// does not vanish with its tasks suspended: every wait ends with
// ErrClosed, posted functions run, and Run returns the failure once the
// tasks have ended.
func TestEpollFailureEndsTasks(t *testing.T) {
	l, err := New()
	if err != nil {
		t.Fatal(err)
	}
	ran := make(chan error, 1)
	go func() { ran <- l.Run() }()
	a, _ := socketpair(t)
	waited, waiting := make(chan error, 1), make(chan struct{}, 1)
	on(t, l, func() {
		l.Go(func(tk *Task) {
			waiting <- struct{}{}
			waited <- tk.WaitRead(a, time.Time{})
		})
	})
	recv(t, waiting, "the task did not start")
	on(t, l, func() {}) // runs once the task is suspended in its wait
	// Make the loop's epoll descriptor something epoll_pwait refuses (a
	// pipe, on the same number: Run closes its own number at its end).
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[1])
	if err := unix.Dup3(p[0], l.ep, unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	unix.Close(p[0])
	if err := l.Post(func() {}); err != nil { // wake the wait in progress: the next one fails
		t.Fatal(err)
	}
	if err := recv(t, waited, "a task waiting on a descriptor never heard the loop fail"); !errors.Is(err, ErrClosed) {
		t.Fatalf("the wait ended with %v, want ErrClosed", err)
	}
	if err := recv(t, ran, "Run did not return after epoll failed"); err == nil || !strings.Contains(err.Error(), "epoll_pwait") {
		t.Fatalf("Run returned %v, want the epoll failure", err)
	}
	if err := l.Post(func() {}); !errors.Is(err, ErrClosed) {
		t.Fatalf("Post after the failure: %v, want ErrClosed", err)
	}
}
