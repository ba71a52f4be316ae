//go:build linux

package pgproxy

import (
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/fenceline/fenceline/pgproxy/internal/evloop"
	"golang.org/x/sys/unix"
)

// A plain session (TCP or Unix socket, no TLS) runs on the proxy's event
// loop once startup is over: its client loop and its relay become two
// tasks of one loop (pgproxy/internal/evloop) that every such session
// shares, on one locked thread waiting in epoll. A goroutine per direction
// waking through Go's poller costs 1.3–1.7 times PgBouncer's CPU per
// transaction here, a loop about what PgBouncer costs (docs/benchmarks.md,
// stops 54 and 55); the session code stays as it is, code that blocks,
// since a task waits where a goroutine would.
//
// The session's sockets leave Go's poller for good: moveToLoop duplicates
// each descriptor and closes the net.Conn, which takes the socket out of
// the runtime's epoll set. While the runtime watched them too, every
// message the loop handled also woke an idle thread in the runtime's own
// poller, and the fence on the loop cost more than on goroutines (stop 56).
//
// What may block a goroutine must not block the loop's thread: waits for
// another session (a shared catalog lookup), for a goroutine (an audit
// record, a cancel request on a new connection, the parse of a text over
// classifyInline) or for the relay are task waits (waitChan, blocking,
// Park); the lock on the client's writer is an evloop.Mutex; the lease's
// fence is read without waiting (noWaitFencer); and a task that has run
// loopSlice yields (yieldIfLong). TLS sessions stay on goroutines
// (crypto/tls owns their sockets), and so does every session off Linux.

// eventLoop is the proxy's loop.
type eventLoop = evloop.Loop

// sessionLoop is a session's place on the loop. Its fields are the loop
// thread's alone once the session's tasks run.
type sessionLoop struct {
	l              *evloop.Loop
	client, server *fdConn
	ctask          *evloop.Task // the client loop's task
	relayEnded     bool         // the relay's task returned
	cmu            evloop.Mutex // cmu's part between the two tasks
}

// loopProcs gives each running loop a processor of its own: a loop waits
// in a raw epoll_pwait, and the processor it holds runs nothing else
// meanwhile (see evloop). GOMAXPROCS is the process's own plus one per
// loop, and back to its own once no loop runs; an operator's GOMAXPROCS
// variable stands as it is.
var loopProcs struct {
	mu    sync.Mutex
	loops int
	base  int
}

func addLoopProc(n int) {
	if os.Getenv("GOMAXPROCS") != "" {
		return
	}
	loopProcs.mu.Lock()
	defer loopProcs.mu.Unlock()
	if loopProcs.loops == 0 {
		loopProcs.base = runtime.GOMAXPROCS(0)
	}
	loopProcs.loops += n
	runtime.GOMAXPROCS(loopProcs.base + loopProcs.loops)
}

// startLoop makes and runs the proxy's loop. Without one (epoll refused),
// every session runs on goroutines.
func (p *Proxy) startLoop() {
	l, err := evloop.New()
	if err != nil {
		p.log.Warn("no event loop for the sessions: they run on goroutines", "err", err)
		return
	}
	addLoopProc(1)
	p.loop = l
	go func() {
		defer addLoopProc(-1)
		if err := l.Run(); err != nil {
			p.log.Error("the sessions' event loop failed; the sessions on it ended, new ones run on goroutines", "err", err)
		}
	}()
}

// closeLoopIfIdle ends the loop once the proxy is shut down and no session
// is left on it. The caller holds p.mu.
func (p *Proxy) closeLoopIfIdle() {
	if p.loop != nil && p.closed && len(p.sessions) == 0 {
		p.loop.Close()
	}
}

// waitLoop waits for the loop's end (Close, after closeLoopIfIdle).
func (p *Proxy) waitLoop() {
	if p.loop != nil {
		<-p.loop.Done()
	}
}

