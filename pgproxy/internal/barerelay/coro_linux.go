package main

import (
	"fmt"
	"net"
	"os"
	"time"

	"github.com/fenceline/fenceline/pgproxy/internal/evloop"
	"golang.org/x/sys/unix"
)

// coroRelay is loopRelay's design with each direction written as
// straight-line code that blocks, run as a task of an evloop.Loop: it
// waits for its source to be readable, reads once, and writes to its peer,
// waiting for room when the peer's buffer is full. What it costs against
// the plain loop is what keeping the fence's session code as it is, on such
// a loop, would cost.
func coroRelay(lfd int, upstream string, stop int) error {
	l, err := evloop.New()
	if err != nil {
		return err
	}
	if stop >= 0 {
		l.Go(func(t *evloop.Task) {
			if t.WaitRead(stop, time.Time{}) == nil {
				l.Close()
			}
		})
	}
	l.Go(func(t *evloop.Task) {
		for {
			if err := t.WaitRead(lfd, time.Time{}); err != nil {
				return
			}
			for {
				cfd, ufd, ok, err := acceptOne(lfd, upstream)
				if err != nil {
					fmt.Fprintln(os.Stderr, "barerelay:", err)
					l.Close()
					return
				}
				if !ok {
					break
				}
				pair := &pair{l: l, fds: [2]int{cfd, ufd}}
				l.Go(func(t *evloop.Task) { pair.copy(t, cfd, ufd) })
				l.Go(func(t *evloop.Task) { pair.copy(t, ufd, cfd) })
			}
		}
	})
	return l.Run()
}

// pair is a relayed connection: the client's socket and the server's,
// closed when either direction ends.
type pair struct {
	l      *evloop.Loop
	fds    [2]int
	closed bool
}

func (p *pair) close() {
	if p.closed {
		return
	}
	p.closed = true
	for _, fd := range p.fds {
		p.l.Forget(fd) // ends the other direction's wait
		unix.Close(fd)
	}
}

// copy is one direction of the relay as code that blocks.
func (p *pair) copy(t *evloop.Task, src, dst int) {
	defer p.close()
	buf := make([]byte, 64<<10)
	for {
		if err := t.WaitRead(src, time.Time{}); err != nil {
			return
		}
		n, err := rawRead(src, buf)
		if err == unix.EAGAIN || err == unix.EINTR {
			continue
		}
		if err != nil || n == 0 {
			return
		}
		for b := buf[:n]; len(b) > 0; {
			m, err := rawWrite(dst, b)
			switch {
			case err == unix.EAGAIN:
				writeStalls.Add(1)
				if t.WaitWrite(dst, time.Time{}) != nil {
					return
				}
			case err == unix.EINTR:
			case err != nil:
				return
			default:
				b = b[m:]
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
	sa := &unix.SockaddrInet4{Port: addr.Port}
	copy(sa.Addr[:], addr.IP.To4())
	if err = unix.SetsockoptInt(lfd, unix.SOL_SOCKET, unix.SO_REUSEADDR, 1); err != nil {
		err = fmt.Errorf("SO_REUSEADDR: %w", err)
	} else if err = unix.Bind(lfd, sa); err != nil {
		err = fmt.Errorf("bind %s: %w", listen, err)
	} else if err = unix.Listen(lfd, 128); err != nil {
		err = fmt.Errorf("listen on %s: %w", listen, err)
	}
	if err != nil {
		unix.Close(lfd)
		return -1, err
	}
	return lfd, nil
}
