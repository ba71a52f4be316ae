package main

// Listen probes for fsguard's bind tests (bind_test.go): the agent tries
// to take a port someone else (its sidecar) connects to.

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

func init() {
	netModes["listen"] = listenMode         // listen ADDR: bind ADDR, then listen; prints ok:PORT or the step that failed
	netModes["listenauto"] = listenAuto     // listenauto: listen with no bind (the kernel picks a port)
	netModes["bindudp"] = bindUDP           // bindudp ADDR
	netModes["bindabstract"] = bindAbstract // bindabstract NAME|"": an abstract Unix name ("" autobinds)
	netModes["bindrace"] = bindRace         // bindrace PATH PORT N: a Unix bind whose descriptor and address turn into TCP PORT
}

// boundPort is the local port of fd (0 when unbound).
func boundPort(fd int) int {
	sa, err := unix.Getsockname(fd)
	if err != nil {
		return -1
	}
	switch a := sa.(type) {
	case *unix.SockaddrInet4:
		return a.Port
	case *unix.SockaddrInet6:
		return a.Port
	}
	return -1
}

func listenMode(args []string) {
	sa := sockaddr(args[0])
	fd := tcpSocket(sa, 0)
	if err := unix.Bind(fd, sa); err != nil {
		fmt.Println("bind:", res(err))
		return
	}
	if err := unix.Listen(fd, 8); err != nil {
		fmt.Println("listen:", res(err))
		return
	}
	fmt.Printf("ok:%d\n", boundPort(fd))
}

func listenAuto([]string) {
	fd, err := unix.Socket(unix.AF_INET6, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println("socket:", res(err))
		return
	}
	if err := unix.Listen(fd, 8); err != nil {
		fmt.Println("listen:", res(err))
		return
	}
	fmt.Printf("ok:%d\n", boundPort(fd))
}

func bindUDP(args []string) {
	sa := sockaddr(args[0])
	fd, err := unix.Socket(family(sa), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println("socket:", res(err))
		return
	}
	if err := unix.Bind(fd, sa); err != nil {
		fmt.Println("bind:", res(err))
		return
	}
	fmt.Printf("ok:%d\n", boundPort(fd))
}

func bindAbstract(args []string) {
	fd, err := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println("socket:", res(err))
		return
	}
	if args[0] == "" { // autobind: only sun_family
		var fam [2]byte
		*(*uint16)(unsafe.Pointer(&fam[0])) = unix.AF_UNIX
		_, _, errno := unix.Syscall(unix.SYS_BIND, uintptr(fd), uintptr(unsafe.Pointer(&fam[0])), 2)
		if errno != 0 {
			fmt.Println(res(errno))
			return
		}
		fmt.Println("ok")
		return
	}
	fmt.Println(res(unix.Bind(fd, &unix.SockaddrUnix{Name: "@" + args[0]})))
}

// bindRace binds descriptor D to a Unix socket path N times while another
// thread keeps putting a TCP socket on D and rewriting the address to
// 127.0.0.1:PORT: a check of the Unix bind that lets the call continue
// would bind the TCP socket to PORT. It then tries to listen on every TCP
// socket that got PORT and prints how many binds reached PORT and how
// many of those could listen.
var spin int64

func bindRace(args []string) {
	path := args[0]
	port, _ := strconv.Atoi(args[1])
	n, _ := strconv.Atoi(args[2])
	var un unix.RawSockaddrUnix
	un.Family = unix.AF_UNIX
	for i := range len(path) {
		un.Path[i] = int8(path[i])
	}
	var in unix.RawSockaddrInet4
	in.Family = unix.AF_INET
	in.Port = uint16(port>>8) | uint16(port&0xff)<<8
	in.Addr = [4]byte{127, 0, 0, 1}
	var buf [unix.SizeofSockaddrUnix]byte
	unixBytes := (*[unix.SizeofSockaddrUnix]byte)(unsafe.Pointer(&un))[:]
	inBytes := (*[unix.SizeofSockaddrInet4]byte)(unsafe.Pointer(&in))[:]
	var words [len(buf) / 4]uint32
	put := func(b []byte) { // whole words, atomically, so the reader sees one or the other per word
		var tmp [len(buf)]byte
		copy(tmp[:], b)
		for i := range words {
			atomic.StoreUint32(&words[i], *(*uint32)(unsafe.Pointer(&tmp[4*i])))
		}
	}
	put(unixBytes)

	const d = 100 // the raced descriptor number
	fresh := make(chan int)
	swapped := make(chan struct{})
	go func() {
		runtime.LockOSThread()
		for i := 0; ; i++ {
			t, ok := <-fresh
			if !ok {
				return
			}
			for range (i * 7919) % 30000 { // a different moment each round
				atomic.AddInt64(&spin, 1)
			}
			unix.Dup3(t, d, unix.O_CLOEXEC)
			put(inBytes)
			swapped <- struct{}{}
		}
	}()
	var tcps []int
	reached, listened := 0, 0
	for range n {
		u, _ := unix.Socket(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		t, _ := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		put(unixBytes)
		unix.Dup3(u, d, unix.O_CLOEXEC)
		os.Remove(path)
		fresh <- t
		unix.Syscall(unix.SYS_BIND, d, uintptr(unsafe.Pointer(&words[0])), unix.SizeofSockaddrUnix)
		<-swapped
		if boundPort(t) == port {
			reached++
			if unix.Listen(t, 1) == nil && boundPort(t) == port {
				listened++
			}
		}
		unix.Close(u)
		tcps = append(tcps, t)
	}
	close(fresh)
	for _, t := range tcps {
		unix.Close(t)
	}
	fmt.Printf("reached=%d listened=%d\n", reached, listened)
}
