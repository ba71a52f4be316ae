//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Classic BPF opcodes (linux/bpf_common.h).
const (
	bpfLdWAbs = 0x00 | 0x00 | 0x20 // BPF_LD|BPF_W|BPF_ABS
	bpfJeqK   = 0x05 | 0x10 | 0x00 // BPF_JMP|BPF_JEQ|BPF_K
	bpfJsetK  = 0x05 | 0x40 | 0x00 // BPF_JMP|BPF_JSET|BPF_K
	bpfRetK   = 0x06 | 0x00        // BPF_RET|BPF_K

	// struct seccomp_data offsets.
	offNr   = 0
	offArch = 4
	offArgs = 16

	retAllow  = unix.SECCOMP_RET_ALLOW
	retNotify = unix.SECCOMP_RET_USER_NOTIF
	retKill   = unix.SECCOMP_RET_KILL_PROCESS

	// writeOpenFlags make an open a write-open.
	writeOpenFlags = unix.O_WRONLY | unix.O_RDWR | unix.O_CREAT | unix.O_TRUNC | unix.O_APPEND

	// ioctls missing from x/sys/unix.
	ioctlNotifSetFlags = 0x40082104 // SECCOMP_IOW(4, __u64)
)

// asm is a tiny classic-BPF assembler with forward labels.
type asm struct {
	prog   []unix.SockFilter
	fixups []fixup
	labels map[string]int
}

type fixup struct {
	at     int
	jt, jf string
}

func (a *asm) stmt(code uint16, k uint32) { a.prog = append(a.prog, unix.SockFilter{Code: code, K: k}) }

// jump appends a conditional jump; "" means fall through.
func (a *asm) jump(code uint16, k uint32, jt, jf string) {
	a.fixups = append(a.fixups, fixup{at: len(a.prog), jt: jt, jf: jf})
	a.prog = append(a.prog, unix.SockFilter{Code: code, K: k})
}

func (a *asm) label(name string) {
	if a.labels == nil {
		a.labels = map[string]int{}
	}
	a.labels[name] = len(a.prog)
}

func (a *asm) assemble() ([]unix.SockFilter, error) {
	off := func(from int, name string) (uint8, error) {
		if name == "" {
			return 0, nil
		}
		to, ok := a.labels[name]
		if !ok {
			return 0, fmt.Errorf("bpf: undefined label %s", name)
		}
		d := to - from - 1
		if d < 0 || d > 255 {
			return 0, fmt.Errorf("bpf: jump to %s out of range (%d)", name, d)
		}
		return uint8(d), nil
	}
	for _, f := range a.fixups {
		jt, err := off(f.at, f.jt)
		if err != nil {
			return nil, err
		}
		jf, err := off(f.at, f.jf)
		if err != nil {
			return nil, err
		}
		a.prog[f.at].Jt, a.prog[f.at].Jf = jt, jf
	}
	return a.prog, nil
}

// filterProgram is the seccomp filter of a guarded attempt: a foreign
// architecture (or x32) kills the process; io_uring is refused (its
// operations would bypass the filter); open/openat trap only with write,
// create, truncate or append flags; every other write-class call traps;
// everything else is allowed without leaving the kernel.
func filterProgram() ([]unix.SockFilter, error) {
	calls := writeSyscalls()
	var a asm
	a.stmt(bpfLdWAbs, offArch)
	a.jump(bpfJeqK, auditArch, "", "kill")
	a.stmt(bpfLdWAbs, offNr)
	if x32Bit != 0 {
		a.jump(bpfJsetK, x32Bit, "kill", "")
	}
	nrs := make([]uint32, 0, len(calls))
	for nr := range calls {
		nrs = append(nrs, nr)
	}
	slices.Sort(nrs)
	for _, nr := range nrs {
		s := calls[nr]
		if s.custom {
			continue
		}
		if s.flags >= 0 {
			a.jump(bpfJeqK, nr, "flags"+strconv.Itoa(s.flags), "")
		} else {
			a.jump(bpfJeqK, nr, "notify", "")
		}
	}
	a.jump(bpfJeqK, unix.SYS_IO_URING_SETUP, "eperm", "")
	for _, e := range filterEmitters {
		e.jumps(&a)
	}
	a.label("allow")
	a.stmt(bpfRetK, retAllow)
	for _, e := range filterEmitters {
		e.blocks(&a)
	}
	a.label("notify")
	a.stmt(bpfRetK, retNotify)
	a.label("eperm")
	a.stmt(bpfRetK, unix.SECCOMP_RET_ERRNO|uint32(unix.EPERM))
	a.label("kill")
	a.stmt(bpfRetK, retKill)
	for _, idx := range []int{1, 2} {
		a.label("flags" + strconv.Itoa(idx))
		a.stmt(bpfLdWAbs, uint32(offArgs+8*idx)) // low word (little endian)
		a.jump(bpfJsetK, writeOpenFlags, "", "allow"+strconv.Itoa(idx))
		a.stmt(bpfRetK, retNotify)
		a.label("allow" + strconv.Itoa(idx))
		a.stmt(bpfRetK, retAllow)
	}
	return a.assemble()
}

