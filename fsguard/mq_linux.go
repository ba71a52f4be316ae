//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// POSIX message queues. They live in the IPC namespace's mqueue file
// system, which the agent reaches by name (mq_open, mq_unlink) without a
// path Landlock judges: its walk from an internal mount ends at the mount
// root and it refuses the open, but only in dentry_open, after mq_open(2)
// made the queue (EACCES, and a queue that outlives the run), and
// mq_unlink and the calls on a descriptor (one the agent inherited, or
// opened read-only through a mounted /dev/mqueue) pass untouched. So the
// agent uses only queues its attempt made, as with System V IPC:
//
//   - mq_open always traps and the supervisor makes it (same user, same
//     IPC namespace) from a copy of the name and attributes: a create is
//     made O_EXCL, recorded by inode (the supervisor keeps a descriptor of
//     each such queue, so its inode number stays its own) and handed over
//     with SECCOMP_IOCTL_NOTIF_ADDFD; an existing queue is opened and
//     handed over only when its inode is recorded. After the loss nothing
//     is created and nothing opened for writing.
//   - mq_unlink removes only a recorded queue still under its name, and
//     nothing after the loss.
//   - mq_timedsend, mq_timedreceive and mq_getsetattr setting flags are
//     performed by the supervisor on its duplicate of the descriptor
//     (pidfd_getfd), only for a recorded queue, with copies of the
//     message, timeout and attributes: a dup2 onto the number afterwards
//     changes nothing. Sends and flag changes stop at the loss; receiving
//     from the attempt's own queue goes on.
//   - mq_notify registering a notification continues only for a recorded
//     queue while the lease holds (the notification belongs to the
//     registering task, so the supervisor cannot make it in its place).
//
// Queues the attempt made and left are removed once it settled.

// mqAttr is struct mq_attr.
type mqAttr struct {
	Flags, Maxmsg, Msgsize, Curmsgs int64
	_                               [4]int64
}

const mqueueMagic = 0x19800202 // MQUEUE_MAGIC

// mqQueue is a queue the attempt made: its name (without "/") and the
// supervisor's descriptor of it.
type mqQueue struct {
	name string
	fd   int
}

// mqOwned are the queues each attempt made, by Process.
type mqOwned struct {
	mu     sync.Mutex
	queues map[[2]uint64]mqQueue // {dev, ino}; guarded by mu
}

var mqObjects sync.Map // *Process -> *mqOwned

func (pr *Process) mq() *mqOwned {
	o, _ := mqObjects.LoadOrStore(pr, &mqOwned{queues: map[[2]uint64]mqQueue{}})
	return o.(*mqOwned)
}

func mqKey(fd int) ([2]uint64, bool) {
	var sfs unix.Statfs_t
	if unix.Fstatfs(fd, &sfs) != nil || sfs.Type != mqueueMagic {
		return [2]uint64{}, false
	}
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil {
		return [2]uint64{}, false
	}
	return [2]uint64{st.Dev, st.Ino}, true
}

// owns reports whether the supervisor's descriptor fd is of a queue the
// attempt made.
func (o *mqOwned) owns(fd int) bool {
	k, ok := mqKey(fd)
	if !ok {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	_, ok = o.queues[k]
	return ok
}

// add records the queue of the supervisor's descriptor fd, which it keeps.
func (o *mqOwned) add(name string, fd int) {
	k, _ := mqKey(fd)
	o.mu.Lock()
	o.queues[k] = mqQueue{name: name, fd: fd}
	o.mu.Unlock()
}

// named returns the recorded queue that name names now: the supervisor's
// descriptor of it is still linked under that name.
func (o *mqOwned) named(name string) (k [2]uint64, q mqQueue, ok bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for k, q := range o.queues {
		if q.name == name && mqLinked(q) {
			return k, q, true
		}
	}
	return k, q, false
}

// mqLinked reports whether q's queue is still linked under its name (a
// queue unlinked and made again under the name is another dentry).
func mqLinked(q mqQueue) bool {
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(q.fd))
	return err == nil && p == "/"+q.name
}

