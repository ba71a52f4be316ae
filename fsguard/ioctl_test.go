//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"github.com/fenceline/fenceline/lease"
	"golang.org/x/sys/unix"
)

// openPty makes a pseudo-terminal: the master and the slave.
func openPty(t *testing.T) (master, slave *os.File) {
	t.Helper()
	m, err := os.OpenFile("/dev/ptmx", os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	if err := unix.IoctlSetPointerInt(int(m.Fd()), unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetInt(int(m.Fd()), unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	s, err := os.OpenFile("/dev/pts/"+strconv.Itoa(n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	return m, s
}

// findEvent returns the first audit event matching f.
func findEvent(evs []lease.AuditEvent, f func(lease.AuditEvent) bool) (lease.AuditEvent, bool) {
	for _, ev := range evs {
		if f(ev) {
			return ev, true
		}
	}
	return lease.AuditEvent{}, false
}

// TestTerminalInjectionRefused: TIOCSTI on the terminal the agent was
// given would push a command into the user's shell; TIOCLINUX is the same
// class. Both are refused whatever the lease, and audited; nothing reaches
// the terminal's input.
func TestTerminalInjectionRefused(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	master, slave := openPty(t)
	audit := &memAuditor{}
	cmd := exec.Command(helper, "tty", "0")
	cmd.Stdin = slave
	r := runGuardedAudit(t, w.policy(), &testGate{}, audit, cmd)
	if r.code != 0 || r.out != "tiocsti=EPERM tioclinux=EPERM" {
		t.Errorf("guarded TIOCSTI/TIOCLINUX: exit %d %q, want both EPERM", r.code, r.out)
	}
	// TIOCSTI queues its byte synchronously: had it worked, the line would
	// wait in the slave's input now.
	if n, err := unix.IoctlGetInt(int(slave.Fd()), unix.TIOCINQ); err != nil || n != 0 {
		t.Errorf("terminal input queue holds %d bytes (%v), want none injected", n, err)
	}
	mfd := int(master.Fd()) // Fd makes the file blocking: call it once
	unix.SetNonblock(mfd, true)
	buf := make([]byte, 4096)
	n, _ := unix.Read(mfd, buf)
	if n > 0 && bytes.Contains(buf[:n], []byte("INJECTED")) {
		t.Errorf("the master saw the injected bytes: %q", buf[:n])
	}
	ev, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Boundary == lease.BoundaryFile && ev.Reason == lease.ReasonNotAllowed &&
			strings.Contains(ev.Message, "TIOCSTI") && strings.Contains(ev.Message, "terminal input injection")
	})
	if !ok {
		t.Fatalf("no not-allowed audit event for TIOCSTI among %+v", audit.all())
	}
	if ev.LeaseID != "lease_test1" || ev.Fence != 7 {
		t.Errorf("audit event %+v: want the lease and fence named", ev)
	}
}

const fsNodumpFl = 0x40 // FS_NODUMP_FL

func inodeFlags(t *testing.T, path string) int32 {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	var flags int32
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.FS_IOC_GETFLAGS, uintptr(unsafe.Pointer(&flags))); e != 0 {
		t.Fatalf("FS_IOC_GETFLAGS %s: %v (the test needs a file system with inode flags, e.g. ext4)", path, e)
	}
	return flags
}

// TestSetFlagsConfined: chattr (FS_IOC_SETFLAGS on a read-only descriptor)
// changes only files of the lease while it holds, and none after it is
// lost. The test's temp dir must support inode flags (ext4 here); the
// test fails loudly where it does not.
func TestSetFlagsConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	mine, theirs, secret := filepath.Join(w.leased, "mine.txt"), filepath.Join(w.other, "theirs.txt"), filepath.Join(w.outside, "secret.txt")
	for _, f := range []string{mine, theirs, secret} {
		if inodeFlags(t, f)&fsNodumpFl != 0 {
			t.Fatalf("%s already has FS_NODUMP_FL", f)
		}
	}
	audit := &memAuditor{}
	gate := &testGate{}
	for _, f := range []string{theirs, secret} {
		r := runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "setflags", f))
		if r.out != "setflags=EACCES" {
			t.Errorf("chattr of %s outside the lease: %q, want EACCES", f, r.out)
		}
		if inodeFlags(t, f)&fsNodumpFl != 0 {
			t.Errorf("%s outside the lease got FS_NODUMP_FL", f)
		}
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Boundary == lease.BoundaryFile && ev.Reason == lease.ReasonOutsideLease && strings.Contains(ev.Message, secret)
	}); !ok {
		t.Errorf("no outside-lease audit event naming %s among %+v", secret, audit.all())
	}
	r := runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "setflags", mine))
	if r.out != "setflags=ok" || inodeFlags(t, mine)&fsNodumpFl == 0 {
		t.Errorf("chattr of the leased %s: %q, want ok and the flag set", mine, r.out)
	}

	mine2 := filepath.Join(w.leased, "mine2.txt")
	if err := os.WriteFile(mine2, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	gate.lost.Store(true)
	r = runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "setflags", mine2))
	if r.out != "setflags=EACCES" || inodeFlags(t, mine2)&fsNodumpFl != 0 {
		t.Errorf("chattr of the leased %s after the loss: %q, want EACCES and no flag", mine2, r.out)
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonLeaseLost && strings.Contains(ev.Message, mine2)
	}); !ok {
		t.Errorf("no lease-lost audit event naming %s", mine2)
	}
}

// TestSetFlagsDup2Race: a thread switches the descriptor number between a
// leased and an outside file with dup2 while another chattrs through it.
// The supervisor judges and uses its own duplicate of the open file, so
// the outside file never gets the flag.
func TestSetFlagsDup2Race(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	mine, secret := filepath.Join(w.leased, "mine.txt"), filepath.Join(w.outside, "secret.txt")
	r := runGuardedAudit(t, w.policy(), &testGate{}, &memAuditor{}, exec.Command(helper, "setflagsrace", mine, secret, "3000"))
	t.Logf("race: %s", r.out)
	if !strings.HasPrefix(r.out, "ok=") || strings.HasPrefix(r.out, "ok=0 ") {
		t.Errorf("race output %q: want some chattrs of the leased file to succeed", r.out)
	}
	if inodeFlags(t, secret)&fsNodumpFl != 0 {
		t.Errorf("the outside file got FS_NODUMP_FL during the race")
	}
}
