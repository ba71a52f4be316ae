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
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestCancelSettlesWholeTree: an agent that ignores SIGTERM, with a
// background child, a double-forked orphan and a child in its own session.
// Wait returns only after the grace ran out and every one of them is gone.
func TestCancelSettlesWholeTree(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	p := w.policy()
	p.KillGrace = 300 * time.Millisecond
	pids := filepath.Join(w.leased, "pids")
	script := `trap '' TERM
sleep 1000 & echo $! >> leased/pids
(sleep 1000 & echo $! >> leased/pids)
setsid sleep 1000 & echo $! >> leased/pids
echo $$ >> leased/pids
wait`
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Dir = w.root
	pr, err := Start(ctx, p, &testGate{}, nil, cmd)
	if err != nil {
		t.Fatal(err)
	}
	var procs []int
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		b, _ := os.ReadFile(pids)
		procs = procs[:0]
		for _, f := range strings.Fields(string(b)) {
			n, _ := strconv.Atoi(f)
			procs = append(procs, n)
		}
		if len(procs) < 4 {
			return errors.New("the agent has not started its children yet")
		}
		return nil
	})
	canceled := time.Now()
	cancel()
	if _, err := pr.Wait(); err != nil {
		t.Fatal(err)
	}
	if d := time.Since(canceled); d < p.KillGrace {
		t.Errorf("settled %v after cancel, before the %v grace: SIGTERM was ignored, so something was left", d, p.KillGrace)
	}
	for _, pid := range procs {
		if err := unix.Kill(pid, 0); !errors.Is(err, unix.ESRCH) {
			t.Errorf("process %d of the attempt still exists after Wait (kill 0: %v)", pid, err)
		}
	}
	if _, err := os.Stat(pr.TempDir()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("private temp dir %s still there after settle: %v", pr.TempDir(), err)
	}
}

// TestWaitOutlastsOrphans: the command exits at once but leaves a
// double-forked child behind; Wait returns only after that one is done.
func TestWaitOutlastsOrphans(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	r := sh(t, w.policy(), w.root, `(sleep 0.3; echo finished > leased/orphan.txt) & exit 5`)
	if r.code != 5 {
		t.Fatalf("exit %d (%s), want 5", r.code, r.out)
	}
	if b, err := os.ReadFile(filepath.Join(w.leased, "orphan.txt")); err != nil || string(b) != "finished\n" {
		t.Fatalf("orphan's file = %q, %v: Wait returned before the orphan finished, or its write failed (output: %q)", b, err, r.out)
	}
}

// TestCancelSparesAnotherAttemptsOrphan: one process supervises two
// attempts and adopts the orphans of both. Attempt A's command exits and
// leaves an orphan in its process group that writes a file a little
// later; attempt B is cancelled and killed meanwhile. B's kill must not
// reach A's orphan (it did: every adopted orphan counted as each
// attempt's, and a CI run's TestWaitOutlastsOrphans lost its orphan to
// TestCancelSettlesWholeTree beside it), and A's Wait outlasts it.
func TestCancelSparesAnotherAttemptsOrphan(t *testing.T) {
	t.Parallel()
	wa, wb := newWorktree(t), newWorktree(t)
	a := exec.Command("/bin/sh", "-c", `(sleep 1; echo finished > leased/orphan.txt) & exit 0`)
	a.Dir = wa.root
	pa, err := Start(context.Background(), wa.policy(), &testGate{}, nil, a)
	if err != nil {
		t.Fatal(err)
	}
	// A's command is gone: its orphan is this process's now.
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if pi, alive := readStat(pa.Pid()); alive && pi.state != 'Z' {
			return errors.New("attempt A's command has not exited yet")
		}
		return nil
	})
	pb := wb.policy()
	pb.KillGrace = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := exec.Command("/bin/sh", "-c", `trap '' TERM; sleep 1000`)
	b.Dir = wb.root
	prb, err := Start(ctx, pb, &testGate{}, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	cancel()
	if _, err := prb.Wait(); err != nil {
		t.Fatal(err)
	}
	if _, err := pa.Wait(); err != nil {
		t.Fatal(err)
	}
	if got, err := os.ReadFile(filepath.Join(wa.leased, "orphan.txt")); err != nil || string(got) != "finished\n" {
		t.Fatalf("attempt A's orphan's file = %q, %v: attempt B's cancel killed it, or A's Wait returned before it finished", got, err)
	}
}

