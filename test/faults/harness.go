package faults

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
)

// Binary returns the fenceline command: $FENCELINE_BIN, or cmd/fenceline
// built once per test binary (testutil.FencelineBinary).
func Binary(t testing.TB) string {
	t.Helper()
	return testutil.FencelineBinary(t)
}

// Env is what one test's fenceline processes share: the binary, the state
// directory (XDG_STATE_HOME: the bus writes its credentials there and the
// CLI finds them) and the bus URL the clients use (FENCELINE_NATS).
type Env struct {
	Bin       string
	StateHome string
	BusURL    string
	// Extra is added to every process's environment.
	Extra []string
	// FenceSecrets is the lease service's fence-secret directory when it
	// is not the default of StateHome (a cluster's nodes share one).
	FenceSecrets string
}

// NewEnv returns an Env with its own state directory and a bus address.
func NewEnv(t testing.TB, bin string) *Env {
	t.Helper()
	return &Env{Bin: bin, StateHome: t.TempDir(), BusURL: "nats://" + testutil.FreeAddr(t)}
}

// environ is the environment of a client process (with FENCELINE_NATS) or
// of the bus itself (without: with it, `bus serve` would only run a service
// against that URL).
func (e *Env) environ(client bool) []string {
	var env []string
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "FENCELINE_NATS=") || strings.HasPrefix(kv, "XDG_STATE_HOME=") {
			continue
		}
		env = append(env, kv)
	}
	env = append(env, "XDG_STATE_HOME="+e.StateHome)
	if client {
		env = append(env, "FENCELINE_NATS="+e.BusURL)
	}
	return append(env, e.Extra...)
}

// CLI runs one fenceline command to its end and returns its output; err is
// an *exec.ExitError for a non-zero exit.
func (e *Env) CLI(ctx context.Context, args ...string) (stdout, stderr string, err error) {
	cmd := exec.CommandContext(ctx, e.Bin, args...)
	cmd.Env = e.environ(true)
	var o, s bytes.Buffer
	cmd.Stdout, cmd.Stderr = &o, &s
	err = cmd.Run()
	return o.String(), s.String(), err
}

// Proc is a long-running fenceline process.
type Proc struct {
	Name   string
	cmd    *exec.Cmd
	out    testutil.SyncBuffer
	errOut testutil.SyncBuffer
	done   chan struct{}
	state  *os.ProcessState // set before done is closed
}

// Start starts `fenceline args...` as a client (with FENCELINE_NATS); it is
// killed when the test ends if it still runs.
func (e *Env) Start(t testing.TB, name string, args ...string) *Proc {
	t.Helper()
	return e.start(t, name, true, args...)
}

func (e *Env) start(t testing.TB, name string, client bool, args ...string) *Proc {
	t.Helper()
	p := &Proc{Name: name, done: make(chan struct{})}
	p.cmd = exec.Command(e.Bin, args...)
	p.cmd.Env = e.environ(client)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.errOut
	// Its own process group (a run's agent joins it), and gone with the
	// test binary.
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	// A child in a process group of its own (a run's guarded command)
	// may hold the output pipes after the process is gone.
	p.cmd.WaitDelay = 5 * time.Second
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		_ = p.cmd.Wait()
		p.state = p.cmd.ProcessState
		close(p.done)
	}()
	t.Cleanup(func() {
		if !p.Exited() {
			p.KillTree()
			<-p.done
		}
	})
	return p
}

