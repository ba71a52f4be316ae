//go:build linux && (amd64 || arm64)

package fsguard

import (
	"errors"
	"os/exec"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"
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
	if own.groupReused() {
		t.Fatal("the command's own number counted as reused")
	}
	if len(own.members()) != 1 {
		t.Fatalf("the attempt whose command this is has %d members, want it", len(own.members()))
	}

	if !own.commandHolds() {
		t.Fatal("a running command does not hold its own number")
	}

	gone := &Process{pid: other.Process.Pid, started: pi.start - 1}
	if gone.commandHolds() {
		t.Fatal("a command gone since holds a number now another process's")
	}
	if !gone.groupReused() {
		t.Fatal("a number now another process's (another start time) not seen as reused")
	}
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
