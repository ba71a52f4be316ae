package attempt

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestTerminalNotOursNotGiven: a terminal on stdin that this process is
// not in the foreground of (here not even its controlling terminal: a
// run started in the background, or by a daemon holding a terminal) is
// not given to the agent. In a session of its own the agent would read
// it freely, taking what the user types to the shell; it reads
// /dev/null.
func TestTerminalNotOursNotGiven(t *testing.T) {
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	master := os.NewFile(uintptr(m), "ptmx")
	defer master.Close()
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		t.Fatal(err)
	}
	n, err := unix.IoctlGetUint32(m, unix.TIOCGPTN)
	if err != nil {
		t.Fatal(err)
	}
	tty, err := os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|unix.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer tty.Close()
	// What the user typed, waiting on the terminal.
	if _, err := master.Write([]byte("typed to the shell\n")); err != nil {
		t.Fatal(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var out bytes.Buffer
	cmd := exec.CommandContext(ctx, "sh", "-c", `cat; echo done`)
	cmd.Stdin, cmd.Stdout = tty, &out
	term, err := giveTerminal(cmd)
	if err != nil {
		t.Fatal(err)
	}
	if f, ok := cmd.Stdin.(*os.File); !ok || f.Name() != os.DevNull {
		t.Fatalf("the agent's stdin is %v, want %s", cmd.Stdin, os.DevNull)
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
	if err != nil || out.String() != "done\n" {
		t.Fatalf("agent: %v, output %q: it read the terminal (want only %q)", err, out.String(), "done\n")
	}
	if strings.Contains(out.String(), "typed") {
		t.Fatal("the agent read what the user typed to the shell")
	}
}
