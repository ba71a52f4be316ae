package attempt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// An interactive agent gets a terminal of its own. The guard starts every
// attempt in a session of its own (so no process of one attempt can join
// a process group of another, or of the user's shell), and a session
// cannot share the user's terminal as its controlling terminal. So, as
// sudo's use_pty does, run opens a pseudo-terminal, makes it the agent's
// controlling terminal, and relays between it and the user's terminal,
// which it puts in raw mode meanwhile: what the user types reaches the
// agent's terminal as typed (Ctrl-C included, which the agent's terminal
// turns into SIGINT for the agent), and the window size follows the
// user's. The agent never holds the user's terminal: once it is gone,
// nothing of it can read what is typed there next.
//
// Stopped and continued (kill -TSTP of run, then the shell's "fg"), run
// takes the terminal back in raw mode: the shell gave it its own mode back
// when the job stopped, and without raw mode what is typed would be
// echoed twice, and Ctrl-C would reach run rather than the agent.

// terminal is the relay between the user's terminal and the agent's.
type terminal struct {
	user      int           // the user's terminal (run's stdin)
	saved     *unix.Termios // its mode before run changed it
	master    *os.File
	masterFD  int      // master's descriptor, for ioctls (Fd would make it blocking)
	slave     *os.File // the agent's end; closed here once it started
	out       io.Writer
	stopR     int // a byte on stopW ends the input relay
	stopW     int
	in        int // the user's terminal, as relayInput reads it
	winch     chan os.Signal
	raw       *unix.Termios // the mode run gives the user's terminal
	cont      chan os.Signal
	wg        sync.WaitGroup
	outDone   chan struct{}
	sizeDone  chan struct{}
	contDone  chan struct{}
	closeOnce sync.Once
	// onlyWrites' pipes in place of a terminal stdout or stderr: the
	// agent's ends until run, the read ends, where they are copied, and
	// the copies' end.
	pipeWrites, pipeReads []*os.File
	pipeDsts              []io.Writer
	pipesDone             chan struct{}
}

// giveTerminal prepares cmd so that the agent holds no terminal of the
// user's. When this process's group has the terminal on cmd.Stdin in the
// foreground, cmd gets a pseudo-terminal of its own in place of every
// terminal among its stdin, stdout and stderr (start the relay with run
// once cmd started, end it with close). Otherwise a terminal stdin
// becomes /dev/null (in a session of its own the agent would read what
// the user types to the shell), and a terminal stdout or stderr a pipe
// whose output this process copies there. t is nil when there is nothing
// to relay or close.
func giveTerminal(cmd *exec.Cmd) (t *terminal, err error) {
	in, _ := cmd.Stdin.(*os.File)
	if in == nil || !isTerminal(in) {
		t = &terminal{user: -1}
		if err := t.onlyWrites(cmd); err != nil {
			return nil, err
		}
		if len(t.pipeReads) == 0 {
			return nil, nil
		}
		return t, nil
	}
	fd := int(in.Fd())
	if fg, err := unix.IoctlGetInt(fd, unix.TIOCGPGRP); err != nil || fg != unix.Getpgrp() {
		null, err := os.Open(os.DevNull)
		if err != nil {
			return nil, fmt.Errorf("agent stdin: %w", err)
		}
		cmd.Stdin = null
		t = &terminal{user: -1, slave: null}
		if err := t.onlyWrites(cmd); err != nil {
			null.Close()
			return nil, err
		}
		return t, nil
	}
	saved, err := unix.IoctlGetTermios(fd, unix.TCGETS)
	if err != nil {
		return nil, fmt.Errorf("the terminal's mode: %w", err)
	}
	size, err := unix.IoctlGetWinsize(fd, unix.TIOCGWINSZ)
	if err != nil {
		return nil, fmt.Errorf("the terminal's window size: %w", err)
	}
	m, err := unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open a terminal for the agent: %w", err)
	}
	// Non-blocking, so the poller owns it and close can end a read.
	if err := unix.SetNonblock(m, true); err != nil {
		unix.Close(m)
		return nil, fmt.Errorf("open a terminal for the agent: %w", err)
	}
	master := os.NewFile(uintptr(m), "/dev/ptmx")
	if err := unix.IoctlSetPointerInt(m, unix.TIOCSPTLCK, 0); err != nil {
		master.Close()
		return nil, fmt.Errorf("unlock the agent's terminal: %w", err)
	}
	s, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(m), unix.TIOCGPTPEER, uintptr(unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC))
	if errno != 0 {
		master.Close()
		return nil, fmt.Errorf("open the agent's terminal: %w", errno)
	}
	slave := os.NewFile(s, "agent-terminal")
	if err := unix.IoctlSetTermios(int(s), unix.TCSETS, saved); err != nil {
		master.Close()
		slave.Close()
		return nil, fmt.Errorf("set the agent's terminal mode: %w", err)
	}
	if err := unix.IoctlSetWinsize(int(s), unix.TIOCSWINSZ, size); err != nil {
		master.Close()
		slave.Close()
		return nil, fmt.Errorf("set the agent's terminal size: %w", err)
	}
	t = &terminal{user: fd, saved: saved, master: master, masterFD: m, slave: slave, out: in, outDone: make(chan struct{})}
	cmd.Stdin = slave
	for _, w := range []*io.Writer{&cmd.Stdout, &cmd.Stderr} {
		if f, ok := (*w).(*os.File); ok && isTerminal(f) {
			if t.out == io.Writer(in) {
				t.out = f // the agent's terminal shows where its output went
			}
			*w = slave
		}
	}
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setctty, cmd.SysProcAttr.Ctty = true, 0 // stdin, in the agent
	return t, nil
}

