//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// Attacks of the second pass on issue 17: calls and paths the first
// rebuild of the guard left open, each shown on the real kernel.

// TestFileSetattrConfined: file_setattr (Linux 6.17) is FS_IOC_FSSETXATTR
// by path, with no ioctl and no write-open: while the lease holds it must
// change only files of the lease, and none after the loss.
func TestFileSetattrConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	mine, secret := filepath.Join(w.leased, "mine.txt"), filepath.Join(w.outside, "secret.txt")
	audit := &memAuditor{}
	gate := &testGate{}
	r := runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "atk-setattr", secret))
	if r.out != "path=EACCES empty=EACCES" {
		t.Errorf("file_setattr of %s outside the lease: %q, want EACCES both ways", secret, r.out)
	}
	if inodeFlags(t, secret)&fsNodumpFl != 0 {
		t.Errorf("%s outside the lease got FS_NODUMP_FL through file_setattr", secret)
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Boundary == lease.BoundaryFile && ev.Reason == lease.ReasonOutsideLease && strings.Contains(ev.Message, secret)
	}); !ok {
		t.Errorf("no outside-lease audit event naming %s among %+v", secret, audit.all())
	}
	r = runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "atk-setattr", mine))
	if r.out != "path=ok empty=ok" || inodeFlags(t, mine)&fsNodumpFl == 0 {
		t.Errorf("file_setattr of the leased %s: %q, want ok and the flag set", mine, r.out)
	}
	mine2 := filepath.Join(w.leased, "mine2.txt")
	if err := os.WriteFile(mine2, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	gate.lost.Store(true)
	r = runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "atk-setattr", mine2))
	if r.out != "path=EACCES empty=EACCES" || inodeFlags(t, mine2)&fsNodumpFl != 0 {
		t.Errorf("file_setattr of the leased %s after the loss: %q, want EACCES and no flag", mine2, r.out)
	}
}

// TestLostLeaseForeignPipesRefused: after the loss the supervisor opens
// harmless targets for the agent with its own credentials, outside
// Landlock. A pipe of another process (/proc/PID/fd/N, which Landlock's
// ptrace scope keeps from the agent itself) and a named FIFO outside the
// lease (which Landlock refuses to open for writing while the lease holds)
// are not harmless: a pipe feeding a shell runs what is written into it.
// Both stay refused; /dev/stdout on the agent's own pipe keeps working.
func TestLostLeaseForeignPipesRefused(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	marker := filepath.Join(w.leased, "LOSE")

	// The victim: a process reading a pipe (its stdin), as a shell would.
	victim := exec.Command("cat")
	vin, err := victim.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	var vout strings.Builder
	victim.Stdout = &vout
	if err := victim.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { victim.Process.Kill(); victim.Wait() })

	fifo := filepath.Join(w.outside, "fifo")
	if err := unix.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	rfd, err := unix.Open(fifo, unix.O_RDONLY|unix.O_NONBLOCK|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(rfd)

	script := `set -u
if echo held > "$FIFO"; then exit 10; fi
: > "$MARKER" || exit 9
echo piped > /dev/stdout || exit 11
if echo owned-pipe > "/proc/$VICTIM/fd/0"; then echo pipe-written; fi
if echo owned-pipe2 > "/proc/self/../$VICTIM/fd/0"; then echo pipe2-written; fi
if echo owned-fifo > "$FIFO"; then echo fifo-written; fi
echo done`
	audit := &memAuditor{}
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Env = append(os.Environ(), "MARKER="+marker, "FIFO="+fifo, "VICTIM="+strconv.Itoa(victim.Process.Pid))
	cmd.Dir = w.root
	var stderr strings.Builder
	cmd.Stderr = &stderr
	r := runGuardedAudit(t, w.policy(), markerGate{marker}, audit, cmd)
	if r.code != 0 || r.out != "piped\ndone" {
		t.Errorf("after the loss: exit %d, stdout %q, stderr %q; want exit 0 and piped, done (no foreign pipe written)", r.code, r.out, stderr.String())
	}
	buf := make([]byte, 4096)
	if n, _ := unix.Read(rfd, buf); n > 0 {
		t.Errorf("the FIFO outside the lease got %q", buf[:n])
	}
	vin.Close()
	testutil.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if victim.ProcessState == nil {
			if err := victim.Wait(); err != nil {
				return fmt.Errorf("victim: %w", err)
			}
		}
		return nil
	})
	if strings.Contains(vout.String(), "owned") {
		t.Errorf("the victim's stdin pipe got %q", vout.String())
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonLeaseLost && strings.Contains(ev.Message, fifo)
	}); !ok {
		t.Errorf("no lease-lost audit event naming %s among %+v", fifo, audit.all())
	}
}

