//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/net/dns/dnsmessage"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
	"golang.org/x/sys/unix"
)

// The sealed network: UDP for the agent's resolver, with nothing leaving.
//
// Resolvers that ask over UDP only (Go's own, musl's) need a datagram
// socket, and a datagram socket in the supervisor's network namespace
// sends to any address with sendto/sendmsg, whose address the filter
// cannot read. So, with transparent capture on, the agent's UDP socket()
// is answered with a socket made in a network namespace of its own: one
// helper process, started on the first such call, unshares a user and a
// network namespace, brings its loopback up with every address local
// (`ip route add local 0.0.0.0/0 dev lo`, and ::/0), and makes sockets
// there on request. Whatever the agent sends from such a socket arrives
// in that namespace and goes nowhere else: to port 53 of any address it
// reaches the supervisor's DNS relay (a socket the helper bound first),
// which asks the egress proxy over captured TCP (CapturePreamble to the
// address the agent asked) and answers from the address asked; to any
// other port it is refused (ICMP port unreachable, inside the namespace).
// The socket's namespace is fixed when it is made, so neither connect,
// bind, sendto, setsockopt nor setns by the agent moves it out.
//
// Where no user namespace can be made (a container runtime's default
// seccomp profile, an AppArmor rule against unprivileged namespaces), UDP
// stays refused at socket() as before, and the refusal says why.

// sealedEnv marks the re-executed binary as the sealed network's helper;
// its value is the number of the inherited socket.
const sealedEnv = "_FENCELINE_FSGUARD_SEALEDNET"

// sealedStartTimeout bounds starting the helper and setting up its
// namespace.
const sealedStartTimeout = 10 * time.Second

// sealedBatch is how many sockets the helper makes per request.
const sealedBatch = 8

// maxDNSRelays bounds the queries relayed at once; more are dropped (the
// agent's resolver asks again).
const maxDNSRelays = 16

// udpDNSMax is the largest answer sent over UDP without EDNS (RFC 1035);
// a longer one is truncated, and the resolver asks again over TCP, which
// is captured.
const udpDNSMax = 512

// sealedNet is a Process's sealed network, started on first use.
type sealedNet struct {
	pr   *Process
	once sync.Once
	err  error // why the network could not be made (sticky)

	mu       sync.Mutex    // one request at a time on sock, and pool
	pool     map[int][]int // unused sockets made in the namespace, by family
	sock     int           // the supervisor's end of the helper's socket
	cmd      *exec.Cmd
	cmdStart uint64        // cmd's start time (see registerDirect)
	ns       atomic.Uint64 // inode of the namespace: sockets made there are the agent's sealed ones

	dns    []net.PacketConn
	connMu sync.Mutex
	idle   []idleConn // connections to the proxy kept for the next query, oldest first
	relays sync.WaitGroup
	ctx    context.Context
	cancel context.CancelFunc
}

// udpSocket makes a UDP socket of family (AF_INET or AF_INET6) in the
// sealed network; the caller owns it.
func (s *sealedNet) udpSocket(family int) (int, error) {
	s.once.Do(func() { s.err = s.start() })
	if s.err != nil {
		return -1, s.err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.pool[family]) == 0 {
		if err := s.refill(family); err != nil {
			return -1, err
		}
	}
	fds := s.pool[family]
	fd := fds[len(fds)-1]
	s.pool[family] = fds[:len(fds)-1]
	// Checked again as it leaves the pool: only a UDP socket of the
	// sealed network may ever be handed to the agent.
	if !s.sealedUDP(fd, family) {
		s.pr.policy.logger().Error("fenceline guard: a pooled sealed socket is no longer one; refusing the agent's socket()", "fd", fd)
		return -1, errors.New("sealed network: internal error: a pooled socket changed")
	}
	return fd, nil
}