func (o *mqOwned) forget(k [2]uint64) {
	o.mu.Lock()
	if q, ok := o.queues[k]; ok {
		unix.Close(q.fd)
		delete(o.queues, k)
	}
	o.mu.Unlock()
}

// mqCleanup removes the queues the attempt made and left (those still
// under their names) once it settled.
func (pr *Process) mqCleanup() {
	v, ok := mqObjects.LoadAndDelete(pr)
	if !ok {
		return
	}
	o := v.(*mqOwned)
	o.mu.Lock()
	defer o.mu.Unlock()
	for _, q := range o.queues {
		if mqLinked(q) {
			if err := mqUnlink(q.name); err != nil {
				pr.policy.logger().Warn("remove a POSIX message queue the attempt left", "queue", "/"+q.name, "err", err)
			} else {
				pr.policy.logger().Info("removed a POSIX message queue the attempt left", "queue", "/"+q.name)
			}
		}
		unix.Close(q.fd)
	}
	o.queues = nil
}

func init() {
	calls := map[uint32]sysSpec{
		unix.SYS_MQ_OPEN:         spec("mq_open").handledBy(mqOpenCall),
		unix.SYS_MQ_UNLINK:       spec("mq_unlink").handledBy(mqUnlinkCall),
		unix.SYS_MQ_TIMEDSEND:    spec("mq_timedsend").handledBy(mqSendCall),
		unix.SYS_MQ_TIMEDRECEIVE: spec("mq_timedreceive").handledBy(mqReceiveCall),
		unix.SYS_MQ_NOTIFY:       spec("mq_notify").handledBy(mqNotifyCall),
		unix.SYS_MQ_GETSETATTR:   spec("mq_getsetattr").handledBy(mqSetattrCall),
	}
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: calls,
		jumps: func(a *asm) {
			for _, nr := range []uint32{unix.SYS_MQ_OPEN, unix.SYS_MQ_UNLINK, unix.SYS_MQ_TIMEDSEND,
				unix.SYS_MQ_TIMEDRECEIVE, unix.SYS_MQ_NOTIFY, unix.SYS_MQ_GETSETATTR} {
				a.jump(bpfJeqK, nr, "notify", "")
			}
		},
		blocks: func(*asm) {},
	})
}

func mqOpenSys(name string, flags int, mode uint32, attr *mqAttr) (int, error) {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return -1, unix.EINVAL
	}
	fd, _, e := unix.Syscall6(unix.SYS_MQ_OPEN, uintptr(unsafe.Pointer(p)), uintptr(flags), uintptr(mode), uintptr(unsafe.Pointer(attr)), 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(fd), nil
}

func mqUnlink(name string) error {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return unix.EINVAL
	}
	if _, _, e := unix.Syscall(unix.SYS_MQ_UNLINK, uintptr(unsafe.Pointer(p)), 0, 0); e != 0 {
		return e
	}
	return nil
}

// mqDenyForeign refuses a call on a queue the attempt did not make.
func (t *trap) mqDenyForeign(what string) {
	t.deny(unix.EACCES, lease.BoundaryFile, lease.ReasonNotAllowed,
		what+": a POSIX message queue made by another process; the agent uses only its own", nil)
}

// mqDenyLost refuses a write-class call on a queue once the lease is lost.
func (t *trap) mqDenyLost(what string, gateErr error) {
	t.deny(unix.EACCES, lease.BoundaryFile, lease.LeaseReason(gateErr), what, gateErr)
}

