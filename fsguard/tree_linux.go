//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

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
// session and process group too. So processes are told apart by number
// and start time (a command, a session's leader, a process a scan read
// and then signals through a pidfd), and the command's process group is
// signalled only until the command is reaped (Process.signalGroup).

var (
	directMu sync.Mutex
	// direct counts the commands of running attempts (and the sealed
	// network's helpers) by number and start time: their exec.Cmd reaps
	// them. A process that later got the number of one reaped already is
	// not one of them.
	direct = map[procKey]int{} // guarded by directMu
	// sessions maps the id of every session an attempt made — its
	// command's, at start, and each one a process of it made with setsid —
	// to the attempt and the leader's start time. The kernel gives a
	// process a number only once no session uses it, and every session an
	// attempt's process makes is recorded before it exists, so the latest
	// record of a number is the session's that uses it now.
	sessions = map[int]sessionRecord{} // guarded by directMu
	// recorded counts the records made, so a scan prunes only those older
	// than itself (the processes of a newer one may not be in it).
	recorded uint64 // guarded by directMu
)

// procKey is a process told apart from later owners of its number.
type procKey struct {
	pid   int
	start uint64
}

type sessionRecord struct {
	pr    *Process
	start uint64 // the leader's, to tell a record no session uses yet from one none uses any more
	seq   uint64 // its place among the records made
	// seen is when the latest scan that found a process of the session
	// (or its leader) began, or when the record was made.
	seen time.Time
}

// sessionGone is how long a session must go unseen, across scans, before
// its record is dropped: one scan can miss a session whose process forks
// and exits while the scan reads /proc.
const sessionGone = 2 * time.Second

// recordSession records that process pid (started at start) of pr leads,
// or is about to lead, a session of pr's.
func (pr *Process) recordSession(pid int, start uint64) {
	directMu.Lock()
	recorded++
	sessions[pid] = sessionRecord{pr: pr, start: start, seq: recorded, seen: time.Now()}
	directMu.Unlock()
}

// handleSetsid records the session a process of the attempt is about to
// lead, then lets setsid run: what the process starts from then on, and
// leaves behind, stays the attempt's. The thread's process is read before
// the notification is checked to be still pending, so it is the caller's.
// A call whose caller cannot be read is refused (EPERM, setsid's own
// refusal): a session nobody recorded would be every attempt's.
func handleSetsid(t *trap) {
	tgid, ok := taskTgid(t.pid())
	var pi procInfo
	if ok {
		pi, ok = readStat(tgid)
	}
	if !ok || !t.valid() {
		t.fail(unix.EPERM)
		return
	}
	t.pr.recordSession(tgid, pi.start)
	t.proceed()
}

// forgetSessions drops pr's session records once none of its processes
// is left.
func (pr *Process) forgetSessions() {
	directMu.Lock()
	defer directMu.Unlock()
	for sid, r := range sessions {
		if r.pr == pr {
			delete(sessions, sid)
		}
	}
}

// pruneSessions drops the records of sessions that ended, given every
// live process by number, as read by a scan that began at began (before
// is the last record made before it; complete, whether it read every
// process that did not exit meanwhile): the leader's number is another
// process's now, or no complete scan that began sessionGone or more after
// the last one to find a process of the session (its leader included,
// whose record comes before its setsid) found one. One scan can miss a
// session whose process forks and exits while /proc is read. An attempt
// that makes sessions by the thousand keeps only those in use.
func pruneSessions(all map[int]procInfo, before uint64, began time.Time, complete bool) {
	inUse := make(map[int]bool, len(all))
	for _, pi := range all {
		inUse[pi.sid] = true
	}
	directMu.Lock()
	defer directMu.Unlock()
	for sid, r := range sessions {
		if r.seq > before {
			continue // recorded during the scan: its processes may be missing from all
		}
		leader, alive := all[sid]
		switch {
		case alive && leader.start != r.start:
			// The number is another process's: the session ended.
			delete(sessions, sid)
		case inUse[sid] || alive:
			if began.After(r.seen) {
				r.seen = began
				sessions[sid] = r
			}
		case complete && began.Sub(r.seen) >= sessionGone:
			delete(sessions, sid)
		}
	}
}

