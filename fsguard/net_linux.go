//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// The network part of the guard. Landlock (ABI 4..8) judges only TCP
// connect and bind by port, and only in connect(2): TCP Fast Open connects
// inside sendto/sendmsg, UDP and Unix sockets are not judged at all. So:
//
//   - socket() and socketpair() allow only TCP (protocol 0 or IPPROTO_TCP),
//     Unix stream and seqpacket sockets and netlink route sockets (libc's
//     getifaddrs), decided in the filter without a round trip. Every other
//     kind (UDP, raw, MPTCP, SCTP, Unix datagram, packet, vsock...) is
//     refused and audited; Policy.AllowAnyConnect allows UDP, and with
//     Policy.Capture a UDP socket is made in the sealed network
//     (sealednet_linux.go), where whatever it sends stays. Without a
//     datagram socket an address given to sendto/sendmsg reaches nobody:
//     TCP ignores it unless Fast Open is asked for, Unix stream and
//     seqpacket sockets refuse or ignore it.
//   - sendto, sendmsg and sendmmsg with MSG_FASTOPEN, and setsockopt
//     TCP_FASTOPEN_CONNECT, are refused with EOPNOTSUPP (what the kernel
//     answers when client Fast Open is off, so clients fall back to
//     connect) and audited; other sends never leave the kernel.
//   - connect() always traps, and the supervisor performs it: it copies
//     the address once, judges the copy and connects its own duplicate of
//     the agent's socket to the copy. The agent can rewrite the address
//     or dup2 another socket onto the descriptor after the check; neither
//     reaches the connect. A Unix socket path is opened O_PATH, judged by
//     device and inode, and connected through /proc/self/fd/N of that
//     descriptor, so a symlink swapped after the check changes nothing.
//   - bind() always traps. While the lease holds it continues to the
//     kernel, where Landlock's MAKE_SOCK right judges a socket file like
//     any other new file. Once the lease is lost or unknown, a pathname
//     bind is refused (it would create a file) and any other bind is
//     performed by the supervisor on its copy of the address.

// Values missing from x/sys/unix or spelled for readability.
const (
	bpfAndK       = 0x04 | 0x50 | 0x00 // BPF_ALU|BPF_AND|BPF_K
	sockTypeMask  = 0xf                // SOCK_TYPE_MASK: SOCK_NONBLOCK/CLOEXEC are above it
	netlinkRoute  = 0                  // NETLINK_ROUTE
	sockaddrMax   = 128                // sizeof(struct sockaddr_storage)
	sunPathOffset = 2                  // offsetof(struct sockaddr_un, sun_path)
)

func init() {
	filterEmitters = append(filterEmitters, filterEmitter{calls: netCalls, jumps: netJumps, blocks: netBlocks})
}

var netCalls = map[uint32]sysSpec{
	unix.SYS_SOCKET:     spec("socket").handledBy(netSocket),
	unix.SYS_SOCKETPAIR: spec("socketpair").handledBy(netSocket),
	unix.SYS_CONNECT:    spec("connect").f(0).handledBy(netConnect),
	unix.SYS_BIND:       spec("bind").f(0).handledBy(netBind),
	unix.SYS_LISTEN:     spec("listen").f(0).handledBy(netListen),
	unix.SYS_SENDTO:     spec("sendto").f(0).handledBy(netFastOpen),
	unix.SYS_SENDMSG:    spec("sendmsg").f(0).handledBy(netFastOpen),
	unix.SYS_SENDMMSG:   spec("sendmmsg").f(0).handledBy(netFastOpen),
	unix.SYS_SETSOCKOPT: spec("setsockopt").f(0).handledBy(netFastOpen),
}

// netJumps sends each network call to its block (connect, bind and
// listen always trap).
func netJumps(a *asm) {
	a.jump(bpfJeqK, unix.SYS_SOCKET, "net_socket", "")
	a.jump(bpfJeqK, unix.SYS_SOCKETPAIR, "net_socketpair", "")
	a.jump(bpfJeqK, unix.SYS_CONNECT, "notify", "")
	a.jump(bpfJeqK, unix.SYS_BIND, "notify", "")
	a.jump(bpfJeqK, unix.SYS_LISTEN, "notify", "")
	a.jump(bpfJeqK, unix.SYS_SENDTO, "net_flags3", "")
	a.jump(bpfJeqK, unix.SYS_SENDMMSG, "net_flags3", "")
	a.jump(bpfJeqK, unix.SYS_SENDMSG, "net_flags2", "")
	a.jump(bpfJeqK, unix.SYS_SETSOCKOPT, "net_sockopt", "")
}