// mqOpenCall is mq_open(name, oflag, mode, attr).
func mqOpenCall(t *trap) {
	name, err := t.str(t.arg(0))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	flags := int(int32(t.arg(1)))
	mode := uint32(t.arg(2))
	what := fmt.Sprintf("mq_open of /%s (%s)", name, openFlags(uint64(flags)))
	writes := flags&unix.O_CREAT != 0 || flags&unix.O_ACCMODE != unix.O_RDONLY
	if gateErr := t.gate(); writes && gateErr != nil {
		t.mqDenyLost(what, gateErr)
		return
	}
	o := t.pr.mq()
	sysFlags := flags | unix.O_CLOEXEC
	if flags&unix.O_CREAT != 0 {
		var attr *mqAttr
		if a := t.arg(3); a != 0 {
			b, err := t.mem(a, int(unsafe.Sizeof(mqAttr{})))
			if err != nil {
				if !errors.Is(err, errTaskGone) {
					t.fail(unix.EFAULT)
				}
				return
			}
			attr = &mqAttr{Maxmsg: int64(binary.LittleEndian.Uint64(b[8:])), Msgsize: int64(binary.LittleEndian.Uint64(b[16:]))}
		}
		if err := t.pr.useTaskUmask(t); err != nil {
			t.failErr(err)
			return
		}
		// O_EXCL: made now by the supervisor, or found and judged below.
		fd, err := mqOpenSys(name, sysFlags|unix.O_EXCL, mode, attr)
		if err == nil {
			o.add(name, fd)
			if err := t.addFD(fd, flags&unix.O_CLOEXEC != 0); err != nil && !t.sent {
				t.failErr(err)
			}
			return // recorded: removed at settle if the agent never got it
		}
		if !errors.Is(err, unix.EEXIST) || flags&unix.O_EXCL != 0 {
			t.failErr(err)
			return
		}
	}
	fd, err := mqOpenSys(name, sysFlags&^(unix.O_CREAT|unix.O_EXCL), 0, nil)
	if err != nil {
		t.failErr(err)
		return
	}
	if !o.owns(fd) {
		unix.Close(fd)
		t.mqDenyForeign(what)
		return
	}
	t.handOver(fd, uint64(flags))
}

// mqUnlinkCall is mq_unlink(name).
func mqUnlinkCall(t *trap) {
	name, err := t.str(t.arg(0))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.failErr(err)
		}
		return
	}
	what := "mq_unlink of /" + name
	if gateErr := t.gate(); gateErr != nil {
		t.mqDenyLost(what, gateErr)
		return
	}
	o := t.pr.mq()
	k, _, ok := o.named(name)
	if !ok {
		// Not one of the attempt's: a name that names nothing gets the
		// kernel's ENOENT (removing a stale name first is common).
		fd, err := mqOpenSys(name, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0, nil)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENAMETOOLONG) {
			t.failErr(err)
			return
		}
		if err == nil {
			unix.Close(fd)
		}
		t.mqDenyForeign(what)
		return
	}
	if err := mqUnlink(name); err != nil {
		t.failErr(err)
		return
	}
	o.forget(k)
	t.reply(0)
}

// mqFD duplicates the queue descriptor of argument 0 and tells whether it
// is one of the attempt's queues; ok is false once the trap was answered
// (not a queue: EBADF, as the kernel answers).
func (t *trap) mqFD() (fd int, own, ok bool) {
	fd, err := t.getFD(int32(t.arg(0)))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EBADF)
		}
		return -1, false, false
	}
	if _, isMq := mqKey(fd); !isMq {
		unix.Close(fd)
		t.fail(unix.EBADF)
		return -1, false, false
	}
	return fd, t.pr.mq().owns(fd), true
}

func (t *trap) mqWhat() string {
	return fmt.Sprintf("%s on %s", t.spec.name, fdPath(t.pid(), int32(t.arg(0))))
}

// mqOwnQueue returns the supervisor's own copy of the call's queue
// descriptor (argument 0) and the queue's attributes, when the queue is
// the agent's own; otherwise it answers the call (refused, or failed) and
// returns ok false. The caller closes fd.
func (t *trap) mqOwnQueue() (fd int, a mqAttr, ok bool) {
	if fd, ok = t.mqOwnFD(); !ok {
		return -1, a, false
	}
	if err := mqGetSetAttr(fd, nil, &a); err != nil {
		unix.Close(fd)
		t.failErr(err)
		return -1, a, false
	}
	return fd, a, true
}

