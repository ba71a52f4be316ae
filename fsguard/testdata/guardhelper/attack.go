package main

// Modes of the second attack pass on issue 17 (calls the first rebuild of
// the guard left out). Dispatched from init like filemodes.go.

import (
	"fmt"
	"os"
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
