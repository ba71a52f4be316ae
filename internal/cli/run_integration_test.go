//go:build integration

package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestRunSettlesBeforeRelease: an agent that ignores SIGTERM and has a
// background child keeps its lease renewed past its ttl after run is
// cancelled, until every one of its processes is gone; then the lease is
// released (invariant 6).
func TestRunSettlesBeforeRelease(t *testing.T) {
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newCheckout(t, "")
	script := `trap '' TERM
(while [ ! -e stop ]; do sleep 0.05; done; echo done > in/child-done) &
echo started > in/ready
wait`
	const ttl = 3 * time.Second
	r := startRun(t, url, "--checkout", co, "--scope", "in", "--ttl", ttl.String(), "--kill-grace", "1m", "--", "sh", "-c", script)
	t.Cleanup(func() { os.WriteFile(filepath.Join(co, "stop"), nil, 0o644) }) // before startRun's cleanup waits
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		return exists(filepath.Join(co, "in", "ready"))
	})
	id := leaseOf(t, r.errOut.String())
	r.cancel()
	canceled := time.Now()
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		r.running(t)
		l, err := client.Get(context.Background(), id)
		if err != nil {
			return err
		}
		if !l.Active() {
			t.Fatalf("lease %s is %s (%s) while the agent's processes live", id, l.Status, l.Reason)
		}
		if !l.RenewedAt.After(canceled.Add(ttl)) {
			return fmt.Errorf("last renewed %s, cancelled %s", l.RenewedAt.Format(time.StampMilli), canceled.Format(time.StampMilli))
		}
		return nil
	})
	mustContain(t, "run stderr", r.errOut.String(), "stopping: SIGTERM to the agent's processes")

	if err := os.WriteFile(filepath.Join(co, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("run exited %d, want the agent's 0\n%s", code, r.errOut)
	}
	releasedAfterChild(t, client, id, co)
	mustContain(t, "run stderr", r.errOut.String(), "lease "+id+" released")
}

