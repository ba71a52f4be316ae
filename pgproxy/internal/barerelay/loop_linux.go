package main

import (
	"fmt"
	"net"
	"os"
	"runtime"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

// writeStalls counts the writes that found the peer's buffer full (the
// loops' EAGAIN paths), for the tests.
var writeStalls atomic.Int64

// The loop's reads, writes and waits are raw system calls: the runtime
// neither hands the thread's processor on nor takes it back around them.
// The relay is this process's only goroutine, so a wait that blocks without
// telling the runtime keeps nothing else from running; in a process with
// other goroutines to run, it would hold them off until the runtime's
// monitor preempts the loop (10 ms).

func rawRead(fd int, p []byte) (int, error) {
	r, _, e := unix.RawSyscall(unix.SYS_READ, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

func rawWrite(fd int, p []byte) (int, error) {
	r, _, e := unix.RawSyscall(unix.SYS_WRITE, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
	if e != 0 {
		return -1, e
	}
	return int(r), nil
}

func rawWait(ep int, events []unix.EpollEvent) (int, error) {
	r, _, e := unix.RawSyscall6(unix.SYS_EPOLL_PWAIT, uintptr(ep), uintptr(unsafe.Pointer(&events[0])), uintptr(len(events)), ^uintptr(0), 0, 0)
	if e != 0 {
		return 0, e
	}
	return int(r), nil
}

// end is one side of a relayed connection: a socket, the socket its bytes
// go to, and what it read that the peer has not taken yet.
type end struct {
	fd, peer int
	pending  []byte
}

// loopRelay relays every connection from one event loop on one locked
// thread: level-triggered epoll, one read per readiness, the read's bytes
// written to the peer at once (kept and written on the peer's EPOLLOUT if
// its buffer is full, reading stopped meanwhile). This is the shape of
// PgBouncer's loop (libevent, one thread), in Go: no goroutine per
// direction, no scheduler between a readiness and its read, and no read that
// only learns EAGAIN.
func loopRelay(lfd int, upstream string, stop int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ep, err := newLoop(lfd, stop)
	if err != nil {
		return err
	}
	defer unix.Close(ep)
	ends := map[int]*end{}
	buf := make([]byte, 64<<10)
	events := make([]unix.EpollEvent, 128)
	// rearm sets what fd waits for: reading while what it read last is
	// written, writing while its peer's bytes wait for room.
	rearm := func(e *end) {
		var ev uint32
		if len(e.pending) == 0 {
			ev |= unix.EPOLLIN
		}
		if p := ends[e.peer]; p != nil && len(p.pending) > 0 {
			ev |= unix.EPOLLOUT
		}
		unix.EpollCtl(ep, unix.EPOLL_CTL_MOD, e.fd, &unix.EpollEvent{Events: ev, Fd: int32(e.fd)}) //nolint:errcheck // fds are ours
	}
	closePair := func(e *end) {
		for _, fd := range []int{e.fd, e.peer} {
			if _, ok := ends[fd]; ok {
				unix.EpollCtl(ep, unix.EPOLL_CTL_DEL, fd, nil) //nolint:errcheck // closing anyway
				unix.Close(fd)
				delete(ends, fd)
			}
		}
	}
	// flush writes e's pending bytes to its peer; false when the peer's
	// buffer filled first (the caller waits for EPOLLOUT).
	flush := func(e *end) (bool, error) {
		for len(e.pending) > 0 {
			n, err := rawWrite(e.peer, e.pending)
			switch {
			case err == unix.EINTR:
			case err == unix.EAGAIN:
				writeStalls.Add(1)
				return false, nil
			case err != nil:
				return false, err
			default:
				e.pending = e.pending[n:]
			}
		}
		return true, nil
	}
	for {
		n, err := rawWait(ep, events)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("epoll_wait: %w", err)
		}
		for _, ev := range events[:n] {
			fd := int(ev.Fd)
			if fd == stop {
				for fd := range ends {
					unix.Close(fd)
				}
				return nil
			}
			if fd == lfd {
				for {
					cfd, ufd, ok, err := acceptOne(lfd, upstream)
					if err != nil {
						return err
					}
					if !ok {
						break
					}
					ends[cfd] = &end{fd: cfd, peer: ufd}
					ends[ufd] = &end{fd: ufd, peer: cfd}
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, cfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(cfd)}) //nolint:errcheck // new fd
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, ufd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(ufd)}) //nolint:errcheck // new fd
				}
				continue
			}
			e := ends[fd]
			if e == nil {
				continue // closed earlier in this batch
			}
			if ev.Events&unix.EPOLLOUT != 0 {
				// fd's buffer has room: write what its peer read.
				src := ends[e.peer]
				done, err := flush(src)
				if err != nil {
					closePair(e)
					continue
				}
				if done {
					rearm(e)
					rearm(src)
				}
			}
			if len(e.pending) > 0 {
				if ev.Events&(unix.EPOLLHUP|unix.EPOLLERR) != 0 {
					closePair(e) // reported on every turn until closed
				}
				continue
			}
			if ev.Events&(unix.EPOLLIN|unix.EPOLLHUP|unix.EPOLLERR) == 0 {
				continue
			}
			m, err := rawRead(fd, buf)
			if err == unix.EAGAIN || err == unix.EINTR {
				continue
			}
			if err != nil || m == 0 {
				closePair(e)
				continue
			}
			e.pending = buf[:m]
			done, err := flush(e)
			if err != nil {
				closePair(e)
				continue
			}
			if !done {
				// Keep the rest (buf is reused) and read no more from fd
				// until the peer took it.
				e.pending = append([]byte(nil), e.pending...)
				rearm(e)
				rearm(ends[e.peer])
			}
		}
	}
}

