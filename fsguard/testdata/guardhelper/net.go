package main

// Network probes for fsguard's network tests (net_test.go): each makes the
// system calls itself so that the guard, not a library, decides.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// netModes are the network subcommands; main dispatches to them.
var netModes = map[string]func(args []string){
	"tfo":         tfo,         // tfo ADDR sendto|sendmsg: MSG_FASTOPEN on a fresh TCP socket
	"tfoconnect":  tfoConnect,  // tfoconnect: setsockopt(TCP_FASTOPEN_CONNECT)
	"rawconnect":  rawConnect,  // rawconnect ADDR block|nonblock
	"unixconnect": unixConnect, // unixconnect PATH (@name: abstract)
	"unixrace":    unixRace,    // unixrace PATH N
	"connectrace": connectRace, // connectrace ALLOWED-PORT FORBIDDEN-PORT N
	"capturerace": captureRace, // capturerace ADDR:PORT ADDR:PORT N (IPv4): the address flips under the call
	"connectsend": connectSend, // connectsend NETWORK ADDR: connect, write "hello\n"
	"peername":    peerName,    // peername NETWORK ADDR: connect, print getpeername's answer (and with a short buffer)
	"udp":         udpSend,     // udp ADDR
	"udpconnect":  udpConnect,  // udpconnect ADDR: connect, send, read an answer (1 s)
	"udpbind":     udpBind,     // udpbind PORT
	"resolve":     resolve,     // resolve NAMESERVER NAME: Go's own resolver over UDP to NAMESERVER
	"resolveloop": resolveLoop, // resolveloop udp|tcp NAMESERVER NAME N: ns for N lookups
	"resolvemany": resolveMany, // resolvemany NAME N: NAME asked of N name servers 10.9.x.y:53 in turn
	"socket":      socketMode,  // socket DOMAIN TYPE PROTO [pair]
	"bindunix":    bindUnix,    // bindunix PATH
	"bindtcp":     bindTCP,     // bindtcp
	"connectloop": connectLoop, // connectloop ADDR N: ns for N blocking connects
	"connectsig":  connectSig,  // connectsig ADDR N: N blocking connects under a hail of signals
}

func sockaddr(s string) unix.Sockaddr {
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		fmt.Println("bad address:", err)
		os.Exit(2)
	}
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

func family(sa unix.Sockaddr) int {
	if _, ok := sa.(*unix.SockaddrInet4); ok {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func tcpSocket(sa unix.Sockaddr, flags int) int {
	fd, err := unix.Socket(family(sa), unix.SOCK_STREAM|unix.SOCK_CLOEXEC|flags, 0)
	if err != nil {
		fmt.Println("socket:", res(err))
		os.Exit(1)
	}
	return fd
}

func tfo(args []string) {
	sa := sockaddr(args[0])
	fd := tcpSocket(sa, 0)
	var err error
	switch args[1] {
	case "sendto":
		err = unix.Sendto(fd, []byte("hello"), unix.MSG_FASTOPEN, sa)
	case "sendmsg":
		_, err = unix.SendmsgN(fd, []byte("hello"), nil, sa, unix.MSG_FASTOPEN|unix.MSG_NOSIGNAL)
	}
	fmt.Println(res(err))
}

func tfoConnect(args []string) {
	fd := tcpSocket(&unix.SockaddrInet4{}, 0)
	fmt.Println(res(unix.SetsockoptInt(fd, unix.IPPROTO_TCP, unix.TCP_FASTOPEN_CONNECT, 1)))
}

func rawConnect(args []string) {
	sa := sockaddr(args[0])
	if args[1] == "block" {
		fd := tcpSocket(sa, 0)
		fmt.Println(res(unix.Connect(fd, sa)))
		return
	}
	fd := tcpSocket(sa, unix.SOCK_NONBLOCK)
	err := unix.Connect(fd, sa)
	if err == unix.EINPROGRESS {
		pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLOUT}}
		if n, perr := unix.Poll(pfd, 5000); perr != nil || n == 0 {
			fmt.Println("poll:", n, perr)
			return
		}
		soerr, gerr := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_ERROR)
		err = gerr
		if gerr == nil && soerr != 0 {
			err = syscall.Errno(soerr)
		}
	}
	fmt.Println(res(err))
}

func unixConnect(args []string) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Connect(fd, &unix.SockaddrUnix{Name: args[0]})
	}
	fmt.Println(res(err))
}