// moveToLoop moves the session's sockets to the proxy's loop; false when
// the session stays on goroutines (TLS, no loop, the session aborted, or
// a socket that cannot be duplicated).
func (s *session) moveToLoop() bool {
	l := s.p.loop
	if l == nil || s.tls {
		return false
	}
	select {
	case <-l.Done(): // it failed
		return false
	default:
	}
	crw, ok1 := s.crw.(*rawIO)
	srw, ok2 := s.srw.(*rawIO)
	if !ok1 || !ok2 {
		return false
	}
	// What startup left in the writers goes out first: they are rebuilt
	// on the duplicates.
	s.cmu.Lock()
	err := s.cw.Flush()
	s.cmu.Unlock()
	if err != nil || s.sw.Flush() != nil {
		return false
	}
	s.amu.Lock()
	defer s.amu.Unlock()
	if s.aborted {
		return false
	}
	cfd, err := dupSocket(crw.rc)
	if err != nil {
		s.p.log.Warn("session stays on goroutines", "err", err)
		return false
	}
	sfd, err := dupSocket(srw.rc)
	if err != nil {
		unix.Close(cfd)
		s.p.log.Warn("session stays on goroutines", "err", err)
		return false
	}
	// Closing the net.Conns takes the sockets out of Go's poller; the
	// duplicates keep them open.
	s.client.Close()
	s.server.Close()
	s.lp = &sessionLoop{l: l, client: &fdConn{l: l, fd: cfd}, server: &fdConn{l: l, fd: sfd}}
	crw.fc, srw.fc = s.lp.client, s.lp.server
	s.p.loopSessions.Add(1)
	return true
}

// dupSocket duplicates a socket's descriptor (close-on-exec; non-blocking,
// as the open file is).
func dupSocket(rc syscall.RawConn) (int, error) {
	fd := -1
	var derr error
	if err := rc.Control(func(f uintptr) {
		fd, derr = unix.FcntlInt(f, unix.F_DUPFD_CLOEXEC, 0)
	}); err != nil {
		return -1, err
	}
	if derr != nil {
		return -1, os.NewSyscallError("fcntl F_DUPFD_CLOEXEC", derr)
	}
	return fd, nil
}

// serveOnLoop runs the client loop and the relay as tasks and waits for
// both; the client task ends the backend's side itself (endBackend).
func (s *session) serveOnLoop() (clientErr, relayErr error) {
	l := s.lp.l
	cdone, rdone := make(chan error, 1), make(chan error, 1)
	sl := s.lp
	err := l.Post(func() {
		sl.ctask = l.Go(func(t *evloop.Task) {
			err := s.clientLoop()
			s.endBackend(err)
			// The relay reads what the server still sends until it ends
			// the stream, for relayGrace at most (a read deadline set
			// now would not reach the wait the relay is in).
			deadline := time.Now().Add(relayGrace)
			for !sl.relayEnded && t.Park(deadline) == nil {
			}
			if !sl.relayEnded {
				sl.close(sl.server) // ends the relay's wait
			}
			cdone <- err
		})
		l.Go(func(*evloop.Task) {
			err := s.relay()
			sl.relayEnded = true
			sl.ctask.Unpark()
			rdone <- err
		})
	})
	if err != nil { // the loop failed: nothing of the session runs on it
		s.lp.closeNow()
		return net.ErrClosed, nil
	}
	clientErr, relayErr = <-cdone, <-rdone
	s.lp.closeAll()
	return clientErr, relayErr
}

// closeAll closes both sockets on the loop's thread and waits for it.
func (sl *sessionLoop) closeAll() {
	done := make(chan struct{})
	if sl.l.Post(func() {
		sl.close(sl.client)
		sl.close(sl.server)
		close(done)
	}) != nil {
		sl.closeNow()
		return
	}
	<-done
}

// closeNow closes both sockets from the calling goroutine: only once the
// loop has ended, when no task can touch them.
func (sl *sessionLoop) closeNow() {
	for _, c := range []*fdConn{sl.client, sl.server} {
		if c.fd >= 0 {
			unix.Close(c.fd)
			c.fd = -1
		}
	}
}

// close stops the loop watching c and closes it; waits on it end with
// ErrClosed. On the loop's thread.
func (sl *sessionLoop) close(c *fdConn) {
	if c.fd < 0 {
		return
	}
	sl.l.Forget(c.fd)
	unix.Close(c.fd)
	c.fd = -1
}

