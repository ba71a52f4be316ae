//go:build linux && (amd64 || arm64)

package fsguard

import (
	"errors"
	"fmt"
	"slices"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// trap is one trapped call that the supervisor answers itself rather than
// with CONTINUE: it judges a copy of the call's arguments (memory the agent
// could rewrite after a check is read once, here) and, where the call is
// allowed, performs it on its own descriptors (a duplicate of the agent's
// socket, an O_PATH handle it opened and verified) and hands the result
// back. Nothing the agent changes after the read reaches the operation.
//
// A handler ends every trap with exactly one of reply, fail, deny, addFD or
// proceed. Values read from the task are trusted only when valid reports
// the task is still waiting in this call (its pid was not reused).
type trap struct {
	pr    *Process
	n     *seccompNotif
	spec  sysSpec
	pidfd int // -1 until pidFD opened it
	sent  bool
}

func (pr *Process) newTrap(n *seccompNotif, s sysSpec) *trap {
	return &trap{pr: pr, n: n, spec: s, pidfd: -1}
}

// close releases what the trap opened; a handler that sent nothing is
// answered EACCES (fail closed).
func (t *trap) close() {
	if !t.sent {
		t.fail(unix.EACCES)
	}
	if t.pidfd >= 0 {
		unix.Close(t.pidfd)
	}
}

func (t *trap) pid() int         { return int(t.n.pid) }
func (t *trap) arg(i int) uint64 { return t.n.args[i] }

// valid reports whether the task still waits in this call.
func (t *trap) valid() bool { return notifValid(t.pr.listener, t.n.id) }

// gate is the lease's state now: nil while it allows writes.
func (t *trap) gate() error {
	if t.pr.gate == nil {
		return nil
	}
	_, err := t.pr.gate.Fence()
	return err
}

// pidFD opens a pidfd of the trapped task, checked to be the task of this
// call.
func (t *trap) pidFD() (int, error) {
	if t.pidfd >= 0 {
		return t.pidfd, nil
	}
	// The trapped task may be any thread: without PIDFD_THREAD (Linux
	// 6.9+) pidfd_open refuses one that does not lead its thread group.
	fd, err := unix.PidfdOpen(t.pid(), unix.PIDFD_NONBLOCK|unix.PIDFD_THREAD)
	if errors.Is(err, unix.EINVAL) {
		fd, err = unix.PidfdOpen(t.pid(), unix.PIDFD_NONBLOCK)
	}
	if err != nil {
		return -1, fmt.Errorf("pidfd_open %d: %w", t.pid(), err)
	}
	if !t.valid() {
		unix.Close(fd)
		return -1, errTaskGone
	}
	t.pidfd = fd
	return fd, nil
}

var errTaskGone = errors.New("the trapped task is gone")

// getFD duplicates the task's descriptor fd into the supervisor (a new
// descriptor on the same open file; the caller closes it).
func (t *trap) getFD(fd int32) (int, error) {
	pfd, err := t.pidFD()
	if err != nil {
		return -1, err
	}
	dup, err := unix.PidfdGetfd(pfd, int(fd), 0)
	if err != nil {
		return -1, fmt.Errorf("pidfd_getfd %d of %d: %w", fd, t.pid(), err)
	}
	unix.CloseOnExec(dup)
	if !t.valid() {
		unix.Close(dup)
		return -1, errTaskGone
	}
	return dup, nil
}

// mem copies n bytes at addr from the task. The copy is what the handler
// judges and uses; later changes by the task do not reach it.
func (t *trap) mem(addr uint64, n int) ([]byte, error) {
	if n == 0 {
		return nil, nil
	}
	b, err := readMemN(t.pid(), addr, n)
	if err != nil {
		return nil, err
	}
	if !t.valid() {
		return nil, errTaskGone
	}
	return b, nil
}

// str copies the NUL-terminated string at addr (at most PATH_MAX bytes).
func (t *trap) str(addr uint64) (string, error) {
	if addr == 0 {
		return "", unix.EFAULT
	}
	b, err := readMem(t.pid(), addr, unix.PathMax)
	if err != nil {
		return "", err
	}
	i := slices.Index(b, 0)
	if i < 0 {
		return "", unix.ENAMETOOLONG
	}
	if !t.valid() {
		return "", errTaskGone
	}
	return string(b[:i]), nil
}

func (t *trap) send(r *seccompNotifResp) {
	t.sent = true
	notifSend(t.pr.listener, r)
}

// reply answers the call as having returned val.
func (t *trap) reply(val int64) { t.send(&seccompNotifResp{id: t.n.id, val: val}) }

// fail answers the call as having failed with errno, without audit (the
// call's own failure, e.g. ENOENT from the emulated operation).
func (t *trap) fail(errno unix.Errno) {
	t.send(&seccompNotifResp{id: t.n.id, error: -int32(errno)})
}

// failErr answers with err's errno (EACCES when it carries none).
func (t *trap) failErr(err error) {
	var errno unix.Errno
	if !errors.As(err, &errno) || errno == 0 {
		errno = unix.EACCES
	}
	t.fail(errno)
}

// proceed lets the call run in the kernel as the task made it (CONTINUE).
// Only for calls whose outcome the kernel judges itself (Landlock), never
// after a decision on memory or descriptors the task can change.
func (t *trap) proceed() {
	t.send(&seccompNotifResp{id: t.n.id, flags: unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE})
}

// deny refuses the call with errno, counts it and audits it on boundary
// with reason; what describes the call (and its target) in the message.
func (t *trap) deny(errno unix.Errno, boundary, reason, what string, cause error) {
	t.fail(errno)
	t.pr.refused(reason)
	t.pr.enqueueDenial(boundary, reason, what, cause)
}

// seccompNotifAddfd is struct seccomp_notif_addfd.
type seccompNotifAddfd struct {
	id         uint64
	flags      uint32
	srcfd      uint32
	newfd      uint32
	newfdFlags uint32
}

const seccompAddfdFlagSend = 1 << 1 // SECCOMP_ADDFD_FLAG_SEND

// addFD installs the supervisor's descriptor fd in the task and answers
// the call with its number, atomically (SECCOMP_ADDFD_FLAG_SEND, Linux
// 5.14+). The caller still owns fd.
func (t *trap) addFD(fd int, cloexec bool) error {
	a := seccompNotifAddfd{id: t.n.id, flags: seccompAddfdFlagSend, srcfd: uint32(fd)}
	if cloexec {
		a.newfdFlags = unix.O_CLOEXEC
	}
	t.sent = true
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(t.pr.listener), unix.SECCOMP_IOCTL_NOTIF_ADDFD, uintptr(unsafe.Pointer(&a)))
	if errno != 0 {
		if errno != unix.ENOENT { // ENOENT: the task left the call
			t.sent = false
		}
		return fmt.Errorf("seccomp addfd: %w", errno)
	}
	return nil
}

// enqueueDenial queues the audit event of a refused call.
func (pr *Process) enqueueDenial(boundary, reason, what string, cause error) {
	msg := fmt.Sprintf("%s denied: %s: %s", boundaryNoun(boundary), what, pr.policy.leaseDesc())
	if cause != nil {
		msg += fmt.Sprintf(" (%v)", cause)
	}
	pr.enqueueEvent(boundary, reason, msg)
}

// enqueueEvent queues a denial event naming the attempt's lease; what does
// not fit the queue is counted and audited in one event at the end.
func (pr *Process) enqueueEvent(boundary, reason, msg string) {
	l := pr.policy.Lease
	ev := lease.AuditEvent{
		Time: time.Now().UTC(), Type: lease.EventDenied, Boundary: boundary,
		Repo: l.Repo, LeaseID: l.LeaseID, Owner: l.Owner, Scope: l.Scope, Fence: l.Fence,
		Reason: reason, Message: msg,
	}
	select {
	case pr.auditQ <- ev:
	default:
		pr.dropped.Add(1)
	}
}

func boundaryNoun(b string) string {
	switch b {
	case lease.BoundaryNet:
		return "network access"
	case lease.BoundaryFile:
		return "file write"
	default:
		return b
	}
}
