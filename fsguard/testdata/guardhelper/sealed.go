package main

// Attacks on the sealed network (fsguard/sealednet_linux.go) from an
// agent of the supervisor's uid without capabilities: its helper process
// and the namespaces a sealed UDP socket lives in.

import (
	"bytes"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

func init() {
	netModes["nocaps"] = noCaps          // nocaps MODE ARGS...: MODE with no capability left (same uid)
	netModes["sealedescape"] = sealedEsc // sealedescape ENTER FILE HOST:PORT: the helper, then the namespaces
	netModes["insealed"] = inSealed      // insealed HOST:PORT: run inside the sealed namespaces
}

// noCaps drops every capability (bounding set, securebits NOROOT: exec as
// uid 0 grants none) and runs MODE: what an agent of the supervisor's uid
// holds when that uid is not root.
func noCaps(args []string) {
	runtime.LockOSThread()                   // capabilities are per thread: drop them on the one that execs
	const secure = 1<<0 | 1<<1 | 1<<2 | 1<<3 // SECBIT_NOROOT(_LOCKED), SECBIT_NO_SETUID_FIXUP(_LOCKED)
	if err := unix.Prctl(unix.PR_SET_SECUREBITS, secure, 0, 0, 0); err != nil {
		fmt.Println("securebits:", res(err))
		os.Exit(1)
	}
	for c := 0; c <= 63; c++ {
		unix.Prctl(unix.PR_CAPBSET_DROP, uintptr(c), 0, 0, 0)
	}
	unix.Prctl(unix.PR_CAP_AMBIENT, unix.PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		fmt.Println("capset:", res(err))
		os.Exit(1)
	}
	self, _ := os.Executable()
	err := syscall.Exec(self, append([]string{os.Args[0]}, args...), os.Environ())
	fmt.Println("exec:", res(err))
	os.Exit(1)
}

func capEff() string {
	b, _ := os.ReadFile("/proc/self/status")
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "CapEff:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

// sealedHelper is the sealed network helper started by this process's
// supervisor (its parent).
func sealedHelper() int {
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		cmd, _ := os.ReadFile("/proc/" + e.Name() + "/cmdline")
		st, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
		if bytes.HasPrefix(cmd, []byte("fenceline-sealednet\x00")) {
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 1 && f[1] == strconv.Itoa(os.Getppid()) {
				return pid
			}
		}
	}
	return 0
}

func udpSock() int {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		fmt.Println("socket:", res(err))
		os.Exit(1)
	}
	return fd
}

// sealedEsc attacks the helper (signals, ptrace, its memory and
// descriptors, SIGIO on a sealed socket owned by it), then enters the
// sealed namespaces with ENTER (testdata/sealedenter) and runs insealed
// there.
func sealedEsc(args []string) {
	fmt.Println("capeff=" + capEff())
	sock := udpSock()
	helper := sealedHelper()
	if helper == 0 {
		fmt.Println("helper=none")
		os.Exit(1)
	}
	fmt.Println("helper=found")
	fmt.Println("kill=" + res(unix.Kill(helper, unix.SIGKILL)))
	fmt.Println("kill-supervisor=" + res(unix.Kill(os.Getppid(), 0)))
	_, _, e := unix.Syscall6(unix.SYS_PTRACE, unix.PTRACE_SEIZE, uintptr(helper), 0, 0, 0, 0)
	fmt.Println("ptrace=" + res(errnoErr(e)))
	_, err := os.Open(fmt.Sprintf("/proc/%d/mem", helper))
	fmt.Println("mem=" + res(pathErr(err)))
	_, err = os.Open(fmt.Sprintf("/proc/%d/ns/user", helper))
	fmt.Println("nsfile=" + res(pathErr(err)))
	pidfd, err := unix.PidfdOpen(helper, 0)
	if err == nil {
		_, err = unix.PidfdGetfd(pidfd, 3, 0)
	}
	fmt.Println("getfd=" + res(err))
	var lim unix.Rlimit
	unix.Prlimit(helper, unix.RLIMIT_NOFILE, nil, &lim)
	fmt.Println("prlimit=" + res(unix.Prlimit(helper, unix.RLIMIT_NOFILE, &lim, nil))) // the same limit: harmless if allowed

	// SIGIO: the kernel signals a socket's owner when data arrives.
	err = unix.Bind(sock, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}})
	if err == nil {
		_, err = unix.FcntlInt(uintptr(sock), unix.F_SETOWN, helper)
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(sock), unix.F_SETSIG, int(unix.SIGKILL))
	}
	if err == nil {
		_, err = unix.FcntlInt(uintptr(sock), unix.F_SETFL, unix.O_ASYNC)
	}
	if err == nil {
		var la unix.Sockaddr
		if la, err = unix.Getsockname(sock); err == nil {
			err = unix.Sendto(sock, []byte("sigio"), 0, la)
		}
	}
	fmt.Println("sigio=" + res(err))
	// The helper answers for new sockets past the pool: it is alive.
	var fds []int
	for range 20 {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			fmt.Println("after-sigio=" + res(err))
			break
		}
		fds = append(fds, fd)
	}
	if len(fds) == 20 {
		fmt.Println("after-sigio=ok")
	}

	// The namespaces the sealed socket lives in.
	ns, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(sock), unix.SIOCGSKNS, 0)
	fmt.Println("skns=" + res(errnoErr(e)))
	if e != 0 {
		return
	}
	userns, _, e := unix.Syscall(unix.SYS_IOCTL, ns, unix.NS_GET_USERNS, 0)
	fmt.Println("userns=" + res(errnoErr(e)))
	if e != 0 {
		return
	}
	// CAP_NET_ADMIN in the sealed network: the agent is its user
	// namespace's owner.
	fmt.Println("somark=" + res(unix.SetsockoptInt(sock, unix.SOL_SOCKET, unix.SO_MARK, 1)))
	self, _ := os.Executable()
	cmd := exec.Command(args[0], "3", "4", args[1], args[2], self, "insealed", args[2])
	cmd.ExtraFiles = []*os.File{os.NewFile(userns, "userns"), os.NewFile(ns, "netns")}
	out, err := cmd.CombinedOutput()
	os.Stdout.Write(out)
	if err != nil {
		fmt.Println("enter:", err)
	}
}