// installFilter installs the filter on the calling thread and returns the
// user-notification listener. no_new_privs must be set.
func installFilter() (int, error) {
	prog, err := filterProgram()
	if err != nil {
		return -1, err
	}
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	// WAIT_KILLABLE_RECV (Linux 5.19+): once the supervisor received a
	// call, only a fatal signal ends the task's wait. Otherwise a signal
	// could interrupt a call the supervisor already performed (a connect)
	// and the kernel would restart it: the agent would see EISCONN.
	fd, _, errno := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
		unix.SECCOMP_FILTER_FLAG_NEW_LISTENER|unix.SECCOMP_FILTER_FLAG_WAIT_KILLABLE_RECV, uintptr(unsafe.Pointer(&fprog)))
	if errno == unix.EINVAL {
		fd, _, errno = unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER,
			unix.SECCOMP_FILTER_FLAG_NEW_LISTENER, uintptr(unsafe.Pointer(&fprog)))
	}
	if errno != 0 {
		return -1, fmt.Errorf("seccomp(SET_MODE_FILTER, NEW_LISTENER): %w", errno)
	}
	return int(fd), nil
}

// seccompNotif and seccompNotifResp are struct seccomp_notif and
// struct seccomp_notif_resp.
type seccompNotif struct {
	id    uint64
	pid   uint32
	flags uint32
	nr    int32
	arch  uint32
	ip    uint64
	args  [6]uint64
}

type seccompNotifResp struct {
	id    uint64
	val   int64
	error int32
	flags uint32
}

func notifRecv(fd int, n *seccompNotif) error {
	*n = seccompNotif{}
	// Raw: called only after poll reported a pending notification, so it
	// does not block.
	_, _, errno := unix.RawSyscall(unix.SYS_IOCTL, uintptr(fd), unix.SECCOMP_IOCTL_NOTIF_RECV, uintptr(unsafe.Pointer(n)))
	if errno != 0 {
		return errno
	}
	return nil
}

func notifSend(fd int, r *seccompNotifResp) error {
	_, _, errno := unix.RawSyscall(unix.SYS_IOCTL, uintptr(fd), unix.SECCOMP_IOCTL_NOTIF_SEND, uintptr(unsafe.Pointer(r)))
	if errno != 0 {
		return errno
	}
	return nil
}

// notifValid reports whether the trapped call id is still waiting: the
// task has not died and its pid was not reused, so what we read from its
// /proc entries was its own.
func notifValid(fd int, id uint64) bool {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SECCOMP_IOCTL_NOTIF_ID_VALID, uintptr(unsafe.Pointer(&id)))
	return errno == 0
}

// setSyncWakeup asks the kernel to run the supervisor on the trapping
// task's CPU (Linux 6.6+), which roughly halves the round trip.
func setSyncWakeup(fd int) error {
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), ioctlNotifSetFlags, unix.SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)
	if errno != 0 {
		return errno
	}
	return nil
}

