//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bytes"
	"os"
	"strconv"
	"strings"
	"sync"

	"golang.org/x/sys/unix"
)

// The process tree of an attempt is: the command and its descendants, plus
// the orphans this (subreaper) process adopts from it. An adopted child is
// recognised by carrying more seccomp filters than this process — only an
// attempt's processes got one from us — and by not being the command of an
// attempt (those are reaped by their own exec.Cmd).
//
// This process supervises every attempt it started and adopts all their
// orphans, so an orphan is told apart by its session. Each attempt's
// command leads a session of its own (Setsid): no process can join a
// process group of another session, so a process of one attempt cannot
// move into another attempt's group and out of reach of its own
// attempt's cancel. A process that leaves its session (setsid) is seen
// doing it: the filter traps setsid, and the supervisor records the new
// session as the attempt's before the call runs (recordSession).

//
// Process ids are reused (pid_max is often 32,768, and a busy supervisor
// starts thousands of processes): once an attempt's command has been
// reaped, its number may be another attempt's command, and that one's
// process group id too. The kernel frees a number only once no process
// uses it as its id or its group's, so after the reap a live process
// with the command's number and another start time means the attempt's
// group is empty and the number is someone else's (Process.members,
// Process.Signal).

var (
	directMu sync.Mutex
	// direct counts, by pid, the commands of running attempts that were
	// started with that pid: an attempt that settles after its number
	// was reused by another's command leaves the other's registered.
	direct = map[int]int{} // guarded by directMu
	// sessions maps the id of each session a process of an attempt made
	// with setsid to that attempt. The kernel gives a process a number
	// only once no session uses it, so a new session of a number is
	// never an old one still in use: the latest record wins.
	sessions = map[int]*Process{} // guarded by directMu
)

// recordSession records that process tgid of pr, about to call setsid,
// leads a session of pr's. A setsid that then fails (tgid already leads
// a group) leaves a record no session uses.
func (pr *Process) recordSession(tgid int) {
	directMu.Lock()
	sessions[tgid] = pr
	directMu.Unlock()
}

// handleSetsid records the session a process of the attempt is about to
// lead, then lets setsid run: what the process starts from then on, and
// leaves behind, stays the attempt's. The thread's process is read before
// the notification is checked to be still pending, so it is the caller's.
func handleSetsid(t *trap) {
	if tgid, ok := taskTgid(t.pid()); ok && t.valid() {
		t.pr.recordSession(tgid)
	}
	t.proceed()
}

// forgetSessions drops pr's session records once none of its processes
// is left.
func (pr *Process) forgetSessions() {
	directMu.Lock()
	defer directMu.Unlock()
	for sid, owner := range sessions {
		if owner == pr {
			delete(sessions, sid)
		}
	}
}

// sessionOwner is the attempt a process of session sid belongs to: the
// one whose command leads it, or that recorded it; nil if none did.
func sessionOwner(sid int) *Process {
	directMu.Lock()
	defer directMu.Unlock()
	return sessions[sid]
}

func registerDirect(pid int) {
	directMu.Lock()
	direct[pid]++
	directMu.Unlock()
}

func unregisterDirect(pid int) {
	directMu.Lock()
	if direct[pid]--; direct[pid] <= 0 {
		delete(direct, pid)
	}
	directMu.Unlock()
}

func isDirect(pid int) bool {
	directMu.Lock()
	defer directMu.Unlock()
	return direct[pid] > 0
}

// groupReused reports whether the attempt's command is gone and its
// number belongs to another process (one started at another time): the
// attempt's process group is then empty, and the group of that number is
// not the attempt's.
func (pr *Process) groupReused() bool {
	pi, alive := readStat(pr.pid)
	return alive && pr.started != 0 && pi.start != pr.started
}