// argLow loads the low word of argument i (little endian): int and
// unsigned int arguments are all the kernel reads.
func argLow(i int) uint32 { return uint32(offArgs + 8*i) }

// netBlocks checks the arguments. Each block returns itself (the shared
// "allow" label lies before the blocks, and BPF jumps only forward).
func netBlocks(a *asm) {
	allow := func() { a.stmt(bpfRetK, retAllow) }
	notify := func() { a.stmt(bpfRetK, retNotify) }

	a.label("net_socket")
	a.stmt(bpfLdWAbs, argLow(0))
	a.jump(bpfJeqK, unix.AF_UNIX, "net_unix_type", "")
	a.jump(bpfJeqK, unix.AF_INET, "net_inet_type", "")
	a.jump(bpfJeqK, unix.AF_INET6, "net_inet_type", "")
	a.jump(bpfJeqK, unix.AF_NETLINK, "net_netlink", "")
	notify()

	a.label("net_socketpair")
	a.stmt(bpfLdWAbs, argLow(0))
	a.jump(bpfJeqK, unix.AF_UNIX, "net_unix_type", "")
	notify()

	a.label("net_unix_type")
	a.stmt(bpfLdWAbs, argLow(1))
	a.stmt(bpfAndK, sockTypeMask)
	a.jump(bpfJeqK, unix.SOCK_STREAM, "net_allow", "")
	a.jump(bpfJeqK, unix.SOCK_SEQPACKET, "net_allow", "")
	notify()

	a.label("net_inet_type")
	a.stmt(bpfLdWAbs, argLow(1))
	a.stmt(bpfAndK, sockTypeMask)
	a.jump(bpfJeqK, unix.SOCK_STREAM, "", "net_notify")
	a.stmt(bpfLdWAbs, argLow(2))
	a.jump(bpfJeqK, 0, "net_allow", "")
	a.jump(bpfJeqK, unix.IPPROTO_TCP, "net_allow", "")
	notify()

	a.label("net_netlink")
	a.stmt(bpfLdWAbs, argLow(2))
	a.jump(bpfJeqK, netlinkRoute, "net_allow", "")
	notify()

	a.label("net_flags2")
	a.stmt(bpfLdWAbs, argLow(2))
	a.jump(bpfJsetK, unix.MSG_FASTOPEN, "net_notify", "net_allow")

	a.label("net_flags3")
	a.stmt(bpfLdWAbs, argLow(3))
	a.jump(bpfJsetK, unix.MSG_FASTOPEN, "net_notify", "net_allow")

	a.label("net_sockopt")
	a.stmt(bpfLdWAbs, argLow(1))
	a.jump(bpfJeqK, unix.IPPROTO_TCP, "", "net_allow")
	a.stmt(bpfLdWAbs, argLow(2))
	a.jump(bpfJeqK, unix.TCP_FASTOPEN_CONNECT, "net_notify", "net_allow")

	a.label("net_notify")
	notify()
	a.label("net_allow")
	allow()
}

// egressHint tells the agent's operator how to reach what was refused.
const egressHint = "reach other hosts through the sidecar's egress proxy (HTTPS_PROXY; allow a host with --allow-host) or allow a loopback port with --allow-connect"

// netSocket answers a socket() or socketpair() the filter did not allow.
// With AllowAnyConnect a UDP socket continues: the arguments are registers
// the agent cannot change while it waits.
func netSocket(t *trap) {
	domain, typ, proto := int(int32(t.arg(0))), int(int32(t.arg(1))), int(int32(t.arg(2)))
	udp := (domain == unix.AF_INET || domain == unix.AF_INET6) && typ&sockTypeMask == unix.SOCK_DGRAM &&
		(proto == 0 || proto == unix.IPPROTO_UDP)
	if udp && t.spec.name == "socket" && t.pr.policy.AllowAnyConnect {
		t.proceed()
		return
	}
	if udp && t.spec.name == "socket" && t.pr.policy.Capture.IsValid() {
		t.pr.goTrap(t, func(t *trap) { sealedSocket(t, domain, typ) })
		return
	}
	what := fmt.Sprintf("%s(%s, %s, %d): only TCP and Unix stream sockets are allowed (names resolve through the egress proxy); %s",
		t.spec.name, familyName(domain), typeName(typ), proto, egressHint)
	t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed, what, nil)
}