func errnoErr(e syscall.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func pathErr(err error) error {
	if pe, ok := err.(*os.PathError); ok {
		return pe.Err
	}
	return err
}

// inSealed runs inside the sealed namespaces: a TCP connect to this
// machine's listener, a veth pair whose peer is put in the machine's
// network namespace (pid 1's), a device made inside moved there, a
// mount.
func inSealed(args []string) {
	fmt.Println("insealed-capeff=" + capEff())
	c, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	if err == nil {
		err = unix.Connect(c, sockaddr(args[0]))
	}
	fmt.Println("insealed-tcp=" + res(err))
	ip := func(a ...string) string {
		out, err := exec.Command("ip", a...).CombinedOutput()
		if err != nil {
			return strings.ReplaceAll(strings.TrimSpace(string(out)), "\n", " ")
		}
		return "ok"
	}
	fmt.Println("veth=" + ip("link", "add", "flx0", "type", "veth", "peer", "name", "flx1", "netns", "1"))
	if r := ip("link", "add", "flx2", "type", "veth", "peer", "name", "flx3"); r != "ok" {
		fmt.Println("move=veth inside: " + r)
	} else {
		fmt.Println("move=" + ip("link", "set", "flx2", "netns", "1"))
	}
	runtime.LockOSThread()
	err = unix.Unshare(unix.CLONE_NEWNS)
	if err == nil {
		err = unix.Mount("none", "/tmp", "tmpfs", 0, "")
	}
	fmt.Println("mount=" + res(err))
}

func init() {
	netModes["sealedsockets"] = sealedSockets // sealedsockets N THREADS: N UDP sockets made by THREADS threads at once
	netModes["sealedflood"] = sealedFlood     // sealedflood N: N datagrams of odd sizes to port 53 of N addresses
	netModes["sealeddup"] = sealedDup         // sealeddup ADDR N: connect a descriptor flipped between TCP and sealed UDP
}

// sealedSockets makes N UDP sockets from THREADS threads at once, keeps
// them, checks each is a distinct UDP socket and prints ok.
func sealedSockets(args []string) {
	n, _ := strconv.Atoi(args[0])
	threads, _ := strconv.Atoi(args[1])
	errs := make(chan string, threads)
	fds := make(chan int, n)
	for t := range threads {
		go func() {
			runtime.LockOSThread()
			for i := t; i < n; i += threads {
				fd, err := unix.Socket(unix.AF_INET+(i%2)*(unix.AF_INET6-unix.AF_INET), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
				if err != nil {
					errs <- fmt.Sprintf("socket %d: %s", i, res(err))
					return
				}
				fds <- fd
			}
			errs <- ""
		}()
	}
	for range threads {
		if e := <-errs; e != "" {
			fmt.Println(e)
			return
		}
	}
	close(fds)
	seen := map[int]bool{}
	for fd := range fds {
		typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE)
		fl, _ := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err != nil || typ != unix.SOCK_DGRAM || seen[fd] || fl&unix.O_NONBLOCK == 0 {
			fmt.Println("bad socket", fd, typ, err)
			return
		}
		seen[fd] = true
	}
	fmt.Println(len(seen))
}

// sealedFlood sends N datagrams (sizes 0, 1, 12, 512, 65507 in turn,
// none a DNS query) to port 53 of N addresses without reading answers.
func sealedFlood(args []string) {
	n, _ := strconv.Atoi(args[0])
	fd := udpSock()
	sizes := []int{0, 1, 12, 512, 65507}
	q := bytes.Repeat([]byte{0xff}, 65507)
	for i := range n {
		sa := &unix.SockaddrInet4{Port: 53, Addr: [4]byte{10, 77, byte(i / 250), byte(i%250 + 1)}}
		if err := unix.Sendto(fd, q[:sizes[i%len(sizes)]], 0, sa); err != nil {
			fmt.Println("sendto:", res(err))
			return
		}
	}
	fmt.Println("ok")
}

// sealedDup connects N times a descriptor another thread keeps flipping
// (dup2) between a TCP socket and a sealed UDP socket, to ADDR, and
// counts the results.
func sealedDup(args []string) {
	sa := sockaddr(args[0])
	n, _ := strconv.Atoi(args[1])
	counts := map[string]int{}
	for range n {
		tcp := tcpSocket(sa, 0)
		udp := udpSock()
		target := tcpSocket(sa, 0)
		done := make(chan struct{})
		go func() {
			defer close(done)
			for i := range 200 {
				src := tcp
				if i%2 == 1 {
					src = udp
				}
				unix.Dup3(src, target, unix.O_CLOEXEC)
			}
		}()
		counts[res(unix.Connect(target, sa))]++
		<-done
		unix.Close(tcp)
		unix.Close(udp)
		unix.Close(target)
	}
	fmt.Println(counts)
}

func init() {
	netModes["sealedsigchld"] = sealedSigchld // sealedsigchld N: N UDP sockets while orphans die (SIGCHLD to the supervisor)
}

// sealedSigchld makes and closes N UDP sockets (a refill of the helper
// every 8) while other threads keep making orphans that die at once: the
// supervisor, their subreaper, gets a SIGCHLD for each. It prints the
// socket() results.
func sealedSigchld(args []string) {
	n, _ := strconv.Atoi(args[0])
	var stop atomic.Bool
	done := make(chan struct{})
	for range 2 {
		go func() {
			defer func() { done <- struct{}{} }()
			for !stop.Load() {
				// sh forks a child and exits: the child is an orphan
				// reparented to the supervisor, which reaps it.
				exec.Command("/bin/sh", "-c", "/bin/true & exit 0").Run()
			}
		}()
	}
	counts := map[string]int{}
	for i := range n {
		fd, err := unix.Socket(unix.AF_INET+(i/8%2)*(unix.AF_INET6-unix.AF_INET), unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		counts[res(err)]++
		if err == nil {
			unix.Close(fd)
		}
	}
	stop.Store(true)
	<-done
	<-done
	fmt.Println(counts)
}

func init() {
	netModes["sealedsend"] = sealedSend // sealedsend ADDR: datagrams to ADDR with every option that picks a route or source
}

// sealedSend sends a datagram to ADDR (IPv4) from sealed sockets with
// IP_PKTINFO naming interface 1 and a source, SO_BINDTODEVICE lo,
// IP_TRANSPARENT with a foreign source bound, SO_MARK and a raised
// priority, and prints each result.
func sealedSend(args []string) {
	sa := sockaddr(args[0]).(*unix.SockaddrInet4)
	try := func(name string, setup func(fd int) error, oob []byte) {
		fd := udpSock()
		defer unix.Close(fd)
		err := setup(fd)
		if err == nil {
			_, err = unix.SendmsgN(fd, []byte("leak "+name), oob, sa, 0)
		}
		fmt.Printf("%s=%s\n", name, res(err))
	}
	none := func(int) error { return nil }
	pi := unix.Inet4Pktinfo{Ifindex: 1, Spec_dst: [4]byte{192, 0, 2, 1}}
	b := unsafe.Slice((*byte)(unsafe.Pointer(&pi)), unix.SizeofInet4Pktinfo)
	oob := make([]byte, unix.CmsgSpace(len(b)))
	h := (*unix.Cmsghdr)(unsafe.Pointer(&oob[0]))
	h.Level, h.Type = unix.IPPROTO_IP, unix.IP_PKTINFO
	h.SetLen(unix.CmsgLen(len(b)))
	copy(oob[unix.CmsgLen(0):], b)
	try("pktinfo", none, oob)
	try("bindtodevice", func(fd int) error { return unix.BindToDevice(fd, "lo") }, nil)
	try("transparent", func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.SOL_IP, unix.IP_TRANSPARENT, 1); err != nil {
			return err
		}
		return unix.Bind(fd, &unix.SockaddrInet4{Addr: [4]byte{203, 0, 113, 9}})
	}, nil)
	try("mark", func(fd int) error {
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_MARK, 0x1234); err != nil {
			return err
		}
		return unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PRIORITY, 7)
	}, nil)
}