// sealedUDP reports whether fd is a UDP socket of family made in the
// sealed network.
func (s *sealedNet) sealedUDP(fd, family int) bool {
	typ, terr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
	dom, derr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DOMAIN)
	return terr == nil && derr == nil && typ == unix.SOCK_DGRAM && dom == family && s.owns(fd)
}

// refill asks the helper for sealedBatch sockets of family (one round
// trip: resolvers make two sockets per lookup) and checks each: what goes
// to the agent must be what was asked for, whatever the helper sent.
func (s *sealedNet) refill(family int) error {
	if err := sendmsg(s.sock, []byte(strconv.Itoa(family))); err != nil {
		return fmt.Errorf("sealed network helper: %w", err)
	}
	fds, err := recvFDs(s.sock, sealedBatch)
	if err != nil {
		return err
	}
	for _, fd := range fds {
		if !s.sealedUDP(fd, family) {
			closeAll(fds)
			return errors.New("sealed network helper: its answer is not a UDP socket of the sealed network")
		}
	}
	if s.pool == nil {
		s.pool = map[int][]int{}
	}
	s.pool[family] = fds
	return nil
}

// owns reports whether sock was made in the sealed network.
func (s *sealedNet) owns(sock int) bool {
	if s == nil || s.ns.Load() == 0 {
		return false
	}
	ino, err := socketNetns(sock)
	return err == nil && ino == s.ns.Load()
}

// socketNetns is the inode of the network namespace sock lives in. sock
// may be any descriptor the agent passed (connect): only a socket is
// asked, as another file's driver may read the request as its own.
func socketNetns(sock int) (uint64, error) {
	var st unix.Stat_t
	if err := unix.Fstat(sock, &st); err != nil {
		return 0, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFSOCK {
		return 0, unix.ENOTSOCK
	}
	nsfd, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(sock), unix.SIOCGSKNS, 0)
	if errno != 0 {
		return 0, fmt.Errorf("SIOCGSKNS: %w", errno)
	}
	defer unix.Close(int(nsfd))
	if err := unix.Fstat(int(nsfd), &st); err != nil {
		return 0, err
	}
	return st.Ino, nil
}

// start runs the helper and the DNS relay.
func (s *sealedNet) start() error {
	if !s.pr.policy.Capture.IsValid() {
		return errors.New("no egress proxy to answer its DNS (transparent capture is off)")
	}
	if err := s.startHelper(); err != nil {
		return err
	}
	if err := s.openDNS(); err != nil {
		s.stopHelper()
		return err
	}
	for _, c := range s.dns {
		s.relays.Add(1)
		go s.serveDNS(c)
	}
	s.pr.policy.logger().Info("sealed network for the agent's UDP started: DNS is answered by the egress proxy, nothing else leaves", "helper_pid", s.cmd.Process.Pid)
	return nil
}

// startHelper starts the helper in a user and network namespace of its
// own, with a setup socket to it (s.sock).
func (s *sealedNet) startHelper() error {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("sealed network: %w", err)
	}
	child := os.NewFile(uintptr(fds[1]), "fsguard-sealednet")
	defer child.Close()
	// The helper's user namespace maps no uid: the agent, of the
	// supervisor's uid, owns it and can setns into it (its sealed
	// socket's SIOCGSKNS and NS_GET_USERNS give the descriptors), where it
	// holds every capability. Had the namespace mapped that uid, those
	// capabilities (CAP_DAC_OVERRIDE, CAP_FOWNER...) would reach every
	// file of the uid, a mode 000 file outside the lease read
	// (TestSealedUDPEscape); with no mapping they reach the sealed
	// network alone, as in a namespace the agent unshares itself. The
	// helper keeps what it needs across exec as ambient capabilities.
	cmd := &exec.Cmd{
		Path:       "/proc/self/exe",
		Args:       []string{"fenceline-sealednet"},
		Env:        []string{sealedEnv + "=3"},
		ExtraFiles: []*os.File{child},
		Stderr:     os.Stderr,
		SysProcAttr: &syscall.SysProcAttr{
			Cloneflags:  unix.CLONE_NEWUSER | unix.CLONE_NEWNET,
			AmbientCaps: []uintptr{unix.CAP_NET_ADMIN, unix.CAP_NET_BIND_SERVICE},
			Setpgid:     true,
		},
	}
	if err := cmd.Start(); err != nil {
		unix.Close(fds[0])
		return fmt.Errorf("cannot make a user and network namespace for the agent's UDP (%w); UDP stays refused", err)
	}
	pi, err := statProc(cmd.Process.Pid) // not reaped: the number is the helper's
	if err != nil {
		unix.Close(fds[0])
		cmd.Process.Kill()
		cmd.Wait()
		return fmt.Errorf("sealed network helper: read its start time: %w", err)
	}
	registerDirect(cmd.Process.Pid, pi.start)
	s.sock, s.cmd, s.cmdStart = fds[0], cmd, pi.start
	return nil
}

