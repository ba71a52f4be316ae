//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// Emulated calls. Landlock does not govern metadata (chmod, chown, times,
// xattrs), so while the lease holds the supervisor performs those itself on
// a descriptor it resolved once and judged by its real path. After the
// loss, write-opens and namespace changes in the private temp dir and
// write-opens of harmless devices and pipes are performed by the
// supervisor too (the new descriptor handed over with ADDFD); everything
// else stays refused.

// callHandlers give the calls of both architectures, by name, the handler
// that answers them (see writeSyscalls).
var callHandlers = map[string]func(*trap){
	// metadata: emulated while the lease holds, refused after
	"fchmod":        metaCall{fd: 0, do: doChmod, mode: 1}.handle,
	"chmod":         metaCall{fd: -1, dir: -1, path: 0, do: doChmod, mode: 1}.handle,
	"fchmodat":      metaCall{fd: -1, dir: 0, path: 1, do: doChmod, mode: 2}.handle,
	"fchmodat2":     metaCall{fd: -1, dir: 0, path: 1, atFlags: 3, do: doChmod, mode: 2}.handle,
	"fchown":        metaCall{fd: 0, do: doChown, owner: 1}.handle,
	"chown":         metaCall{fd: -1, dir: -1, path: 0, do: doChown, owner: 1}.handle,
	"lchown":        metaCall{fd: -1, dir: -1, path: 0, nofollow: true, do: doChown, owner: 1}.handle,
	"fchownat":      metaCall{fd: -1, dir: 0, path: 1, atFlags: 4, do: doChown, owner: 2}.handle,
	"utimensat":     metaCall{fd: -1, dir: 0, path: 1, atFlags: 3, nullIsFD: true, do: doTimes, times: 2, timeKind: timesNs}.handle,
	"utime":         metaCall{fd: -1, dir: -1, path: 0, do: doTimes, times: 1, timeKind: timesUtimbuf}.handle,
	"utimes":        metaCall{fd: -1, dir: -1, path: 0, do: doTimes, times: 1, timeKind: timesUs}.handle,
	"futimesat":     metaCall{fd: -1, dir: 0, path: 1, nullIsFD: true, do: doTimes, times: 2, timeKind: timesUs}.handle,
	"setxattr":      metaCall{fd: -1, dir: -1, path: 0, do: doSetxattr, name: 1, value: 2}.handle,
	"lsetxattr":     metaCall{fd: -1, dir: -1, path: 0, nofollow: true, do: doSetxattr, name: 1, value: 2}.handle,
	"fsetxattr":     metaCall{fd: 0, do: doSetxattr, name: 1, value: 2}.handle,
	"setxattrat":    metaCall{fd: -1, dir: 0, path: 1, atFlags: 2, do: doSetxattrat, name: 3, value: 4}.handle,
	"removexattr":   metaCall{fd: -1, dir: -1, path: 0, do: doRemovexattr, name: 1}.handle,
	"lremovexattr":  metaCall{fd: -1, dir: -1, path: 0, nofollow: true, do: doRemovexattr, name: 1}.handle,
	"fremovexattr":  metaCall{fd: 0, do: doRemovexattr, name: 1}.handle,
	"removexattrat": metaCall{fd: -1, dir: 0, path: 1, atFlags: 2, do: doRemovexattr, name: 3}.handle,
	"file_setattr":  metaCall{fd: -1, dir: 0, path: 1, atFlags: 4, do: doFileSetattr, value: 2}.handle,

	// write-opens and namespace changes: CONTINUE to Landlock while the
	// lease holds; after the loss only the temp dir and harmless devices
	"open":      openCall{dir: -1, path: 0, flags: 1, mode: 2, how: -1}.handle,
	"openat":    openCall{dir: 0, path: 1, flags: 2, mode: 3, how: -1}.handle,
	"creat":     openCall{dir: -1, path: 0, flags: -1, mode: 1, how: -1}.handle,
	"openat2":   openCall{dir: 0, path: 1, flags: -1, mode: -1, how: 2}.handle,
	"mkdir":     nsCall{op: nsMkdir, dir: -1, path: 0, arg: 1}.handle,
	"mkdirat":   nsCall{op: nsMkdir, dir: 0, path: 1, arg: 2}.handle,
	"unlink":    nsCall{op: nsUnlink, dir: -1, path: 0, arg: -1}.handle,
	"unlinkat":  nsCall{op: nsUnlink, dir: 0, path: 1, arg: 2}.handle,
	"rmdir":     nsCall{op: nsRmdir, dir: -1, path: 0, arg: -1}.handle,
	"rename":    nsCall{op: nsRename, dir: -1, path: 0, dir2: -1, path2: 1, arg: -1}.handle,
	"renameat":  nsCall{op: nsRename, dir: 0, path: 1, dir2: 2, path2: 3, arg: -1}.handle,
	"renameat2": nsCall{op: nsRename, dir: 0, path: 1, dir2: 2, path2: 3, arg: 4}.handle,
}

