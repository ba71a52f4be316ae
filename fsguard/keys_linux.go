//go:build linux && (amd64 || arm64)

package fsguard

import (
	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// The kernel keyrings. The user keyring and the user session keyring are
// shared by every process of the user, belong to no namespace and to no
// file system: Landlock does not see them. An agent could read what other
// programs keep there (Kerberos tickets, tokens) and plant keys for them.
// keyctl, add_key and request_key are refused (EPERM, audited), as the
// default seccomp profiles of container runtimes refuse them.
func init() {
	calls := map[uint32]sysSpec{
		unix.SYS_KEYCTL:      spec("keyctl").handledBy(refuseKeyring),
		unix.SYS_ADD_KEY:     spec("add_key").handledBy(refuseKeyring),
		unix.SYS_REQUEST_KEY: spec("request_key").handledBy(refuseKeyring),
	}
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: calls,
		jumps: func(a *asm) {
			for _, nr := range []uint32{unix.SYS_KEYCTL, unix.SYS_ADD_KEY, unix.SYS_REQUEST_KEY} {
				a.jump(bpfJeqK, nr, "notify", "")
			}
		},
		blocks: func(*asm) {},
	})
}

func refuseKeyring(t *trap) {
	t.deny(unix.EPERM, lease.BoundaryFile, lease.ReasonNotAllowed,
		t.spec.name+": the kernel keyrings are shared by every process of the user (no namespace, no file system): refused", nil)
}
