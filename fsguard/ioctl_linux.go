//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// Trapped ioctl requests (the low 32 bits of ioctl's second argument, as
// the kernel reads them). The encodings are the generic ones, identical on
// amd64 and arm64.
const (
	ioctlTIOCSTI   = 0x5412 // push a byte into a terminal's input
	ioctlTIOCLINUX = 0x541c // virtual console control (selection paste, ...)

	ioctlSetFlags         = 0x40086602 // FS_IOC_SETFLAGS, _IOW('f', 2, long): chattr
	ioctlSetFlags32       = 0x40046602 // FS_IOC32_SETFLAGS, _IOW('f', 2, int)
	ioctlFSSetXattr       = 0x401c5820 // FS_IOC_FSSETXATTR, _IOW('X', 32, struct fsxattr)
	ioctlSetVersion       = 0x40087602 // FS_IOC_SETVERSION, _IOW('v', 2, long)
	ioctlSetVersion32     = 0x40047602 // FS_IOC32_SETVERSION, _IOW('v', 2, int)
	ioctlEnableVerity     = 0x40806685 // FS_IOC_ENABLE_VERITY, _IOW('f', 133, struct fsverity_enable_arg)
	ioctlSetEncryptPolicy = 0x800c6613 // FS_IOC_SET_ENCRYPTION_POLICY, _IOR('f', 19, struct fscrypt_policy_v1)
)

// inodeIoctls change a file's inode (flags, project, version, verity,
// encryption) through any descriptor of it, a read-only one included, so
// Landlock's write rights do not govern them.
var inodeIoctls = map[uint32]string{
	ioctlSetFlags:         "FS_IOC_SETFLAGS",
	ioctlSetFlags32:       "FS_IOC32_SETFLAGS",
	ioctlFSSetXattr:       "FS_IOC_FSSETXATTR",
	ioctlSetVersion:       "FS_IOC_SETVERSION",
	ioctlSetVersion32:     "FS_IOC32_SETVERSION",
	ioctlEnableVerity:     "FS_IOC_ENABLE_VERITY",
	ioctlSetEncryptPolicy: "FS_IOC_SET_ENCRYPTION_POLICY",
}

// terminalIoctls inject input into a terminal: refused whatever the lease.
var terminalIoctls = map[uint32]string{
	ioctlTIOCSTI:   "TIOCSTI",
	ioctlTIOCLINUX: "TIOCLINUX",
}

// The filter sends ioctl to the supervisor only for the requests above;
// every other request stays in the kernel.
func init() {
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: map[uint32]sysSpec{unix.SYS_IOCTL: spec("ioctl").f(0).handledBy(handleIoctl)},
		jumps: func(a *asm) { a.jump(bpfJeqK, unix.SYS_IOCTL, "ioctl", "") },
		blocks: func(a *asm) {
			a.label("ioctl")
			a.stmt(bpfLdWAbs, offArgs+8) // the request's low word (little endian)
			for _, reqs := range []map[uint32]string{terminalIoctls, inodeIoctls} {
				for req := range reqs {
					a.jump(bpfJeqK, req, "ioctl.notify", "")
				}
			}
			a.stmt(bpfRetK, retAllow)
			a.label("ioctl.notify")
			a.stmt(bpfRetK, retNotify)
		},
	})
}