// onlyWrites gives cmd a pipe in place of a terminal stdout or stderr
// (a descriptor of a terminal reads as well as it writes): what comes
// through it is copied to the terminal until every writer is gone, or
// for outputDrain after the attempt settled (see close) — a holder
// outside the attempt cannot keep run waiting.
func (t *terminal) onlyWrites(cmd *exec.Cmd) error {
	for _, w := range []*io.Writer{&cmd.Stdout, &cmd.Stderr} {
		f, ok := (*w).(*os.File)
		if !ok || !isTerminal(f) {
			continue
		}
		r, pw, err := os.Pipe()
		if err != nil {
			t.closePipes()
			return fmt.Errorf("agent output: %w", err)
		}
		t.pipeReads, t.pipeWrites = append(t.pipeReads, r), append(t.pipeWrites, pw)
		t.pipeDsts = append(t.pipeDsts, f)
		*w = pw
	}
	return nil
}

// closePipes closes what onlyWrites opened (the relay never ran).
func (t *terminal) closePipes() {
	for _, f := range append(t.pipeReads, t.pipeWrites...) {
		f.Close()
	}
	t.pipeReads, t.pipeWrites = nil, nil
}

// copyOut copies r to dst until its writers are gone or close closes it;
// a destination that stops taking it does not stop the agent.
func copyOut(dst io.Writer, r io.Reader) {
	buf := make([]byte, 32*1024)
	for {
		n, err := r.Read(buf)
		if n > 0 && dst != nil {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				dst = nil
			}
		}
		if err != nil {
			return
		}
	}
}

// isTerminal reports whether f is a terminal.
func isTerminal(f *os.File) bool {
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// run starts the relay once the agent has started: the user's terminal
// goes raw (output processing kept, so run's own lines still end where
// they should), what is typed goes to the agent's terminal, what it shows
// comes back, and window size changes follow. A nil t has nothing to run.
func (t *terminal) run() error {
	if t == nil {
		return nil
	}
	if t.slave != nil {
		t.slave.Close() // the agent holds it now: its last close ends the output
		t.slave = nil
	}
	for _, f := range t.pipeWrites {
		f.Close() // the agent's now
	}
	t.pipeWrites = nil
	t.pipesDone = make(chan struct{})
	var copies sync.WaitGroup
	for i, r := range t.pipeReads {
		copies.Go(func() { copyOut(t.pipeDsts[i], r) })
	}
	go func() {
		copies.Wait()
		close(t.pipesDone)
	}()
	if t.user < 0 {
		return nil
	}
	raw := *t.saved
	raw.Iflag &^= unix.IGNBRK | unix.BRKINT | unix.PARMRK | unix.ISTRIP | unix.INLCR | unix.IGNCR | unix.ICRNL | unix.IXON
	raw.Lflag &^= unix.ECHO | unix.ECHONL | unix.ICANON | unix.ISIG | unix.IEXTEN
	raw.Cflag &^= unix.CSIZE | unix.PARENB
	raw.Cflag |= unix.CS8
	raw.Cc[unix.VMIN], raw.Cc[unix.VTIME] = 1, 0
	var p [2]int
	var err error
	if err = unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("terminal relay: %w", err)
	}
	if err := unix.IoctlSetTermios(t.user, unix.TCSETS, &raw); err != nil {
		unix.Close(p[0])
		unix.Close(p[1])
		return fmt.Errorf("put the terminal in raw mode: %w", err)
	}
	t.stopR, t.stopW = p[0], p[1]
	// A description of its own, non-blocking: a read never blocks when
	// another reader of the terminal took what poll saw.
	if t.in, err = unix.Open("/proc/self/fd/"+strconv.Itoa(t.user), unix.O_RDONLY|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_CLOEXEC, 0); err != nil {
		t.in = t.user
	}
	t.raw = &raw
	t.winch = make(chan os.Signal, 1)
	signal.Notify(t.winch, unix.SIGWINCH)
	t.sizeDone = make(chan struct{})
	t.cont = make(chan os.Signal, 1)
	signal.Notify(t.cont, unix.SIGCONT)
	t.contDone = make(chan struct{})
	t.wg.Add(1)
	go t.relayInput()
	go t.followSize()
	go t.followContinue()
	go t.relayOutput()
	return nil
}