// sealedSocket answers a UDP socket() with a socket of the sealed network
// (sealednet_linux.go): DNS to any address is answered by the egress
// proxy, and nothing sent from it leaves the namespace it was made in.
func sealedSocket(t *trap, domain, typ int) {
	fd, err := t.pr.sealed.udpSocket(domain)
	if err != nil {
		what := fmt.Sprintf("socket(%s, %s): a UDP socket is only given in a sealed network, and there is none: %v; %s",
			familyName(domain), typeName(typ), err, egressHint)
		t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed, what, nil)
		return
	}
	defer unix.Close(fd)
	if typ&unix.SOCK_NONBLOCK != 0 {
		if err := unix.SetNonblock(fd, true); err != nil {
			t.failErr(err)
			return
		}
	}
	if err := t.addFD(fd, typ&unix.SOCK_CLOEXEC != 0); err != nil && !t.sent {
		t.failErr(err)
	}
}

// netFastOpen refuses TCP Fast Open: a send with MSG_FASTOPEN (or on a
// socket with TCP_FASTOPEN_CONNECT) connects to the address it carries
// without passing connect's check.
func netFastOpen(t *trap) {
	what := t.spec.name + " with MSG_FASTOPEN"
	if t.spec.name == "setsockopt" {
		what = "setsockopt TCP_FASTOPEN_CONNECT"
	}
	what += ": TCP Fast Open would connect past the connect check; connect first"
	t.deny(unix.EOPNOTSUPP, lease.BoundaryNet, lease.ReasonNotAllowed, what, nil)
}

// netConnect performs the agent's connect itself, in a goroutine of the
// Process: a connect can block (a slow remote, a full backlog), and one
// blocked connect must not hold up the agent's other trapped calls.
func netConnect(t *trap) {
	t.pr.goTrap(t, emulateConnect)
}

// goTrap hands the trap to a goroutine owned by the Process (netOps, which
// settling waits for) that answers it. The goroutine's trap has its own
// copy of the notification (the loop reuses its buffer).
func (pr *Process) goTrap(t *trap, f func(*trap)) {
	n := *t.n
	gt := pr.newTrap(&n, t.spec)
	t.sent = true // answered by the goroutine
	pr.netOps.Add(1)
	go func() {
		defer pr.netOps.Done()
		defer gt.close()
		f(gt)
	}()
}

// sockaddrArg copies the call's address (arguments 1 and 2); ok is false
// once the trap was answered.
func sockaddrArg(t *trap) ([]byte, bool) {
	n := int(int32(t.arg(2)))
	if n < 2 || n > sockaddrMax {
		t.fail(unix.EINVAL)
		return nil, false
	}
	b, err := t.memVM(t.arg(1), n)
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EFAULT)
		}
		return nil, false
	}
	return b, true
}

// memVM is t.mem through process_vm_readv: for the few bytes of a
// sockaddr it costs about a microsecond where opening /proc/PID/mem costs
// ten. It falls back to t.mem when the call is unavailable.
func (t *trap) memVM(addr uint64, n int) ([]byte, error) {
	b := make([]byte, n)
	local := []unix.Iovec{{Base: &b[0]}}
	local[0].SetLen(n)
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: n}}
	got, err := unix.ProcessVMReadv(t.pid(), local, remote, 0)
	switch {
	case errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EPERM):
		return t.mem(addr, n)
	case err != nil:
		return nil, err
	case got < n:
		return nil, unix.EFAULT
	case !t.valid():
		return nil, errTaskGone
	}
	return b, nil
}