// openDNS hears the helper's setup and takes the DNS sockets it sends (in
// the sealed namespace, whose inode it records). The caller stops the
// helper when this fails.
func (s *sealedNet) openDNS() error {
	// Every answer of the helper is bounded: a helper stopped or killed
	// (on a kernel without Landlock's signal scope the agent can signal
	// it) fails the agent's socket() instead of holding the supervisor.
	tv := unix.NsecToTimeval(sealedStartTimeout.Nanoseconds())
	unix.SetsockoptTimeval(s.sock, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	unix.SetsockoptTimeval(s.sock, unix.SOL_SOCKET, unix.SO_SNDTIMEO, &tv)
	buf := make([]byte, 512)
	oob := make([]byte, unix.CmsgSpace(2*4))
	n, oobn, err := recvmsg(s.sock, buf, oob)
	if err != nil {
		return fmt.Errorf("sealed network helper: %w", err)
	}
	if msg := string(buf[:n]); msg != msgOK {
		if msg == "" {
			msg = "exited during setup"
		}
		return fmt.Errorf("sealed network helper: %s; UDP stays refused", msg)
	}
	resolvers, err := parseRights(oob[:oobn])
	if err != nil || len(resolvers) == 0 {
		return fmt.Errorf("sealed network helper sent no DNS socket: %v", err)
	}
	ns, err := socketNetns(resolvers[0])
	if err != nil {
		closeAll(resolvers)
		return fmt.Errorf("sealed network: %w", err)
	}
	s.ns.Store(ns)
	s.ctx, s.cancel = context.WithCancel(context.Background())
	for i, fd := range resolvers {
		f := os.NewFile(uintptr(fd), "fsguard-sealed-dns")
		c, err := net.FilePacketConn(f)
		f.Close()
		if err != nil {
			closeAll(resolvers[i+1:])
			s.closeDNS()
			return fmt.Errorf("sealed network DNS socket: %w", err)
		}
		s.dns = append(s.dns, c)
	}
	return nil
}

// stop ends the relay and the helper; sockets the agent holds keep their
// (now unreachable) namespace until they are closed.
func (s *sealedNet) stop() {
	if s == nil {
		return
	}
	s.once.Do(func() { s.err = errors.New("the attempt ended") })
	if s.cancel != nil {
		s.cancel()
	}
	s.closeDNS()
	s.relays.Wait()
	s.connMu.Lock()
	for _, ic := range s.idle {
		ic.conn.Close()
	}
	s.idle = nil
	s.connMu.Unlock()
	s.stopHelper()
	s.mu.Lock()
	for _, fds := range s.pool {
		closeAll(fds)
	}
	s.pool = nil
	s.mu.Unlock()
}

func (s *sealedNet) closeDNS() {
	for _, c := range s.dns {
		c.Close()
	}
}

func (s *sealedNet) stopHelper() {
	if s.cmd == nil {
		return
	}
	unix.Close(s.sock) // the helper exits on EOF
	s.cmd.Process.Kill()
	s.cmd.Wait()
	unregisterDirect(s.cmd.Process.Pid, s.cmdStart)
	s.cmd = nil
}

// serveDNS answers the queries that reach port 53 of any address in the
// sealed network, one relay each (at most maxDNSRelays at once).
func (s *sealedNet) serveDNS(c net.PacketConn) {
	defer s.relays.Done()
	read, write := dnsPacketIO(c)
	sem := make(chan struct{}, maxDNSRelays)
	buf := make([]byte, 65536)
	for {
		n, dst, from, err := read(buf)
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				s.pr.policy.logger().Warn("fenceline guard: sealed DNS relay stopped", "err", err)
			}
			return
		}
		if !dst.IsValid() {
			continue
		}
		select {
		case sem <- struct{}{}:
		default:
			continue // busy: the resolver asks again
		}
		q := append([]byte(nil), buf[:n]...)
		s.relays.Add(1)
		go func() {
			defer s.relays.Done()
			defer func() { <-sem }()
			ans, err := s.relayDNS(q, netip.AddrPortFrom(dst, 53))
			if err != nil {
				s.pr.policy.logger().Debug("fenceline guard: sealed DNS query not answered", "dst", dst.String(), "err", err)
				return
			}
			write(ans, dst, from)
		}()
	}
}