// unixRace connects to PATH N times (the test swaps what PATH names) and
// prints how the connects ended.
func unixRace(args []string) {
	n, _ := strconv.Atoi(args[1])
	counts := map[string]int{}
	for range n {
		fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			fmt.Println("socket:", res(err))
			os.Exit(1)
		}
		counts[res(unix.Connect(fd, &unix.SockaddrUnix{Name: args[0]}))]++
		unix.Close(fd)
	}
	fmt.Println(counts)
}

// connectRace connects N times to 127.0.0.1 with a sockaddr that another
// thread keeps rewriting between the allowed and the forbidden port.
func connectRace(args []string) {
	allowed, _ := strconv.Atoi(args[0])
	forbidden, _ := strconv.Atoi(args[1])
	n, _ := strconv.Atoi(args[2])
	word := func(port int) uint32 { // sin_family and sin_port, little endian
		return uint32(unix.AF_INET) | uint32(port>>8)<<16 | uint32(port&0xff)<<24
	}
	var sa [4]uint32 // struct sockaddr_in, 16 bytes
	sa[0] = word(allowed)
	sa[1] = 0x0100007f // 127.0.0.1
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		for i := 0; !stop.Load(); i++ {
			if i%2 == 0 {
				atomic.StoreUint32(&sa[0], word(forbidden))
			} else {
				atomic.StoreUint32(&sa[0], word(allowed))
			}
		}
	}()
	counts := rawConnects(n, &sa)
	stop.Store(true)
	<-done
	fmt.Println(counts)
}

func udpSend(args []string) {
	sa := sockaddr(args[0])
	fd, err := unix.Socket(family(sa), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println(res(err))
		return
	}
	fmt.Println(res(unix.Sendto(fd, []byte("leak"), 0, sa)))
}

func peerName(args []string) {
	c, err := net.Dial(args[0], args[1])
	if err != nil {
		fmt.Println(res(err))
		return
	}
	f, err := c.(*net.TCPConn).File()
	if err != nil {
		fmt.Println("file:", err)
		return
	}
	sa, err := unix.Getpeername(int(f.Fd()))
	if err != nil {
		fmt.Println("getpeername:", res(err))
		return
	}
	var out string
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		out = netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)).String()
	case *unix.SockaddrInet6:
		out = netip.AddrPortFrom(netip.AddrFrom16(a.Addr), uint16(a.Port)).String()
	}
	// A buffer shorter than the address: the kernel's rule is to cut it
	// and say how long it is.
	var buf [4]byte
	n := uint32(len(buf))
	_, _, e := unix.Syscall(unix.SYS_GETPEERNAME, f.Fd(), uintptr(unsafe.Pointer(&buf[0])), uintptr(unsafe.Pointer(&n)))
	fmt.Printf("%s %d %x %v\n", out, n, buf, e)
}

func udpConnect(args []string) {
	sa := sockaddr(args[0])
	fd, err := unix.Socket(family(sa), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println(res(err))
		return
	}
	if err := unix.Connect(fd, sa); err != nil {
		fmt.Println("connect:", res(err))
		return
	}
	if _, err := unix.Write(fd, []byte("leak")); err != nil {
		fmt.Println("write:", res(err))
		return
	}
	tv := unix.NsecToTimeval(int64(time.Second))
	unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
	_, err = unix.Read(fd, make([]byte, 64))
	fmt.Println("read:", res(err))
}

func udpBind(args []string) {
	port, _ := strconv.Atoi(args[0])
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Bind(fd, &unix.SockaddrInet4{Port: port})
	}
	fmt.Println(res(err))
}

// resolveLoop looks NAME up N times with Go's resolver asking NAMESERVER
// over NETWORK alone, and prints the nanoseconds the loop took.
func resolveLoop(args []string) {
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, args[0], args[1])
	}}
	n, _ := strconv.Atoi(args[3])
	start := time.Now()
	for range n {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		_, err := r.LookupHost(ctx, args[2])
		cancel()
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
	}
	fmt.Println(time.Since(start).Nanoseconds())
}

// resolveMany asks N different name server addresses for NAME over UDP,
// one after another, and prints how many answered.
func resolveMany(args []string) {
	n, _ := strconv.Atoi(args[1])
	answered := 0
	for i := range n {
		server := fmt.Sprintf("10.9.%d.%d:53", i/250, i%250+1)
		r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "udp", server)
		}}
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		if _, err := r.LookupHost(ctx, args[0]); err == nil {
			answered++
		}
		cancel()
	}
	fmt.Println(answered)
}

