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
)

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
	pid, ppid, pgid int
	state           byte
	start           uint64 // when it started, in clock ticks after boot
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
		case pi.pgid == pr.pid && !reused || (pi.ppid == self && !isDirect(pid) && (pi.pgid == pr.pid || !isDirect(pi.pgid))):
			// Its group is the attempt's, or this process adopted it (its
			// parent died: an orphan) — unless its group is another
			// attempt's: this process supervises every attempt it
			// started and adopts all their orphans, and one attempt's
			// cancel killed another's (TestCancelSparesAnotherAttemptsOrphan).
			// An orphan that left its attempt's group (setsid) is still
			// counted by every attempt this process supervises.
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
	pgid, _ := strconv.Atoi(f[2])
	var start uint64
	if len(f) > 19 {
		start, _ = strconv.ParseUint(f[19], 10, 64) // starttime, field 22 of proc_pid_stat(5)
	}
	return procInfo{pid: pid, ppid: ppid, pgid: pgid, state: f[0][0], start: start}, true
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