// acceptOne accepts the next waiting client and connects it upstream; ok
// is false when none waits. A client whose upstream cannot be reached is
// reported and closed, and the next one taken. Any other failure to accept
// (out of descriptors) is returned: the listener would stay readable and
// the loop spin on it.
func acceptOne(lfd int, upstream string) (cfd, ufd int, ok bool, err error) {
	for {
		cfd, _, err := unix.Accept4(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
		switch err {
		case nil:
		case unix.EAGAIN:
			return -1, -1, false, nil // accepted all
		case unix.EINTR, unix.ECONNABORTED:
			continue
		default:
			return -1, -1, false, fmt.Errorf("accept: %w", err)
		}
		unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) //nolint:errcheck // best effort
		ufd, err := dialUpstream(upstream)
		if err != nil {
			fmt.Fprintln(os.Stderr, "barerelay:", err)
			unix.Close(cfd)
			continue
		}
		return cfd, ufd, true, nil
	}
}

// newLoop makes the loop's epoll set: the listener and, unless it is -1,
// stop, an eventfd whose write ends the loop.
func newLoop(lfd, stop int) (int, error) {
	ep, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("epoll_create1: %w", err)
	}
	for _, fd := range []int{lfd, stop} {
		if fd < 0 {
			continue
		}
		if err := unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, fd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(fd)}); err != nil {
			unix.Close(ep)
			return -1, fmt.Errorf("epoll_ctl: %w", err)
		}
	}
	return ep, nil
}

// dialUpstream connects to upstream (a Unix socket's path, or host:port).
// The connect blocks the loop while it runs: immediate on the same
// machine, which is where the yardstick's Postgres is.
func dialUpstream(upstream string) (int, error) {
	if strings.HasPrefix(upstream, "/") {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			return -1, err
		}
		if err := unix.Connect(fd, &unix.SockaddrUnix{Name: upstream}); err != nil {
			unix.Close(fd)
			return -1, fmt.Errorf("connect %s: %w", upstream, err)
		}
		return nonblocking(fd)
	}
	addr, err := net.ResolveTCPAddr("tcp", upstream)
	if err != nil {
		return -1, err
	}
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	sa := &unix.SockaddrInet4{Port: addr.Port}
	copy(sa.Addr[:], addr.IP.To4())
	if err := unix.Connect(fd, sa); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("connect %s: %w", upstream, err)
	}
	unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) //nolint:errcheck // best effort
	return nonblocking(fd)
}

// nonblocking makes a connected socket non-blocking, or closes it.
func nonblocking(fd int) (int, error) {
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return -1, err
	}
	return fd, nil
}