// denyLost refuses a call because the lease is not live, audited as the
// default path does.
func (t *trap) denyLost(what string, gateErr error) {
	t.fail(unix.EACCES)
	t.pr.refused(lease.LeaseReason(gateErr))
	t.pr.enqueueAudit(denial{call: what}, gateErr)
}

// denyLostCall is denyLost describing the call from its spec.
func (t *trap) denyLostCall(gateErr error) {
	d := describe(t.n, t.spec)
	t.denyLost(d.String(), gateErr)
}

// denyOutside refuses a call whose target lies outside the lease.
func (t *trap) denyOutside(what string) {
	t.deny(unix.EACCES, lease.BoundaryFile, lease.ReasonOutsideLease, what+" (outside the lease)", nil)
}

// inLease reports whether the file of the supervisor's descriptor fd lies
// beneath a writable path of the policy (real paths, resolved at Start)
// or the private temp dir, and returns its real path. A deleted file is
// never in the lease.
func (pr *Process) inLease(fd int) (string, bool) {
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return fmt.Sprintf("(fd: %v)", err), false
	}
	if !filepath.IsAbs(real) || strings.HasSuffix(real, " (deleted)") {
		return real, false
	}
	for _, w := range pr.writableReal {
		if within(real, w) {
			return real, true
		}
	}
	return real, false
}

// taskPath rewrites a path the task spelled so that the supervisor opens
// what the task would: /proc/self, /proc/thread-self and /dev/fd, stdin,
// stdout, stderr name the task's own entries, not the supervisor's.
func (t *trap) taskPath(p string) string {
	task := "/proc/" + strconv.Itoa(t.pid())
	for _, m := range []struct{ from, to string }{
		{"/proc/self", task}, {"/proc/thread-self", task},
		{"/dev/fd", task + "/fd"}, {"/dev/stdin", task + "/fd/0"},
		{"/dev/stdout", task + "/fd/1"}, {"/dev/stderr", task + "/fd/2"},
	} {
		if p == m.from || strings.HasPrefix(p, m.from+"/") {
			return m.to + p[len(m.from):]
		}
	}
	return p
}

// dirFD opens (O_PATH) the directory a relative path of the task starts
// from: its cwd, or its descriptor dirfd.
func (t *trap) dirFD(dirArg int) (int, error) {
	base := fmt.Sprintf("/proc/%d/cwd", t.pid())
	if dirArg >= 0 && int32(t.arg(dirArg)) != unix.AT_FDCWD {
		base = fmt.Sprintf("/proc/%d/fd/%d", t.pid(), int32(t.arg(dirArg)))
	}
	fd, err := unix.Open(base, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) {
			err = unix.EBADF
		}
		return -1, err
	}
	if !t.valid() {
		unix.Close(fd)
		return -1, errTaskGone
	}
	return fd, nil
}

// resolve opens (O_PATH) the file path names for the task, relative to
// dirArg; nofollow keeps a final symlink.
func (t *trap) resolve(dirArg int, path string, nofollow bool) (int, error) {
	flags := unix.O_PATH | unix.O_CLOEXEC
	if nofollow {
		flags |= unix.O_NOFOLLOW
	}
	if filepath.IsAbs(path) {
		fd, err := unix.Open(t.taskPath(path), flags, 0)
		if err != nil {
			return -1, err
		}
		if !t.valid() {
			unix.Close(fd)
			return -1, errTaskGone
		}
		return fd, nil
	}
	base, err := t.dirFD(dirArg)
	if err != nil {
		return -1, err
	}
	defer unix.Close(base)
	return unix.Openat(base, path, flags, 0)
}