// TestRunnerKilledLeaseReclaimed: a runner killed with SIGKILL cannot
// release its lease, and its lease's TTL is the default 5 minutes: the
// lease service reclaims it once the runner's session has sent no
// keepalive for its grace — within 15 s — with an audit event naming the
// session, and the next lease's fence is higher. The agent it leaves
// behind writes nothing from the moment its runner died: the kernel guard
// fails its writes closed without its supervisor.
func TestRunnerKilledLeaseReclaimed(t *testing.T) {
	isolate(t)
	url := startBus(t)
	client, nc := busClient(t, url)
	co := newCheckout(t, "")
	cmd, logPath := startRunnerProcess(t, "--nats", url, "run", "--checkout", co, "--scope", "in", "--",
		"sh", "-c", `echo $$ > in/agent.pid; while [ ! -e stop ]; do if (echo x >> in/ticks) 2>/dev/null; then echo write=ok; else echo write=refused; fi; sleep 0.05; done`)
	var agent int
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
		os.WriteFile(filepath.Join(co, "stop"), nil, 0o644)
		if agent > 0 {
			unix.Kill(-agent, unix.SIGKILL)
			// After the runner died this process may have adopted the
			// agent (it is a subreaper once it ran a guarded attempt).
			checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
				if pid, err := unix.Wait4(agent, nil, unix.WNOHANG, nil); pid == 0 && err == nil {
					return errors.New("the agent has not exited")
				}
				return nil
			})
		}
	})
	var id string
	var fence uint64
	checkFor(t, 15*time.Second, 10*time.Millisecond, func() error {
		b, _ := os.ReadFile(filepath.Join(co, "in", "agent.pid"))
		if _, err := fmt.Sscan(string(b), &agent); err != nil {
			log, _ := os.ReadFile(logPath)
			if cmd.ProcessState != nil {
				t.Fatalf("runner ended:\n%s", log)
			}
			return fmt.Errorf("agent not started: %s", log)
		}
		log, _ := os.ReadFile(logPath)
		m := leaseIDRE.FindSubmatch(log)
		if m == nil || !strings.Contains(string(log), "write=ok") {
			return errors.New("no lease announced, or no write yet")
		}
		id = string(m[1])
		l, err := client.Get(context.Background(), id)
		if err != nil {
			return err
		}
		fence = l.Fence
		return nil
	})
	if err := cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
	killed := time.Now()
	log, _ := os.ReadFile(logPath)
	mark := len(log)
	next, err := client.Acquire(context.Background(), leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "in"), WorkspaceID: "checkout",
		Owner: lease.Owner{TaskID: "next", AgentID: "next", AttemptID: "next"}, Wait: lease.Duration(time.Minute)}, leasebus.NewCredential())
	if err != nil {
		t.Fatalf("the killed runner's scope: %v", err)
	}
	took := time.Since(killed)
	t.Logf("scope back %v after the runner was killed (ttl 5m)", took)
	if took > 15*time.Second {
		t.Errorf("scope back %v after the runner was killed: want within 15 s", took)
	}
	if next.Fence <= fence {
		t.Errorf("next fence %d, not above the killed runner's %d", next.Fence, fence)
	}
	if l, err := client.Get(context.Background(), id); err != nil || l.Status != lease.StatusReclaimed {
		t.Fatalf("lease %s: %v %v, want reclaimed", id, l, err)
	}
	checkFor(t, 5*time.Second, 50*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(context.Background(), nc, co, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventReclaimed && ev.LeaseID == id && ev.Reason == "session-lost" {
				return nil
			}
		}
		return fmt.Errorf("no reclaimed (session-lost) event for %s among %d", id, len(evs))
	})
	// The orphaned agent tried to write all along: each try since its
	// runner died was refused.
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		log, _ := os.ReadFile(logPath)
		if !strings.Contains(string(log[mark:]), "write=refused") {
			return errors.New("no write tried since the kill")
		}
		return nil
	})
	log, _ = os.ReadFile(logPath)
	if after := string(log[mark:]); strings.Contains(after, "write=ok") {
		t.Errorf("the agent wrote after its runner was killed:\n%s", after)
	}
}

// TestRunInteractiveAgent: run started on a terminal gives the agent a
// terminal of its own (the agent leads a session of its own, so it cannot
// share the user's) and relays between the two: an interactive agent
// reads its input, gets the terminal's Ctrl-C as SIGINT, and sees the
// user's window size, before and after it changes.
func TestRunInteractiveAgent(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	master, slave := openPty(t)
	userTTY := slave.Name()
	setWinsize(t, master, 33, 77)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(self, "--nats", url, "run", "--checkout", co, "--", "sh", "-c",
		`trap 'echo "size $(stty size)"' WINCH; echo "tty $(tty) $(tty <&1) $(tty <&2)."; echo "size $(stty size)"; read x; echo "got $x"; while :; do sleep 100 & wait $!; done`)
	cmd.Env = append(cfgEnv(t), runAsCLIEnv+"=1")
	out, exited, copied := startOnTerminal(t, cmd, master, slave)
	if _, err := master.Write([]byte("hello\n")); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "got hello") {
			return fmt.Errorf("the agent has not read its terminal:\n%s", out.String())
		}
		return nil
	})
	mustContain(t, "the agent's terminal", out.String(), "size 33 77")
	mustContain(t, "the agent's terminal", out.String(), "tty /dev/pts/")
	if strings.Contains(out.String(), userTTY+" ") || strings.Contains(out.String(), userTTY+".") {
		t.Errorf("the agent holds the user's terminal (%s), not one of its own:\n%s", userTTY, out.String())
	}
	// The user's window changes: the agent's terminal follows, and the
	// agent hears of it (SIGWINCH).
	setWinsize(t, master, 41, 101)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "size 41 101") {
			return fmt.Errorf("the agent's terminal did not follow the window size:\n%s", out.String())
		}
		return nil
	})
	// Ctrl-C, again while the agent lives: one typed while its shell
	// forks sleep can be lost, as in any terminal. Had it reached run
	// rather than the agent, run would have sent SIGTERM (exit 143).
	checkFor(t, 10*time.Second, 100*time.Millisecond, func() error {
		select {
		case <-exited:
			return nil
		default:
		}
		if _, err := master.Write([]byte{3}); err != nil {
			t.Fatal(err)
		}
		return fmt.Errorf("Ctrl-C did not end the agent:\n%s", out.String())
	})
	if code := cmd.ProcessState.ExitCode(); code != 128+int(syscall.SIGINT) {
		t.Fatalf("run exited %d, want %d (the agent's SIGINT)\n%s", code, 128+int(syscall.SIGINT), out.String())
	}
	<-copied
	mustContain(t, "terminal", out.String(), "released (the agent exited 130")
}