func emulateConnect(t *trap) {
	sa, ok := sockaddrArg(t)
	if !ok {
		return
	}
	sock, err := t.getFD(int32(t.arg(0)))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	defer unix.Close(sock)
	switch fam := binary.LittleEndian.Uint16(sa); fam {
	case unix.AF_INET, unix.AF_INET6:
		ap, err := inetAddr(sa)
		if err != nil {
			t.failErr(err)
			return
		}
		if !t.pr.policy.AllowAnyConnect && (!ap.Addr().Unmap().IsLoopback() || !slices.Contains(t.pr.policy.ConnectPorts, ap.Port())) &&
			!t.pr.sealed.owns(sock) { // a sealed socket reaches its own namespace alone

			if t.pr.policy.captures(ap) && isTCP(sock) {
				captureConnect(t, sock, fam, ap)
				return
			}
			t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
				fmt.Sprintf("connect to %s: only the sidecar's loopback ports are allowed; %s", ap, egressHint), nil)
			return
		}
	case unix.AF_UNIX:
		connectUnix(t, sock, sa)
		return
	case unix.AF_NETLINK:
		// Only the kernel (port 0, no groups): another process's netlink
		// socket is no one the agent should talk to.
		if len(sa) < 12 || binary.LittleEndian.Uint32(sa[4:]) != 0 || binary.LittleEndian.Uint32(sa[8:]) != 0 {
			t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed, "connect of a netlink socket to a process: only the kernel is allowed", nil)
			return
		}
	case unix.AF_UNSPEC:
		// Dissolves the association; reaches no one.
	default:
		t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
			fmt.Sprintf("connect to a %s address: not allowed; %s", familyName(int(fam)), egressHint), nil)
		return
	}
	t.replyErr(t.pr.doConnect(sock, sa))
}

// captures reports whether a TCP connect to dst, not allowed as it is,
// goes to the egress proxy instead: any address but the loopback's, and
// DNS (port 53) anywhere.
func (p *Policy) captures(dst netip.AddrPort) bool {
	return p.Capture.IsValid() && (!dst.Addr().Unmap().IsLoopback() || dst.Port() == 53)
}

// isTCP reports whether sock is a TCP socket (MPTCP and the rest are
// refused at socket()).
func isTCP(sock int) bool {
	typ, err := unix.GetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil || typ != unix.SOCK_STREAM {
		return false
	}
	proto, err := unix.GetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_PROTOCOL)
	return err == nil && proto == unix.IPPROTO_TCP
}

// CapturePreamble is what the supervisor writes on a captured connection
// before any byte of the agent's: a CONNECT to the address the agent
// chose, marked with the egress proxy's capture header. The proxy answers
// nothing and judges the bytes that follow by name.
func CapturePreamble(dst netip.AddrPort) []byte {
	d := netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port()).String()
	return []byte("CONNECT " + d + " HTTP/1.1\r\nHost: " + d + "\r\nFenceline-Capture: 1\r\n\r\n")
}

// captureTimeout bounds connecting to the egress proxy and writing the
// preamble.
const captureTimeout = 10 * time.Second

// captureConnect connects the supervisor's duplicate of the agent's TCP
// socket to the egress proxy (Policy.Capture) instead of dst, writes the
// capture preamble naming dst and answers the connect as done: the
// agent's first byte follows the preamble. Nothing is read from the
// agent after the address was copied.
func captureConnect(t *trap, sock int, fam uint16, dst netip.AddrPort) {
	c := t.pr.policy.Capture
	var sa unix.Sockaddr
	if fam == unix.AF_INET {
		if !c.Addr().Unmap().Is4() {
			t.deny(unix.ENETUNREACH, lease.BoundaryNet, lease.ReasonNotAllowed,
				fmt.Sprintf("connect to %s: the egress proxy (%s) cannot be reached from an IPv4 socket", dst, c), nil)
			return
		}
		sa = &unix.SockaddrInet4{Port: int(c.Port()), Addr: c.Addr().Unmap().As4()}
	} else {
		sa = &unix.SockaddrInet6{Port: int(c.Port()), Addr: c.Addr().As16()} // v4-mapped for an IPv4 proxy
		if c.Addr().Unmap().Is4() {
			// A v6-only socket (Go's "tcp6") cannot reach a v4-mapped
			// address; it is connected to the proxy alone, so the option
			// guards nothing here.
			unix.SetsockoptInt(sock, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 0)
		}
	}
	err := t.pr.abortable(sock, func() error { return unix.Connect(sock, sa) })
	// EINTR: a signal to the supervisor's thread cut a blocking connect
	// short; the connection goes on (EALREADY when restarted).
	if errors.Is(err, unix.EINPROGRESS) || errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) || errors.Is(err, unix.EALREADY) {
		err = waitWritable(sock, captureTimeout)
	}
	if err == nil {
		err = writeAll(sock, CapturePreamble(dst), captureTimeout)
	}
	if err != nil {
		t.pr.policy.logger().Warn("fenceline guard: a captured connect did not reach the egress proxy", "dst", dst.String(), "proxy", c.String(), "err", err)
		t.failErr(err)
		return
	}
	t.pr.peers.record(sock, dst)
	t.reply(0)
}