// denial describes a refused call for the audit event.
type denial struct {
	call      string
	paths     []string
	flags     string
	rawFlags  uint64
	haveFlags bool
}

func (d denial) String() string {
	s := d.call + " " + strings.Join(d.paths, " -> ")
	if d.flags != "" {
		s += " (" + d.flags + ")"
	}
	return s
}

// describe reads the target path(s) of a trapped call from the task.
func describe(n *seccompNotif, s sysSpec) denial {
	d := denial{call: s.name}
	pid := int(n.pid)
	if s.fd >= 0 {
		d.paths = append(d.paths, fdPath(pid, int32(n.args[s.fd])))
	}
	if s.path >= 0 {
		d.paths = append(d.paths, targetPath(pid, n, s.dirfd, s.path))
	}
	if s.path2 >= 0 {
		d.paths = append(d.paths, targetPath(pid, n, s.dir2, s.path2))
	}
	if s.flags >= 0 {
		d.rawFlags, d.haveFlags = n.args[s.flags], true
	}
	if s.how >= 0 {
		if b, err := readMemN(pid, n.args[s.how], 8); err == nil {
			d.rawFlags, d.haveFlags = binary.LittleEndian.Uint64(b), true
		}
	}
	if d.haveFlags {
		d.flags = openFlags(d.rawFlags)
	}
	return d
}

func openFlags(f uint64) string {
	var out []string
	switch f & unix.O_ACCMODE {
	case unix.O_WRONLY:
		out = append(out, "O_WRONLY")
	case unix.O_RDWR:
		out = append(out, "O_RDWR")
	default:
		out = append(out, "O_RDONLY")
	}
	for _, fl := range []struct {
		bit  uint64
		name string
	}{{unix.O_CREAT, "O_CREAT"}, {unix.O_TRUNC, "O_TRUNC"}, {unix.O_APPEND, "O_APPEND"}, {unix.O_EXCL, "O_EXCL"}} {
		if f&fl.bit != 0 {
			out = append(out, fl.name)
		}
	}
	return strings.Join(out, "|")
}

func fdPath(pid int, fd int32) string {
	p, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", pid, fd))
	if err != nil {
		return fmt.Sprintf("fd %d", fd)
	}
	return p
}

func targetPath(pid int, n *seccompNotif, dirArg, pathArg int) string {
	addr := n.args[pathArg]
	if addr == 0 {
		if dirArg >= 0 {
			return fdPath(pid, int32(n.args[dirArg]))
		}
		return "(null)"
	}
	b, err := readMem(pid, addr, unix.PathMax)
	if err != nil {
		return fmt.Sprintf("(unreadable path: %v)", err)
	}
	if i := slices.Index(b, 0); i >= 0 {
		b = b[:i]
	}
	p := string(b)
	if filepath.IsAbs(p) {
		return filepath.Clean(p)
	}
	base := ""
	if dirArg >= 0 && int32(n.args[dirArg]) != unix.AT_FDCWD {
		base = fdPath(pid, int32(n.args[dirArg]))
	} else if cwd, err := os.Readlink(fmt.Sprintf("/proc/%d/cwd", pid)); err == nil {
		base = cwd
	}
	return filepath.Join(base, p)
}

// readMem reads up to max bytes at addr of pid's memory, stopping at the
// first NUL or unmapped page.
func readMem(pid int, addr uint64, max int) ([]byte, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []byte
	for len(out) < max {
		chunk := 4096 - int((addr+uint64(len(out)))%4096)
		chunk = min(chunk, max-len(out))
		buf := make([]byte, chunk)
		n, err := f.ReadAt(buf, int64(addr)+int64(len(out)))
		out = append(out, buf[:n]...)
		if slices.Contains(buf[:n], 0) || err != nil || n < chunk {
			if len(out) == 0 && err != nil {
				return nil, err
			}
			break
		}
	}
	return out, nil
}

// readMemN reads exactly n bytes at addr of pid's memory.
func readMemN(pid int, addr uint64, n int) ([]byte, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/mem", pid))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, int64(addr)); err != nil {
		return nil, err
	}
	return b, nil
}