// relayDNS asks the egress proxy over captured TCP, as if the agent had
// asked dst over TCP, and returns the answer fit for UDP. Connections are
// kept for the next query to the same address (the proxy answers many
// on one); one the proxy closed meanwhile is replaced once.
func (s *sealedNet) relayDNS(q []byte, dst netip.AddrPort) ([]byte, error) {
	ctx, cancel := context.WithTimeout(s.ctx, captureTimeout)
	defer cancel()
	for retried := false; ; retried = true {
		conn, reused, err := s.dnsConn(ctx, dst)
		if err != nil {
			return nil, err
		}
		ans, err := exchangeDNS(ctx, conn, q)
		if err != nil {
			conn.Close()
			if reused && !retried && ctx.Err() == nil {
				continue
			}
			return nil, err
		}
		s.putDNSConn(dst, conn)
		if len(ans) > udpDNSMax {
			return truncated(ans)
		}
		return ans, nil
	}
}

// maxIdleDNSConns bounds the connections kept in all: the agent picks
// the address it asks (any address reaches the relay), so a bound per
// address would be none.
const maxIdleDNSConns = 8

// idleConn is a connection to the proxy announced for dst.
type idleConn struct {
	dst  netip.AddrPort
	conn net.Conn
}

// dnsConn is an idle connection to the proxy for dst, or a new one
// announced with the capture preamble.
func (s *sealedNet) dnsConn(ctx context.Context, dst netip.AddrPort) (conn net.Conn, reused bool, err error) {
	s.connMu.Lock()
	for i, ic := range s.idle {
		if ic.dst == dst {
			conn = ic.conn
			s.idle = slices.Delete(s.idle, i, i+1)
			break
		}
	}
	s.connMu.Unlock()
	if conn != nil {
		return conn, true, nil
	}
	var d net.Dialer
	if conn, err = d.DialContext(ctx, "tcp", s.pr.policy.Capture.String()); err != nil {
		return nil, false, err
	}
	conn = countDNSConn(conn)
	deadline, _ := ctx.Deadline()
	conn.SetWriteDeadline(deadline)
	if _, err := conn.Write(CapturePreamble(dst)); err != nil {
		conn.Close()
		return nil, false, err
	}
	return conn, false, nil
}

// dnsConnsOpen counts the relays' connections to the proxy in this
// process, and dnsConnsHigh is the most it has counted at once (what
// TestSealedUDPFlood bounds: the proxy itself sees a connection end only
// when it next reads, later).
var dnsConnsOpen, dnsConnsHigh atomic.Int64