// sessionOwner is the attempt whose session sid is (nil if no attempt
// recorded it).
func sessionOwner(sid int) *Process {
	directMu.Lock()
	defer directMu.Unlock()
	return sessions[sid].pr
}

// registerDirect records a command the caller's exec.Cmd reaps.
func registerDirect(pid int, start uint64) {
	directMu.Lock()
	direct[procKey{pid, start}]++
	directMu.Unlock()
}

func unregisterDirect(pid int, start uint64) {
	k := procKey{pid, start}
	directMu.Lock()
	if direct[k]--; direct[k] <= 0 {
		delete(direct, k)
	}
	directMu.Unlock()
}

// isDirect reports whether pi is a registered command (not a process
// that got its number since).
func isDirect(pi procInfo) bool {
	directMu.Lock()
	defer directMu.Unlock()
	return direct[procKey{pi.pid, pi.start}] > 0
}

var ownFilters = sync.OnceValue(func() int { return seccompFilters(os.Getpid()) })

type procInfo struct {
	pid, ppid, sid int
	state          byte
	start          uint64 // when it started, in clock ticks after boot
}

// members lists the attempt's processes (live and zombie).
func (pr *Process) members() []procInfo {
	directMu.Lock()
	before, began := recorded, time.Now()
	directMu.Unlock()
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	all := map[int]procInfo{}
	children := map[int][]int{}
	var roots []int
	complete := true
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		pi, err := statProc(pid)
		if err != nil {
			if !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ESRCH) {
				complete = false // not read, not gone: it may be in any session
			}
			continue
		}
		all[pid] = pi
		children[pi.ppid] = append(children[pi.ppid], pid)
	}
	pruneSessions(all, before, began, complete)
	self := os.Getpid()
	for pid, pi := range all {
		switch {
		case pid == pr.pid && pi.start == pr.started:
			// The command, by the start time this scan read: its number
			// may be another process's once it was reaped.
			roots = append(roots, pid)
		case pi.ppid == self && !isDirect(pi) && pr.ownsSession(pi.sid) && seccompFilters(pid) > ownFilters():
			// Adopted by this process (its parent died: an orphan), from
			// a session of the attempt's (its command's, or one a process
			// of it made), and carrying a filter this process installed.
			// Another attempt's orphan is not this one's, so one
			// attempt's cancel never kills it
			// (TestCancelSparesAnotherAttemptsOrphan,
			// TestCancelSparesAnotherAttemptsSessionOrphan,
			// TestSessionRecordBeatsTheCommandsNumber). The rest of the
			// attempt descends from these or from the command.
			roots = append(roots, pid)
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

// ownsSession reports whether session sid is the attempt's. A session
// no attempt recorded — every session an attempt's process makes is
// recorded first, so none is expected — counts for every attempt: a
// cancel then kills too much rather than leave a process behind.
func (pr *Process) ownsSession(sid int) bool {
	owner := sessionOwner(sid)
	return owner == nil || owner == pr
}

// reap collects the attempt's zombies this process adopted.
func (pr *Process) reap(members []procInfo) {
	self := os.Getpid()
	for _, m := range members {
		if m.ppid == self && m.state == 'Z' && !isDirect(m) {
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
	pi, err := statProc(pid)
	return pi, err == nil
}

// statProc reads process pid's /proc/PID/stat (an error wrapping
// fs.ErrNotExist or ESRCH: there is no such process now).
func statProc(pid int) (procInfo, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return procInfo{}, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: no command name's end", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return procInfo{}, fmt.Errorf("/proc/%d/stat: %d fields after the command name, want 20 or more", pid, len(f))
	}
	ppid, _ := strconv.Atoi(f[1])
	sid, _ := strconv.Atoi(f[3])
	start, _ := strconv.ParseUint(f[19], 10, 64) // starttime, field 22 of proc_pid_stat(5)
	return procInfo{pid: pid, ppid: ppid, sid: sid, state: f[0][0], start: start}, nil
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