// TestRunContinuedTakesTheTerminalBack: run stopped from outside (kill
// -TSTP) and continued by its shell ("fg") takes the terminal raw again.
// The shell gives the terminal its own mode back when the job stops;
// before, run went on relaying in that mode after "fg", so what was typed
// echoed twice and Ctrl-C interrupted run instead of reaching the agent.
func TestRunContinuedTakesTheTerminalBack(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	master, slave := openPty(t)
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	// A shell with job control; without line editing it reads its lines
	// in the terminal's cooked mode (readline would switch ISIG off).
	shell := exec.Command("bash", "--norc", "--noprofile", "--noediting", "-i")
	shell.Env = append(cfgEnv(t), runAsCLIEnv+"=1", "PS1=$ ", "HISTFILE=/dev/null", "TERM=dumb")
	out, _, _ := startOnTerminal(t, shell, master, slave)
	control := func(f func(fd int)) {
		rc, err := master.SyscallConn()
		if err != nil {
			t.Fatal(err)
		}
		if err := rc.Control(func(fd uintptr) { f(int(fd)) }); err != nil {
			t.Fatal(err)
		}
	}
	// ISIG is on in the shell's cooked mode and off in run's raw one.
	raw := func() bool {
		var tio *unix.Termios
		var err error
		control(func(fd int) { tio, err = unix.IoctlGetTermios(fd, unix.TCGETS) })
		if err != nil {
			t.Fatalf("the terminal's mode: %v", err)
		}
		return tio.Lflag&unix.ISIG == 0
	}
	ticks := func() int { return strings.Count(out.String(), "tick\r") } // (the command line has "tick;")
	cmdline := fmt.Sprintf("'%s' --nats '%s' run --checkout '%s' -- sh -c 'while :; do echo tick; sleep 0.1; done'\n", self, url, co)
	if _, err := master.Write([]byte(cmdline)); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if ticks() < 3 || !raw() {
			return fmt.Errorf("the agent has not ticked under run's raw mode yet:\n%s", out.String())
		}
		return nil
	})
	// Stop run's job (the terminal's foreground group: run; the agent
	// leads a session of its own and goes on).
	var job int
	control(func(fd int) { job, err = unix.IoctlGetInt(fd, unix.TIOCGPGRP) })
	if err != nil || job <= 0 || job == shell.Process.Pid {
		t.Fatalf("the terminal's foreground group is %d (%v), want run's job", job, err)
	}
	if err := syscall.Kill(-job, syscall.SIGTSTP); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "Stopped") || raw() {
			return fmt.Errorf("the shell does not say the job stopped, with its own mode back:\n%s", out.String())
		}
		return nil
	})
	if _, err := master.Write([]byte("fg\n")); err != nil {
		t.Fatal(err)
	}
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		if !raw() {
			return fmt.Errorf("run did not take the terminal raw again after fg:\n%s", out.String())
		}
		return nil
	})
	// Ctrl-C is the agent's again: it ends the agent (130), not run.
	checkFor(t, 10*time.Second, 100*time.Millisecond, func() error {
		if strings.Contains(out.String(), "released (the agent exited 130") {
			return nil
		}
		if _, err := master.Write([]byte{3}); err != nil {
			t.Fatal(err)
		}
		return fmt.Errorf("Ctrl-C did not end the agent:\n%s", out.String())
	})
	if strings.Contains(out.String(), "interrupt again") {
		t.Errorf("Ctrl-C interrupted run, not the agent:\n%s", out.String())
	}
}