// waitWritable waits until a connecting non-blocking socket is
// connected, and returns its error.
func waitWritable(sock int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		fds := []unix.PollFd{{Fd: int32(sock), Events: unix.POLLOUT}}
		ms := int(time.Until(deadline).Milliseconds())
		if ms <= 0 {
			return unix.ETIMEDOUT
		}
		n, err := unix.Poll(fds, ms)
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil {
			return err
		}
		if n == 0 {
			return unix.ETIMEDOUT
		}
		soErr, err := unix.GetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			return err
		}
		if soErr != 0 {
			return unix.Errno(soErr)
		}
		return nil
	}
}

// writeAll writes b on sock, waiting while a non-blocking socket is full.
func writeAll(sock int, b []byte, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for len(b) > 0 {
		n, err := unix.SendmsgN(sock, b, nil, nil, unix.MSG_NOSIGNAL)
		switch {
		case errors.Is(err, unix.EAGAIN):
			if err := waitWritable(sock, time.Until(deadline)); err != nil {
				return err
			}
			continue
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return err
		}
		b = b[n:]
	}
	return nil
}

// inetAddr decodes an AF_INET or AF_INET6 address, with the length checks
// the kernel makes (EINVAL when too short).
func inetAddr(sa []byte) (netip.AddrPort, error) {
	port := binary.BigEndian.Uint16(sa[2:4])
	if binary.LittleEndian.Uint16(sa) == unix.AF_INET {
		if len(sa) < unix.SizeofSockaddrInet4 {
			return netip.AddrPort{}, unix.EINVAL
		}
		return netip.AddrPortFrom(netip.AddrFrom4([4]byte(sa[4:8])), port), nil
	}
	if len(sa) < 24 { // SIN6_LEN_RFC2133
		return netip.AddrPort{}, unix.EINVAL
	}
	return netip.AddrPortFrom(netip.AddrFrom16([16]byte(sa[8:24])), port), nil
}

// connectUnix connects sock to the Unix socket sa names when the policy
// lists it: the path is opened O_PATH (relative to the task's cwd), judged
// by device and inode, and connected through that descriptor.
func connectUnix(t *trap, sock int, sa []byte) {
	path := sa[sunPathOffset:]
	if len(path) == 0 || path[0] == 0 {
		t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
			fmt.Sprintf("connect to the abstract Unix socket %q: not allowed; list a pathname socket in the policy", string(path)), nil)
		return
	}
	if i := slices.Index(path, 0); i >= 0 {
		path = path[:i]
	}
	name := string(path)
	opath, err := t.openAt(name, unix.O_PATH)
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	defer unix.Close(opath)
	var st unix.Stat_t
	if err := unix.Fstat(opath, &st); err != nil {
		t.failErr(err)
		return
	}
	real, _ := os.Readlink("/proc/self/fd/" + strconv.Itoa(opath))
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK || !t.pr.unixSocketListed(st) {
		t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
			fmt.Sprintf("connect to the Unix socket %s (%s): not a socket the policy lists; add it to the policy's unix sockets", name, real), nil)
		return
	}
	via := &unix.SockaddrUnix{Name: "/proc/self/fd/" + strconv.Itoa(opath)}
	t.replyErr(t.pr.doConnectUnix(sock, via))
}

// unixSocketListed reports whether st is the socket file a path of
// Policy.UnixSockets names now.
func (pr *Process) unixSocketListed(st unix.Stat_t) bool {
	for _, p := range pr.policy.UnixSockets {
		var ls unix.Stat_t
		if unix.Stat(p, &ls) == nil && ls.Dev == st.Dev && ls.Ino == st.Ino {
			return true
		}
	}
	return false
}