// countedConn is a relay's connection to the proxy, counted while open.
type countedConn struct {
	net.Conn
	once sync.Once
}

func countDNSConn(c net.Conn) net.Conn {
	n := dnsConnsOpen.Add(1)
	for {
		high := dnsConnsHigh.Load()
		if n <= high || dnsConnsHigh.CompareAndSwap(high, n) {
			break
		}
	}
	return &countedConn{Conn: c}
}

func (c *countedConn) Close() error {
	c.once.Do(func() { dnsConnsOpen.Add(-1) })
	return c.Conn.Close()
}

// putDNSConn keeps conn for the next query to dst; past the bound the
// oldest kept connection is closed.
func (s *sealedNet) putDNSConn(dst netip.AddrPort, conn net.Conn) {
	s.connMu.Lock()
	defer s.connMu.Unlock()
	if s.ctx.Err() != nil {
		conn.Close()
		return
	}
	if len(s.idle) >= maxIdleDNSConns {
		s.idle[0].conn.Close()
		s.idle = s.idle[1:]
	}
	s.idle = append(s.idle, idleConn{dst, conn})
}

// exchangeDNS sends q as DNS over TCP (RFC 7766) and reads the answer.
// The attempt's end (stop cancels ctx) cuts it short: a query the proxy
// had not answered held settling for captureTimeout
// (TestSealedUDPSettlesWithQueriesPending).
func exchangeDNS(ctx context.Context, conn net.Conn, q []byte) ([]byte, error) {
	deadline, _ := ctx.Deadline()
	conn.SetDeadline(deadline)
	defer context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })()
	if _, err := conn.Write(append([]byte{byte(len(q) >> 8), byte(len(q))}, q...)); err != nil {
		return nil, err
	}
	var n [2]byte
	if _, err := io.ReadFull(conn, n[:]); err != nil {
		return nil, err
	}
	ans := make([]byte, binary.BigEndian.Uint16(n[:]))
	if _, err := io.ReadFull(conn, ans); err != nil {
		return nil, err
	}
	return ans, nil
}

// truncated is ans cut to its header and question with the TC bit set.
func truncated(ans []byte) ([]byte, error) {
	var p dnsmessage.Parser
	h, err := p.Start(ans)
	if err != nil {
		return nil, err
	}
	qs, err := p.AllQuestions()
	if err != nil {
		return nil, err
	}
	h.Truncated = true
	b := dnsmessage.NewBuilder(nil, h)
	if err := b.StartQuestions(); err != nil {
		return nil, err
	}
	for _, q := range qs {
		if err := b.Question(q); err != nil {
			return nil, err
		}
	}
	return b.Finish()
}

// dnsPacketIO reads datagrams with the address they were sent to, and
// answers from that address (resolvers drop an answer from another).
func dnsPacketIO(c net.PacketConn) (read func([]byte) (int, netip.Addr, net.Addr, error), write func([]byte, netip.Addr, net.Addr)) {
	if la, ok := c.LocalAddr().(*net.UDPAddr); ok && la.IP.To4() == nil {
		pc := ipv6.NewPacketConn(c)
		pc.SetControlMessage(ipv6.FlagDst, true)
		return func(b []byte) (int, netip.Addr, net.Addr, error) {
				n, cm, from, err := pc.ReadFrom(b)
				if err != nil || cm == nil {
					return n, netip.Addr{}, from, err
				}
				a, _ := netip.AddrFromSlice(cm.Dst)
				return n, a, from, nil
			}, func(b []byte, src netip.Addr, to net.Addr) {
				pc.WriteTo(b, &ipv6.ControlMessage{Src: src.AsSlice()}, to)
			}
	}
	pc := ipv4.NewPacketConn(c)
	pc.SetControlMessage(ipv4.FlagDst, true)
	return func(b []byte) (int, netip.Addr, net.Addr, error) {
			n, cm, from, err := pc.ReadFrom(b)
			if err != nil || cm == nil {
				return n, netip.Addr{}, from, err
			}
			a, _ := netip.AddrFromSlice(cm.Dst.To4())
			return n, a, from, nil
		}, func(b []byte, src netip.Addr, to net.Addr) {
			pc.WriteTo(b, &ipv4.ControlMessage{Src: src.AsSlice()}, to)
		}
}

