//go:build linux && (amd64 || arm64)

package fsguard

import "golang.org/x/sys/unix"

// sysSpec says where a write-class system call keeps its target, so a
// denial can be audited with the path: argument indexes, -1 for none.
type sysSpec struct {
	name  string
	dirfd int // dirfd of path (absent: relative to the cwd)
	path  int
	fd    int // the target is an open file (ftruncate, fchmod...)
	dir2  int // second target (the new name of rename, link)
	path2 int
	flags int // open flags: trapped only with write, create or truncate flags
	how   int // openat2's struct open_how
	// handle, when set, answers the call itself (see trap) instead of the
	// default: CONTINUE to Landlock while the lease holds, EACCES after.
	handle func(*trap)
	// custom: the filter's jumps for this call are made by its own
	// emitter (see filterEmitters), not the generic chain.
	custom bool
}

func spec(name string) sysSpec {
	return sysSpec{name: name, dirfd: -1, path: -1, fd: -1, dir2: -1, path2: -1, flags: -1, how: -1}
}

func (s sysSpec) at(dirfd, path int) sysSpec      { s.dirfd, s.path = dirfd, path; return s }
func (s sysSpec) p(path int) sysSpec              { s.path = path; return s }
func (s sysSpec) f(fd int) sysSpec                { s.fd = fd; return s }
func (s sysSpec) second(dirfd, path int) sysSpec  { s.dir2, s.path2 = dirfd, path; return s }
func (s sysSpec) withFlags(flags int) sysSpec     { s.flags = flags; return s }
func (s sysSpec) withHow(how int) sysSpec         { s.how = how; return s }
func (s sysSpec) handledBy(h func(*trap)) sysSpec { s.handle = h; return s }

// writeSyscallsCommon are the write-class calls of both architectures.
// openat is trapped only for write flags (see the BPF); the others always.
var writeSyscallsCommon = map[uint32]sysSpec{
	unix.SYS_OPENAT:            spec("openat").at(0, 1).withFlags(2),
	unix.SYS_OPENAT2:           spec("openat2").at(0, 1).withHow(2),
	unix.SYS_RENAMEAT:          spec("renameat").at(0, 1).second(2, 3),
	unix.SYS_RENAMEAT2:         spec("renameat2").at(0, 1).second(2, 3),
	unix.SYS_UNLINKAT:          spec("unlinkat").at(0, 1),
	unix.SYS_MKDIRAT:           spec("mkdirat").at(0, 1),
	unix.SYS_LINKAT:            spec("linkat").at(0, 1).second(2, 3),
	unix.SYS_SYMLINKAT:         spec("symlinkat").at(1, 2),
	unix.SYS_TRUNCATE:          spec("truncate").p(0),
	unix.SYS_FTRUNCATE:         spec("ftruncate").f(0),
	unix.SYS_FALLOCATE:         spec("fallocate").f(0),
	unix.SYS_MKNODAT:           spec("mknodat").at(0, 1),
	unix.SYS_FCHMOD:            spec("fchmod").f(0),
	unix.SYS_FCHMODAT:          spec("fchmodat").at(0, 1),
	unix.SYS_FCHMODAT2:         spec("fchmodat2").at(0, 1),
	unix.SYS_FCHOWN:            spec("fchown").f(0),
	unix.SYS_FCHOWNAT:          spec("fchownat").at(0, 1),
	unix.SYS_UTIMENSAT:         spec("utimensat").at(0, 1),
	unix.SYS_SETXATTR:          spec("setxattr").p(0),
	unix.SYS_LSETXATTR:         spec("lsetxattr").p(0),
	unix.SYS_FSETXATTR:         spec("fsetxattr").f(0),
	unix.SYS_REMOVEXATTR:       spec("removexattr").p(0),
	unix.SYS_LREMOVEXATTR:      spec("lremovexattr").p(0),
	unix.SYS_FREMOVEXATTR:      spec("fremovexattr").f(0),
	unix.SYS_SETXATTRAT:        spec("setxattrat").at(0, 1),
	unix.SYS_REMOVEXATTRAT:     spec("removexattrat").at(0, 1),
	unix.SYS_OPEN_BY_HANDLE_AT: spec("open_by_handle_at").f(0),
	unix.SYS_FILE_SETATTR:      spec("file_setattr").at(0, 1),
	// Not a write: trapped so the supervisor knows the sessions an
	// attempt's processes make (handleSetsid).
	unix.SYS_SETSID: spec("setsid").handledBy(handleSetsid),
}

// writeSyscalls are every call the filter may send to the supervisor, by
// number: the write-class calls and those of the emitters.
func writeSyscalls() map[uint32]sysSpec {
	m := make(map[uint32]sysSpec, len(writeSyscallsCommon)+len(writeSyscallsArch))
	for _, src := range []map[uint32]sysSpec{writeSyscallsCommon, writeSyscallsArch} {
		for k, v := range src {
			m[k] = v
		}
	}
	for _, e := range filterEmitters {
		for k, v := range e.calls {
			v.custom = true
			m[k] = v
		}
	}
	for k, v := range m {
		if h, ok := callHandlers[v.name]; ok && v.handle == nil {
			v.handle = h
			m[k] = v
		}
	}
	return m
}

// filterEmitter adds calls with argument checks of their own to the
// seccomp filter: jumps goes in the chain of system-call numbers (each
// jump to a label of its own, "" falls through to the next), blocks after
// the chain's final allow (each block ends in a return). The labels
// "notify", "allow", "eperm" and "kill" exist for both.
type filterEmitter struct {
	calls  map[uint32]sysSpec
	jumps  func(a *asm)
	blocks func(a *asm)
}

// filterEmitters are the filter's custom parts (network, ioctl).
var filterEmitters []filterEmitter