// commandHolds reports whether the attempt's command still holds its
// number (running, or a zombie not yet reaped): only then is a signal to
// the process group of that number surely the attempt's. Once the command
// is reaped the number is free, and a group signal sent after any check
// could reach whoever takes it next; the attempt's processes are then
// signalled one by one.
func (pr *Process) commandHolds() bool {
	pi, alive := readStat(pr.pid)
	return alive && (pr.started == 0 || pi.start == pr.started)
}

var ownFilters = sync.OnceValue(func() int { return seccompFilters(os.Getpid()) })

type procInfo struct {
	pid, ppid, sid int
	state          byte
	start          uint64 // when it started, in clock ticks after boot
}

// members lists the attempt's processes (live and zombie).
func (pr *Process) members() []procInfo {
	self := os.Getpid()
	reused := pr.groupReused()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	all := map[int]procInfo{}
	children := map[int][]int{}
	var roots []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		pi, ok := readStat(pid)
		if !ok {
			continue
		}
		all[pid] = pi
		children[pi.ppid] = append(children[pi.ppid], pid)
		switch {
		case pid == pr.pid && !reused:
			roots = append(roots, pid)
		case pi.sid == pr.pid && !reused || pi.ppid == self && !isDirect(pid) && pr.ownsSession(pi.sid, reused):
			// In the session the attempt's command leads, or adopted by
			// this process (its parent died: an orphan) from a session
			// of the attempt's: another attempt's orphan is not this
			// one's, so one attempt's cancel never kills it
			// (TestCancelSparesAnotherAttemptsOrphan,
			// TestCancelSparesAnotherAttemptsSessionOrphan).
			if seccompFilters(pid) > ownFilters() {
				roots = append(roots, pid)
			}
		}
	}
	seen := map[int]bool{}
	var out []procInfo
	for len(roots) > 0 {
		pid := roots[len(roots)-1]
		roots = roots[:len(roots)-1]
		if seen[pid] {
			continue
		}
		seen[pid] = true
		out = append(out, all[pid])
		roots = append(roots, children[pid]...)
	}
	return out
}

// ownsSession reports whether an orphan of session sid, adopted by this
// process, is the attempt's: sid is the attempt's command's (and that
// number is not another's now), or recorded for the attempt. A session
// no attempt made or recorded — every setsid of an attempt's process is
// trapped and recorded, so none is expected — counts for every attempt:
// a cancel then kills too much rather than leave a process behind.
func (pr *Process) ownsSession(sid int, reused bool) bool {
	if sid == pr.pid {
		return !reused
	}
	if owner := sessionOwner(sid); owner != nil {
		return owner == pr
	}
	return !isDirect(sid)
}

// reap collects the attempt's zombies this process adopted.
func (pr *Process) reap(members []procInfo) {
	self := os.Getpid()
	for _, m := range members {
		if m.ppid == self && m.pid != pr.pid && m.state == 'Z' && !isDirect(m.pid) {
			var ws unix.WaitStatus
			unix.Wait4(m.pid, &ws, unix.WNOHANG, nil)
		}
	}
}

// live drops zombies whose parent is not us and the command itself once
// it is a zombie (its exec.Cmd reaps it).
func live(ms []procInfo) []procInfo {
	var out []procInfo
	for _, m := range ms {
		if m.state != 'Z' {
			out = append(out, m)
		}
	}
	return out
}

func readStat(pid int) (procInfo, bool) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procInfo{}, false
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procInfo{}, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 4 {
		return procInfo{}, false
	}
	ppid, _ := strconv.Atoi(f[1])
	sid, _ := strconv.Atoi(f[3])
	var start uint64
	if len(f) > 19 {
		start, _ = strconv.ParseUint(f[19], 10, 64) // starttime, field 22 of proc_pid_stat(5)
	}
	return procInfo{pid: pid, ppid: ppid, sid: sid, state: f[0][0], start: start}, true
}

func seccompFilters(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "Seccomp_filters:"); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(v))
			return n
		}
	}
	return 0
}
