package main

// Modes of the second attack pass on issue 17 (calls the first rebuild of
// the guard left out). Dispatched from init like filemodes.go.

import (
	"bufio"
	"fmt"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

func init() {
	if len(os.Args) < 2 {
		return
	}
	var run func([]string) int
	switch os.Args[1] {
	case "atk-setattr":
		run = atkSetattr
	case "atk-shm":
		run = atkShm
	case "atk-mq":
		run = atkMq
	case "atk-ownshm":
		run = atkOwnShm
	case "atk-notif":
		run = atkNotif
	case "atk-keys":
		run = atkKeys
	case "atk-lease":
		run = atkLease
	default:
		return
	}
	os.Exit(run(os.Args[2:]))
}

// fileAttr is struct file_attr (Linux 6.17+).
type fileAttr struct {
	xflags                                uint64
	extsize, nextents, projid, cowextsize uint32
}

const fsXflagNodump = 0x80 // FS_XFLAG_NODUMP

// atkSetattr PATH...: file_setattr (Linux 6.17) sets FS_XFLAG_NODUMP on
// each PATH, by path and by a read-only descriptor with AT_EMPTY_PATH: the
// chattr of FS_IOC_FSSETXATTR without an ioctl. One result per PATH and
// form: "path=RESULT empty=RESULT ...".
func atkSetattr(args []string) int {
	var out []string
	for _, p := range args {
		var fa fileAttr
		fa.xflags = fsXflagNodump
		out = append(out, "path="+sysRes(unix.Syscall6(unix.SYS_FILE_SETATTR, cwdFD, cstr(p),
			uintptr(unsafe.Pointer(&fa)), unsafe.Sizeof(fa), 0, 0)))
		pfd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			out = append(out, "empty=open:"+err.Error())
			continue
		}
		out = append(out, "empty="+sysRes(unix.Syscall6(unix.SYS_FILE_SETATTR, uintptr(pfd), cstr(""),
			uintptr(unsafe.Pointer(&fa)), unsafe.Sizeof(fa), unix.AT_EMPTY_PATH, 0)))
		unix.Close(pfd)
	}
	fmt.Println(joinFields(out))
	return 0
}

func joinFields(f []string) string {
	s := ""
	for i, x := range f {
		if i > 0 {
			s += " "
		}
		s += x
	}
	return s
}

// atkShm ID: attaches the System V shared memory segment ID (another
// process's: ids are listed in /proc/sysvipc/shm) and writes "owned" at
// its start.
func atkShm(args []string) int {
	id, _ := strconv.Atoi(args[0])
	mem, err := unix.SysvShmAttach(id, 0, 0)
	if err != nil {
		fmt.Println("shmat=" + res(err))
		return 0
	}
	copy(mem, "owned")
	fmt.Println("shmat=ok")
	return 0
}

// atkMq NAME: opens the POSIX message queue NAME (another process's) for
// writing and sends "owned".
func atkMq(args []string) int {
	fd, _, e := unix.Syscall6(unix.SYS_MQ_OPEN, cstr(args[0]), unix.O_WRONLY, 0, 0, 0, 0)
	if e != 0 {
		fmt.Println("mq_open=" + errRes(e))
		return 0
	}
	msg := []byte("owned")
	_, _, e = unix.Syscall6(unix.SYS_MQ_TIMEDSEND, fd, uintptr(unsafe.Pointer(&msg[0])), uintptr(len(msg)), 0, 0, 0)
	fmt.Println("mq_open=ok mq_send=" + errRes(e))
	return 0
}

// atkOwnShm: makes a private segment, attaches it, writes and reads it
// back, removes it; and a keyed one, found again by its key.
func atkOwnShm([]string) int {
	id, err := unix.SysvShmGet(unix.IPC_PRIVATE, 4096, unix.IPC_CREAT|0o600)
	if err != nil {
		fmt.Println("shmget=" + res(err))
		return 0
	}
	mem, err := unix.SysvShmAttach(id, 0, 0)
	if err != nil {
		fmt.Println("shmat=" + res(err))
		return 0
	}
	copy(mem, "mine")
	ok := string(mem[:4]) == "mine"
	unix.SysvShmDetach(mem)
	_, err = unix.SysvShmCtl(id, unix.IPC_RMID, nil)
	k1, err1 := unix.SysvShmGet(0x5eed, 4096, unix.IPC_CREAT|0o600)
	k2, err2 := unix.SysvShmGet(0x5eed, 4096, 0o600)
	if err1 == nil {
		unix.SysvShmCtl(k1, unix.IPC_RMID, nil)
	}
	fmt.Printf("own=%v rmid=%s keyed=%v\n", ok, res(err), err1 == nil && err2 == nil && k1 == k2)
	return 0
}

