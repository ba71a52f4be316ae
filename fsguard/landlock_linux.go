//go:build linux && (amd64 || arm64)

package fsguard

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Landlock access rights by ABI version (include/uapi/linux/landlock.h).
const (
	llExecute    = unix.LANDLOCK_ACCESS_FS_EXECUTE
	llWriteFile  = unix.LANDLOCK_ACCESS_FS_WRITE_FILE
	llReadFile   = unix.LANDLOCK_ACCESS_FS_READ_FILE
	llReadDir    = unix.LANDLOCK_ACCESS_FS_READ_DIR
	llTruncate   = unix.LANDLOCK_ACCESS_FS_TRUNCATE
	llIoctlDev   = unix.LANDLOCK_ACCESS_FS_IOCTL_DEV
	llRefer      = unix.LANDLOCK_ACCESS_FS_REFER
	llFSv1       = 0x1fff // EXECUTE .. MAKE_SYM
	llFileRights = llExecute | llWriteFile | llReadFile | llTruncate | llIoctlDev

	llConnectTCP = unix.LANDLOCK_ACCESS_NET_CONNECT_TCP
	llBindTCP    = unix.LANDLOCK_ACCESS_NET_BIND_TCP
	llScopeSig   = unix.LANDLOCK_SCOPE_SIGNAL
	// llScopeAbstract keeps abstract Unix sockets made outside the
	// domain unreachable (ABI >= 6).
	llScopeAbstract = unix.LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET

	llRuleNetPort  = 2
	llLogNewExecOn = unix.LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON
)

// Available reports the kernel's Landlock ABI version, or ErrNoLandlock
// (wrapped with what to do) when writes cannot be confined.
func Available() (int, error) {
	abi, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, 0, 0, unix.LANDLOCK_CREATE_RULESET_VERSION)
	switch errno {
	case 0:
		return int(abi), nil
	case unix.ENOSYS:
		return 0, fmt.Errorf("%w: the kernel has no Landlock (needs Linux 5.13+ built with CONFIG_SECURITY_LANDLOCK)", ErrNoLandlock)
	case unix.EOPNOTSUPP:
		return 0, fmt.Errorf("%w: Landlock is built in but disabled; add landlock to the lsm= kernel boot parameter", ErrNoLandlock)
	default:
		return 0, fmt.Errorf("%w: landlock_create_ruleset: %w", ErrNoLandlock, errno)
	}
}

func handledFS(abi int) uint64 {
	r := uint64(llFSv1)
	if abi >= 2 {
		r |= llRefer
	}
	if abi >= 3 {
		r |= llTruncate
	}
	if abi >= 5 {
		r |= llIoctlDev
	}
	return r
}

// landlockRules is what the guarded child restricts itself to; the parent
// computes it from the Policy and sends it over the setup socket.
type landlockRules struct {
	ABI         int      `json:"abi"`
	Writable    []string `json:"writable"`
	Devices     []string `json:"devices"`
	Hidden      []string `json:"hidden"`
	Ports       []uint16 `json:"ports"`
	RestrictNet bool     `json:"restrictNet"`
	// BindPorts are the fixed TCP ports the child may bind besides a port
	// the kernel chooses (port 0); every other TCP bind is refused (ABI >= 4).
	BindPorts []uint16 `json:"bindPorts"`
}

// writableDevices may always be written: shells redirect to /dev/null and
// terminals need their ptys.
var writableDevices = []string{"/dev/null", "/dev/zero", "/dev/full", "/dev/tty", "/dev/ptmx", "/dev/pts"}

type rulesetAttr struct {
	fs, net, scoped uint64
}

type pathBeneathAttr struct {
	allowed uint64
	fd      int32
}

type netPortAttr struct {
	allowed, port uint64
}

// restrictSelf confines the calling thread (and what it execs) to r. The
// caller has set no_new_privs and locked its OS thread.
func restrictSelf(r landlockRules) error {
	fs := handledFS(r.ABI)
	attr := rulesetAttr{fs: fs}
	size := unsafe.Sizeof(attr.fs)
	if r.ABI >= 4 {
		// Binds are always handled: the supervisor binds an address it
		// judged itself, so a TCP bind that reaches the kernel from the
		// agent is one that raced a check (a socket and an address
		// swapped in while a Unix bind waited).
		attr.net = llBindTCP
		if r.RestrictNet {
			attr.net |= llConnectTCP
		}
		size += unsafe.Sizeof(attr.net)
	}
	if r.ABI >= 6 {
		attr.scoped = llScopeSig | llScopeAbstract
		size += unsafe.Sizeof(attr.scoped)
	}
	rfd, _, errno := unix.Syscall(unix.SYS_LANDLOCK_CREATE_RULESET, uintptr(unsafe.Pointer(&attr)), size, 0)
	if errno != 0 {
		return fmt.Errorf("landlock_create_ruleset: %w", errno)
	}
	defer unix.Close(int(rfd))

	read := uint64(llExecute|llReadFile|llReadDir|llIoctlDev) & fs
	full, dirOnly, err := readRules(r.Hidden)
	if err != nil {
		return err
	}
	for _, p := range full {
		if err := addPathRule(int(rfd), p, read, true); err != nil {
			return err
		}
	}
	for _, p := range dirOnly {
		if err := addPathRule(int(rfd), p, llReadDir, false); err != nil {
			return err
		}
	}
	for _, p := range r.Writable {
		if err := addWritableRule(int(rfd), p, fs); err != nil {
			return err
		}
	}
	for _, p := range r.Devices {
		if err := addPathRule(int(rfd), p, (llReadFile|llWriteFile|llTruncate|llIoctlDev)&fs, true); err != nil {
			return err
		}
	}
	if attr.net&llConnectTCP != 0 {
		for _, port := range r.Ports {
			if err := addPortRule(int(rfd), llConnectTCP, port); err != nil {
				return err
			}
		}
	}
	if attr.net&llBindTCP != 0 {
		// Port 0 asks the kernel for a port of ip_local_port_range.
		for _, port := range append([]uint16{0}, r.BindPorts...) {
			if err := addPortRule(int(rfd), llBindTCP, port); err != nil {
				return err
			}
		}
	}
	var flags uintptr
	if r.ABI >= 7 {
		flags = llLogNewExecOn // the kernel audit log records the agent's denials
	}
	if _, _, errno := unix.Syscall(unix.SYS_LANDLOCK_RESTRICT_SELF, rfd, flags, 0); errno != 0 {
		return fmt.Errorf("landlock_restrict_self: %w", errno)
	}
	return nil
}

