package main

import (
	"fmt"
	"iter"
	"net"
	"os"
	"runtime"

	"golang.org/x/sys/unix"
)

// wait is what a relay coroutine waits for: a descriptor to be readable
// or writable.
type wait struct {
	fd     int
	events uint32
}

// coroRelay is loopRelay's event loop with each direction written as
// straight-line code that blocks: a coroutine (iter.Pull) that reads,
// writes and, on EAGAIN, yields what it waits for; the loop resumes it
// when epoll says so. The coroutine switch is the runtime's direct
// hand-off (no scheduler, no poller): what it costs against the plain loop
// is what keeping the fence's session code as it is, on such a loop,
// would cost.
func coroRelay(lfd int, upstream string, stop int) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	ep, err := newLoop(lfd, stop)
	if err != nil {
		return err
	}
	defer unix.Close(ep)
	type direction struct {
		next func() (wait, bool)
		stop func()
		w    wait
	}
	type conn struct {
		peer    int
		readers *direction // the direction reading this descriptor
		writers *direction // the direction waiting to write it, if any
	}
	conns := map[int]*conn{}
	events := make([]unix.EpollEvent, 128)
	rearm := func(fd int) {
		c := conns[fd]
		var ev uint32
		if c.readers != nil && c.readers.w.fd == fd && c.readers.w.events == unix.EPOLLIN {
			ev |= unix.EPOLLIN
		}
		if c.writers != nil {
			ev |= unix.EPOLLOUT
		}
		unix.EpollCtl(ep, unix.EPOLL_CTL_MOD, fd, &unix.EpollEvent{Events: ev, Fd: int32(fd)}) //nolint:errcheck // fds are ours
	}
	closeConn := func(fd int) {
		c := conns[fd]
		if c == nil {
			return
		}
		for _, f := range []int{fd, c.peer} {
			if cc := conns[f]; cc != nil {
				delete(conns, f)
				unix.EpollCtl(ep, unix.EPOLL_CTL_DEL, f, nil) //nolint:errcheck // closing anyway
				unix.Close(f)
				if cc.readers != nil {
					cc.readers.stop()
				}
			}
		}
	}
	// step resumes d and files what it waits for next; false when the
	// direction ended (its pair is closed).
	step := func(d *direction) bool {
		w, ok := d.next()
		if !ok {
			return false
		}
		d.w = w
		if w.events == unix.EPOLLOUT {
			conns[w.fd].writers = d
		}
		return true
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
				for fd := range conns {
					closeConn(fd)
				}
				return nil
			}
			if fd == lfd {
				for {
					cfd, _, err := unix.Accept4(lfd, unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC)
					if err != nil {
						break
					}
					unix.SetsockoptInt(cfd, unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) //nolint:errcheck // best effort
					ufd, err := dialUpstream(upstream)
					if err != nil {
						fmt.Fprintln(os.Stderr, "barerelay:", err)
						unix.Close(cfd)
						continue
					}
					up := &direction{}
					up.next, up.stop = iter.Pull(copyDirection(cfd, ufd))
					down := &direction{}
					down.next, down.stop = iter.Pull(copyDirection(ufd, cfd))
					conns[cfd] = &conn{peer: ufd, readers: up}
					conns[ufd] = &conn{peer: cfd, readers: down}
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, cfd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(cfd)}) //nolint:errcheck // new fd
					unix.EpollCtl(ep, unix.EPOLL_CTL_ADD, ufd, &unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(ufd)}) //nolint:errcheck // new fd
					if !step(up) || !step(down) {
						closeConn(cfd)
					}
				}
				continue
			}
			c := conns[fd]
			if c == nil {
				continue
			}
			if ev.Events&unix.EPOLLOUT != 0 && c.writers != nil {
				d := c.writers
				c.writers = nil
				if !step(d) {
					closeConn(fd)
					continue
				}
				rearm(fd)
				rearm(c.peer)
			}
			if ev.Events&(unix.EPOLLIN|unix.EPOLLHUP|unix.EPOLLERR) != 0 && c.readers.w.fd == fd && c.readers.w.events == unix.EPOLLIN {
				if !step(c.readers) {
					closeConn(fd)
					continue
				}
				if c.readers.w.events == unix.EPOLLOUT {
					rearm(fd)
					rearm(c.peer)
				}
			}
		}
	}
}

// copyDirection is one direction of a relay as blocking code: it reads
// src and writes dst until either ends, yielding what it waits for.
func copyDirection(src, dst int) iter.Seq[wait] {
	return func(yield func(wait) bool) {
		buf := make([]byte, 64<<10)
		for {
			if !yield(wait{src, unix.EPOLLIN}) {
				return
			}
			n, err := rawRead(src, buf)
			if err == unix.EAGAIN || err == unix.EINTR {
				continue
			}
			if err != nil || n == 0 {
				return
			}
			for p := buf[:n]; len(p) > 0; {
				m, err := rawWrite(dst, p)
				switch {
				case err == unix.EAGAIN:
					if !yield(wait{dst, unix.EPOLLOUT}) {
						return
					}
				case err == unix.EINTR:
				case err != nil:
					return
				default:
					p = p[m:]
				}
			}
		}
	}
}

func listenTCP(listen string) (int, error) {
	addr, err := net.ResolveTCPAddr("tcp", listen)
	if err != nil {
		return -1, err
	}
	lfd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("socket: %w", err)
	}
	if err := unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		return -1, err
	}
	sa := &unix.SockaddrInet4{Port: addr.Port}
	copy(sa.Addr[:], addr.IP.To4())
	if err := unix.Bind(lfd, sa); err != nil {
		return -1, fmt.Errorf("bind %s: %w", listen, err)
	}
	if err := unix.Listen(lfd, 128); err != nil {
		return -1, fmt.Errorf("listen: %w", err)
	}
	return lfd, nil
}