// atkNotif OUTSIDE LEASED MARKER: installs a seccomp filter of its own
// with a listener (SECCOMP_FILTER_FLAG_NEW_LISTENER) on one thread, for
// fchmodat and openat, and answers every call CONTINUE from another
// thread. When several filters return USER_NOTIF the most recent one's
// listener gets the call: the supervisor would never see them. Then, on
// the filtered thread: chmod OUTSIDE, create MARKER (the test's gate
// loses the lease), and open LEASED for writing and write to it.
// Prints "install=R chmod=R write=R".
func atkNotif(args []string) int {
	outside, leased, marker := args[0], args[1], args[2]
	type installed struct {
		fd  int
		err error
	}
	got := make(chan installed)
	results := make(chan string)
	go func() {
		runtime.LockOSThread() // the filter stays on this thread: never unlocked
		prog := []unix.SockFilter{
			{Code: 0x20, K: 0}, // ld nr
			{Code: 0x15, Jt: 2, Jf: 0, K: unix.SYS_FCHMODAT},
			{Code: 0x15, Jt: 1, Jf: 0, K: unix.SYS_OPENAT},
			{Code: 0x06, K: unix.SECCOMP_RET_ALLOW},
			{Code: 0x06, K: unix.SECCOMP_RET_USER_NOTIF},
		}
		fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
		fd, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, unix.SECCOMP_FILTER_FLAG_NEW_LISTENER, uintptr(unsafe.Pointer(&fprog)))
		if e != 0 {
			got <- installed{-1, e}
			return
		}
		got <- installed{int(fd), nil}
		chmod := res(unix.Fchmodat(unix.AT_FDCWD, outside, 0o600, 0))
		if f, err := os.Create(marker); err == nil {
			f.Close()
		}
		w := "?"
		f, err := os.OpenFile(leased, os.O_WRONLY|os.O_TRUNC, 0)
		if err == nil {
			_, err = f.WriteString("owned")
			f.Close()
		}
		w = res(err)
		results <- "chmod=" + chmod + " write=" + w
	}()
	in := <-got
	if in.err != nil {
		fmt.Println("install=" + res(in.err))
		return 0
	}
	go func() {
		// struct seccomp_notif is 80 bytes; the response 24.
		for {
			var n [80]byte
			if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(in.fd), unix.SECCOMP_IOCTL_NOTIF_RECV, uintptr(unsafe.Pointer(&n[0]))); e != 0 {
				if e == unix.EINTR || e == unix.ENOENT {
					continue
				}
				return
			}
			var r [24]byte
			copy(r[:8], n[:8]) // id
			r[20] = unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE
			unix.Syscall(unix.SYS_IOCTL, uintptr(in.fd), unix.SECCOMP_IOCTL_NOTIF_SEND, uintptr(unsafe.Pointer(&r[0])))
		}
	}()
	fmt.Println("install=ok " + <-results)
	return 0
}

// atkKeys DESC: reads the "user" key DESC from the user keyring (shared
// by every process of the user, in no namespace, seen by no Landlock
// rule) and adds a key DESC-planted there. Prints "read=RESULT[:payload]
// add=RESULT".
func atkKeys(args []string) int {
	read := ""
	id, err := unix.KeyctlSearch(unix.KEY_SPEC_USER_KEYRING, "user", args[0], 0)
	if err == nil {
		buf := make([]byte, 256)
		var n int
		n, err = unix.KeyctlBuffer(unix.KEYCTL_READ, id, buf, 0)
		if err == nil {
			read = ":" + string(buf[:min(n, len(buf))])
		}
	}
	_, aerr := unix.AddKey("user", args[0]+"-planted", []byte("x"), unix.KEY_SPEC_USER_KEYRING)
	fmt.Println("read=" + res(err) + read + " add=" + res(aerr))
	return 0
}

// atkLease PATH: takes a read lease (F_SETLEASE) on PATH, then opens it
// O_WRONLY|O_TRUNC from another thread. The open passes the guard while
// the lease holds and then waits in the kernel for the read lease to be
// given up (up to fs.lease-break-time): the truncation and the writable
// descriptor come as late as the lease holder likes. It prints
// "breaking" once the open waits, gives the lease up when a line arrives
// on stdin, and prints "setlease=RESULT open=RESULT".
func atkLease(args []string) int {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, unix.SIGIO)
	rfd, err := unix.Open(args[0], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open ro=" + res(err))
		return 1
	}
	if _, err := unix.FcntlInt(uintptr(rfd), unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		fmt.Println("setlease=" + res(err))
		return 0
	}
	opened := make(chan string)
	go func() {
		fd, err := unix.Open(args[0], unix.O_WRONLY|unix.O_TRUNC|unix.O_CLOEXEC, 0)
		if err == nil {
			_, err = unix.Write(fd, []byte("owned"))
			unix.Close(fd)
		}
		opened <- res(err)
	}()
	select {
	case <-sig:
		fmt.Println("breaking")
	case r := <-opened:
		fmt.Println("setlease=ok open=" + r + " (did not wait)")
		return 0
	}
	bufio.NewReader(os.Stdin).ReadString('\n')
	unix.FcntlInt(uintptr(rfd), unix.F_SETLEASE, unix.F_UNLCK)
	fmt.Println("setlease=ok open=" + <-opened)
	return 0
}

func init() {
	if len(os.Args) < 2 || os.Args[1] != "atk-sysv-leave" {
		return
	}
	// A segment, a message queue and a semaphore set made and left
	// behind, and a segment made and removed; prints "shm msg sem".
	shm, err1 := unix.SysvShmGet(unix.IPC_PRIVATE, 4096, unix.IPC_CREAT|0o600)
	msg, _, e2 := unix.Syscall(unix.SYS_MSGGET, unix.IPC_PRIVATE, unix.IPC_CREAT|0o600, 0)
	sem, _, e3 := unix.Syscall(unix.SYS_SEMGET, unix.IPC_PRIVATE, 1, unix.IPC_CREAT|0o600)
	if err1 != nil || e2 != 0 || e3 != 0 {
		fmt.Println("get:", err1, e2, e3)
		os.Exit(1)
	}
	if gone, err := unix.SysvShmGet(unix.IPC_PRIVATE, 4096, unix.IPC_CREAT|0o600); err == nil {
		unix.SysvShmCtl(gone, unix.IPC_RMID, nil)
	}
	fmt.Println(shm, msg, sem)
	os.Exit(0)
}