// metaCall describes a metadata call: where its target is and what to do
// with it (argument indexes, -1 for none).
type metaCall struct {
	fd        int // the target is this open descriptor (fchmod, fsetxattr...)
	dir, path int
	atFlags   int  // AT_SYMLINK_NOFOLLOW / AT_EMPTY_PATH; 0: none (never the first argument)
	nofollow  bool // l-variants
	nullIsFD  bool // a NULL path means dir itself (utimensat, futimesat)
	do        func(t *trap, c metaCall, fd int, viaPath bool) error
	mode      int
	owner     int
	times     int
	timeKind  int
	name      int
	value     int
}

const (
	timesNs      = iota // struct timespec[2]
	timesUs             // struct timeval[2]
	timesUtimbuf        // struct utimbuf
)

// handle answers a metadata call: refused after the loss; while the lease
// holds, the target is resolved once into a descriptor of the supervisor,
// judged by its real path and changed through that descriptor.
func (c metaCall) handle(t *trap) {
	if err := t.gate(); err != nil {
		t.denyLostCall(err)
		return
	}
	fd, viaPath, err := c.target(t)
	if err != nil {
		t.failErr(err)
		return
	}
	defer unix.Close(fd)
	if real, ok := t.pr.inLease(fd); !ok {
		t.denyOutside(t.spec.name + " " + real)
		return
	}
	if err := c.do(t, c, fd, viaPath); err != nil {
		t.failErr(err)
		return
	}
	t.reply(0)
}

// target opens the call's target: a duplicate of the task's descriptor
// (viaPath false: act on the open file itself) or an O_PATH descriptor of
// the resolved path (viaPath true: act through /proc/self/fd or
// AT_EMPTY_PATH).
func (c metaCall) target(t *trap) (fd int, viaPath bool, err error) {
	if c.fd >= 0 {
		fd, err := t.getFD(int32(t.arg(c.fd)))
		return fd, false, err
	}
	var flags uint64
	if c.atFlags > 0 {
		flags = t.arg(c.atFlags)
	}
	nofollow := c.nofollow || flags&unix.AT_SYMLINK_NOFOLLOW != 0
	addr := t.arg(c.path)
	if addr == 0 && c.nullIsFD {
		fd, err := t.getFD(int32(t.arg(c.dir)))
		return fd, false, err
	}
	p, err := t.str(addr)
	if err != nil {
		return -1, false, memErr(err)
	}
	if p == "" {
		if flags&unix.AT_EMPTY_PATH == 0 || c.dir < 0 {
			return -1, false, unix.ENOENT
		}
		if int32(t.arg(c.dir)) == unix.AT_FDCWD {
			fd, err := t.dirFD(c.dir)
			return fd, true, err
		}
		fd, err := t.getFD(int32(t.arg(c.dir)))
		return fd, true, err
	}
	fd, err = t.resolve(c.dir, p, nofollow)
	return fd, true, err
}

func procFD(fd int) string { return "/proc/self/fd/" + strconv.Itoa(fd) }

func isSymlink(fd int) bool {
	var st unix.Stat_t
	return unix.Fstatat(fd, "", &st, unix.AT_EMPTY_PATH) == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK
}

func doChmod(t *trap, c metaCall, fd int, viaPath bool) error {
	mode := uint32(t.arg(c.mode))
	if !viaPath {
		return unix.Fchmod(fd, mode)
	}
	if isSymlink(fd) {
		return unix.EOPNOTSUPP // as fchmodat2(AT_SYMLINK_NOFOLLOW) on a symlink
	}
	return unix.Fchmodat(unix.AT_FDCWD, procFD(fd), mode, 0)
}

func doChown(t *trap, c metaCall, fd int, viaPath bool) error {
	uid, gid := int(int32(t.arg(c.owner))), int(int32(t.arg(c.owner+1)))
	if !viaPath {
		return unix.Fchown(fd, uid, gid)
	}
	return unix.Fchownat(fd, "", uid, gid, unix.AT_EMPTY_PATH)
}