// openAt opens path as the task would resolve it: relative to its working
// directory. The descriptor is the supervisor's.
func (t *trap) openAt(path string, flags int) (int, error) {
	dir := unix.AT_FDCWD
	if !filepath.IsAbs(path) {
		cwd, err := unix.Open(fmt.Sprintf("/proc/%d/cwd", t.pid()), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return -1, fmt.Errorf("working directory of %d: %w", t.pid(), err)
		}
		defer unix.Close(cwd)
		if !t.valid() {
			return -1, errTaskGone
		}
		dir = cwd
	}
	fd, err := unix.Openat(dir, path, flags|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	return fd, nil
}

// doConnect connects the supervisor's duplicate of the agent's socket
// (same open file: blocking mode and timeouts are the agent's). It is
// aborted when the attempt's notification loop ends (every task is gone).
func (pr *Process) doConnect(sock int, sa []byte) error {
	return pr.abortable(sock, func() error {
		_, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(sock), uintptr(unsafe.Pointer(&sa[0])), uintptr(len(sa)))
		if errno != 0 {
			return errno
		}
		return nil
	})
}

func (pr *Process) doConnectUnix(sock int, sa *unix.SockaddrUnix) error {
	return pr.abortable(sock, func() error { return unix.Connect(sock, sa) })
}

// abortable runs a blocking socket call; once the attempt's notification
// loop ended (no task is left to answer) it shuts the socket down, which
// ends a TCP connect still waiting for its handshake. A shutdown before
// the connect began does nothing (the socket is not connecting yet), so
// it is repeated until the call returns.
func (pr *Process) abortable(sock int, call func() error) error {
	done := make(chan struct{})
	watched := make(chan struct{})
	go func() {
		defer close(watched)
		select {
		case <-done:
			return
		case <-pr.notifDone:
		}
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for {
			unix.Shutdown(sock, unix.SHUT_RDWR)
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	err := call()
	close(done)
	<-watched
	return err
}

// replyErr answers with err's errno, or 0 when err is nil.
func (t *trap) replyErr(err error) {
	if err == nil {
		t.reply(0)
		return
	}
	t.failErr(err)
}

// netBind judges a bind by its copy of the address. The agent shares its
// network namespace with the sidecar (and, in a pod, every container): a
// port or an abstract name it holds is one their clients reach once the
// sidecar is gone, so it may take only what no one else will be asked
// for.
//
//   - An IP address (TCP, and UDP under AllowAnyConnect) is bound by the
//     supervisor on its copy when the port is 0 (the kernel chooses) or in
//     Policy.BindPorts and not reserved; anything else is refused, lease
//     held or not (a bind writes nothing).
//   - An abstract Unix name is refused; an autobind (the kernel picks the
//     name) is performed.
//   - A pathname Unix bind continues to the kernel while the lease holds,
//     where Landlock's MAKE_SOCK right judges the socket file (and its
//     BIND_TCP right refuses a TCP socket and port swapped in meanwhile);
//     once the lease is lost or unknown it is refused (it creates a file).
//   - Any other family (netlink) is bound on the supervisor's copy.
func netBind(t *trap) {
	sa, ok := sockaddrArg(t)
	if !ok {
		return
	}
	switch binary.LittleEndian.Uint16(sa) {
	case unix.AF_INET, unix.AF_INET6:
		ap, err := inetAddr(sa)
		if err != nil {
			t.failErr(err)
			return
		}
		if why := t.pr.bindRefusal(ap.Port()); why != "" {
			t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed, fmt.Sprintf("bind to %s: %s", ap, why), nil)
			return
		}
	case unix.AF_UNIX:
		if len(sa) == sunPathOffset {
			break // autobind: a name the kernel picks
		}
		if sa[sunPathOffset] == 0 {
			name := sa[sunPathOffset+1:]
			if i := slices.Index(name, 0); i >= 0 {
				name = name[:i]
			}
			t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
				fmt.Sprintf("bind to the abstract Unix socket @%s: not allowed (anyone in the network namespace, the sidecar's container included, reaches it by name); bind a socket file in a writable directory", name), nil)
			return
		}
		bindUnixPath(t, sa)
		return
	}
	sock, err := t.getFD(int32(t.arg(0)))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	defer unix.Close(sock)
	_, _, errno := unix.Syscall(unix.SYS_BIND, uintptr(sock), uintptr(unsafe.Pointer(&sa[0])), uintptr(len(sa)))
	if errno != 0 {
		t.fail(errno)
		return
	}
	t.reply(0)
}

