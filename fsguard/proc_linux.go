//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// Calls that act on another process by its pid and that the kernel lets
// any process of the same uid make: they are not ptrace-checked, so
// Landlock's scoping of ptrace and signals does not cover them. The agent
// runs as the supervisor's uid; with these it could lower the
// supervisor's (or the sealed network helper's, or any other process of
// the user's) resource limits — RLIMIT_NOFILE to nothing, RLIMIT_CPU to
// a second — or starve it (SCHED_IDLE, nice 19, idle I/O class).
//
// On the calling process itself (pid or who 0) they go straight to the
// kernel. On any other pid they trap, and continue only when the pid is
// a thread of a process of the attempt; anything else (another process of
// the user, a process group or user-wide setpriority or ioprio_set) is
// refused with EPERM and audited. The pid is resolved when the call
// traps; should the process it names end and its pid be taken by another
// before the kernel acts, the call reaches that one (pids are reused only
// after the whole pid space).

// procCall says where a call's target is: the index of its pid argument,
// or of its (which, who) pair.
type procCall struct {
	pid   int // index of the pid argument, or -1
	which int // index of "which" (setpriority, ioprio_set), or -1
	self  uint32
}

// Values of "which" that name one process: PRIO_PROCESS for setpriority,
// IOPRIO_WHO_PROCESS for ioprio_set.
const (
	prioProcess      = 0
	ioprioWhoProcess = 1
)

var procCalls = map[uint32]procCall{
	unix.SYS_PRLIMIT64:          {pid: 0, which: -1},
	unix.SYS_SCHED_SETPARAM:     {pid: 0, which: -1},
	unix.SYS_SCHED_SETSCHEDULER: {pid: 0, which: -1},
	unix.SYS_SCHED_SETATTR:      {pid: 0, which: -1},
	unix.SYS_SCHED_SETAFFINITY:  {pid: 0, which: -1},
	unix.SYS_SETPRIORITY:        {pid: -1, which: 0, self: prioProcess},
	unix.SYS_IOPRIO_SET:         {pid: -1, which: 0, self: ioprioWhoProcess},
}

func init() {
	calls := map[uint32]sysSpec{}
	names := map[uint32]string{
		unix.SYS_PRLIMIT64: "prlimit64", unix.SYS_SCHED_SETPARAM: "sched_setparam",
		unix.SYS_SCHED_SETSCHEDULER: "sched_setscheduler", unix.SYS_SCHED_SETATTR: "sched_setattr",
		unix.SYS_SCHED_SETAFFINITY: "sched_setaffinity", unix.SYS_SETPRIORITY: "setpriority",
		unix.SYS_IOPRIO_SET: "ioprio_set",
	}
	for nr, name := range names {
		calls[nr] = spec(name).handledBy(procTarget)
	}
	filterEmitters = append(filterEmitters, filterEmitter{
		calls: calls,
		jumps: func(a *asm) {
			for _, nr := range sortedKeys(procCalls) {
				a.jump(bpfJeqK, nr, "proc_"+strconv.Itoa(int(nr)), "")
			}
		},
		blocks: func(a *asm) {
			for _, nr := range sortedKeys(procCalls) {
				c := procCalls[nr]
				a.label("proc_" + strconv.Itoa(int(nr)))
				if c.pid >= 0 {
					// pid 0: the caller itself.
					a.stmt(bpfLdWAbs, argLow(c.pid))
					a.jump(bpfJeqK, 0, "proc_allow_"+strconv.Itoa(int(nr)), "")
					a.stmt(bpfRetK, retNotify)
				} else {
					// (which, who) = (one process, 0): the caller itself.
					a.stmt(bpfLdWAbs, argLow(c.which))
					a.jump(bpfJeqK, c.self, "", "proc_notify_"+strconv.Itoa(int(nr)))
					a.stmt(bpfLdWAbs, argLow(c.which+1))
					a.jump(bpfJeqK, 0, "proc_allow_"+strconv.Itoa(int(nr)), "")
					a.label("proc_notify_" + strconv.Itoa(int(nr)))
					a.stmt(bpfRetK, retNotify)
				}
				a.label("proc_allow_" + strconv.Itoa(int(nr)))
				a.stmt(bpfRetK, retAllow)
			}
		},
	})
}

func sortedKeys(m map[uint32]procCall) []uint32 { return slices.Sorted(maps.Keys(m)) }

// procTarget answers a call on another process: it continues when the
// target is a process of the attempt, else it is refused.
func procTarget(t *trap) {
	c := procCalls[uint32(t.n.nr)]
	if t.n.nr == unix.SYS_PRLIMIT64 && t.arg(2) == 0 {
		t.proceed() // no new limit: it only reads them, as /proc/PID/limits does
		return
	}
	var target int
	if c.pid >= 0 {
		target = int(int32(t.arg(c.pid)))
	} else {
		if uint32(t.arg(c.which)) != c.self {
			t.deny(unix.EPERM, lease.BoundaryFile, lease.ReasonNotAllowed,
				fmt.Sprintf("%s on a process group or every process of the user: it reaches processes outside the attempt (the supervisor's among them)", t.spec.name), nil)
			return
		}
		target = int(int32(t.arg(c.which + 1)))
	}
	if target < 0 {
		t.fail(unix.EINVAL)
		return
	}
	if t.pr.ownsTask(target, t.pid()) {
		t.proceed()
		return
	}
	t.deny(unix.EPERM, lease.BoundaryFile, lease.ReasonNotAllowed,
		fmt.Sprintf("%s on process %d: not a process of the attempt (its limits, priority and CPUs are its own)", t.spec.name, target), nil)
}

// ownsTask reports whether task (a pid or a thread id) belongs to a
// process of the attempt; caller is the trapped thread.
func (pr *Process) ownsTask(task, caller int) bool {
	tgid, ok := taskTgid(task)
	if !ok {
		return false
	}
	if own, ok := taskTgid(caller); ok && own == tgid {
		return true
	}
	for _, m := range pr.members() {
		if m.pid == tgid {
			return true
		}
	}
	return false
}

// taskTgid is the process (thread group) task belongs to.
func taskTgid(task int) (int, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(task) + "/status")
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "Tgid:"); ok {
			n, err := strconv.Atoi(strings.TrimSpace(v))
			return n, err == nil
		}
	}
	return 0, false
}
