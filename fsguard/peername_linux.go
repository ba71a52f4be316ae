//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"errors"
	"net/netip"
	"sync"

	"golang.org/x/sys/unix"
)

// The peer of a captured socket. A captured connect is connected to the
// egress proxy (captureConnect), so the kernel would answer getpeername
// with the proxy's loopback address; tools that log, check or reuse their
// peer's address (an HTTP client's connection pool, ssh's known hosts,
// test suites) expect the one they asked for. getpeername traps: for a
// socket the supervisor captured it answers the address the agent
// connected to, in the socket's own family; for any other it continues
// to the kernel (it reads, it changes nothing). The supervisor knows a
// captured socket by its inode, for the last maxCapturedPeers captures.

// maxCapturedPeers bounds the captures remembered; an older captured
// socket's getpeername answers the proxy's address.
const maxCapturedPeers = 4096

func init() {
	calls := map[uint32]sysSpec{unix.SYS_GETPEERNAME: spec("getpeername").handledBy(netPeerName)}
	filterEmitters = append(filterEmitters, filterEmitter{
		calls:  calls,
		jumps:  func(a *asm) { a.jump(bpfJeqK, unix.SYS_GETPEERNAME, "notify", "") },
		blocks: func(*asm) {},
	})
}

// capturedPeers maps a captured socket's inode to the address the agent
// connected it to.
type capturedPeers struct {
	mu    sync.Mutex
	peer  map[uint64]netip.AddrPort
	order []uint64 // oldest first
}

// record notes that sock was captured on its way to dst.
func (c *capturedPeers) record(sock int, dst netip.AddrPort) {
	var st unix.Stat_t
	if unix.Fstat(sock, &st) != nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.peer == nil {
		c.peer = map[uint64]netip.AddrPort{}
	}
	if _, ok := c.peer[st.Ino]; !ok {
		if len(c.order) >= maxCapturedPeers {
			delete(c.peer, c.order[0])
			c.order = c.order[1:]
		}
		c.order = append(c.order, st.Ino)
	}
	c.peer[st.Ino] = dst
}

func (c *capturedPeers) empty() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.peer) == 0
}

func (c *capturedPeers) lookup(sock int) (netip.AddrPort, bool) {
	var st unix.Stat_t
	if unix.Fstat(sock, &st) != nil {
		return netip.AddrPort{}, false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	dst, ok := c.peer[st.Ino]
	return dst, ok
}

// netPeerName answers getpeername(fd, addr, addrlen) for a captured socket
// with the address the agent connected to; any other continues.
func netPeerName(t *trap) {
	if t.pr.peers.empty() {
		t.proceed()
		return
	}
	sock, err := t.getFD(int32(t.arg(0)))
	if err != nil {
		t.proceed() // not a descriptor, gone, ...: the kernel says so
		return
	}
	defer unix.Close(sock)
	dst, ok := t.pr.peers.lookup(sock)
	if !ok {
		t.proceed()
		return
	}
	family, err := unix.GetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_DOMAIN)
	if err != nil {
		t.proceed()
		return
	}
	sa := rawSockaddr(family, dst)
	lb, err := t.memVM(t.arg(2), 4)
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EFAULT)
		}
		return
	}
	n := int(int32(binary.NativeEndian.Uint32(lb)))
	if n < 0 {
		t.fail(unix.EINVAL)
		return
	}
	var real [4]byte
	binary.NativeEndian.PutUint32(real[:], uint32(len(sa)))
	if err := t.writeMem(t.arg(1), sa[:min(n, len(sa))]); err != nil {
		t.failErr(err)
		return
	}
	if err := t.writeMem(t.arg(2), real[:]); err != nil {
		t.failErr(err)
		return
	}
	t.reply(0)
}

// rawSockaddr is dst as a struct sockaddr_in (AF_INET) or sockaddr_in6
// (AF_INET6: an IPv4 address v4-mapped).
func rawSockaddr(family int, dst netip.AddrPort) []byte {
	if family == unix.AF_INET {
		b := make([]byte, unix.SizeofSockaddrInet4)
		binary.NativeEndian.PutUint16(b, unix.AF_INET)
		binary.BigEndian.PutUint16(b[2:], dst.Port())
		a := dst.Addr().Unmap().As4()
		copy(b[4:], a[:])
		return b
	}
	b := make([]byte, unix.SizeofSockaddrInet6)
	binary.NativeEndian.PutUint16(b, unix.AF_INET6)
	binary.BigEndian.PutUint16(b[2:], dst.Port())
	a := dst.Addr().As16()
	copy(b[8:], a[:])
	return b
}
