//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestReusedNumberIsNotTheAttempts: process ids are reused (pid_max is
// often 32,768). Once an attempt's command is gone and its number is
// another process's — another attempt's command, with a process group of
// that number — the attempt claims neither that process nor its group,
// and signals neither: before, a supervisor still killing what a canceled
// attempt left behind killed the group of the next attempt that got the
// number (an orphan of TestWaitOutlastsOrphans died before its write, in
// a CI run of the whole fast tier).
func TestReusedNumberIsNotTheAttempts(t *testing.T) {
	t.Parallel()
	// Another attempt's command, in a group of its own, that got the
	// number of an attempt's command gone since.
	other := exec.Command("sleep", "30")
	other.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		other.Process.Kill()
		other.Wait()
	})
	pi, ok := readStat(other.Process.Pid)
	if !ok || pi.start == 0 {
		t.Fatalf("no start time in /proc/%d/stat", other.Process.Pid)
	}

	own := &Process{pid: other.Process.Pid, started: pi.start}
	if ms := own.members(); len(ms) != 1 {
		for _, m := range ms {
			b, _ := os.ReadFile("/proc/" + strconv.Itoa(m.pid) + "/cmdline")
			t.Logf("member %+v owner %p filters %d cmd %q", m, sessionOwner(m.sid), seccompFilters(m.pid), b)
		}
		t.Fatalf("the attempt whose command this is has %d members, want it", len(ms))
	}

	// Reaped: its number is free, and group signals go no more.
	gone := &Process{pid: other.Process.Pid, started: pi.start - 1, reaped: true}
	if ms := gone.members(); len(ms) != 0 {
		t.Fatalf("an attempt whose command is gone claims %+v, another's", ms)
	}
	if err := gone.Signal(unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(other.Process.Pid, 0); errors.Is(err, unix.ESRCH) {
		t.Fatal("an attempt whose command is gone killed the process that got its number")
	}
}

// startAttempt starts script under the guard in a fresh worktree,
// canceled and waited for at the test's end.
func startAttempt(t *testing.T, script string) (*Process, worktree) {
	t.Helper()
	w := newWorktree(t)
	p := w.policy()
	p.KillGrace = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = w.root
	pr, err := Start(ctx, p, &testGate{}, nil, cmd)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		pr.Wait()
	})
	return pr, w
}

// waitFile waits for a process of the attempt to write file, and returns
// what it wrote.
func waitFile(t *testing.T, file string) string {
	t.Helper()
	var got string
	testutil.CheckFor(t, 60*time.Second, 10*time.Millisecond, func() error {
		b, err := os.ReadFile(file)
		if got = strings.TrimSpace(string(b)); err != nil || got == "" {
			return fmt.Errorf("nothing in %s yet (%v)", file, err)
		}
		return nil
	})
	return got
}

func isMember(ms []procInfo, pid int) bool {
	for _, m := range ms {
		if m.pid == pid {
			return true
		}
	}
	return false
}

// TestSessionRecordBeatsTheCommandsNumber: attempt A's command is gone
// and its number S went to a process of attempt B, which made session S
// (setsid), started a daemon in it and exited. The daemon is B's: A,
// whose command had that number, neither claims nor kills it (it did:
// a session of the command's number counted as the attempt's whenever
// no process held the number).
func TestSessionRecordBeatsTheCommandsNumber(t *testing.T) {
	t.Parallel()
	b, w := startAttempt(t, `setsid /bin/sh -c 'sleep 1000 & echo $! > leased/daemon'; sleep 1000`)
	daemon, _ := strconv.Atoi(waitFile(t, filepath.Join(w.leased, "daemon")))
	var sid int
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		pi, ok := readStat(daemon)
		if !ok || pi.ppid != os.Getpid() {
			return fmt.Errorf("the daemon %d is not an orphan of this process yet: %+v", daemon, pi)
		}
		if _, alive := readStat(pi.sid); alive {
			return fmt.Errorf("the daemon's session leader %d has not exited yet", pi.sid)
		}
		sid = pi.sid
		return nil
	})
	a := &Process{pid: sid, started: 1} // A, whose command had number sid
	if ms := a.members(); isMember(ms, daemon) {
		t.Fatalf("attempt A, whose reaped command had number %d, claims B's daemon %d in session %d: %+v", sid, daemon, sid, ms)
	}
	if !isMember(b.members(), daemon) {
		t.Fatalf("attempt B does not claim its daemon %d in the session %d it made", daemon, sid)
	}
}

