//go:build linux && (amd64 || arm64)

package fsguard

import (
	"errors"
	"fmt"
	"sync"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// System V IPC. Shared memory segments, message queues and semaphore sets
// live in the IPC namespace, outside any file system: Landlock does not
// see them, and the agent, as the same user, may attach another process's
// segment (its id is listed in /proc/sysvipc/shm) and write into that
// process's memory, or send to and take from its message queues. So the
// agent uses only objects its attempt made:
//
//   - shmget, msgget and semget always trap. The supervisor makes the
//     call itself (same user, same namespace), records the id of an
//     object it created, and answers with it. A key naming an object the
//     attempt did not make is refused (EACCES, audited).
//   - shmat, shmctl, msgsnd, msgrcv, msgctl, semop, semtimedop and semctl
//     trap and continue only for a recorded id (a register: the agent
//     cannot change it while it waits). Read-only queries (IPC_STAT and
//     the *_INFO and *_STAT commands) continue for any id.
//   - What the attempt made and did not remove (IPC_RMID) is removed once
//     it settled.

const (
	ipcShm = iota
	ipcMsg
	ipcSem
)

// ipcOwned are the System V objects each attempt made, by Process.
type ipcOwned struct {
	mu  sync.Mutex
	ids map[[2]int]bool // {kind, id}
}

var ipcObjects sync.Map // *Process -> *ipcOwned

func (pr *Process) ipc() *ipcOwned {
	o, _ := ipcObjects.LoadOrStore(pr, &ipcOwned{ids: map[[2]int]bool{}})
	return o.(*ipcOwned)
}

func (o *ipcOwned) has(kind, id int) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.ids[[2]int{kind, id}]
}

func (o *ipcOwned) add(kind, id int) {
	o.mu.Lock()
	o.ids[[2]int{kind, id}] = true
	o.mu.Unlock()
}

func (o *ipcOwned) forget(kind, id int) {
	o.mu.Lock()
	delete(o.ids, [2]int{kind, id})
	o.mu.Unlock()
}

// ipcCleanup removes the System V objects the attempt made and did not
// remove itself, once it settled (an id it removed is forgotten, so a new
// object of another process under a reused id is not touched).
func (pr *Process) ipcCleanup() {
	v, ok := ipcObjects.LoadAndDelete(pr)
	if !ok {
		return
	}
	o := v.(*ipcOwned)
	o.mu.Lock()
	defer o.mu.Unlock()
	for k := range o.ids {
		var err error
		switch k[0] {
		case ipcShm:
			_, err = unix.SysvShmCtl(k[1], unix.IPC_RMID, nil)
		case ipcMsg:
			_, _, e := unix.Syscall(unix.SYS_MSGCTL, uintptr(k[1]), unix.IPC_RMID, 0)
			err = errnoErr(e)
		case ipcSem:
			_, _, e := unix.Syscall6(unix.SYS_SEMCTL, uintptr(k[1]), 0, unix.IPC_RMID, 0, 0, 0)
			err = errnoErr(e)
		}
		if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.EIDRM) {
			pr.policy.logger().Warn("remove a System V IPC object the attempt left", "id", k[1], "err", err)
		}
	}
	o.ids = nil
}

func errnoErr(e unix.Errno) error {
	if e == 0 {
		return nil
	}
	return e
}

func init() {
	calls := map[uint32]sysSpec{
		unix.SYS_SHMGET:     spec("shmget").handledBy(ipcGet{kind: ipcShm, nr: unix.SYS_SHMGET, flags: 2}.handle),
		unix.SYS_MSGGET:     spec("msgget").handledBy(ipcGet{kind: ipcMsg, nr: unix.SYS_MSGGET, flags: 1}.handle),
		unix.SYS_SEMGET:     spec("semget").handledBy(ipcGet{kind: ipcSem, nr: unix.SYS_SEMGET, flags: 2}.handle),
		unix.SYS_SHMAT:      spec("shmat").handledBy(ipcOp{kind: ipcShm, cmd: -1}.handle),
		unix.SYS_SHMCTL:     spec("shmctl").handledBy(ipcOp{kind: ipcShm, cmd: 1}.handle),
		unix.SYS_MSGSND:     spec("msgsnd").handledBy(ipcOp{kind: ipcMsg, cmd: -1}.handle),
		unix.SYS_MSGRCV:     spec("msgrcv").handledBy(ipcOp{kind: ipcMsg, cmd: -1}.handle),
		unix.SYS_MSGCTL:     spec("msgctl").handledBy(ipcOp{kind: ipcMsg, cmd: 1}.handle),
		unix.SYS_SEMOP:      spec("semop").handledBy(ipcOp{kind: ipcSem, cmd: -1}.handle),
		unix.SYS_SEMTIMEDOP: spec("semtimedop").handledBy(ipcOp{kind: ipcSem, cmd: -1}.handle),
		unix.SYS_SEMCTL:     spec("semctl").handledBy(ipcOp{kind: ipcSem, cmd: 2}.handle),
	}
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: calls,
		jumps: func(a *asm) {
			for _, nr := range []uint32{unix.SYS_SHMGET, unix.SYS_MSGGET, unix.SYS_SEMGET, unix.SYS_SHMAT, unix.SYS_SHMCTL,
				unix.SYS_MSGSND, unix.SYS_MSGRCV, unix.SYS_MSGCTL, unix.SYS_SEMOP, unix.SYS_SEMTIMEDOP, unix.SYS_SEMCTL} {
				a.jump(bpfJeqK, nr, "notify", "")
			}
		},
		blocks: func(*asm) {},
	})
}