// followContinue takes the user's terminal raw again each time run is
// continued in its foreground (SIGCONT after a stop: the shell, which
// took the terminal back when the job stopped, gave it its own mode), and
// gives the agent's terminal the window's size, which may have changed
// meanwhile. Continued in the background ("bg"), run leaves the mode as
// it is: it stops again once it reads the terminal from there (SIGTTIN),
// and the "fg" after that continues it here.
func (t *terminal) followContinue() {
	defer close(t.contDone)
	for range t.cont {
		if fg, err := unix.IoctlGetInt(t.user, unix.TIOCGPGRP); err != nil || fg != unix.Getpgrp() {
			continue
		}
		unix.IoctlSetTermios(t.user, unix.TCSETS, t.raw)
		t.copySize()
	}
}

// relayInput copies what the user types to the agent's terminal until
// close asks it to stop or the user's terminal ends.
func (t *terminal) relayInput() {
	defer t.wg.Done()
	fds := []unix.PollFd{{Fd: int32(t.in), Events: unix.POLLIN}, {Fd: int32(t.stopR), Events: unix.POLLIN}}
	buf := make([]byte, 4096)
	for {
		if _, err := unix.Poll(fds, -1); err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		if fds[0].Revents&unix.POLLIN == 0 {
			if fds[0].Revents&(unix.POLLHUP|unix.POLLERR|unix.POLLNVAL) != 0 {
				return
			}
			continue
		}
		n, err := unix.Read(t.in, buf)
		if errors.Is(err, unix.EINTR) || errors.Is(err, unix.EAGAIN) {
			continue
		}
		if n <= 0 || err != nil {
			return
		}
		// Blocks while the agent's terminal takes no more input; close
		// ends it by closing the master.
		if _, err := t.master.Write(buf[:n]); err != nil {
			return
		}
	}
}

// relayOutput shows what the agent's terminal prints until no process
// holds it (EIO) or close closes it; a user's terminal that stops taking
// it does not stop the agent (what it prints is then dropped).
func (t *terminal) relayOutput() {
	defer close(t.outDone)
	copyOut(t.out, t.master)
}

// followSize gives the agent's terminal the user's window size whenever
// it changes.
func (t *terminal) followSize() {
	defer close(t.sizeDone)
	for range t.winch {
		t.copySize()
	}
}

// copySize gives the agent's terminal the user's window size.
func (t *terminal) copySize() {
	if ws, err := unix.IoctlGetWinsize(t.user, unix.TIOCGWINSZ); err == nil {
		unix.IoctlSetWinsize(t.masterFD, unix.TIOCSWINSZ, ws)
	}
}

// outputDrain is how long close waits for the agent's last output once
// every process of the attempt is gone.
const outputDrain = 2 * time.Second

// close ends the relay once the attempt has settled, shows what the
// agent's terminal still held, and gives the user's terminal its mode
// back; only the first call does anything. A nil t, or one whose relay
// never ran, closes what it opened.
func (t *terminal) close() {
	if t == nil {
		return
	}
	t.closeOnce.Do(t.closeNow)
}

func (t *terminal) closeNow() {
	if t.slave != nil { // the agent never started
		t.slave.Close()
	}
	// What a process outside the attempt still holds gets outputDrain.
	drain, stop := context.WithTimeout(context.Background(), outputDrain)
	defer stop()
	if t.pipesDone == nil {
		t.closePipes() // the relay never ran
	} else {
		select {
		case <-t.pipesDone:
		case <-drain.Done():
		}
		for _, r := range t.pipeReads {
			r.Close() // ends a copy whose writer outlived the attempt
		}
		<-t.pipesDone
	}
	if t.user < 0 {
		return
	}
	if t.winch != nil {
		signal.Stop(t.winch)
		close(t.winch)
		<-t.sizeDone // before the master closes: it sets the master's size
		signal.Stop(t.cont)
		close(t.cont)
		<-t.contDone // before the mode is given back: it sets the raw one
		unix.Write(t.stopW, []byte{0})
		select {
		case <-t.outDone:
		case <-drain.Done():
		}
		t.master.Close() // ends the output relay, and an input write the agent's terminal no longer takes
		<-t.outDone
		t.wg.Wait()
		if t.in != t.user {
			unix.Close(t.in)
		}
		unix.Close(t.stopR)
		unix.Close(t.stopW)
		// Run may be in the background by now: changing the terminal's
		// mode from there would stop it (SIGTTOU).
		signal.Ignore(unix.SIGTTOU)
		unix.IoctlSetTermios(t.user, unix.TCSETS, t.saved)
		signal.Reset(unix.SIGTTOU)
		return
	}
	t.master.Close()
}