func doTimes(t *trap, c metaCall, fd int, _ bool) error {
	var ts *[2]unix.Timespec
	if addr := t.arg(c.times); addr != 0 {
		b, err := t.mem(addr, 32)
		if c.timeKind == timesUtimbuf {
			b, err = t.mem(addr, 16)
		}
		if err != nil {
			return memErr(err)
		}
		le := binary.LittleEndian
		ts = new([2]unix.Timespec)
		switch c.timeKind {
		case timesNs:
			for i := range 2 {
				ts[i] = unix.Timespec{Sec: int64(le.Uint64(b[16*i:])), Nsec: int64(le.Uint64(b[16*i+8:]))}
			}
		case timesUs:
			for i := range 2 {
				us := int64(le.Uint64(b[16*i+8:]))
				if us < 0 || us >= 1_000_000 {
					return unix.EINVAL
				}
				ts[i] = unix.Timespec{Sec: int64(le.Uint64(b[16*i:])), Nsec: us * 1000}
			}
		case timesUtimbuf:
			for i := range 2 {
				ts[i] = unix.Timespec{Sec: int64(le.Uint64(b[8*i:]))}
			}
		}
	}
	empty := [1]byte{}
	_, _, errno := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), uintptr(unsafe.Pointer(&empty[0])),
		uintptr(unsafe.Pointer(ts)), unix.AT_EMPTY_PATH, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

const xattrSizeMax = 65536 // XATTR_SIZE_MAX

func (t *trap) xattrName(c metaCall) (string, error) {
	name, err := t.str(t.arg(c.name))
	if err != nil {
		return "", memErr(err)
	}
	if len(name) == 0 || len(name) > 255 {
		return "", unix.ERANGE
	}
	return name, nil
}

func setxattrOn(fd int, viaPath bool, name string, val []byte, flags int) error {
	if !viaPath {
		return unix.Fsetxattr(fd, name, val, flags)
	}
	return unix.Setxattr(procFD(fd), name, val, flags)
}

func doSetxattr(t *trap, c metaCall, fd int, viaPath bool) error {
	name, err := t.xattrName(c)
	if err != nil {
		return err
	}
	size := t.arg(c.value + 1)
	if size > xattrSizeMax {
		return unix.E2BIG
	}
	val, err := t.mem(t.arg(c.value), int(size))
	if err != nil {
		return memErr(err)
	}
	return setxattrOn(fd, viaPath, name, val, int(int32(t.arg(c.value+2))))
}

// doSetxattrat: setxattrat(dirfd, path, at_flags, name, struct xattr_args
// *args, size); xattr_args is {u64 value; u32 size; u32 flags}.
func doSetxattrat(t *trap, c metaCall, fd int, viaPath bool) error {
	name, err := t.xattrName(c)
	if err != nil {
		return err
	}
	if usize := t.arg(c.value + 1); usize < 16 || usize > 4096 {
		return unix.EINVAL
	}
	a, err := t.mem(t.arg(c.value), 16)
	if err != nil {
		return memErr(err)
	}
	le := binary.LittleEndian
	size := le.Uint32(a[8:])
	if size > xattrSizeMax {
		return unix.E2BIG
	}
	val, err := t.mem(le.Uint64(a), int(size))
	if err != nil {
		return memErr(err)
	}
	return setxattrOn(fd, viaPath, name, val, int(le.Uint32(a[12:])))
}

func doRemovexattr(t *trap, c metaCall, fd int, viaPath bool) error {
	name, err := t.xattrName(c)
	if err != nil {
		return err
	}
	if !viaPath {
		return unix.Fremovexattr(fd, name)
	}
	return unix.Removexattr(procFD(fd), name)
}

// fileAttrSizeVer0 is FILE_ATTR_SIZE_VER0, the smallest struct file_attr.
const fileAttrSizeVer0 = 24