// handleIoctl refuses terminal injection always; an inode ioctl is
// refused once the lease is lost, and while it holds is performed by the
// supervisor on its own duplicate of the descriptor when that file lies in
// the lease (the agent may dup2 another file onto the number after any
// check, so the number is never judged and let through).
func handleIoctl(t *trap) {
	fd, req := int32(t.arg(0)), uint32(t.arg(1))
	if name, ok := terminalIoctls[req]; ok {
		t.deny(unix.EPERM, lease.BoundaryFile, lease.ReasonNotAllowed,
			fmt.Sprintf("ioctl %s on %s: terminal input injection is refused", name, fdPath(t.pid(), fd)), nil)
		return
	}
	name, ok := inodeIoctls[req]
	if !ok {
		t.fail(unix.EACCES) // the filter sends no other request
		return
	}
	if err := t.gate(); err != nil {
		t.denyLost(fmt.Sprintf("ioctl %s on %s", name, fdPath(t.pid(), fd)), err)
		return
	}
	dup, err := t.getFD(fd)
	if err != nil {
		t.failErr(err)
		return
	}
	defer unix.Close(dup)
	if real, ok := t.pr.inLease(dup); !ok {
		t.denyOutside(fmt.Sprintf("ioctl %s on %s", name, real))
		return
	}
	arg, err := t.ioctlArg(req)
	if err != nil {
		t.failErr(err)
		return
	}
	var pin runtime.Pinner
	defer pin.Unpin()
	if len(arg.buf) > 0 {
		pin.Pin(&arg.buf[0])
	}
	for _, b := range arg.refs {
		pin.Pin(&b[0])
	}
	var p unsafe.Pointer
	if len(arg.buf) > 0 {
		p = unsafe.Pointer(&arg.buf[0])
	}
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(dup), uintptr(req), uintptr(p))
	if errno != 0 {
		t.fail(errno)
		return
	}
	t.reply(int64(r))
}

// ioctlArgument is the supervisor's copy of an ioctl's argument: buf, and
// the buffers its pointers were rewritten to (kept pinned during the call).
type ioctlArgument struct {
	buf  []byte
	refs [][]byte
}

// ioctlArg copies the argument of an inode ioctl from the task.
func (t *trap) ioctlArg(req uint32) (ioctlArgument, error) {
	addr := t.arg(2)
	switch req {
	case ioctlSetFlags, ioctlSetFlags32, ioctlSetVersion, ioctlSetVersion32:
		b, err := t.mem(addr, 4) // the kernel reads an int for all four
		return ioctlArgument{buf: b}, memErr(err)
	case ioctlFSSetXattr:
		b, err := t.mem(addr, 28) // struct fsxattr
		return ioctlArgument{buf: b}, memErr(err)
	case ioctlSetEncryptPolicy:
		v, err := t.mem(addr, 1)
		if err != nil {
			return ioctlArgument{}, memErr(err)
		}
		n := 0
		switch v[0] {
		case 0: // FSCRYPT_POLICY_V1
			n = 12
		case 2: // FSCRYPT_POLICY_V2
			n = 24
		default:
			return ioctlArgument{}, unix.EINVAL
		}
		b, err := t.mem(addr, n)
		return ioctlArgument{buf: b}, memErr(err)
	case ioctlEnableVerity:
		// struct fsverity_enable_arg (128 bytes): salt_size at 12,
		// salt_ptr at 16, sig_size at 24, sig_ptr at 32.
		b, err := t.mem(addr, 128)
		if err != nil {
			return ioctlArgument{}, memErr(err)
		}
		a := ioctlArgument{buf: b}
		for _, f := range []struct{ size, ptr, max int }{{12, 16, 32}, {24, 32, 16128}} {
			n := int(binary.LittleEndian.Uint32(b[f.size:]))
			if n == 0 {
				continue
			}
			if n > f.max {
				return ioctlArgument{}, unix.EMSGSIZE
			}
			ref, err := t.mem(binary.LittleEndian.Uint64(b[f.ptr:]), n)
			if err != nil {
				return ioctlArgument{}, memErr(err)
			}
			a.refs = append(a.refs, ref)
			binary.LittleEndian.PutUint64(b[f.ptr:], uint64(uintptr(unsafe.Pointer(&ref[0]))))
		}
		return a, nil
	}
	return ioctlArgument{}, unix.EINVAL
}

// memErr is what a call answers when its argument cannot be read: EFAULT
// (or the error itself when the task is gone).
func memErr(err error) error {
	if err == nil || err == errTaskGone {
		return err
	}
	return unix.EFAULT
}
