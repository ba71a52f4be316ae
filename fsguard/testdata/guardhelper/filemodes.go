package main

// Modes for the file part of issue 17 (terminal ioctls, inode flags,
// metadata, writes after the lease is lost). They are dispatched from
// init, before main, so main's switch stays as it is.

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync/atomic"
	"unsafe"

	"golang.org/x/sys/unix"
)

func init() {
	if len(os.Args) < 2 {
		return
	}
	var run func([]string) int
	switch os.Args[1] {
	case "tty":
		run = ttyInject
	case "setflags":
		run = setFlags
	case "meta":
		run = meta
	case "chmodrace":
		run = chmodRace
	case "openat2":
		run = openat2
	case "setflagsrace":
		run = setFlagsRace
	default:
		return
	}
	os.Exit(run(os.Args[2:]))
}

func errRes(errno unix.Errno) string {
	if errno == 0 {
		return "ok"
	}
	return res(errno)
}

// ttyInject FD: pushes "echo INJECTED\n" into the input of the terminal
// on FD with TIOCSTI, then tries TIOCLINUX (subcode 6: get selection mode).
func ttyInject(args []string) int {
	fd, _ := strconv.Atoi(args[0])
	sti := unix.Errno(0)
	for _, c := range []byte("echo INJECTED\n") {
		b := c
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCSTI, uintptr(unsafe.Pointer(&b))); e != 0 {
			sti = e
			break
		}
	}
	sub := [2]byte{6, 0}
	_, _, lin := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.TIOCLINUX, uintptr(unsafe.Pointer(&sub[0])))
	fmt.Printf("tiocsti=%s tioclinux=%s\n", errRes(sti), errRes(lin))
	return 0
}

const fsNodumpFl = 0x40 // FS_NODUMP_FL

// setFlags PATH: adds FS_NODUMP_FL with FS_IOC_SETFLAGS on a read-only
// descriptor of PATH (what chattr +d does).
func setFlags(args []string) int {
	fd, err := unix.Open(args[0], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open=" + res(err))
		return 1
	}
	var flags int32
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.FS_IOC_GETFLAGS, uintptr(unsafe.Pointer(&flags))); e != 0 {
		fmt.Println("getflags=" + errRes(e))
		return 1
	}
	flags |= fsNodumpFl
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.FS_IOC_SETFLAGS, uintptr(unsafe.Pointer(&flags)))
	fmt.Println("setflags=" + errRes(e))
	return 0
}

func sysRes(_, _ uintptr, e unix.Errno) string { return errRes(e) }

func cstr(s string) uintptr { b, _ := unix.BytePtrFromString(s); return uintptr(unsafe.Pointer(b)) }

// meta PATH: every metadata call on PATH, one result each, on one line.
// chown sets uid/gid 4242, times are set to 1000 s, xattrs user.a..user.e
// are set and user.pre1..user.pre4 removed.
func meta(args []string) int {
	p := args[0]
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open=" + res(err))
		return 1
	}
	pfd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open=" + res(err))
		return 1
	}
	ts := [2]unix.Timespec{{Sec: 1000}, {Sec: 1000}}
	val := []byte("v")
	xargs := struct {
		value uint64
		size  uint32
		flags uint32
	}{uint64(uintptr(unsafe.Pointer(&val[0]))), 1, 0}
	var out []string
	add := func(name, r string) { out = append(out, name+"="+r) }
	add("fchmodat", sysRes(unix.Syscall(unix.SYS_FCHMODAT, cwdFD, cstr(p), 0o600)))
	add("fchmodat2", sysRes(unix.Syscall6(unix.SYS_FCHMODAT2, cwdFD, cstr(p), 0o600, 0, 0, 0)))
	add("fchmodat2-empty", sysRes(unix.Syscall6(unix.SYS_FCHMODAT2, uintptr(pfd), cstr(""), 0o600, unix.AT_EMPTY_PATH, 0, 0)))
	add("fchmod", sysRes(unix.Syscall(unix.SYS_FCHMOD, uintptr(fd), 0o600, 0)))
	add("fchownat", sysRes(unix.Syscall6(unix.SYS_FCHOWNAT, cwdFD, cstr(p), 4242, 4242, 0, 0)))
	add("fchownat-nofollow", sysRes(unix.Syscall6(unix.SYS_FCHOWNAT, cwdFD, cstr(p), 4242, 4242, unix.AT_SYMLINK_NOFOLLOW, 0)))
	add("fchownat-empty", sysRes(unix.Syscall6(unix.SYS_FCHOWNAT, uintptr(pfd), cstr(""), 4242, 4242, unix.AT_EMPTY_PATH, 0)))
	add("fchown", sysRes(unix.Syscall(unix.SYS_FCHOWN, uintptr(fd), 4242, 4242)))
	add("utimensat", sysRes(unix.Syscall6(unix.SYS_UTIMENSAT, cwdFD, cstr(p), uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)))
	add("utimensat-fd", sysRes(unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)))
	add("setxattr", sysRes(unix.Syscall6(unix.SYS_SETXATTR, cstr(p), cstr("user.a"), uintptr(unsafe.Pointer(&val[0])), 1, 0, 0)))
	add("lsetxattr", sysRes(unix.Syscall6(unix.SYS_LSETXATTR, cstr(p), cstr("user.b"), uintptr(unsafe.Pointer(&val[0])), 1, 0, 0)))
	add("fsetxattr", sysRes(unix.Syscall6(unix.SYS_FSETXATTR, uintptr(fd), cstr("user.c"), uintptr(unsafe.Pointer(&val[0])), 1, 0, 0)))
	add("setxattrat", sysRes(unix.Syscall6(unix.SYS_SETXATTRAT, cwdFD, cstr(p), 0, cstr("user.d"), uintptr(unsafe.Pointer(&xargs)), unsafe.Sizeof(xargs))))
	add("removexattr", sysRes(unix.Syscall(unix.SYS_REMOVEXATTR, cstr(p), cstr("user.pre1"), 0)))
	add("lremovexattr", sysRes(unix.Syscall(unix.SYS_LREMOVEXATTR, cstr(p), cstr("user.pre2"), 0)))
	add("fremovexattr", sysRes(unix.Syscall(unix.SYS_FREMOVEXATTR, uintptr(fd), cstr("user.pre3"), 0)))
	add("removexattrat", sysRes(unix.Syscall6(unix.SYS_REMOVEXATTRAT, cwdFD, cstr(p), 0, cstr("user.pre4"), 0, 0)))
	out = append(out, legacyMeta(p)...)
	fmt.Println(strings.Join(out, " "))
	return 0
}

