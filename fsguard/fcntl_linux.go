//go:build linux && (amd64 || arm64)

package fsguard

import (
	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// File leases (fcntl F_SETLEASE) are refused. A read lease makes any
// write-open of the file wait in the kernel, after Landlock and the
// supervisor let it through, until the lease holder gives it up (up to
// fs.lease-break-time): a sibling holding one stretched a write-open made
// while the lease held past its loss (the truncation and the writable
// descriptor came after it). A lease also lets the agent stall every
// other program's write-opens of any file it owns.
func init() {
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: map[uint32]sysSpec{unix.SYS_FCNTL: spec("fcntl").f(0).handledBy(refuseFileLease)},
		jumps: func(a *asm) { a.jump(bpfJeqK, unix.SYS_FCNTL, "fcntl", "") },
		blocks: func(a *asm) {
			a.label("fcntl")
			a.stmt(bpfLdWAbs, argLow(1)) // the command (an int)
			a.jump(bpfJeqK, unix.F_SETLEASE, "fcntl.notify", "")
			a.stmt(bpfRetK, retAllow)
			a.label("fcntl.notify")
			a.stmt(bpfRetK, retNotify)
		},
	})
}

func refuseFileLease(t *trap) {
	t.deny(unix.EPERM, lease.BoundaryFile, lease.ReasonNotAllowed,
		"fcntl F_SETLEASE on "+fdPath(t.pid(), int32(t.arg(0)))+": file leases would hold other opens of the file in the kernel: refused", nil)
}