// TestCancelSparesAnotherAttemptsSessionOrphan: as
// TestCancelSparesAnotherAttemptsOrphan, but attempt A's orphans, alive
// until B has settled, left A's session first — one with setsid(1), one calling setsid on a thread
// other than its first (the kernel names that thread to the supervisor).
// Before, an orphan in a session of its own counted as every attempt's,
// so B's cancel killed both. B's own orphan in a session of its own is
// still B's: its cancel kills it.
func TestCancelSparesAnotherAttemptsSessionOrphan(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	wa, wb := newWorktree(t), newWorktree(t)
	// The orphans finish once B settled (leased/go), or after a minute.
	a := exec.Command("/bin/sh", "-c", `(setsid /bin/sh -c 'echo $$ > leased/sess; i=0; while [ ! -e leased/go ] && [ $i -lt 1200 ]; do sleep 0.05; i=$((i+1)); done; echo finished > leased/orphan.txt' &)
(`+helper+` atk-threadsetsid leased/threadsess leased/go leased/thread.txt &)
exit 0`)
	a.Dir = wa.root
	pa, err := Start(context.Background(), wa.policy(), &testGate{}, nil, a)
	if err != nil {
		t.Fatal(err)
	}
	var orphans []int
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		orphans = orphans[:0]
		for _, f := range []string{"sess", "threadsess"} {
			b, err := os.ReadFile(filepath.Join(wa.leased, f))
			fields := strings.Fields(string(b))
			if err != nil || len(fields) == 0 {
				return fmt.Errorf("attempt A's orphan has not written %s yet", f)
			}
			pid, _ := strconv.Atoi(fields[len(fields)-1])
			orphans = append(orphans, pid)
		}
		if pi, alive := readStat(pa.Pid()); alive && pi.state != 'Z' {
			return errors.New("attempt A's command has not exited yet")
		}
		return nil
	})
	for _, pid := range orphans {
		if pi, ok := readStat(pid); !ok || pi.sid != pid {
			t.Fatalf("attempt A's orphan %d is not in a session of its own: %+v", pid, pi)
		}
	}

	pb := wb.policy()
	pb.KillGrace = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := exec.Command("/bin/sh", "-c", `(setsid sleep 1000 & echo $! > leased/own) ; trap '' TERM; sleep 1000`)
	b.Dir = wb.root
	prb, err := Start(ctx, pb, &testGate{}, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	var own int
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		b, _ := os.ReadFile(filepath.Join(wb.leased, "own"))
		if own, _ = strconv.Atoi(strings.TrimSpace(string(b))); own == 0 {
			return errors.New("attempt B has not started its own orphan yet")
		}
		if pi, ok := readStat(own); !ok || pi.sid != own {
			return fmt.Errorf("attempt B's orphan %d has not made its session yet", own)
		}
		return nil
	})
	cancel()
	if _, err := prb.Wait(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Kill(own, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("attempt B's own orphan %d, in a session of its own, outlived B's cancel (kill 0: %v)", own, err)
	}
	if err := os.WriteFile(filepath.Join(wa.leased, "go"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := pa.Wait(); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"orphan.txt", "thread.txt"} {
		if got, err := os.ReadFile(filepath.Join(wa.leased, f)); err != nil || string(got) != "finished\n" {
			t.Errorf("attempt A's orphan's %s = %q, %v: attempt B's cancel killed it, or A's Wait returned before it finished", f, got, err)
		}
	}
}

// TestAttemptCannotJoinAnotherAttemptsGroup: a process of attempt B
// moves into attempt A's process group, then is orphaned, to be out of
// reach of B's cancel (A's cancel would kill it, B's would not). Each
// attempt leads a session of its own, and Linux refuses a move into a
// group of another session: the process stays B's, and B's cancel kills
// it while A runs on.
func TestAttemptCannotJoinAnotherAttemptsGroup(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	wa, wb := newWorktree(t), newWorktree(t)
	ctxA, cancelA := context.WithCancel(context.Background())
	defer cancelA()
	a := exec.Command("/bin/sh", "-c", `sleep 1000`)
	a.Dir = wa.root
	pa, err := Start(ctxA, wa.policy(), &testGate{}, nil, a)
	if err != nil {
		t.Fatal(err)
	}
	defer pa.Wait()
	defer cancelA()

	pb := wb.policy()
	pb.KillGrace = 50 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	b := exec.Command("/bin/sh", "-c", `(`+helper+` atk-joingroup `+strconv.Itoa(pa.Pid())+` leased/join &) ; trap '' TERM; sleep 1000`)
	b.Dir = wb.root
	prb, err := Start(ctx, pb, &testGate{}, nil, b)
	if err != nil {
		t.Fatal(err)
	}
	var joiner int
	var result string
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		out, _ := os.ReadFile(filepath.Join(wb.leased, "join"))
		fields := strings.Fields(string(out))
		if len(fields) < 2 {
			return errors.New("attempt B's process has not tried to join A's group yet")
		}
		joiner, _ = strconv.Atoi(fields[len(fields)-1])
		result = strings.Join(fields[:len(fields)-1], " ")
		return nil
	})
	if result != "refused: operation not permitted" {
		t.Errorf("attempt B's process moving into attempt A's group %d: %s, want refused (EPERM)", pa.Pid(), result)
	}
	cancel()
	waited := make(chan struct{})
	go func() {
		prb.Wait()
		close(waited)
	}()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
		unix.Kill(joiner, unix.SIGKILL)
		<-waited
		t.Fatalf("attempt B did not settle within 30 s of its cancel: its process %d (%s) was out of its reach", joiner, result)
	}
	if err := unix.Kill(joiner, 0); !errors.Is(err, unix.ESRCH) {
		t.Errorf("attempt B's process %d outlived B's cancel (kill 0: %v)", joiner, err)
	}
	if pi, alive := readStat(pa.Pid()); !alive || pi.state == 'Z' {
		t.Errorf("attempt B's cancel ended attempt A's command %d", pa.Pid())
	}
}