// chmodRace LINK IN OUT N: one goroutine swaps LINK between a symlink to
// IN and one to OUT while the main one calls chmod(LINK, 0600) N times.
func chmodRace(args []string) int {
	link, in, out := args[0], args[1], args[2]
	n, _ := strconv.Atoi(args[3])
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; !stop.Load() && i < 1_000_000; i++ {
			target := in
			if i%2 == 1 {
				target = out
			}
			os.Remove(link + ".new")
			if os.Symlink(target, link+".new") == nil {
				os.Rename(link+".new", link)
			}
		}
	}()
	ok, denied := 0, 0
	for range n {
		if unix.Chmod(link, 0o600) == nil {
			ok++
		} else {
			denied++
		}
		if unix.Fchmodat(unix.AT_FDCWD, link, 0o600, 0) == nil {
			ok++
		} else {
			denied++
		}
	}
	stop.Store(true)
	<-done
	fmt.Printf("ok=%d denied=%d\n", ok, denied)
	return 0
}

var atFDCWD = unix.AT_FDCWD

// cwdFD is AT_FDCWD as a raw system-call argument.
var cwdFD = uintptr(atFDCWD)

// openat2 PATH... : openat2 of each PATH read-only, then for writing
// (O_WRONLY|O_CREAT), one result each: "ro=RESULT rw=RESULT ...".
func openat2(args []string) int {
	var out []string
	for _, p := range args {
		for _, m := range []struct {
			name  string
			flags uint64
		}{{"ro", unix.O_RDONLY}, {"rw", unix.O_WRONLY | unix.O_CREAT}} {
			how := unix.OpenHow{Flags: m.flags | unix.O_CLOEXEC, Mode: 0o644}
			fd, err := unix.Openat2(unix.AT_FDCWD, p, &how)
			if err == nil {
				unix.Close(fd)
			}
			out = append(out, m.name+"="+res(err))
		}
	}
	fmt.Println(strings.Join(out, " "))
	return 0
}

// setFlagsRace IN OUT N: descriptor 100 is switched with dup2 between IN
// and OUT by one goroutine while the main one sets FS_NODUMP_FL through it
// N times.
func setFlagsRace(args []string) int {
	in, err := unix.Open(args[0], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open=" + res(err))
		return 1
	}
	out, err := unix.Open(args[1], unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("open=" + res(err))
		return 1
	}
	n, _ := strconv.Atoi(args[2])
	const target = 100
	unix.Dup2(in, target)
	var stop atomic.Bool
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; !stop.Load() && i < 1_000_000; i++ {
			src := in
			if i%2 == 1 {
				src = out
			}
			unix.Dup2(src, target)
		}
	}()
	ok, denied := 0, 0
	for range n {
		flags := int32(fsNodumpFl)
		if _, _, e := unix.Syscall(unix.SYS_IOCTL, target, unix.FS_IOC_SETFLAGS, uintptr(unsafe.Pointer(&flags))); e == 0 {
			ok++
		} else {
			denied++
		}
	}
	stop.Store(true)
	<-done
	fmt.Printf("ok=%d denied=%d\n", ok, denied)
	return 0
}
