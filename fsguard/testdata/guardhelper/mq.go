package main

// POSIX message queue modes (issue 33): queues live in the IPC namespace's
// mqueue file system, which no Landlock rule names; mq_open, mq_unlink and
// the descriptor calls reach it without a path the agent spells.

import (
	"fmt"
	"os"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

func init() {
	if len(os.Args) < 2 || os.Args[1] != "atk-posixmq" {
		return
	}
	os.Exit(atkPosixMq(os.Args[2:]))
}

// mqAttr is struct mq_attr.
type mqAttr struct {
	flags, maxmsg, msgsize, curmsgs int64
	_                               [4]int64
}

// sigevNone is a struct sigevent with SIGEV_NONE (64 bytes).
type sigevent struct {
	value  uint64
	signo  int32
	notify int32
	_      [48]byte
}

const sigevNone = 1 // SIGEV_NONE

func mqOpen(name string, flags int, mode uint32, attr *mqAttr) (int, unix.Errno) {
	fd, _, e := unix.Syscall6(unix.SYS_MQ_OPEN, cstr(name), uintptr(flags), uintptr(mode), uintptr(unsafe.Pointer(attr)), 0, 0)
	return int(fd), e
}

func mqSend(fd int, msg string) unix.Errno {
	b := []byte(msg)
	_, _, e := unix.Syscall6(unix.SYS_MQ_TIMEDSEND, uintptr(fd), uintptr(unsafe.Pointer(&b[0])), uintptr(len(b)), 0, 0, 0)
	return e
}

func mqRecv(fd int) (string, unix.Errno) {
	buf := make([]byte, 8192)
	var prio uint32
	ts := unix.Timespec{} // already past: do not wait for an empty queue
	n, _, e := unix.Syscall6(unix.SYS_MQ_TIMEDRECEIVE, uintptr(fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(len(buf)),
		uintptr(unsafe.Pointer(&prio)), uintptr(unsafe.Pointer(&ts)), 0)
	if e != 0 {
		return "", e
	}
	return string(buf[:n]), 0
}

func mqNotify(fd int) unix.Errno {
	ev := sigevent{notify: sigevNone}
	_, _, e := unix.Syscall(unix.SYS_MQ_NOTIFY, uintptr(fd), uintptr(unsafe.Pointer(&ev)), 0)
	return e
}

func mqSetNonblock(fd int) unix.Errno {
	a := mqAttr{flags: unix.O_NONBLOCK}
	var old mqAttr
	_, _, e := unix.Syscall(unix.SYS_MQ_GETSETATTR, uintptr(fd), uintptr(unsafe.Pointer(&a)), uintptr(unsafe.Pointer(&old)))
	return e
}

// atkPosixMq VICTIM FRESH [inherited]: every write-class call on another
// process's POSIX message queue VICTIM (a name without the leading "/",
// as the system call takes it), by name and, with "inherited", through
// its descriptor inherited as fd 3; then the agent's own queue FRESH:
// created, sent to, received from, opened again and left for the guard
// to remove; FRESH-2 created and unlinked twice (the second: ENOENT).
// Prints NAME=RESULT fields on one line.
func atkPosixMq(args []string) int {
	victim, fresh := args[0], args[1]
	var out []string
	add := func(k, v string) { out = append(out, k+"="+v) }
	if fd, e := mqOpen(victim, unix.O_WRONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0, nil); e == 0 {
		add("open-w", "ok")
		add("send", errRes(mqSend(fd, "owned")))
		unix.Close(fd)
	} else {
		add("open-w", errRes(e))
	}
	_, e := mqOpen(victim, unix.O_RDWR|unix.O_CLOEXEC, 0, nil)
	add("open-rw", errRes(e))
	if fd, e := mqOpen(victim, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0, nil); e == 0 {
		add("open-r", "ok")
		_, e := mqRecv(fd)
		add("recv", errRes(e))
		unix.Close(fd)
	} else {
		add("open-r", errRes(e))
	}
	_, e = mqOpen(victim, unix.O_CREAT|unix.O_RDONLY|unix.O_CLOEXEC, 0o600, nil)
	add("creat-existing", errRes(e))
	_, e = mqOpen("a/b", unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600, nil)
	add("slash", errRes(e))
	if len(args) > 2 && args[2] == "inherited" {
		add("fd-send", errRes(mqSend(3, "owned")))
		_, e := mqRecv(3)
		add("fd-recv", errRes(e))
		add("fd-notify", errRes(mqNotify(3)))
		add("fd-setattr", errRes(mqSetNonblock(3)))
	}
	_, _, e = unix.Syscall(unix.SYS_MQ_UNLINK, cstr(victim), 0, 0)
	add("unlink", errRes(e))

	attr := mqAttr{maxmsg: 4, msgsize: 128}
	fd, e := mqOpen(fresh, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_NONBLOCK|unix.O_CLOEXEC, 0o600, &attr)
	add("create", errRes(e))
	if e == 0 {
		own := []string{errRes(mqSend(fd, "mine"))}
		m, e := mqRecv(fd)
		own = append(own, errRes(e)+":"+m, errRes(mqNotify(fd)), errRes(mqSetNonblock(fd)))
		_, e = mqOpen(fresh, unix.O_WRONLY|unix.O_CLOEXEC, 0, nil)
		own = append(own, errRes(e))
		if fd2, e := mqOpen(fresh+"-2", unix.O_CREAT|unix.O_RDONLY|unix.O_CLOEXEC, 0o600, nil); e == 0 {
			unix.Close(fd2)
			_, _, e = unix.Syscall(unix.SYS_MQ_UNLINK, cstr(fresh+"-2"), 0, 0)
			own = append(own, errRes(e))
			_, _, e = unix.Syscall(unix.SYS_MQ_UNLINK, cstr(fresh+"-2"), 0, 0)
			own = append(own, errRes(e))
		} else {
			own = append(own, "create2:"+errRes(e))
		}
		add("own", strings.Join(own, ","))
	}
	fmt.Println(strings.Join(out, " "))
	return 0
}

func init() {
	if len(os.Args) < 2 || os.Args[1] != "atk-mq-race" {
		return
	}
	os.Exit(atkMqRace(os.Args[2:]))
}

// atkMqRace OWN: makes its own queue OWN (one message at most, blocking)
// and sends to it through descriptor number N in a loop while another
// thread swaps the inherited descriptor of another process's queue (fd
// 3) onto N and back (dup2): a check of N followed by CONTINUE would send
// to whichever queue N names when the kernel runs the call. Then a timed
// send on its full queue. Prints "sent=K timed=RESULT".
func atkMqRace(args []string) int {
	attr := mqAttr{maxmsg: 1, msgsize: 16}
	own, e := mqOpen(args[0], unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600, &attr)
	if e != 0 {
		fmt.Println("create=" + errRes(e))
		return 0
	}
	n, _ := unix.Dup(own)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				unix.Dup2(own, n)
				return
			default:
			}
			unix.Dup2(3, n)
			unix.Dup2(own, n)
		}
	}()
	sent := 0
	for range 2000 {
		if mqSend(n, "x") == 0 {
			sent++
			mqRecv(own)
		}
	}
	close(stop)
	<-done
	mqSend(own, "full")
	ts := unix.NsecToTimespec(time.Now().Add(300 * time.Millisecond).UnixNano())
	b := []byte("y")
	_, _, e = unix.Syscall6(unix.SYS_MQ_TIMEDSEND, uintptr(own), uintptr(unsafe.Pointer(&b[0])), 1, 0, uintptr(unsafe.Pointer(&ts)), 0)
	fmt.Printf("sent>0=%v timed=%s\n", sent > 0, errRes(e))
	return 0
}