// ipcGet is shmget(key, size, flags), msgget(key, flags) or
// semget(key, nsems, flags); flags is the index of the flags argument.
type ipcGet struct {
	kind  int
	nr    uintptr
	flags int
}

func (g ipcGet) call(t *trap, flags int) (int, unix.Errno) {
	a := [3]uintptr{uintptr(t.arg(0)), uintptr(t.arg(1)), uintptr(t.arg(2))}
	a[g.flags] = uintptr(flags)
	r, _, e := unix.Syscall(g.nr, a[0], a[1], a[2])
	return int(r), e
}

func (g ipcGet) handle(t *trap) {
	key := int32(t.arg(0))
	flags := int(int32(t.arg(g.flags)))
	const createExcl = unix.IPC_CREAT | unix.IPC_EXCL
	o := t.pr.ipc()
	if key != unix.IPC_PRIVATE {
		id, e := g.call(t, flags&^createExcl)
		switch {
		case e == 0 && o.has(g.kind, id):
			if flags&createExcl == createExcl {
				t.fail(unix.EEXIST)
				return
			}
			t.reply(int64(id))
			return
		case e == 0:
			t.deny(unix.EACCES, lease.BoundaryFile, lease.ReasonNotAllowed,
				fmt.Sprintf("%s of key %#x: System V IPC object %d was made by another process; the agent uses only its own", t.spec.name, uint32(key), id), nil)
			return
		case e != unix.ENOENT || flags&unix.IPC_CREAT == 0:
			t.fail(e)
			return
		}
		flags |= unix.IPC_EXCL // created now, or refused if another process made it meanwhile
	}
	id, e := g.call(t, flags)
	if e != 0 {
		t.fail(e)
		return
	}
	o.add(g.kind, id)
	t.reply(int64(id))
}

// ipcOp is a call on a System V object by id (argument 0); cmd is the
// index of a *ctl call's command (-1 for none).
type ipcOp struct {
	kind int
	cmd  int
}

// Read-only *ctl commands (the IPC_64 bit masked off): IPC_STAT, IPC_INFO
// and the *_STAT, *_STAT_ANY and *_INFO commands of each kind.
var ipcReadOnly = map[int][]int{
	ipcShm: {unix.IPC_STAT, ipcInfo, 13, 14, 15}, // SHM_STAT, SHM_INFO, SHM_STAT_ANY
	ipcMsg: {unix.IPC_STAT, ipcInfo, 11, 12, 13}, // MSG_STAT, MSG_INFO, MSG_STAT_ANY
	ipcSem: {unix.IPC_STAT, ipcInfo, 18, 19, 20}, // SEM_STAT, SEM_INFO, SEM_STAT_ANY
}

const (
	ipc64   = 0x100 // IPC_64
	ipcInfo = 3     // IPC_INFO
)

func (op ipcOp) handle(t *trap) {
	id := int(int32(t.arg(0)))
	if op.cmd >= 0 {
		cmd := int(int32(t.arg(op.cmd))) &^ ipc64
		for _, ro := range ipcReadOnly[op.kind] {
			if cmd == ro {
				t.proceed() // registers: the agent cannot change them while it waits
				return
			}
		}
	}
	o := t.pr.ipc()
	if !o.has(op.kind, id) {
		t.deny(unix.EACCES, lease.BoundaryFile, lease.ReasonNotAllowed,
			fmt.Sprintf("%s on System V IPC object %d: made by another process; the agent uses only its own", t.spec.name, id), nil)
		return
	}
	if op.cmd >= 0 && int(int32(t.arg(op.cmd)))&^ipc64 == unix.IPC_RMID {
		o.forget(op.kind, id) // its id may name another process's object next
	}
	t.proceed()
}