// recvFDs receives one answer of the helper: up to max descriptors, or
// its error.
func recvFDs(sock, max int) ([]int, error) {
	buf := make([]byte, 256)
	oob := make([]byte, unix.CmsgSpace(4*max))
	n, oobn, err := recvmsg(sock, buf, oob)
	if err != nil {
		return nil, fmt.Errorf("sealed network helper: %w", err)
	}
	fds, err := parseRights(oob[:oobn])
	if err != nil || len(fds) == 0 {
		closeAll(fds)
		if n > 0 {
			return nil, fmt.Errorf("sealed network helper: %s", buf[:n])
		}
		return nil, errors.New("sealed network helper: no socket in its answer (it exited?)")
	}
	return fds, nil
}

// recvmsg and sendmsg talk to the helper over its socket, whose
// timeouts make a signal to the waiting thread end the call with EINTR
// whatever SA_RESTART says (signal(7)); the supervisor gets a SIGCHLD for
// each orphan of the attempt it reaps. Nothing was taken or sent then, so
// the call is made again: a socket() failed for it, and an answer left
// unread put every later request one answer behind (TestSealedUDPSignals).
func recvmsg(sock int, buf, oob []byte) (n, oobn int, err error) {
	for {
		n, oobn, _, _, err = unix.Recvmsg(sock, buf, oob, unix.MSG_CMSG_CLOEXEC)
		if !errors.Is(err, unix.EINTR) {
			return n, oobn, err
		}
	}
}

func sendmsg(sock int, b []byte) error {
	for {
		if err := unix.Sendmsg(sock, b, nil, nil, 0); !errors.Is(err, unix.EINTR) {
			return err
		}
	}
}

func parseRights(oob []byte) ([]int, error) {
	scms, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, m := range scms {
		fds, err := unix.ParseUnixRights(&m)
		if err != nil {
			closeAll(out)
			return nil, err
		}
		out = append(out, fds...)
	}
	return out, nil
}

