package attempt

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestTerminalNotOursNotGiven: a terminal on stdin, stdout and stderr
// that this process is not in the foreground of (here not even its
// controlling terminal: a run started in the background, or by a daemon
// holding a terminal) is not given to the agent in any of them. In a
// session of its own the agent would read it freely — through its stdout
// as well, a terminal reads as well as it writes — taking what the user
// types to the shell. It reads /dev/null, and what it prints reaches the
// terminal through a pipe run copies from.
func TestTerminalNotOursNotGiven(t *testing.T) {
	master, tty := openTestPty(t)
	mode, err := unix.IoctlGetTermios(int(tty.Fd()), unix.TCGETS)
	if err != nil {
		t.Fatal(err)
	}
	mode.Lflag &^= unix.ECHO // what is typed is not shown: only what the agent prints is
	if err := unix.IoctlSetTermios(int(tty.Fd()), unix.TCSETS, mode); err != nil {
		t.Fatal(err)
	}
	// What the user typed, waiting on the terminal.
	if _, err := master.Write([]byte("typed to the shell\n")); err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		shown strings.Builder
	)
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		buf := make([]byte, 4096)
		for {
			n, err := master.Read(buf)
			mu.Lock()
			shown.Write(buf[:n])
			mu.Unlock()
			if err != nil {
				return
			}
		}
	}()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "sh", "-c", `cat; cat <&1; cat <&2; echo done`)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = tty, tty, tty
	term, err := giveTerminal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if f, ok := cmd.Stdin.(*os.File); !ok || f.Name() != os.DevNull {
		t.Fatalf("the agent's stdin is %v, want %s", cmd.Stdin, os.DevNull)
	}
	for _, w := range []io.Writer{cmd.Stdout, cmd.Stderr} {
		if f, ok := w.(*os.File); !ok || isTerminal(f) {
			t.Fatalf("the agent's stdout or stderr is %v, want a pipe run copies from", w)
		}
	}
	if err := cmd.Start(); err != nil {
		term.close()
		t.Fatal(err)
	}
	if err := term.run(); err != nil {
		t.Fatal(err)
	}
	err = cmd.Wait()
	term.close()
	if err != nil {
		t.Fatal(err)
	}
	var got string
	testutil.CheckFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		mu.Lock()
		got = shown.String()
		mu.Unlock()
		if !strings.Contains(got, "done") {
			return fmt.Errorf("what the agent printed has not reached the terminal: %q", got)
		}
		return nil
	})
	if strings.Contains(got, "typed") {
		t.Fatalf("the agent read what the user typed to the shell: the terminal shows %q", got)
	}
	master.Close()
	<-copied
}

// TestOutputHeldOutsideDoesNotHoldRun: a process outside the attempt
// holding the agent's output pipe (an agent can hand its descriptors
// over a Unix socket; ssh's ControlMaster takes them) does not keep run
// waiting: the relay's close gives it outputDrain, then stops copying.
func TestOutputHeldOutsideDoesNotHoldRun(t *testing.T) {
	_, tty := openTestPty(t)

	cmd := exec.Command("sh", "-c", `echo hello`)
	cmd.Stdout = tty
	term, err := giveTerminal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	pw, ok := cmd.Stdout.(*os.File)
	if !ok || isTerminal(pw) {
		t.Fatalf("the agent's stdout is %v, want a pipe", cmd.Stdout)
	}
	held, err := unix.Dup(int(pw.Fd())) // the outside holder
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(held)
	if err := cmd.Start(); err != nil {
		term.close()
		t.Fatal(err)
	}
	if err := term.run(); err != nil {
		t.Fatal(err)
	}
	if err := cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	closed := make(chan struct{})
	start := time.Now()
	go func() {
		term.close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(outputDrain + 20*time.Second):
		t.Fatalf("the relay's close waited %v for an output pipe held outside the attempt", time.Since(start))
	}
}

// openTestPty opens a terminal that is not this process's controlling
// one: its master (on the poller, so Close ends a Read) and its slave,
// both closed at the test's end.
func openTestPty(t *testing.T) (master, tty *os.File) {
	t.Helper()
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		t.Fatal(err)
	}
	master = os.NewFile(uintptr(m), "ptmx")
	t.Cleanup(func() { master.Close() })
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetUint32(m, unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	tty, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tty.Close() })
	return master, tty
}