// startOnTerminal starts cmd leading a session of its own whose
// controlling terminal is slave (so cmd's group is its foreground one) and
// copies what the terminal shows into out. exited closes once cmd exited,
// copied once nothing holds the terminal any more; cleanup kills cmd's
// process group.
func startOnTerminal(t *testing.T, cmd *exec.Cmd, master, slave *os.File) (out *syncBuffer, exited, copied <-chan struct{}) {
	t.Helper()
	cmd.Stdin, cmd.Stdout, cmd.Stderr = slave, slave, slave
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Setctty: true, Ctty: 0}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	slave.Close()
	out = &syncBuffer{}
	copyDone, waitDone := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(copyDone)
		io.Copy(out, master) // ends with EIO once no process has the terminal
	}()
	go func() {
		defer close(waitDone)
		cmd.Wait()
	}()
	t.Cleanup(func() {
		syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
		<-waitDone
		master.Close()
		<-copyDone
	})
	return out, waitDone, copyDone
}

// setWinsize sets the window size of the terminal whose master is f
// (without Fd, which would take f off the poller its reader waits in).
func setWinsize(t *testing.T, f *os.File, rows, cols uint16) {
	t.Helper()
	rc, err := f.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if cerr := rc.Control(func(fd uintptr) {
		err = unix.IoctlSetWinsize(int(fd), unix.TIOCSWINSZ, &unix.Winsize{Row: rows, Col: cols})
	}); err != nil || cerr != nil {
		t.Fatalf("set the window size: %v %v", err, cerr)
	}
}

// TestRunReadsGoOnAfterRevoke is finding 8 of issue 17 end to end: after
// a revoke, "cat f >/dev/null", git status and psql through the Postgres
// fence keep working, and so does the private temp dir, while every write
// to the workspace is refused.
func TestRunReadsGoOnAfterRevoke(t *testing.T) {
	isolate(t)
	ctx := context.Background()
	pg, err := pgtest.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Stop() })
	t.Setenv("PGUSER", pg.Admin)
	t.Setenv("PGDATABASE", "postgres")
	url := startBus(t)
	co := newCheckout(t, "")
	r := startRun(t, url, "--checkout", co, "--scope", "in", "--pg-upstream", pg.Addr(), "--", "sh", "-c", readsProbe)
	const allOK = "cat=ok git=ok psql=ok tmp=ok"
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.out.String(), "write=ok "+allOK) {
			return errors.New("no full round under the live lease yet")
		}
		return nil
	})
	id := leaseOf(t, r.errOut.String())
	mark := revokeAndSeeRefused(t, url, id, r.out, filepath.Join(co, "in", "probe"))
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		after := r.out.String()[mark:]
		first := strings.Index(after, "write=refused")
		if n := strings.Count(after[first:], "\n"); n < 3 {
			return fmt.Errorf("%d rounds since the first refusal", n)
		}
		return nil
	})
	after := r.out.String()[mark:]
	rest := after[strings.Index(after, "write=refused"):]
	lines := strings.Split(strings.TrimSpace(rest), "\n")
	for _, l := range lines[1:] { // the first may have begun before the revoke
		if !strings.Contains(l, "write=refused") || !strings.HasSuffix(l, allOK) {
			t.Errorf("after the revoke: %q; want the write refused and %s", l, allOK)
		}
	}
	if err := os.WriteFile(filepath.Join(co, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("run exited %d, want the agent's 0\n%s", code, r.errOut)
	}
}