func closeAll(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// runSealedNet is the helper: it makes its namespace's loopback answer
// for every address, binds the DNS sockets and sends them, then makes a
// UDP socket for each request until the supervisor hangs up.
func runSealedNet(sock int) int {
	fail := func(format string, args ...any) int {
		unix.Sendmsg(sock, []byte(fmt.Sprintf(format, args...)), nil, nil, 0)
		return 1
	}
	if err := loopbackUp(); err != nil {
		return fail("bring the namespace's loopback up: %v", err)
	}
	if err := localRoute(unix.AF_INET); err != nil {
		return fail("route every IPv4 address to the namespace's loopback: %v", err)
	}
	dns, err := bindDNS(unix.AF_INET)
	if err != nil {
		return fail("DNS socket: %v", err)
	}
	resolvers := []int{dns}
	if localRoute(unix.AF_INET6) == nil { // no IPv6 here: IPv4 alone
		if dns6, err := bindDNS(unix.AF_INET6); err == nil {
			resolvers = append(resolvers, dns6)
		}
	}
	if err := unix.Sendmsg(sock, []byte(msgOK), unix.UnixRights(resolvers...), nil, 0); err != nil {
		return 1
	}
	closeAll(resolvers) // the supervisor serves them; no one else may bind port 53
	buf := make([]byte, 16)
	for {
		n, _, _, _, err := unix.Recvmsg(sock, buf, nil, 0)
		if err != nil || n == 0 {
			return 0
		}
		family, _ := strconv.Atoi(string(buf[:n]))
		if family != unix.AF_INET && family != unix.AF_INET6 {
			unix.Sendmsg(sock, []byte("bad family "+string(buf[:n])), nil, nil, 0)
			continue
		}
		var fds []int
		for range sealedBatch {
			fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
			if err != nil {
				break
			}
			fds = append(fds, fd)
		}
		if len(fds) == 0 {
			unix.Sendmsg(sock, []byte("socket: cannot make a UDP socket"), nil, nil, 0)
			continue
		}
		err = unix.Sendmsg(sock, []byte{0}, unix.UnixRights(fds...), nil, 0)
		closeAll(fds)
		if err != nil {
			return 0
		}
	}
}

// bindDNS binds a UDP socket of family to port 53 of every address.
func bindDNS(family int) (int, error) {
	fd, err := unix.Socket(family, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, unix.IPPROTO_UDP)
	if err != nil {
		return -1, err
	}
	// Free bind: an answer is sent from the address the agent asked,
	// which the local route makes this namespace's own for IPv4 but not
	// for IPv6's source check.
	var sa unix.Sockaddr = &unix.SockaddrInet4{Port: 53}
	err = unix.SetsockoptInt(fd, unix.IPPROTO_IP, unix.IP_FREEBIND, 1)
	if family == unix.AF_INET6 {
		sa = &unix.SockaddrInet6{Port: 53}
		err = errors.Join(unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_V6ONLY, 1),
			unix.SetsockoptInt(fd, unix.IPPROTO_IPV6, unix.IPV6_FREEBIND, 1))
	}
	if err != nil {
		unix.Close(fd)
		return -1, err
	}
	if err := unix.Bind(fd, sa); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("bind port 53: %w", err)
	}
	return fd, nil
}

func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return err
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return err
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	return unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr)
}

// localRoute adds `local 0.0.0.0/0 dev lo` (or ::/0) to the local table
// over rtnetlink: every address of family is this namespace's own.
func localRoute(family int) error {
	lo, err := net.InterfaceByName("lo")
	if err != nil {
		return err
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	rt := unix.RtMsg{Family: uint8(family), Table: unix.RT_TABLE_LOCAL, Protocol: unix.RTPROT_BOOT,
		Scope: unix.RT_SCOPE_HOST, Type: unix.RTN_LOCAL}
	oif := unix.RtAttr{Len: unix.SizeofRtAttr + 4, Type: unix.RTA_OIF}
	size := unix.SizeofNlMsghdr + unix.SizeofRtMsg + int(oif.Len)
	b := make([]byte, size)
	*(*unix.NlMsghdr)(unsafe.Pointer(&b[0])) = unix.NlMsghdr{Len: uint32(size), Type: unix.RTM_NEWROUTE,
		Flags: unix.NLM_F_REQUEST | unix.NLM_F_ACK | unix.NLM_F_CREATE | unix.NLM_F_EXCL, Seq: 1}
	*(*unix.RtMsg)(unsafe.Pointer(&b[unix.SizeofNlMsghdr])) = rt
	off := unix.SizeofNlMsghdr + unix.SizeofRtMsg
	*(*unix.RtAttr)(unsafe.Pointer(&b[off])) = oif
	binary.NativeEndian.PutUint32(b[off+unix.SizeofRtAttr:], uint32(lo.Index))
	if err := unix.Sendto(fd, b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		return err
	}
	resp := make([]byte, 4096)
	n, _, err := unix.Recvfrom(fd, resp, 0)
	if err != nil {
		return err
	}
	msgs, err := syscall.ParseNetlinkMessage(resp[:n])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		if m.Header.Type == unix.NLMSG_ERROR && len(m.Data) >= 4 {
			if e := int32(binary.NativeEndian.Uint32(m.Data)); e != 0 {
				return fmt.Errorf("RTM_NEWROUTE: %w", unix.Errno(-e))
			}
			return nil
		}
	}
	return errors.New("RTM_NEWROUTE: no acknowledgement")
}
