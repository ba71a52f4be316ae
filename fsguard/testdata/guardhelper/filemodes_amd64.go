package main

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// legacyMeta are x86-64's path-only metadata calls (arm64 has none).
func legacyMeta(p string) []string {
	tv := [2]unix.Timeval{{Sec: 1000}, {Sec: 1000}}
	ub := [2]int64{1000, 1000} // struct utimbuf
	return []string{
		"chmod=" + sysRes(unix.Syscall(unix.SYS_CHMOD, cstr(p), 0o600, 0)),
		"chown=" + sysRes(unix.Syscall(unix.SYS_CHOWN, cstr(p), 4242, 4242)),
		"lchown=" + sysRes(unix.Syscall(unix.SYS_LCHOWN, cstr(p), 4242, 4242)),
		"utime=" + sysRes(unix.Syscall(unix.SYS_UTIME, cstr(p), uintptr(unsafe.Pointer(&ub[0])), 0)),
		"utimes=" + sysRes(unix.Syscall(unix.SYS_UTIMES, cstr(p), uintptr(unsafe.Pointer(&tv[0])), 0)),
		"futimesat=" + sysRes(unix.Syscall(unix.SYS_FUTIMESAT, cwdFD, cstr(p), uintptr(unsafe.Pointer(&tv[0])))),
	}
}