// resolve looks NAME up with Go's own resolver (UDP first, as static
// binaries do) asking NAMESERVER, and prints the addresses or the error.
func resolve(args []string) {
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, network, args[0])
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	addrs, err := r.LookupHost(ctx, args[1])
	if err != nil {
		var de *net.DNSError
		if errors.As(err, &de) && de.IsNotFound {
			fmt.Println("NXDOMAIN")
			return
		}
		fmt.Println("error:", err)
		return
	}
	fmt.Println(strings.Join(addrs, ","))
}

func socketMode(args []string) {
	var v [3]int
	for i := range v {
		v[i], _ = strconv.Atoi(args[i])
	}
	var err error
	if len(args) > 3 && args[3] == "pair" {
		_, err = unix.Socketpair(v[0], v[1], v[2])
	} else {
		var fd int
		fd, err = unix.Socket(v[0], v[1], v[2])
		if err == nil {
			unix.Close(fd)
		}
	}
	fmt.Println(res(err))
}

func bindUnix(args []string) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Bind(fd, &unix.SockaddrUnix{Name: args[0]})
	}
	fmt.Println(res(err))
}

func bindTCP([]string) {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}})
	}
	fmt.Println(res(err))
}

func connectLoop(args []string) {
	sa := sockaddr(args[0])
	n, _ := strconv.Atoi(args[1])
	start := time.Now()
	for range n {
		fd := tcpSocket(sa, 0)
		if err := unix.Connect(fd, sa); err != nil {
			fmt.Println(res(err))
			os.Exit(1)
		}
		unix.Close(fd)
	}
	fmt.Println(time.Since(start).Nanoseconds())
}

// connectSig connects N times on a thread another goroutine keeps
// signalling (a handler is installed, SA_RESTART): every connect must
// succeed once, never EISCONN from a restarted call.
func connectSig(args []string) {
	sa := sockaddr(args[0])
	n, _ := strconv.Atoi(args[1])
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	runtime.LockOSThread()
	tid := unix.Gettid()
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for !stop.Load() {
			unix.Tgkill(os.Getpid(), tid, syscall.SIGUSR1)
			select {
			case <-ch:
			default:
			}
		}
	}()
	counts := map[string]int{}
	for range n {
		fd := tcpSocket(sa, 0)
		counts[res(unix.Connect(fd, sa))]++
		unix.Close(fd)
	}
	stop.Store(true)
	<-done
	fmt.Println(counts)
}

// connectSend connects (Go's non-blocking connect) and writes a line.
func connectSend(args []string) {
	c, err := net.DialTimeout(args[0], args[1], 5*time.Second)
	if err == nil {
		_, err = c.Write([]byte("hello\n"))
		c.Close()
	}
	fmt.Println(res(err))
}

// captureRace connects N times to an address a second thread flips
// between two whole IPv4 socket addresses under the call.
func captureRace(args []string) {
	word := func(s string) (uint32, uint32) { // family+port, address, little endian
		ap := netip.MustParseAddrPort(s)
		a := ap.Addr().As4()
		return uint32(unix.AF_INET) | uint32(ap.Port()>>8)<<16 | uint32(ap.Port()&0xff)<<24,
			uint32(a[0]) | uint32(a[1])<<8 | uint32(a[2])<<16 | uint32(a[3])<<24
	}
	p1, a1 := word(args[0])
	p2, a2 := word(args[1])
	n, _ := strconv.Atoi(args[2])
	var sa [4]uint32 // struct sockaddr_in, 16 bytes
	sa[0], sa[1] = p1, a1
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		runtime.LockOSThread()
		for i := 0; !stop.Load(); i++ {
			if i%2 == 0 {
				atomic.StoreUint32(&sa[0], p2)
				atomic.StoreUint32(&sa[1], a2)
			} else {
				atomic.StoreUint32(&sa[0], p1)
				atomic.StoreUint32(&sa[1], a1)
			}
		}
	}()
	counts := rawConnects(n, &sa)
	stop.Store(true)
	<-done
	fmt.Println(counts)
}

// rawConnects connects n new TCP sockets to the sockaddr_in at sa, passed
// to the kernel as it is at each call (another goroutine may be flipping
// it), and counts the results.
func rawConnects(n int, sa *[4]uint32) map[string]int {
	counts := map[string]int{}
	for range n {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			fmt.Println("socket:", res(err))
			os.Exit(1)
		}
		_, _, errno := unix.Syscall(unix.SYS_CONNECT, uintptr(fd), uintptr(unsafe.Pointer(&sa[0])), 16)
		var err2 error
		if errno != 0 {
			err2 = errno
		}
		counts[res(err2)]++
		unix.Close(fd)
	}
	return counts
}
