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
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/fenceline/fenceline/lease"
	"golang.org/x/sys/unix"
)

// mqTestSeq makes the test's queue names unique within the process.
var mqTestSeq atomic.Int64

func mqTestName(kind string) string {
	return "fenceline-" + kind + "-" + strconv.Itoa(os.Getpid()) + "-" + strconv.FormatInt(mqTestSeq.Add(1), 10)
}

// testMqOpen is mq_open(2) by name without the leading "/".
func testMqOpen(name string, flags int, mode uint32, attr *mqAttr) (int, error) {
	p, err := unix.BytePtrFromString(name)
	if err != nil {
		return -1, err
	}
	fd, _, e := unix.Syscall6(unix.SYS_MQ_OPEN, uintptr(unsafe.Pointer(p)), uintptr(flags), uintptr(mode), uintptr(unsafe.Pointer(attr)), 0, 0)
	if e != 0 {
		return -1, e
	}
	return int(fd), nil
}

func testMqUnlink(name string) {
	p, _ := unix.BytePtrFromString(name)
	unix.Syscall(unix.SYS_MQ_UNLINK, uintptr(unsafe.Pointer(p)), 0, 0)
}

// victimQueue is another process's queue (the test's, unguarded): one
// message "keep" in it, a blocking descriptor of its own.
type victimQueue struct {
	name string
	fd   int
}

func newVictimQueue(t *testing.T) victimQueue {
	t.Helper()
	v := victimQueue{name: mqTestName("victim")}
	attr := mqAttr{Maxmsg: 4, Msgsize: 64}
	fd, err := testMqOpen(v.name, unix.O_CREAT|unix.O_EXCL|unix.O_RDWR|unix.O_CLOEXEC, 0o600, &attr)
	if err != nil {
		t.Fatalf("mq_open %s: %v", v.name, err)
	}
	v.fd = fd
	t.Cleanup(func() { unix.Close(fd); testMqUnlink(v.name) })
	msg := []byte("keep")
	if _, _, e := unix.Syscall6(unix.SYS_MQ_TIMEDSEND, uintptr(fd), uintptr(unsafe.Pointer(&msg[0])), uintptr(len(msg)), 0, 0, 0); e != 0 {
		t.Fatalf("mq_send: %v", e)
	}
	return v
}

// untouched reports what the agent changed of the queue: its name, its
// messages, its descriptor's flags, its notification.
func (v victimQueue) untouched(t *testing.T) {
	t.Helper()
	fd, err := testMqOpen(v.name, unix.O_RDONLY|unix.O_CLOEXEC, 0, nil)
	if err != nil {
		t.Errorf("the victim's queue %s by name: %v (unlinked by the agent?)", v.name, err)
		return
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	var st2 unix.Stat_t
	if unix.Fstat(fd, &st) != nil || unix.Fstat(v.fd, &st2) != nil || st.Ino != st2.Ino {
		t.Errorf("the name %s names another queue than the victim's", v.name)
	}
	var a mqAttr
	if _, _, e := unix.Syscall(unix.SYS_MQ_GETSETATTR, uintptr(v.fd), 0, uintptr(unsafe.Pointer(&a))); e != 0 {
		t.Fatalf("mq_getattr: %v", e)
	}
	if a.Curmsgs != 1 {
		t.Errorf("the victim's queue holds %d messages, want its 1 (the agent sent or took)", a.Curmsgs)
	}
	if a.Flags&unix.O_NONBLOCK != 0 {
		t.Errorf("the victim's descriptor became O_NONBLOCK (the agent's mq_setattr)")
	}
	ev := struct {
		value         uint64
		signo, notify int32
		_             [48]byte
	}{notify: 1} // SIGEV_NONE
	if _, _, e := unix.Syscall(unix.SYS_MQ_NOTIFY, uintptr(v.fd), uintptr(unsafe.Pointer(&ev)), 0); e != 0 {
		t.Errorf("the victim's mq_notify: %v (the agent registered first)", e)
	} else {
		unix.Syscall(unix.SYS_MQ_NOTIFY, uintptr(v.fd), 0, 0)
	}
}

func mqGone(t *testing.T, name string) {
	t.Helper()
	if fd, err := testMqOpen(name, unix.O_RDONLY|unix.O_CLOEXEC, 0, nil); err == nil {
		unix.Close(fd)
		testMqUnlink(name)
		t.Errorf("the agent's queue %s outlived the attempt", name)
	}
}

// TestPosixMQConfined: POSIX message queues live in the IPC namespace's
// mqueue file system, which the agent reaches by name (mq_open,
// mq_unlink) without any path Landlock judges. Another process's queue
// (the test's) must come through the run untouched: not unlinked, not
// sent to nor taken from, its notification and flags left alone, by name
// or through its descriptor inherited by the agent; a refusal has no
// effect. The agent's own queues work while the lease holds and are
// removed when the attempt settles; after the loss nothing is created.
func TestPosixMQConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	refusedByName := "open-w=EACCES open-rw=EACCES open-r=EACCES creat-existing=EACCES slash=EACCES"
	refusedFD := "fd-send=EACCES fd-recv=EACCES fd-notify=EACCES fd-setattr=EACCES unlink=EACCES"
	for _, tc := range []struct {
		name string
		lost bool
		want string
	}{
		{"held", false, refusedByName + " " + refusedFD + " create=ok own=ok,ok:mine,ok,ok,ok,ok,ENOENT"},
		{"lost", true, refusedByName + " " + refusedFD + " create=EACCES"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			v := newVictimQueue(t)
			fresh := mqTestName("agent")
			t.Cleanup(func() { testMqUnlink(fresh) })
			gate := &testGate{}
			gate.lost.Store(tc.lost)
			audit := &memAuditor{}
			cmd := exec.Command(helper, "atk-posixmq", v.name, fresh, "inherited")
			dup, err := unix.FcntlInt(uintptr(v.fd), unix.F_DUPFD_CLOEXEC, 0) // the same open queue description
			if err != nil {
				t.Fatal(err)
			}
			inherited := os.NewFile(uintptr(dup), "victim-mq")
			cmd.ExtraFiles = []*os.File{inherited}
			r := runGuardedAudit(t, w.policy(), gate, audit, cmd)
			inherited.Close()
			if r.out != tc.want {
				t.Errorf("agent:\n got %s\nwant %s", r.out, tc.want)
			}
			v.untouched(t)
			mqGone(t, fresh)
			mqGone(t, fresh+"-2")
			reason := lease.ReasonNotAllowed
			if tc.lost {
				reason = lease.ReasonLeaseLost
			}
			if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
				return ev.Boundary == lease.BoundaryFile && ev.Reason == reason && ev.LeaseID == "lease_test1" &&
					strings.Contains(ev.Message, "mq_unlink") && strings.Contains(ev.Message, v.name)
			}); !ok {
				t.Errorf("no %s audit event for the mq_unlink of %s among %+v", reason, v.name, audit.all())
			}
		})
	}
}