// abortOnLoop is abort's for a session on the loop: its sockets close on
// the loop's thread, which ends every wait on them.
func (sl *sessionLoop) abort() {
	sl.l.Post(func() { //nolint:errcheck // a closed loop has ended its tasks; serveOnLoop closes the sockets
		sl.close(sl.client)
		sl.close(sl.server)
	})
}

// loopSlice is how long a session's task runs before it lets the loop's
// other sessions go first (yieldIfLong).
const loopSlice = time.Millisecond

// yieldIfLong yields the loop when the running task has had it for
// loopSlice: a client that sends thousands of messages at once, or a
// server result of thousands of rows, is handled in slices, not in one go
// while every other session waits. Only while r has messages read ahead
// (the next read would not wait, and so not yield): the common turn, one
// message per readiness, reads no clock.
func (s *session) yieldIfLong(r *msgReader) {
	if s.lp == nil || r.buffered() == 0 {
		return
	}
	if t := s.lp.l.Current(); t != nil && t.Running() > loopSlice {
		t.Yield() //nolint:errcheck // a closing loop ends the next wait too
	}
}

// task is the loop task running now, nil off the loop (or for a session
// on goroutines).
func (s *session) task() *evloop.Task {
	if s.lp == nil {
		return nil
	}
	return s.lp.l.Current()
}

// onLoopTask is the running task of a session on the loop; it panics when
// such a session is reached off its tasks, which is a bug: the session's
// state belongs to the loop's thread.
func (s *session) onLoopTask() *evloop.Task {
	t := s.lp.l.Current()
	if t == nil {
		panic("pgproxy: a session on the event loop used off its tasks")
	}
	return t
}

// lockClient and unlockClient take and release the client's writer.
func (s *session) lockClient() {
	if s.lp != nil {
		s.lp.cmu.Lock(s.onLoopTask())
		return
	}
	s.cmu.Lock()
}

func (s *session) unlockClient() {
	if s.lp != nil {
		s.lp.cmu.Unlock(s.onLoopTask())
		return
	}
	s.cmu.Unlock()
}

// wakeClient tells the client loop the relay popped a ReadyForQuery (or
// ended).
func (s *session) wakeClient() {
	if s.lp != nil {
		if s.lp.ctask != nil {
			s.lp.ctask.Unpark()
		}
		return
	}
	s.goWakeClient()
}

// waitWake waits for wakeClient or the session's end (net.ErrClosed).
func (s *session) waitWake() error {
	if s.lp != nil {
		select {
		case <-s.done:
			return net.ErrClosed
		default:
		}
		if s.onLoopTask().Park(time.Time{}) != nil {
			return net.ErrClosed
		}
		return nil
	}
	return s.goWaitWake()
}

// waitClientReadable reports whether the client sent something within d:
// awaitClient's, on the loop.
func (s *session) waitClientReadable(d time.Duration) (stalled bool, err error) {
	if s.cr.buffered() > 0 {
		return false, nil
	}
	c := s.lp.client
	if c.fd < 0 {
		return false, net.ErrClosed
	}
	err = s.onLoopTask().WaitRead(c.fd, time.Now().Add(d))
	switch {
	case errors.Is(err, os.ErrDeadlineExceeded):
		return true, nil
	case err != nil:
		return false, loopErr("read", err)
	}
	return false, nil
}

// waitChan waits for ch to close, up to timeout; false when it did not.
// A task parks while a goroutine waits on ch for it.
func (s *session) waitChan(ch <-chan struct{}, timeout time.Duration) bool {
	t := s.task()
	if t == nil {
		return goWaitChan(ch, timeout)
	}
	select {
	case <-ch:
		return true
	default:
	}
	stop := make(chan struct{})
	defer close(stop)
	l := s.lp.l
	go func() {
		select {
		case <-ch:
			l.Post(t.Unpark) //nolint:errcheck // a closed loop ends the Park itself
		case <-stop:
		}
	}()
	deadline := time.Now().Add(timeout)
	for {
		err := t.Park(deadline) // woken by others too: the channel says
		select {
		case <-ch:
			return true
		default:
		}
		if err != nil {
			return false
		}
	}
}