func init() {
	if len(os.Args) < 2 || os.Args[1] != "atk-mq-path" {
		return
	}
	os.Exit(atkMqPath(os.Args[2:]))
}

// atkMqPath DIR VICTIM FRESH: the queues through a mounted mqueue file
// system at DIR (as /dev/mqueue): VICTIM (another process's) opened for
// writing, FRESH created, VICTIM unlinked, and VICTIM opened read-only
// (reads are allowed everywhere) to receive from, register a notification
// on and set its flags. Prints NAME=RESULT fields on one line.
func atkMqPath(args []string) int {
	dir, victim, fresh := args[0], args[1], args[2]
	var out []string
	add := func(k, v string) { out = append(out, k+"="+v) }
	fd, err := unix.Open(dir+"/"+victim, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	add("open-w", res(err))
	if err == nil {
		add("send", errRes(mqSend(fd, "owned")))
	}
	_, err = unix.Open(dir+"/"+fresh, unix.O_CREAT|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	add("create", res(err))
	add("unlink", res(unix.Unlink(dir+"/"+victim)))
	fd, err = unix.Open(dir+"/"+victim, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	add("open-r", res(err))
	if err == nil {
		_, e := mqRecv(fd)
		add("recv", errRes(e))
		add("notify", errRes(mqNotify(fd)))
		add("setattr", errRes(mqSetNonblock(fd)))
	}
	fmt.Println(strings.Join(out, " "))
	return 0
}

func init() {
	if len(os.Args) < 2 || os.Args[1] != "atk-mq-block" {
		return
	}
	os.Exit(atkMqBlock(os.Args[2:]))
}

// atkMqBlock NAME: makes its own queue NAME of one message, fills it,
// prints "full" and sends again, blocking without a timeout (the test
// loses the lease meanwhile). Prints "send=RESULT curmsgs=N".
func atkMqBlock(args []string) int {
	attr := mqAttr{maxmsg: 1, msgsize: 16}
	fd, e := mqOpen(args[0], unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600, &attr)
	if e != 0 {
		fmt.Println("create=" + errRes(e))
		return 0
	}
	if e := mqSend(fd, "a"); e != 0 {
		fmt.Println("first send=" + errRes(e))
		return 0
	}
	fmt.Println("full")
	e = mqSend(fd, "b")
	var a mqAttr
	unix.Syscall(unix.SYS_MQ_GETSETATTR, uintptr(fd), 0, uintptr(unsafe.Pointer(&a)))
	fmt.Printf("send=%s curmsgs=%d\n", errRes(e), a.curmsgs)
	return 0
}