// TestReusedCommandNumberIsAMember: a process of the attempt that got
// the number of a command reaped already (its attempt still settling) is
// a member like any other: it was left out as that command — which its
// exec.Cmd reaps — and so outlived its attempt's cancel and kill, and
// the attempt never settled. A command is told apart by its start time.
func TestReusedCommandNumberIsAMember(t *testing.T) {
	t.Parallel()
	b, w := startAttempt(t, `(sleep 1000 & echo $! > leased/orphan); sleep 1000`)
	orphan, _ := strconv.Atoi(waitFile(t, filepath.Join(w.leased, "orphan")))
	var pi procInfo
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		var ok bool
		if pi, ok = readStat(orphan); !ok || pi.ppid != os.Getpid() {
			return fmt.Errorf("the orphan %d is not this process's yet: %+v", orphan, pi)
		}
		return nil
	})
	// A command, reaped since, that had the orphan's number.
	registerDirect(orphan, pi.start-1)
	defer unregisterDirect(orphan, pi.start-1)
	if !isMember(b.members(), orphan) {
		t.Fatalf("attempt B's orphan %d, which has the number of a command reaped already, is not B's", orphan)
	}
}

// TestEndedSessionsForgotten: an attempt that makes sessions by the
// hundred, each ending at once, keeps records only of those in use.
func TestEndedSessionsForgotten(t *testing.T) {
	t.Parallel()
	pr, w := startAttempt(t, `i=0; while [ $i -lt 300 ]; do setsid true; i=$((i+1)); done; echo done > leased/done; sleep 1000`)
	waitFile(t, filepath.Join(w.leased, "done"))
	owned := func() int {
		directMu.Lock()
		defer directMu.Unlock()
		n := 0
		for _, r := range sessions {
			if r.pr == pr {
				n++
			}
		}
		return n
	}
	if n := owned(); n < 2 {
		t.Logf("%d session records once the sessions ended (a scan may have pruned them already)", n)
	}
	testutil.CheckFor(t, 20*time.Second, 100*time.Millisecond, func() error {
		pr.members() // a scan, as the supervisor makes each second
		if n := owned(); n > 1 {
			return fmt.Errorf("%d session records of the attempt, want only its command's", n)
		}
		return nil
	})
	if owned() != 1 {
		t.Fatal("the record of the attempt's command's session, still in use, was dropped")
	}
}

// TestSignalProcChecksStartTime: a process a scan read may be gone and
// its number another process's by the time it is signalled; signalProc
// signals only the process the scan read (by start time, through a
// pidfd), never the one that took its number. The stale SIGKILL, had it
// gone out, would be how the process died: a fatal signal sets the exit
// status when it is sent, before the SIGTERM that follows.
func TestSignalProcChecksStartTime(t *testing.T) {
	t.Parallel()
	other := exec.Command("sleep", "30")
	if err := other.Start(); err != nil {
		t.Fatal(err)
	}
	pi, ok := readStat(other.Process.Pid)
	if !ok {
		other.Process.Kill()
		other.Wait()
		t.Fatalf("no /proc/%d/stat", other.Process.Pid)
	}
	stale := pi
	stale.start-- // what a scan read of the process that had the number before
	signalProc(stale, unix.SIGKILL)
	signalProc(pi, unix.SIGTERM)
	done := make(chan struct{})
	go func() {
		other.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		other.Process.Kill()
		<-done
		t.Fatal("signalProc did not signal the process the scan read")
	}
	ws, _ := other.ProcessState.Sys().(syscall.WaitStatus)
	if !ws.Signaled() || ws.Signal() != unix.SIGTERM {
		t.Fatalf("the process ended %v, want killed by SIGTERM alone: the stale SIGKILL reached the process that took the number", other.ProcessState)
	}
}