// mqOwnFD is the supervisor's duplicate of the call's queue descriptor
// when the queue is the agent's own; a foreign queue is refused (the
// duplicate closed) and ok is false, as it is when the call was answered.
func (t *trap) mqOwnFD() (fd int, ok bool) {
	fd, own, ok := t.mqFD()
	if !ok {
		return -1, false
	}
	if !own {
		unix.Close(fd)
		t.mqDenyForeign(t.mqWhat())
		return -1, false
	}
	return fd, true
}

// mqSendCall is mq_timedsend(fd, msg, len, prio, abs_timeout).
func mqSendCall(t *trap) {
	if gateErr := t.gate(); gateErr != nil {
		t.mqDenyLost(t.mqWhat(), gateErr)
		return
	}
	fd, a, ok := t.mqOwnQueue()
	if !ok {
		return
	}
	n := t.arg(2)
	if n > uint64(a.Msgsize) {
		unix.Close(fd)
		t.fail(unix.EMSGSIZE)
		return
	}
	msg, err := t.mem(t.arg(1), int(n))
	if err != nil {
		unix.Close(fd)
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EFAULT)
		}
		return
	}
	deadline, ok := t.mqTimeout(4)
	if !ok {
		unix.Close(fd)
		return
	}
	prio := uint32(t.arg(3))
	t.pr.goTrap(t, func(gt *trap) {
		defer unix.Close(fd)
		gt.mqWait(deadline, true, func(ts *unix.Timespec) (int64, unix.Errno) {
			var p *byte
			if len(msg) > 0 {
				p = &msg[0]
			}
			_, _, e := unix.Syscall6(unix.SYS_MQ_TIMEDSEND, uintptr(fd), uintptr(unsafe.Pointer(p)), uintptr(len(msg)), uintptr(prio), uintptr(unsafe.Pointer(ts)), 0)
			return 0, e
		})
	})
}

// mqReceiveCall is mq_timedreceive(fd, msg, len, prio *, abs_timeout).
func mqReceiveCall(t *trap) {
	fd, a, ok := t.mqOwnQueue()
	if !ok {
		return
	}
	n := t.arg(2)
	if n < uint64(a.Msgsize) {
		unix.Close(fd)
		t.fail(unix.EMSGSIZE)
		return
	}
	deadline, ok := t.mqTimeout(4)
	if !ok {
		unix.Close(fd)
		return
	}
	buf := make([]byte, max(a.Msgsize, 1))
	msgAddr, prioAddr := t.arg(1), t.arg(3)
	t.pr.goTrap(t, func(gt *trap) {
		defer unix.Close(fd)
		gt.mqWait(deadline, false, func(ts *unix.Timespec) (int64, unix.Errno) {
			var prio uint32
			r, _, e := unix.Syscall6(unix.SYS_MQ_TIMEDRECEIVE, uintptr(fd), uintptr(unsafe.Pointer(&buf[0])), uintptr(a.Msgsize),
				uintptr(unsafe.Pointer(&prio)), uintptr(unsafe.Pointer(ts)), 0)
			if e != 0 {
				return 0, e
			}
			// Taken from the queue: like the kernel, a bad buffer loses it.
			if err := gt.writeMem(msgAddr, buf[:r]); err != nil {
				return 0, unix.EFAULT
			}
			if prioAddr != 0 {
				if err := gt.writeMem(prioAddr, binary.LittleEndian.AppendUint32(nil, prio)); err != nil {
					return 0, unix.EFAULT
				}
			}
			return int64(r), 0
		})
	})
}

// mqNotifyCall is mq_notify(fd, sevp). Removing a registration touches
// only the task's own (the kernel checks the owner) and continues.
func mqNotifyCall(t *trap) {
	if t.arg(1) == 0 {
		t.proceed() // registers: the agent cannot change them while it waits
		return
	}
	if gateErr := t.gate(); gateErr != nil {
		t.mqDenyLost(t.mqWhat(), gateErr)
		return
	}
	fd, ok := t.mqOwnFD()
	if !ok {
		return
	}
	unix.Close(fd)
	t.proceed()
}