// bindRefusal says why the agent may not bind port ("" when it may).
func (pr *Process) bindRefusal(port uint16) string {
	switch {
	case port == 0:
		return ""
	case pr.policy.reserved(port):
		return fmt.Sprintf("port %d is the sidecar's or a service's the agent is pointed at: whoever listens there is trusted (after a restart the sidecar listens there again)", port)
	case !slices.Contains(pr.policy.BindPorts, port):
		return fmt.Sprintf("fixed port %d is not allowed (a port the kernel chooses, port 0, is); allow a dev server's port with --allow-bind %d", port, port)
	}
	return ""
}

// bindUnixPath lets a pathname bind continue to Landlock while the lease
// holds; after a loss it is refused (it would create a file).
func bindUnixPath(t *trap, sa []byte) {
	gateErr := t.gate()
	if gateErr == nil {
		t.proceed() // Landlock's MAKE_SOCK right judges the socket file
		return
	}
	path := sa[sunPathOffset:]
	if i := slices.Index(path, 0); i >= 0 {
		path = path[:i]
	}
	name := string(path)
	if !filepath.IsAbs(name) {
		if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", t.pid())); err == nil {
			name = filepath.Join(cwd, name)
		}
	}
	t.deny(unix.EACCES, lease.BoundaryFile, lease.LeaseReason(gateErr),
		fmt.Sprintf("bind of the Unix socket %s (creates a file; reads continue)", name), gateErr)
}

// netListen performs the agent's listen on its own duplicate of the socket
// once the port it listens on is judged: only a listening TCP socket
// accepts the connections meant for a sidecar. An unbound socket is bound
// first to a port the kernel chooses (what listen would do), so that port
// is judged too; a reserved port is refused however the socket got it (a
// kernel-chosen port, a bind that raced its check).
func netListen(t *trap) {
	sock, err := t.getFD(int32(t.arg(0)))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	defer unix.Close(sock)
	backlog := int(int32(t.arg(1)))
	typ, err := unix.GetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_TYPE)
	if err != nil {
		t.failErr(err) // ENOTSOCK
		return
	}
	local, err := unix.Getsockname(sock)
	if err != nil {
		t.failErr(err)
		return
	}
	var any unix.Sockaddr
	switch local.(type) {
	case *unix.SockaddrInet4:
		any = &unix.SockaddrInet4{}
	case *unix.SockaddrInet6:
		any = &unix.SockaddrInet6{}
	}
	if any != nil && typ == unix.SOCK_STREAM {
		port := localPort(local)
		if port == 0 {
			if err := unix.Bind(sock, any); err != nil {
				t.failErr(err)
				return
			}
			if local, err = unix.Getsockname(sock); err != nil {
				t.failErr(err)
				return
			}
			port = localPort(local)
		}
		if t.pr.policy.reserved(uint16(port)) {
			t.deny(unix.EACCES, lease.BoundaryNet, lease.ReasonNotAllowed,
				fmt.Sprintf("listen on port %d: it is the sidecar's or a service's the agent is pointed at (whoever listens there is trusted)", port), nil)
			return
		}
	}
	t.replyErr(unix.Listen(sock, backlog))
}

func localPort(sa unix.Sockaddr) int {
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return a.Port
	case *unix.SockaddrInet6:
		return a.Port
	}
	return 0
}

func familyName(f int) string {
	switch f {
	case unix.AF_UNIX:
		return "AF_UNIX"
	case unix.AF_INET:
		return "AF_INET"
	case unix.AF_INET6:
		return "AF_INET6"
	case unix.AF_NETLINK:
		return "AF_NETLINK"
	case unix.AF_PACKET:
		return "AF_PACKET"
	case unix.AF_VSOCK:
		return "AF_VSOCK"
	case unix.AF_UNSPEC:
		return "AF_UNSPEC"
	}
	return "family " + strconv.Itoa(f)
}

func typeName(t int) string {
	switch t & sockTypeMask {
	case unix.SOCK_STREAM:
		return "SOCK_STREAM"
	case unix.SOCK_DGRAM:
		return "SOCK_DGRAM"
	case unix.SOCK_RAW:
		return "SOCK_RAW"
	case unix.SOCK_SEQPACKET:
		return "SOCK_SEQPACKET"
	}
	return "type " + strconv.Itoa(t&sockTypeMask)
}