// doFileSetattr: file_setattr(dirfd, path, struct file_attr *attr, size,
// at_flags) (Linux 6.17) sets what FS_IOC_FSSETXATTR sets, by path. The
// supervisor copies the struct and calls it on its descriptor, through
// /proc/self/fd (file_setattr takes no O_PATH descriptor).
func doFileSetattr(t *trap, c metaCall, fd int, _ bool) error {
	size := t.arg(c.value + 1)
	if size > 4096 {
		return unix.E2BIG
	}
	if size < fileAttrSizeVer0 {
		return unix.EINVAL
	}
	b, err := t.mem(t.arg(c.value), int(size))
	if err != nil {
		return memErr(err)
	}
	p, err := unix.BytePtrFromString(procFD(fd))
	if err != nil {
		return err
	}
	cwd := unix.AT_FDCWD
	_, _, errno := unix.Syscall6(unix.SYS_FILE_SETATTR, uintptr(cwd), uintptr(unsafe.Pointer(p)),
		uintptr(unsafe.Pointer(&b[0])), uintptr(size), 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// openCall describes a write-open: argument indexes, -1 for none (creat
// has no flags; openat2 keeps flags and mode in its struct open_how).
type openCall struct {
	dir, path, flags, mode, how int
}

// handle lets a write-open meet Landlock while the lease holds (CONTINUE:
// the kernel judges it). After the loss the supervisor opens the target
// itself when it lies in the private temp dir or is a harmless device or
// pipe, and hands the descriptor over; everything else is refused. A
// read-only openat2 gets ENOSYS (libc and Go fall back to openat, which
// the filter lets through without a round trip).
func (c openCall) handle(t *trap) {
	gateErr := t.gate()
	if gateErr == nil {
		t.proceed()
		return
	}
	flags, mode := uint64(unix.O_CREAT|unix.O_WRONLY|unix.O_TRUNC), uint64(0)
	var resolve uint64
	switch {
	case c.how >= 0:
		if size := t.arg(c.how + 1); size < 24 {
			t.fail(unix.EINVAL)
			return
		}
		b, err := t.mem(t.arg(c.how), 24)
		if err != nil {
			t.failErr(memErr(err))
			return
		}
		le := binary.LittleEndian
		flags, mode, resolve = le.Uint64(b), le.Uint64(b[8:]), le.Uint64(b[16:])
		if flags&writeOpenFlags == 0 {
			t.fail(unix.ENOSYS)
			return
		}
	case c.flags >= 0:
		flags = uint64(uint32(t.arg(c.flags)))
		mode = t.arg(c.mode)
	default:
		mode = t.arg(c.mode)
	}
	p, err := t.str(t.arg(c.path))
	if err != nil {
		t.failErr(memErr(err))
		return
	}
	if p == "" {
		t.fail(unix.ENOENT)
		return
	}
	what := fmt.Sprintf("%s %s (%s)", t.spec.name, t.spelled(c.dir, p), openFlags(flags))
	if rel, ok := t.beneathTmp(c.dir, p); ok {
		fd, err := t.pr.openInTmp(t, rel, flags, mode, resolve)
		if err == nil {
			t.handOver(fd, flags)
			return
		}
		if errors.Is(err, errNotHarmless) || errors.Is(err, errHardLinked) {
			t.denyLost(what+": "+err.Error(), gateErr)
			return
		}
		if !errors.Is(err, unix.EXDEV) {
			t.failErr(err)
			return
		}
		// it leads out of the temp dir: only a harmless target may open
	}
	fd, err := t.openHarmless(c.dir, p, flags)
	switch {
	case err == nil:
		t.handOver(fd, flags)
	case errors.Is(err, errNotHarmless):
		t.denyLost(what, gateErr)
	default:
		t.failErr(err)
	}
}

// handOver installs the supervisor's new descriptor fd in the task as the
// call's result (O_CLOEXEC as the task asked) and closes fd.
func (t *trap) handOver(fd int, flags uint64) {
	defer unix.Close(fd)
	if err := t.addFD(fd, flags&unix.O_CLOEXEC != 0); err != nil && !t.sent {
		t.failErr(err)
	}
}

// spelled is the absolute spelling of a path of the task (relative ones
// joined to its cwd or dirfd as the kernel names them now), cleaned.
func (t *trap) spelled(dirArg int, p string) string {
	if filepath.IsAbs(p) {
		return filepath.Clean(p)
	}
	base := fmt.Sprintf("/proc/%d/cwd", t.pid())
	if dirArg >= 0 && int32(t.arg(dirArg)) != unix.AT_FDCWD {
		base = fmt.Sprintf("/proc/%d/fd/%d", t.pid(), int32(t.arg(dirArg)))
	}
	b, err := os.Readlink(base)
	if err != nil || !filepath.IsAbs(b) {
		return "(unresolved)/" + p
	}
	return filepath.Join(b, p)
}

// beneathTmp reports whether the task's path is spelled beneath its
// private temp dir and returns it relative to that dir ("." for the dir).
// The spelling only chooses where to look: the open itself is resolved
// beneath the supervisor's descriptor of the dir (RESOLVE_BENEATH), so
// a symlink or ".." leading out fails with EXDEV.
func (t *trap) beneathTmp(dirArg int, p string) (string, bool) {
	abs := t.spelled(dirArg, p)
	if !t.valid() {
		return "", false
	}
	for _, d := range []string{t.pr.tmpDir, t.pr.tmpReal} {
		if d == "" || !within(abs, d) {
			continue
		}
		rel := strings.TrimPrefix(strings.TrimPrefix(abs, d), "/")
		if rel == "" {
			rel = "."
		}
		return rel, true
	}
	return "", false
}

// openFlagsKnown are the open flags the supervisor passes on (openat2
// refuses unknown bits that open ignores).
const openFlagsKnown = unix.O_ACCMODE | unix.O_CREAT | unix.O_EXCL | unix.O_NOCTTY | unix.O_TRUNC | unix.O_APPEND |
	unix.O_NONBLOCK | unix.O_DSYNC | unix.O_SYNC | unix.O_DIRECT | unix.O_LARGEFILE | unix.O_DIRECTORY |
	unix.O_NOFOLLOW | unix.O_NOATIME | unix.O_TMPFILE | unix.O_ASYNC

const tmpResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_MAGICLINKS

// openInTmp opens rel beneath the private temp dir as the task asked,
// under the task's umask. An existing file is looked up first without side
// effects (O_PATH) and judged before it is reopened with the task's flags:
// a regular file with other hard links may be a leased file linked into
// the temp dir while the lease held, and is refused; FIFOs and devices get
// the treatment of openHarmless. A new file is created with O_EXCL, so no
// file renamed into its place meanwhile is opened unjudged.
func (pr *Process) openInTmp(t *trap, rel string, flags, mode, resolve uint64) (int, error) {
	res := tmpResolve | resolve&(unix.RESOLVE_NO_XDEV|unix.RESOLVE_NO_SYMLINKS|unix.RESOLVE_NO_MAGICLINKS)
	how := unix.OpenHow{Flags: flags&openFlagsKnown | unix.O_CLOEXEC | unix.O_NOCTTY, Resolve: res}
	if flags&unix.O_TMPFILE == unix.O_TMPFILE { // a new unnamed file: nothing existing is opened
		how.Mode = mode & 0o7777
		if err := pr.useTaskUmask(t); err != nil {
			return -1, err
		}
		return unix.Openat2(pr.tmpFD, rel, &how)
	}
	err := error(unix.EEXIST)
	for range 8 { // another thread may create and remove the name meanwhile
		pfd, err := unix.Openat2(pr.tmpFD, rel, &unix.OpenHow{
			Flags: unix.O_PATH | unix.O_CLOEXEC | flags&(unix.O_NOFOLLOW|unix.O_DIRECTORY), Resolve: res})
		if err == nil {
			if flags&(unix.O_CREAT|unix.O_EXCL) == unix.O_CREAT|unix.O_EXCL {
				unix.Close(pfd)
				return -1, unix.EEXIST
			}
			fd, err := t.reopen(pfd, flags, true)
			unix.Close(pfd)
			return fd, err
		}
		if !errors.Is(err, unix.ENOENT) || flags&unix.O_CREAT == 0 {
			return -1, err
		}
		how.Flags |= unix.O_EXCL
		how.Mode = mode & 0o7777
		if err := pr.useTaskUmask(t); err != nil {
			return -1, err
		}
		fd, err := unix.Openat2(pr.tmpFD, rel, &how)
		if !errors.Is(err, unix.EEXIST) || flags&unix.O_EXCL != 0 {
			return fd, err
		}
	}
	return -1, err
}

// useTaskUmask sets the supervisor thread's umask (its own: the notify
// loop unshared CLONE_FS) to the task's, so what it creates for the task
// gets the modes the task's own call would.
func (pr *Process) useTaskUmask(t *trap) error {
	if !pr.ownUmask {
		return nil
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", t.pid()))
	if err != nil {
		return errTaskGone
	}
	for l := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(l, "Umask:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32)
			if err != nil {
				return unix.EACCES
			}
			unix.Umask(int(m))
			return nil
		}
	}
	return unix.EACCES
}

var (
	errNotHarmless = errors.New("not a harmless target")
	errHardLinked  = errors.New("a file with other hard links")
)

// openHarmless opens the task's path when it names a harmless target:
// /dev/null, /dev/zero, /dev/full, /dev/tty (when it is the supervisor's
// terminal too), /dev/ptmx, a pty, the task's own terminal, or a pipe
// the task holds itself.
// It resolves the path without side effects first (O_PATH), checks what
// it found, then reopens that very file (see reopen).
func (t *trap) openHarmless(dirArg int, p string, flags uint64) (int, error) {
	pfd, err := t.resolve(dirArg, p, flags&unix.O_NOFOLLOW != 0)
	if err != nil {
		return -1, errNotHarmless
	}
	defer unix.Close(pfd)
	return t.reopen(pfd, flags, false)
}

// reopen opens the file of the O_PATH descriptor pfd through
// /proc/self/fd with the task's flags (never creating: O_CREAT and O_EXCL
// dropped) when it is harmless: a pipe the task holds or a harmless
// character device, or, with inTmp, a FIFO, a directory or a regular file
// with no other hard link. A
// FIFO is opened O_NONBLOCK so the supervisor never blocks (ENXIO when no
// reader is there), the flag cleared afterwards unless the task asked for
// it.
func (t *trap) reopen(pfd int, flags uint64, inTmp bool) (int, error) {
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil {
		return -1, errNotHarmless
	}
	fifo := false
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFIFO:
		// The supervisor resolved the path with its own credentials and
		// no Landlock: /proc/PID/fd/N of another process, or a named FIFO
		// that Landlock keeps the agent from opening for writing. Only a
		// FIFO in the temp dir, or a pipe the task already holds (its
		// /dev/stdout), is the agent's own.
		if !inTmp && !t.holdsPipe(pfd, st) {
			return -1, errNotHarmless
		}
		fifo = true
	case unix.S_IFCHR:
		if !t.harmlessDevice(st.Rdev) {
			return -1, errNotHarmless
		}
	case unix.S_IFDIR:
		if !inTmp {
			return -1, errNotHarmless
		}
	case unix.S_IFREG:
		if !inTmp {
			return -1, errNotHarmless
		}
		if st.Nlink > 1 {
			return -1, errHardLinked
		}
	case unix.S_IFLNK:
		return -1, unix.ELOOP // O_NOFOLLOW on a symlink
	default:
		return -1, errNotHarmless
	}
	of := int(flags&openFlagsKnown&^(unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_TMPFILE)) | unix.O_CLOEXEC | unix.O_NOCTTY
	if fifo {
		of |= unix.O_NONBLOCK
	}
	fd, err := unix.Open(procFD(pfd), of, 0)
	if err != nil {
		return -1, err
	}
	if fifo && flags&unix.O_NONBLOCK == 0 {
		fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
		if err == nil {
			_, err = unix.FcntlInt(uintptr(fd), unix.F_SETFL, fl&^unix.O_NONBLOCK)
		}
		if err != nil {
			unix.Close(fd)
			return -1, err
		}
	}
	return fd, nil
}

// pipefsMagic is PIPEFS_MAGIC: the file system of anonymous pipes.
const pipefsMagic = 0x50495045

// holdsPipe reports whether the FIFO of pfd (with stat st) is an
// anonymous pipe one of the task's own descriptors refers to.
func (t *trap) holdsPipe(pfd int, st unix.Stat_t) bool {
	var fs unix.Statfs_t
	if unix.Fstatfs(pfd, &fs) != nil || fs.Type != pipefsMagic {
		return false
	}
	dir := fmt.Sprintf("/proc/%d/fd", t.pid())
	ents, err := os.ReadDir(dir)
	if err != nil {
		return false
	}
	for _, e := range ents {
		var fst unix.Stat_t
		if unix.Stat(dir+"/"+e.Name(), &fst) == nil && fst.Dev == st.Dev && fst.Ino == st.Ino {
			return t.valid()
		}
	}
	return false
}

// harmlessDevice reports whether writing the character device rdev
// changes nothing but a terminal's output or nothing at all.
func (t *trap) harmlessDevice(rdev uint64) bool {
	major, minor := unix.Major(rdev), unix.Minor(rdev)
	switch {
	case major == 1 && (minor == 3 || minor == 5 || minor == 7): // null, zero, full
		return true
	case major == 5 && minor == 2: // ptmx: a new pty pair
		return true
	case major >= 136 && major <= 143: // pty slaves
		return true
	case major == 5 && minor == 0:
		// /dev/tty opens the caller's controlling terminal: the
		// supervisor's, so only when it is the task's as well.
		own := ttyNr(os.Getpid())
		return own != 0 && own == ttyNr(t.pid())
	}
	own := ttyNr(t.pid())
	return own != 0 && own == rdev
}

// ttyNr is the controlling terminal of pid as a device number (0: none).
func ttyNr(pid int) uint64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')') // the command name may hold anything
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:]) // state ppid pgrp session tty_nr ...
	if len(f) < 5 {
		return 0
	}
	n, err := strconv.ParseUint(f[4], 10, 32)
	if err != nil || n == 0 {
		return 0
	}
	return unix.Mkdev(uint32(n>>8&0xfff), uint32(n&0xff|n>>12&0xfff00))
}