// addPortRule allows access (connect or bind) on TCP port.
func addPortRule(rfd int, access uint64, port uint16) error {
	na := netPortAttr{allowed: access, port: uint64(port)}
	if _, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, uintptr(rfd), llRuleNetPort, uintptr(unsafe.Pointer(&na)), 0, 0, 0); errno != 0 {
		return fmt.Errorf("landlock rule for tcp port %d: %w", port, errno)
	}
	return nil
}

// addWritableRule grants rights beneath the real path p, on a descriptor
// checked to be p itself: a symlink swapped in along p after the
// supervisor resolved it would grant its target.
func addWritableRule(rfd int, p string, rights uint64) error {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("landlock rule for %s: %w", p, err)
	}
	defer unix.Close(fd)
	got, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return fmt.Errorf("landlock rule for %s: %w", p, err)
	}
	if got != p {
		return fmt.Errorf("writable path %s now resolves to %s (a symlink was put in its way): refusing to grant it", p, got)
	}
	return addRuleFD(rfd, fd, p, rights)
}

// addPathRule grants rights beneath path. On a non-directory only file
// rights apply. A missing path is skipped when optional.
func addPathRule(rfd int, path string, rights uint64, optional bool) error {
	fd, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		if optional && (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EACCES)) {
			return nil
		}
		return fmt.Errorf("landlock rule for %s: %w", path, err)
	}
	defer unix.Close(fd)
	return addRuleFD(rfd, fd, path, rights)
}

// addRuleFD grants rights beneath the open O_PATH descriptor fd of path.
func addRuleFD(rfd, fd int, path string, rights uint64) error {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("landlock rule for %s: %w", path, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		rights &= llFileRights
	}
	if rights == 0 {
		return nil
	}
	pa := pathBeneathAttr{allowed: rights, fd: int32(fd)}
	if _, _, errno := unix.Syscall6(unix.SYS_LANDLOCK_ADD_RULE, uintptr(rfd), unix.LANDLOCK_RULE_PATH_BENEATH, uintptr(unsafe.Pointer(&pa)), 0, 0, 0); errno != 0 {
		return fmt.Errorf("landlock rule for %s: %w", path, errno)
	}
	return nil
}

// readRules turns "read everything except hidden" into Landlock's
// additive rules: full read on every sibling along the way from / to each
// hidden path, and only directory listing on the ancestors themselves (a
// read rule on an ancestor would cover the hidden path). A sibling that
// resolves into, or above, a hidden path is left out.
func readRules(hidden []string) (full, dirOnly []string, err error) {
	if len(hidden) == 0 {
		return []string{"/"}, nil, nil
	}
	isHiddenOrAbove := func(p string) bool {
		for _, h := range hidden {
			if within(p, h) || within(h, p) {
				return true
			}
		}
		return false
	}
	ancestors := map[string]bool{}
	for _, h := range hidden {
		for d := filepath.Dir(h); ; d = filepath.Dir(d) {
			ancestors[d] = true
			if d == "/" {
				break
			}
		}
	}
	for a := range ancestors {
		if slices.ContainsFunc(hidden, func(h string) bool { return within(a, h) }) {
			continue // inside another hidden path
		}
		ents, err := os.ReadDir(a)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				// Nothing to list: no rule, so nothing created there
				// later is readable either.
				continue
			}
			return nil, nil, fmt.Errorf("list %s for hidden-path rules: %w", a, err)
		}
		dirOnly = append(dirOnly, a)
		for _, e := range ents {
			p := filepath.Join(a, e.Name())
			if isHiddenOrAbove(p) {
				continue
			}
			real, ok := realPath(p)
			if !ok || isHiddenOrAbove(real) {
				continue
			}
			full = append(full, p)
		}
	}
	slices.Sort(full)
	slices.Sort(dirOnly)
	return full, dirOnly, nil
}

// realPath resolves p the way the kernel will when the rule is added.
func realPath(p string) (string, bool) {
	fd, err := unix.Open(p, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", false
	}
	defer unix.Close(fd)
	real, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return real, err == nil
}
