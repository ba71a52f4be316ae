//go:build linux

package fsguard

import "golang.org/x/sys/unix"

const (
	auditArch = unix.AUDIT_ARCH_AARCH64
	x32Bit    = 0 // no second ABI on arm64
)

// writeSyscallsArch is empty: arm64 has only the *at forms.
var writeSyscallsArch = map[uint32]sysSpec{}