// KillTree kills the process, its process group, and every descendant's
// process group with SIGKILL (a run puts its guarded command in a group of
// its own, which would otherwise outlive it and go on writing).
func (p *Proc) KillTree() {
	pids := append(descendants(p.cmd.Process.Pid), p.cmd.Process.Pid)
	self := syscall.Getpgrp()
	for _, pid := range pids {
		if pg, err := syscall.Getpgid(pid); err == nil && pg != self && pg > 1 {
			_ = syscall.Kill(-pg, syscall.SIGKILL)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// descendants returns the pids of pid's descendants, read from /proc.
func descendants(pid int) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	children := map[int][]int{}
	for _, e := range entries {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces and parentheses.
		i := bytes.LastIndexByte(b, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) < 2 {
			continue
		}
		if pp, err := strconv.Atoi(f[1]); err == nil {
			children[pp] = append(children[pp], n)
		}
	}
	var out []int
	queue := []int{pid}
	for len(queue) > 0 && len(out) < 10000 {
		next := queue[0]
		queue = queue[1:]
		for _, c := range children[next] {
			out = append(out, c)
			queue = append(queue, c)
		}
	}
	return out
}

// Pid is the process id.
func (p *Proc) Pid() int { return p.cmd.Process.Pid }

// Stdout and Stderr are what the process printed so far.
func (p *Proc) Stdout() string { return p.out.String() }

// Stderr is what the process printed on stderr so far.
func (p *Proc) Stderr() string { return p.errOut.String() }

// Exited reports whether the process has exited.
func (p *Proc) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Signal sends sig to the process (not its group).
func (p *Proc) Signal(sig syscall.Signal) error { return p.cmd.Process.Signal(sig) }

// Wait waits up to timeout for the process to exit and returns its exit
// code (128+n for a signal).
func (p *Proc) Wait(timeout time.Duration) (int, error) {
	select {
	case <-p.done:
	case <-time.After(timeout):
		return -1, fmt.Errorf("%s still running after %s", p.Name, timeout)
	}
	if ws, ok := p.state.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return 128 + int(ws.Signal()), nil
	}
	return p.state.ExitCode(), nil
}

// Bus is a `fenceline bus serve` process on a fixed address and store, so
// that it can be killed and restarted in place.
type Bus struct {
	env    *Env
	t      testing.TB
	Listen string
	Store  string
	proc   *Proc
	starts int
}

// StartBus starts the bus at env.BusURL's address and waits until its
// lease service answers. Its store is the default one of env.StateHome
// (<XDG_STATE_HOME>/fenceline/bus), where the bus keeps the credentials it
// makes and the CLI looks for them.
func StartBus(t testing.TB, env *Env) *Bus {
	t.Helper()
	b := &Bus{env: env, t: t, Listen: strings.TrimPrefix(env.BusURL, "nats://"), Store: filepath.Join(env.StateHome, "fenceline", "bus")}
	b.Start()
	return b
}

// Start starts the bus process (again) and waits until it serves.
func (b *Bus) Start() {
	b.t.Helper()
	b.starts++
	b.proc = b.env.start(b.t, fmt.Sprintf("bus#%d", b.starts), false, "bus", "serve", "--listen", b.Listen, "--store", b.Store)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := b.WaitReady(ctx); err != nil {
		b.t.Fatalf("bus at %s: %v\nbus stderr:\n%s", b.Listen, err, b.proc.Stderr())
	}
}

// WaitReady polls `fenceline lease list` until the lease service answers.
func (b *Bus) WaitReady(ctx context.Context) error {
	return testutil.Retry(ctx, 20*time.Millisecond, func() error {
		if b.proc.Exited() {
			return testutil.Permanent(fmt.Errorf("the bus exited:\n%s", b.proc.Stderr()))
		}
		_, stderr, err := b.env.CLI(ctx, "lease", "list", "--json")
		if err != nil {
			return fmt.Errorf("lease list: %v: %s", err, strings.TrimSpace(stderr))
		}
		return nil
	})
}

// Kill kills the bus with SIGKILL and waits for it to be gone.
func (b *Bus) Kill() {
	b.t.Helper()
	_ = b.proc.Signal(syscall.SIGKILL)
	if _, err := b.proc.Wait(10 * time.Second); err != nil {
		b.t.Fatal(err)
	}
}

// Stop stops the bus with SIGTERM.
func (b *Bus) Stop() {
	b.t.Helper()
	if b.proc.Exited() {
		return
	}
	_ = b.proc.Signal(syscall.SIGTERM)
	if _, err := b.proc.Wait(15 * time.Second); err != nil {
		b.t.Error(err)
	}
}

// Stderr is the current bus process's log.
func (b *Bus) Stderr() string { return b.proc.Stderr() }

// parseNanos reads a decimal count of nanoseconds since the Unix epoch.
func parseNanos(s string) (time.Time, error) {
	n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	if err != nil {
		return time.Time{}, fmt.Errorf("not a nanosecond time: %q", s)
	}
	return time.Unix(0, n), nil
}
