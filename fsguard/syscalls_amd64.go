//go:build linux

package fsguard

import "golang.org/x/sys/unix"

const (
	auditArch = unix.AUDIT_ARCH_X86_64
	// x32Bit marks x32-ABI system numbers; the filter kills them rather
	// than decode a second table.
	x32Bit = 0x40000000
)

// writeSyscallsArch are x86-64's legacy path calls (arm64 has only the *at forms).
var writeSyscallsArch = map[uint32]sysSpec{
	unix.SYS_OPEN:      spec("open").p(0).withFlags(1),
	unix.SYS_CREAT:     spec("creat").p(0),
	unix.SYS_RENAME:    spec("rename").p(0).second(-1, 1),
	unix.SYS_UNLINK:    spec("unlink").p(0),
	unix.SYS_MKDIR:     spec("mkdir").p(0),
	unix.SYS_RMDIR:     spec("rmdir").p(0),
	unix.SYS_LINK:      spec("link").p(0).second(-1, 1),
	unix.SYS_SYMLINK:   spec("symlink").p(1),
	unix.SYS_MKNOD:     spec("mknod").p(0),
	unix.SYS_CHMOD:     spec("chmod").p(0),
	unix.SYS_CHOWN:     spec("chown").p(0),
	unix.SYS_LCHOWN:    spec("lchown").p(0),
	unix.SYS_UTIME:     spec("utime").p(0),
	unix.SYS_UTIMES:    spec("utimes").p(0),
	unix.SYS_FUTIMESAT: spec("futimesat").at(0, 1),
}
