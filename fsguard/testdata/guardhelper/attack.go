package main

// Modes of the second attack pass on issue 17 (calls the first rebuild of
// the guard left out). Dispatched from init like filemodes.go.

import (
	"fmt"
	"os"
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