// TestSysVIPCConfined: System V shared memory, message queues and
// semaphores live outside every file system, so Landlock does not see
// them: the agent (same user) could attach another process's segment by
// its id (listed in /proc/sysvipc/shm) and write into that process's
// memory. Only objects the attempt made are usable.
func TestSysVIPCConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	id, err := unix.SysvShmGet(unix.IPC_PRIVATE, 4096, unix.IPC_CREAT|0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.SysvShmCtl(id, unix.IPC_RMID, nil)
	mem, err := unix.SysvShmAttach(id, 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.SysvShmDetach(mem)
	copy(mem, "clean")
	audit := &memAuditor{}
	r := runGuardedAudit(t, w.policy(), &testGate{}, audit, exec.Command(helper, "atk-shm", strconv.Itoa(id)))
	if r.out != "shmat=EACCES" || string(mem[:5]) != "clean" {
		t.Errorf("attach of another process's segment: %q, segment %q; want EACCES and it untouched", r.out, mem[:5])
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonNotAllowed && strings.Contains(ev.Message, "shmat on System V IPC object "+strconv.Itoa(id))
	}); !ok {
		t.Errorf("no not-allowed audit event for the shmat among %+v", audit.all())
	}
	r = runGuardedAudit(t, w.policy(), &testGate{}, audit, exec.Command(helper, "atk-ownshm"))
	if r.out != "own=true rmid=ok keyed=true" {
		t.Errorf("the agent's own segments: %q, want them usable", r.out)
	}
}

// TestNestedListenerRefusedByKernel: when several seccomp filters return
// USER_NOTIF for a call, the kernel notifies only the most recently
// installed one's listener; an agent's own filter with a listener that
// answers CONTINUE would take every trapped call from the supervisor
// (metadata outside the lease, writes after the loss, which Landlock
// still allows in the lease). The kernel refuses a second listener in a
// filter chain (EBUSY) while the supervisor's is open.
func TestNestedListenerRefusedByKernel(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	mine, secret := filepath.Join(w.leased, "mine.txt"), filepath.Join(w.outside, "secret.txt")
	marker := filepath.Join(w.leased, "LOSE")
	r := runGuardedAudit(t, w.policy(), markerGate{marker}, &memAuditor{}, exec.Command(helper, "atk-notif", secret, mine, marker))
	if r.out != "install="+unix.EBUSY.Error() {
		t.Errorf("a filter with a listener of the agent's own: %q, want EBUSY", r.out)
	}
	if st, err := os.Stat(secret); err != nil || st.Mode().Perm() != 0o644 {
		t.Errorf("outside file mode %v (%v), want 0644 untouched", st.Mode().Perm(), err)
	}
	if b, _ := os.ReadFile(mine); string(b) != "data" {
		t.Errorf("leased file = %q, want it untouched", b)
	}
}