// blocking runs f, which may block (a network round trip, a test's hook):
// on a goroutine while the task parks, so the loop's other sessions go on.
func (s *session) blocking(f func()) {
	t := s.task()
	if t == nil {
		f()
		return
	}
	done := make(chan struct{})
	l := s.lp.l
	go func() {
		defer func() {
			close(done)
			l.Post(t.Unpark) //nolint:errcheck // see below
		}()
		f()
	}()
	for {
		err := t.Park(time.Time{})
		select {
		case <-done:
			return
		default:
		}
		if err != nil { // the loop is closing: f is bounded, wait it out
			<-done
			return
		}
	}
}

// setServerDeadline bounds the waits on the server's socket from now on.
func (s *session) setServerDeadline(d time.Time) {
	if s.lp != nil {
		s.lp.server.deadline = d
		return
	}
	s.goSetServerDeadline(d)
}

// closeServerWrite half-closes the server's socket: Postgres reads the end
// of the stream after Terminate.
func (s *session) closeServerWrite() {
	if s.lp != nil {
		if s.lp.server.fd >= 0 {
			unix.Shutdown(s.lp.server.fd, unix.SHUT_WR) //nolint:errcheck // the relay sees how the server ends
		}
		return
	}
	s.goCloseServerWrite()
}

// closeClient closes the client's socket: the relay's end.
func (s *session) closeClient() {
	if s.lp != nil {
		s.lp.close(s.lp.client)
		if s.lp.ctask != nil {
			s.lp.ctask.Unpark()
		}
		return
	}
	s.client.Close()
}

// fdConn is one of a session's sockets on the loop: reads and writes are
// raw system calls, and a task waits on the loop for readiness. Only the
// session's tasks use it.
type fdConn struct {
	l        *evloop.Loop
	fd       int       // -1 once closed
	deadline time.Time // bounds every wait; zero: none
}

// errOffLoop: a socket on the loop used off its tasks (a bug).
var errOffLoop = errors.New("pgproxy: a socket on the event loop used off its tasks")

func loopErr(op string, err error) error {
	if errors.Is(err, evloop.ErrClosed) {
		err = net.ErrClosed
	}
	return &net.OpError{Op: op, Net: "loop", Err: err}
}

// Read waits for the socket to be readable, then reads once: a task is
// woken for the bytes the peer sent, never tries a read that would say
// EAGAIN first.
func (c *fdConn) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	t := c.l.Current()
	if t == nil {
		return 0, errOffLoop
	}
	for {
		if c.fd < 0 {
			return 0, loopErr("read", net.ErrClosed)
		}
		if err := t.WaitRead(c.fd, c.deadline); err != nil {
			return 0, loopErr("read", err)
		}
		if c.fd < 0 {
			return 0, loopErr("read", net.ErrClosed)
		}
		n, _, e := syscall.RawSyscall(syscall.SYS_READ, uintptr(c.fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
		switch e {
		case 0:
			if n == 0 {
				return 0, io.EOF
			}
			return int(n), nil
		case syscall.EAGAIN, syscall.EINTR:
		default:
			return 0, loopErr("read", os.NewSyscallError("read", e))
		}
	}
}

// Write writes all of p, waiting for room when the socket's buffer is
// full.
func (c *fdConn) Write(p []byte) (int, error) {
	t := c.l.Current()
	if t == nil {
		return 0, errOffLoop
	}
	n := 0
	for n < len(p) {
		if c.fd < 0 {
			return n, loopErr("write", net.ErrClosed)
		}
		m, _, e := syscall.RawSyscall(syscall.SYS_WRITE, uintptr(c.fd), uintptr(unsafe.Pointer(&p[n])), uintptr(len(p)-n))
		switch e {
		case 0:
			n += int(m)
		case syscall.EINTR:
		case syscall.EAGAIN:
			if err := t.WaitWrite(c.fd, c.deadline); err != nil {
				return n, loopErr("write", err)
			}
		default:
			return n, loopErr("write", os.NewSyscallError("write", e))
		}
	}
	return n, nil
}