// TestPosixMQSendDup2Race: the supervisor sends on its duplicate of the
// agent's descriptor, so a dup2 of another process's queue onto the
// number after the check sends nothing there. A send on a full queue of
// the agent's still waits until its timeout.
func TestPosixMQSendDup2Race(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	v := newVictimQueue(t)
	own := mqTestName("agent")
	t.Cleanup(func() { testMqUnlink(own) })
	dup, err := unix.FcntlInt(uintptr(v.fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	inherited := os.NewFile(uintptr(dup), "victim-mq")
	defer inherited.Close()
	cmd := exec.Command(helper, "atk-mq-race", own)
	cmd.ExtraFiles = []*os.File{inherited}
	r := runGuardedAudit(t, w.policy(), &testGate{}, &memAuditor{}, cmd)
	if r.out != "sent>0=true timed="+unix.ETIMEDOUT.Error() {
		t.Errorf("agent: %q, want its own sends to go through and the timed send on its full queue to time out", r.out)
	}
	v.untouched(t)
	mqGone(t, own)
}

// TestPosixMQThroughMount: with the mqueue file system mounted (as
// /dev/mqueue often is), another process's queue is a file the agent may
// read: Landlock refuses opening it for writing, creating a queue there
// and unlinking one, and the supervisor refuses receiving from, notifying
// on and setting the flags of the read-only descriptor. The mount is made
// in a mount namespace of the test's own thread, which starts the agent.
func TestPosixMQThroughMount(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	for _, lost := range []bool{false, true} {
		v := newVictimQueue(t)
		fresh := mqTestName("agent")
		t.Cleanup(func() { testMqUnlink(fresh) })
		gate := &testGate{}
		gate.lost.Store(lost)
		cmd := exec.Command(helper, "atk-mq-path", "", v.name, fresh)
		r := runInMqueueMount(t, w, gate, cmd)
		want := "open-w=EACCES create=EACCES unlink=EACCES open-r=ok recv=EACCES notify=EACCES setattr=EACCES"
		if r.out != want {
			t.Errorf("lost=%v: agent:\n got %s\nwant %s", lost, r.out, want)
		}
		v.untouched(t)
		mqGone(t, fresh)
	}
}

// runInMqueueMount runs cmd under the guard from a locked thread with a
// mount namespace of its own where the mqueue file system is mounted on a
// new dir; cmd's first argument after the mode becomes that dir.
func runInMqueueMount(t *testing.T, w worktree, gate Gate, cmd *exec.Cmd) result {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "mqueue")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd.Args[2] = dir
	type ran struct {
		r     result
		err   error
		setup bool // err is the mount's: skip
	}
	done := make(chan ran, 1)
	go func() {
		// The thread never unlocks: it ends with the goroutine, and its
		// mount namespace with it.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			done <- ran{err: fmt.Errorf("unshare: %w", err), setup: true}
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_PRIVATE|unix.MS_REC, ""); err != nil {
			done <- ran{err: fmt.Errorf("make / private: %w", err), setup: true}
			return
		}
		if err := unix.Mount("mqueue", dir, "mqueue", 0, ""); err != nil {
			done <- ran{err: fmt.Errorf("mount mqueue: %w", err), setup: true}
			return
		}
		var out strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &out
		pr, err := Start(context.Background(), w.policy(), gate, &memAuditor{}, cmd)
		if err != nil {
			done <- ran{err: err}
			return
		}
		st, err := pr.Wait()
		if err != nil {
			done <- ran{err: err}
			return
		}
		done <- ran{r: result{out: strings.TrimSpace(out.String()), code: st.ExitCode()}}
	}()
	got := <-done
	if got.setup {
		t.Skipf("no mqueue mount of the test's own (needs CAP_SYS_ADMIN): %v", got.err)
	}
	if got.err != nil {
		t.Fatal(got.err)
	}
	return got.r
}