// mqSetattrCall is mq_getsetattr(fd, newattr, oldattr): only reading the
// attributes continues; setting them (O_NONBLOCK) is made on the
// supervisor's duplicate, which shares the open queue description.
func mqSetattrCall(t *trap) {
	if t.arg(1) == 0 {
		t.proceed() // registers: a read stays a read
		return
	}
	if gateErr := t.gate(); gateErr != nil {
		t.mqDenyLost(t.mqWhat(), gateErr)
		return
	}
	fd, ok := t.mqOwnFD()
	if !ok {
		return
	}
	defer unix.Close(fd)
	b, err := t.mem(t.arg(1), int(unsafe.Sizeof(mqAttr{})))
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EFAULT)
		}
		return
	}
	set := mqAttr{Flags: int64(binary.LittleEndian.Uint64(b))}
	var old mqAttr
	if err := mqGetSetAttr(fd, &set, &old); err != nil {
		t.failErr(err)
		return
	}
	if a := t.arg(2); a != 0 {
		ob := make([]byte, 0, unsafe.Sizeof(old))
		for _, v := range []int64{old.Flags, old.Maxmsg, old.Msgsize, old.Curmsgs, 0, 0, 0, 0} {
			ob = binary.LittleEndian.AppendUint64(ob, uint64(v))
		}
		if err := t.writeMem(a, ob); err != nil {
			t.fail(unix.EFAULT)
			return
		}
	}
	t.reply(0)
}

func mqGetSetAttr(fd int, set, old *mqAttr) error {
	if _, _, e := unix.Syscall(unix.SYS_MQ_GETSETATTR, uintptr(fd), uintptr(unsafe.Pointer(set)), uintptr(unsafe.Pointer(old))); e != 0 {
		return e
	}
	return nil
}

// mqTimeout copies the call's absolute CLOCK_REALTIME timeout (argument
// i; zero time for none); ok is false once the trap was answered.
func (t *trap) mqTimeout(i int) (time.Time, bool) {
	a := t.arg(i)
	if a == 0 {
		return time.Time{}, true
	}
	b, err := t.mem(a, 16)
	if err != nil {
		if !errors.Is(err, errTaskGone) {
			t.fail(unix.EFAULT)
		}
		return time.Time{}, false
	}
	sec, nsec := int64(binary.LittleEndian.Uint64(b)), int64(binary.LittleEndian.Uint64(b[8:]))
	if nsec < 0 || nsec >= 1e9 {
		t.fail(unix.EINVAL)
		return time.Time{}, false
	}
	return time.Unix(sec, nsec), true
}

// mqSlice is how long the supervisor waits in one blocking queue call
// before it looks again whether the task still waits (and, for a send,
// whether the lease still holds).
const mqSlice = 100 * time.Millisecond

// mqWait makes a queue call that may block (a full queue for a send, an
// empty one for a receive) in slices of mqSlice up to deadline (zero: no
// deadline), and answers it. A send is refused once the lease is lost,
// also while it waits.
func (t *trap) mqWait(deadline time.Time, send bool, call func(*unix.Timespec) (int64, unix.Errno)) {
	for {
		if send { // checked again right before each try: the gate is the fence
			if gateErr := t.gate(); gateErr != nil {
				t.mqDenyLost(t.mqWhat(), gateErr)
				return
			}
		}
		until := time.Now().Add(mqSlice)
		last := !deadline.IsZero() && !deadline.After(until)
		if last {
			until = deadline
		}
		ts := unix.NsecToTimespec(until.UnixNano())
		r, e := call(&ts)
		switch {
		case e == 0:
			t.reply(r)
			return
		case e != unix.ETIMEDOUT || last:
			t.fail(e)
			return
		case !t.valid():
			return // the task is gone (killed): nobody waits for the answer
		}
	}
}

// writeMem copies b into the task's memory at addr.
func (t *trap) writeMem(addr uint64, b []byte) error {
	if len(b) == 0 {
		return nil
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/%d/mem", t.pid()), os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	if !t.valid() {
		return errTaskGone
	}
	_, err = f.WriteAt(b, int64(addr))
	return err
}
