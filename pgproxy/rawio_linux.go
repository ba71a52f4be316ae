package pgproxy

import (
	"io"
	"net"
	"os"
	"syscall"
	"unsafe"
)

// rawIO reads and writes a socket with raw system calls, waiting on Go's
// poller only when the socket says EAGAIN. A relay makes several short
// read and write calls per round trip; through net.Conn each is a
// syscall.Syscall, which hands the goroutine's processor to the runtime for
// the call's length, and under load the runtime's monitor takes it back
// for a call it finds running across two of its ticks, wakes another
// thread to run it, and keeps ticking every 20 µs while it does: in a
// profile of the fence under pgbench that monitor and those hand-offs were
// a fifth of the proxy's CPU (docs/benchmarks.md). A read or write of a
// non-blocking socket never blocks, so it may run as a raw call. Deadlines,
// Close and the poller behave as through net.Conn: RawConn's Read and
// Write wait on the same poll descriptor.
type rawIO struct {
	rc syscall.RawConn
	// fc, once the session moved to the proxy's loop (moveToLoop), is
	// where every read and write goes: the socket has left Go's poller.
	fc *fdConn
}

// newRawIO returns a rawIO for c when c is a socket, else c itself (TLS).
func newRawIO(c net.Conn) io.ReadWriter {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return c
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return c
	}
	return &rawIO{rc: rc}
}

func (r *rawIO) Read(p []byte) (int, error) {
	if r.fc != nil {
		return r.fc.Read(p)
	}
	if len(p) == 0 {
		return 0, nil
	}
	var (
		n     int
		errno syscall.Errno
	)
	err := r.rc.Read(func(fd uintptr) bool {
		for {
			m, _, e := syscall.RawSyscall(syscall.SYS_READ, fd, uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)))
			switch e {
			case syscall.EINTR:
				continue
			case syscall.EAGAIN:
				return false // wait for the poller
			}
			n, errno = int(m), e
			return true
		}
	})
	switch {
	case err != nil:
		return 0, err
	case errno != 0:
		return 0, &net.OpError{Op: "read", Net: "raw", Err: os.NewSyscallError("read", errno)}
	case n == 0:
		return 0, io.EOF
	}
	return n, nil
}

func (r *rawIO) Write(p []byte) (int, error) {
	if r.fc != nil {
		return r.fc.Write(p)
	}
	var (
		n     int
		errno syscall.Errno
	)
	err := r.rc.Write(func(fd uintptr) bool {
		for n < len(p) {
			m, _, e := syscall.RawSyscall(syscall.SYS_WRITE, fd, uintptr(unsafe.Pointer(&p[n])), uintptr(len(p)-n))
			switch e {
			case 0:
				n += int(m)
			case syscall.EINTR:
			case syscall.EAGAIN:
				return false // the socket's buffer is full: wait for room
			default:
				errno = e
				return true
			}
		}
		return true
	})
	if err == nil && errno != 0 {
		err = &net.OpError{Op: "write", Net: "raw", Err: os.NewSyscallError("write", errno)}
	}
	if err == nil && n < len(p) {
		err = io.ErrShortWrite
	}
	return n, err
}