// TestPosixMQBlockedSendStopsAtLoss: a send waiting on the agent's full
// queue is made by the supervisor in slices; the lease lost meanwhile, it
// is refused and nothing is sent.
func TestPosixMQBlockedSendStopsAtLoss(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	name := mqTestName("agent")
	t.Cleanup(func() { testMqUnlink(name) })
	gate := &testGate{}
	audit := &memAuditor{}
	cmd := exec.Command(helper, "atk-mq-block", name)
	outR, outW := io.Pipe()
	cmd.Stdout, cmd.Stderr = outW, outW
	pr, err := Start(context.Background(), w.policy(), gate, audit, cmd)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pr.Kill(); pr.Wait(); outW.Close() })
	sc := bufio.NewScanner(outR)
	if !sc.Scan() || sc.Text() != "full" {
		t.Fatalf("helper: %q, want full", sc.Text())
	}
	time.Sleep(3 * mqSlice) // the send waits in the supervisor
	gate.lost.Store(true)
	if !sc.Scan() || sc.Text() != "send=EACCES curmsgs=1" {
		t.Errorf("helper: %q, want the waiting send refused at the loss and nothing sent", sc.Text())
	}
	pr.Wait()
	outW.Close()
	mqGone(t, name)
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Reason == lease.ReasonLeaseLost && strings.Contains(ev.Message, "mq_timedsend")
	}); !ok {
		t.Errorf("no lease-lost audit event for the send among %+v", audit.all())
	}
}

// TestSysVIPCRemovedAtSettle: System V objects the attempt made and left
// are removed once it settled, as its POSIX queues are.
func TestSysVIPCRemovedAtSettle(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	r := runGuardedAudit(t, w.policy(), &testGate{}, &memAuditor{}, exec.Command(helper, "atk-sysv-leave"))
	var shm, msg, sem int
	if _, err := fmt.Sscan(r.out, &shm, &msg, &sem); err != nil {
		t.Fatalf("helper: %q: %v", r.out, err)
	}
	if _, err := unix.SysvShmCtl(shm, unix.IPC_STAT, &unix.SysvShmDesc{}); err == nil {
		unix.SysvShmCtl(shm, unix.IPC_RMID, nil)
		t.Errorf("the attempt's segment %d outlived it", shm)
	}
	var buf [256]byte
	if _, _, e := unix.Syscall(unix.SYS_MSGCTL, uintptr(msg), unix.IPC_STAT, uintptr(unsafe.Pointer(&buf[0]))); e == 0 {
		unix.Syscall(unix.SYS_MSGCTL, uintptr(msg), unix.IPC_RMID, 0)
		t.Errorf("the attempt's message queue %d outlived it", msg)
	}
	if _, _, e := unix.Syscall6(unix.SYS_SEMCTL, uintptr(sem), 0, unix.IPC_STAT, uintptr(unsafe.Pointer(&buf[0])), 0, 0); e == 0 {
		unix.Syscall6(unix.SYS_SEMCTL, uintptr(sem), 0, unix.IPC_RMID, 0, 0, 0)
		t.Errorf("the attempt's semaphore set %d outlived it", sem)
	}
}