// nsCall describes a namespace change: mkdir, unlink, rmdir, rename.
type nsCall struct {
	op                     int
	dir, path, dir2, path2 int
	arg                    int // mode (mkdir), flags (unlinkat, renameat2); -1: none
}

const (
	nsMkdir = iota
	nsUnlink
	nsRmdir
	nsRename
)

// handle lets the call meet Landlock while the lease holds. After the
// loss the supervisor performs it when every name lies in the private temp
// dir: each parent resolved beneath its descriptor of the dir, the final
// component a single name.
func (c nsCall) handle(t *trap) {
	gateErr := t.gate()
	if gateErr == nil {
		t.proceed()
		return
	}
	type target struct {
		parent int
		name   string
	}
	var targets []target
	defer func() {
		for _, tg := range targets {
			unix.Close(tg.parent)
		}
	}()
	paths := [][2]int{{c.dir, c.path}}
	if c.op == nsRename {
		paths = append(paths, [2]int{c.dir2, c.path2})
	}
	for _, dp := range paths {
		p, err := t.str(t.arg(dp[1]))
		if err != nil {
			t.failErr(memErr(err))
			return
		}
		if p == "" {
			t.fail(unix.ENOENT)
			return
		}
		rel, ok := t.beneathTmp(dp[0], p)
		last := filepath.Base(strings.TrimRight(p, "/"))
		if !ok || rel == "." || last == "." || last == ".." {
			t.denyLostCall(gateErr)
			return
		}
		parent, err := unix.Openat2(t.pr.tmpFD, filepath.Dir(rel),
			&unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: tmpResolve})
		if errors.Is(err, unix.EXDEV) {
			t.denyLostCall(gateErr)
			return
		}
		if err != nil {
			t.failErr(err)
			return
		}
		targets = append(targets, target{parent, filepath.Base(rel)})
	}
	var arg uint64
	if c.arg >= 0 {
		arg = t.arg(c.arg)
	}
	var err error
	tg := targets[0]
	switch c.op {
	case nsMkdir:
		if err = t.pr.useTaskUmask(t); err == nil {
			err = unix.Mkdirat(tg.parent, tg.name, uint32(arg&0o7777))
		}
	case nsUnlink:
		err = unix.EINVAL
		if arg&^unix.AT_REMOVEDIR == 0 {
			err = unix.Unlinkat(tg.parent, tg.name, int(arg))
		}
	case nsRmdir:
		err = unix.Unlinkat(tg.parent, tg.name, unix.AT_REMOVEDIR)
	case nsRename:
		err = unix.Renameat2(tg.parent, tg.name, targets[1].parent, targets[1].name, uint(uint32(arg)))
	}
	if err != nil {
		t.failErr(err)
		return
	}
	t.reply(0)
}
