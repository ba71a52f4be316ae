//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"errors"
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