// TestKeyringsRefused: the kernel keyrings (the user keyring in
// particular) are shared by every process of the user, belong to no
// namespace and no file system: Landlock does not see them. The agent
// could read the secrets other programs keep there (Kerberos tickets,
// tokens) and plant keys for them. keyctl, add_key and request_key are
// refused, as container runtimes' default profiles do.
func TestKeyringsRefused(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	desc := "fenceline-test-secret-" + strconv.Itoa(os.Getpid())
	id, err := unix.AddKey("user", desc, []byte("s3cret"), unix.KEY_SPEC_USER_KEYRING)
	if err != nil {
		t.Fatalf("add_key (the test needs the kernel keyrings): %v", err)
	}
	t.Cleanup(func() {
		unix.KeyctlInt(unix.KEYCTL_UNLINK, id, unix.KEY_SPEC_USER_KEYRING, 0, 0)
		if p, err := unix.KeyctlSearch(unix.KEY_SPEC_USER_KEYRING, "user", desc+"-planted", 0); err == nil {
			unix.KeyctlInt(unix.KEYCTL_UNLINK, p, unix.KEY_SPEC_USER_KEYRING, 0, 0)
		}
	})
	audit := &memAuditor{}
	r := runGuardedAudit(t, w.policy(), &testGate{}, audit, exec.Command(helper, "atk-keys", desc))
	if r.out != "read=EPERM add=EPERM" {
		t.Errorf("the user keyring from the agent: %q, want both refused (EPERM)", r.out)
	}
	if _, err := unix.KeyctlSearch(unix.KEY_SPEC_USER_KEYRING, "user", desc+"-planted", 0); err == nil {
		t.Errorf("the agent planted a key in the user keyring")
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonNotAllowed && strings.Contains(ev.Message, "keyring")
	}); !ok {
		t.Errorf("no not-allowed audit event for the keyring among %+v", audit.all())
	}
}

// TestNoCoreDumpAfterLoss: a crashing process's core is written by the
// kernel, not by a system call of the agent, so the filter never sees it
// and Landlock allows it wherever the lease is writable: with
// core_pattern a plain file name, an agent that raised its core limit and
// crashed with its working directory in the lease wrote (or replaced) a
// file there after the loss, with its own memory as content. The guarded
// command gets a hard core limit of 0.
func TestNoCoreDumpAfterLoss(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	marker := filepath.Join(w.other, "LOSE")
	script := `: > "$MARKER" || exit 9
ulimit -c unlimited 2>/dev/null
echo "core limit: $(ulimit -c)"
cd "$LEASED" || exit 10
sh -c 'kill -SEGV $$'
echo "crashed: $?"`
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Env = append(os.Environ(), "MARKER="+marker, "LEASED="+w.leased)
	p := w.policy()
	p.Writable = append(p.Writable, w.other) // the marker's dir
	r := runGuardedAudit(t, p, markerGate{marker}, &memAuditor{}, cmd)
	t.Logf("guarded: %s", r.out)
	ents, err := os.ReadDir(w.leased)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), "core") {
			t.Errorf("a core dump %s landed in the lease after the loss", e.Name())
		}
	}
}

// TestOpenNotStretchedPastLoss: a write-open continues to the kernel
// while the lease holds; a read lease (F_SETLEASE) that a sibling holds
// on the file makes the kernel wait, after the guard's checks, until it is
// given up (up to fs.lease-break-time, 45 s): the truncation and the
// writable descriptor came after the loss. F_SETLEASE is refused (it also
// let the agent stall anyone's write-opens of any file it owns).
func TestOpenNotStretchedPastLoss(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	mine := filepath.Join(w.leased, "mine.txt")
	gate := &testGate{}
	audit := &memAuditor{}
	cmd := exec.Command(helper, "atk-lease", mine)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	outR, outW := io.Pipe()
	cmd.Stdout, cmd.Stderr = outW, outW
	pr, err := Start(context.Background(), w.policy(), gate, audit, cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Kill(); pr.Wait(); outW.Close() })
	lines := make(chan string, 16)
	go func() {
		sc := bufio.NewScanner(outR)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	next := func() string {
		select {
		case l, ok := <-lines:
			if !ok {
				t.Fatal("helper output ended")
			}
			return l
		case <-time.After(20 * time.Second):
			t.Fatal("no helper output within 20s")
		}
		return ""
	}
	l := next()
	if l == "breaking" {
		gate.lost.Store(true)
		io.WriteString(stdin, "go\n")
		l = next()
	}
	if l != "setlease=EPERM" {
		t.Errorf("helper: %q, want F_SETLEASE refused", l)
	}
	pr.Wait()
	if b, _ := os.ReadFile(mine); string(b) != "data" {
		t.Errorf("leased file = %q: written after the loss", b)
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonNotAllowed && strings.Contains(ev.Message, "F_SETLEASE")
	}); !ok {
		t.Errorf("no not-allowed audit event for F_SETLEASE among %+v", audit.all())
	}
}
