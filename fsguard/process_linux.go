//go:build linux && (amd64 || arm64)

package fsguard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/lease"
)

// Process is a guarded attempt: the command, everything it starts, and the
// supervisor answering its trapped write calls.
type Process struct {
	policy  Policy
	gate    Gate
	audit   Auditor
	cmd     *exec.Cmd
	pid     int
	started uint64 // the command's start time (procInfo.start)
	// groupMu orders signals to the command's process group with its
	// reap: until reaped, the command holds its number (running, or a
	// zombie), so the group of that number is surely the attempt's.
	groupMu sync.Mutex
	reaped  bool // guarded by groupMu
	abi     int
	guarded bool

	listener int // seccomp user-notification fd, -1 without seccomp
	sealed   *sealedNet
	peers    capturedPeers // where the agent's captured sockets were headed (getpeername)
	stopR    int           // closing stopW ends the notification loop
	stopW    int
	tmpDir   string
	shimDir  string

	// What the supervisor needs to emulate calls (see emulate_linux.go):
	// the real paths of the writable set and of the temp dir, an O_PATH
	// descriptor of the temp dir, and whether the notify thread has an
	// umask of its own (unshared CLONE_FS).
	writableReal []string
	tmpReal      string
	tmpFD        int
	ownUmask     bool

	refusedConfined atomic.Uint64 // see Refusals
	refusedLost     atomic.Uint64
	dropped         atomic.Uint64 // denials not audited individually (queue full)
	auditQ          chan lease.AuditEvent
	killReq         chan struct{}
	killed          atomic.Bool

	notifDone chan struct{}  // closed when the notification loop ended
	netOps    sync.WaitGroup // traps answered by goroutines (net_linux.go); they end after notifDone
	auditDone chan struct{}
	// auditCtx bounds the audit of denials: canceled auditDrain after the
	// process tree is gone, so a bus that cannot take events (the very
	// fault that may have lost the lease) does not hold Wait.
	auditCtx  context.Context
	auditStop context.CancelFunc
	done      chan struct{} // closed once the whole process tree is gone
	state     *os.ProcessState
	waitErr   error
}

// abiLimit caps the Landlock ABI Start uses (0: the kernel's), so that a
// test can run the guard as on an older kernel.
var abiLimit int

// Start runs cmd under the guard described by p: Landlock confines its
// writes (and TCP connects), a seccomp supervisor refuses every write-class
// call while gate is closed and records each refusal with audit. Canceling
// ctx sends SIGTERM to the process group and, after p.KillGrace, SIGKILL to
// every process of the attempt. The command leads a session of its own.
// cmd is only read (Path, Args, Env, Dir, Stdin, Stdout, Stderr,
// ExtraFiles, and of SysProcAttr only Setctty and Ctty: a terminal for
// that session); it must not have been started.
//
// Without Landlock, Start fails with ErrNoLandlock unless p.AllowUnguarded.
// The binary must call Init first thing in main (the child is re-executed).
func Start(ctx context.Context, p Policy, gate Gate, audit Auditor, cmd *exec.Cmd) (*Process, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if cmd.Err != nil {
		return nil, fmt.Errorf("guarded command: %w", cmd.Err)
	}
	if cmd.Process != nil {
		return nil, errors.New("guarded command: already started")
	}
	log := p.logger()
	abi, abiErr := Available()
	if abiLimit > 0 && abi > abiLimit {
		abi = abiLimit
	}
	if abiErr != nil {
		if !p.AllowUnguarded {
			return nil, fmt.Errorf("refusing to run %s unguarded: %w (pass --allow-unguarded to run without a file-write guard)", cmd.Path, abiErr)
		}
		log.Warn("RUNNING UNGUARDED: file writes are NOT confined to the lease", "cmd", cmd.Path, "err", abiErr, "lease", p.Lease.LeaseID)
	}
	enableSubreaper()

	pr := &Process{policy: p, gate: gate, audit: audit, abi: abi, guarded: abiErr == nil, listener: -1, stopR: -1, stopW: -1, tmpFD: -1,
		auditQ: make(chan lease.AuditEvent, 1024), killReq: make(chan struct{}, 1),
		notifDone: make(chan struct{}), auditDone: make(chan struct{}), done: make(chan struct{})}
	pr.sealed = &sealedNet{pr: pr}
	pr.auditCtx, pr.auditStop = context.WithCancel(context.Background())
	ok := false
	defer func() {
		if !ok {
			pr.auditStop()
			pr.cleanupDirs()
		}
	}()
	env, err := pr.privateEnv(&p, cmd.Env)
	if err != nil {
		return nil, err
	}
	cfg, err := pr.childSetup(&p, log, cmd, env)
	if err != nil {
		return nil, err
	}
	if err := pr.spawn(log, cmd, cfg, env); err != nil {
		return nil, err
	}
	ok = true

	go pr.notifyLoop()
	go pr.auditLoop()
	go pr.superviseTree(ctx)
	log.Info("guarded attempt started", "pid", pr.pid, "landlock_abi", abi, "guarded", pr.guarded, "lease", p.Lease.LeaseID)
	return pr, nil
}

// privateEnv makes the attempt's private temp dir, resolves the writable
// set, and returns the environment the command runs with (env, or this
// process's): TMPDIR the private dir, git's optional locks off, and the git
// shim first in PATH when p asks for it.
func (pr *Process) privateEnv(p *Policy, env []string) ([]string, error) {
	var err error
	if pr.tmpDir, err = os.MkdirTemp(p.TempRoot, "fenceline-tmp-"); err != nil {
		return nil, fmt.Errorf("private temp dir: %w", err)
	}
	real, err := filepath.EvalSymlinks(pr.tmpDir) // granted by its real path
	if err != nil {
		return nil, fmt.Errorf("private temp dir: %w", err)
	}
	pr.tmpDir = real
	if err := pr.resolveWritable(); err != nil {
		return nil, err
	}
	if env == nil {
		env = os.Environ()
	}
	env = setEnv(env, "TMPDIR", pr.tmpDir)
	env = setEnv(env, "GIT_OPTIONAL_LOCKS", "0")
	if p.GitShim {
		if env, err = pr.installShim(env); err != nil {
			return nil, err
		}
	}
	return env, nil
}

// childSetup is what the re-executed child applies before it runs cmd:
// the seccomp filter, and when guarded the Landlock rules that confine its
// writes (p's writable set and the private temp dir), hidden paths and
// ports.
func (pr *Process) childSetup(p *Policy, log *slog.Logger, cmd *exec.Cmd, env []string) (childConfig, error) {
	cfg := childConfig{Path: cmd.Path, Args: cmd.Args, Env: env, Seccomp: true}
	if len(cfg.Args) == 0 {
		cfg.Args = []string{cmd.Path}
	}
	if !pr.guarded {
		return cfg, nil
	}
	rules := &landlockRules{ABI: pr.abi, Devices: writableDevices, Hidden: cleanAll(p.Hidden),
		RestrictNet: !p.AllowAnyConnect, Ports: p.ConnectPorts, BindPorts: p.BindPorts}
	rules.Writable = append(cleanAll(p.writable()), pr.tmpDir)
	var err error
	if rules.Hidden, err = realPaths(rules.Hidden); err != nil {
		return cfg, err
	}
	cfg.Landlock = rules
	if pr.abi < 4 {
		log.Info("landlock ABI < 4: TCP connects, binds and listens are judged by the supervisor alone (no kernel port rule behind it); a reserved port is still refused at listen", "abi", pr.abi)
	}
	return cfg, nil
}

// spawn starts the guarded child (this binary again, see Init) with cfg
// on a setup socket, and completes the setup handshake; a child whose
// setup failed is killed and reaped.
func (pr *Process) spawn(log *slog.Logger, cmd *exec.Cmd, cfg childConfig, env []string) error {
	setup, err := json.Marshal(cfg)
	if err != nil {
		return fmt.Errorf("encode guard setup: %w", err)
	}

	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("guard setup socket: %w", err)
	}
	parentSock := fds[0]
	childSock := os.NewFile(uintptr(fds[1]), "fsguard-setup")
	defer unix.Close(parentSock)

	c := &exec.Cmd{
		Path:       "/proc/self/exe",
		Args:       cfg.Args,
		Env:        append(slices.Clone(env), fmt.Sprintf("%s=%d", childEnv, 3+len(cmd.ExtraFiles))),
		Dir:        cmd.Dir,
		Stdin:      cmd.Stdin,
		Stdout:     cmd.Stdout,
		Stderr:     cmd.Stderr,
		ExtraFiles: append(slices.Clone(cmd.ExtraFiles), childSock),
		// A session of its own: no process of another session can join
		// its process groups, nor it theirs (see tree_linux.go).
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if a := cmd.SysProcAttr; a != nil && a.Setctty {
		// A terminal of its own (the caller's pseudo-terminal, at the
		// child's descriptor Ctty) as the new session's.
		c.SysProcAttr.Setctty, c.SysProcAttr.Ctty = true, a.Ctty
	}
	err = c.Start()
	childSock.Close()
	if err != nil {
		return fmt.Errorf("start guarded %s: %w", cmd.Path, err)
	}
	pr.cmd, pr.pid = c, c.Process.Pid
	pi, err := statProc(pr.pid) // not reaped: the number is the child's
	if err != nil {
		c.Process.Kill()
		c.Wait()
		return fmt.Errorf("start guarded %s: read its start time: %w", cmd.Path, err)
	}
	pr.started = pi.start // tells its number's later owners apart
	registerDirect(pr.pid, pr.started)
	pr.recordSession(pr.pid, pr.started) // before the command runs
	if err := pr.handshake(log, parentSock, setup, cmd.Path); err != nil {
		c.Process.Kill()
		c.Wait()
		unregisterDirect(pr.pid, pr.started)
		pr.forgetSessions()
		if pr.listener >= 0 {
			unix.Close(pr.listener)
		}
		return err
	}
	return nil
}

// handshake sends the child its setup, takes the seccomp listener it
// sends back once its filter is in place, lets it exec the command and
// hears that it did; then makes the supervisor's stop pipe.
func (pr *Process) handshake(log *slog.Logger, parentSock int, setup []byte, path string) error {
	if err := unix.Sendmsg(parentSock, setup, nil, nil, 0); err != nil {
		return fmt.Errorf("send guard setup: %w", err)
	}
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4))
	n, oobn, _, _, err := unix.Recvmsg(parentSock, buf, oob, unix.MSG_CMSG_CLOEXEC)
	if err != nil {
		return fmt.Errorf("guarded child setup: %w", err)
	}
	if msg := string(buf[:n]); msg != msgOK {
		if msg == "" {
			msg = "guarded child exited during setup"
		}
		return fmt.Errorf("guard %s: %s", path, msg)
	}
	if oobn > 0 {
		scms, err := unix.ParseSocketControlMessage(oob[:oobn])
		if err == nil && len(scms) == 1 {
			if rights, err := unix.ParseUnixRights(&scms[0]); err == nil && len(rights) == 1 {
				pr.listener = rights[0]
			}
		}
	}
	if pr.listener < 0 {
		return errors.New("guarded child sent no seccomp listener")
	}
	if err := setSyncWakeup(pr.listener); err != nil {
		log.Debug("seccomp sync wake-up unavailable (Linux < 6.6): each trapped call costs a little more", "err", err)
	}
	if err := unix.Sendmsg(parentSock, []byte(msgGo), nil, nil, 0); err != nil {
		return fmt.Errorf("start guarded command: %w", err)
	}
	n, _, _, _, err = unix.Recvmsg(parentSock, buf, nil, 0)
	if err != nil {
		return fmt.Errorf("guarded child exec: %w", err)
	}
	if n > 0 {
		return fmt.Errorf("guard %s", buf[:n])
	}
	var pipe [2]int
	if err := unix.Pipe2(pipe[:], unix.O_CLOEXEC); err != nil {
		return fmt.Errorf("supervisor pipe: %w", err)
	}
	pr.stopR, pr.stopW = pipe[0], pipe[1]
	return nil
}

// Pid is the guarded command's process id (and its process group id).
func (pr *Process) Pid() int { return pr.pid }

// Guarded reports whether Landlock confines the attempt.
func (pr *Process) Guarded() bool { return pr.guarded }

// TempDir is the attempt's private temp dir (its TMPDIR), removed after it.
func (pr *Process) TempDir() string { return pr.tmpDir }

// Denials is how many calls the supervisor refused, for any cause.
func (pr *Process) Denials() uint64 { return pr.Refusals().Total() }

// Refusals is how many calls the supervisor refused, by cause: only
// Refusals.AfterLoss are refused because the lease was lost.
func (pr *Process) Refusals() Refusals {
	return Refusals{Confined: pr.refusedConfined.Load(), AfterLoss: pr.refusedLost.Load()}
}

// refused counts one refused call by its audit reason.
func (pr *Process) refused(reason string) {
	if afterLoss(reason) {
		pr.refusedLost.Add(1)
	} else {
		pr.refusedConfined.Add(1)
	}
}

// Signal sends sig to the attempt's process group while its command holds
// the group's number, and to each of its processes once it no longer does
// (see signalGroup).
func (pr *Process) Signal(sig syscall.Signal) error {
	sent, err := pr.signalGroup(sig)
	if !sent {
		for _, m := range live(pr.members()) {
			signalProc(m, sig)
		}
		return nil
	}
	if err != nil && !errors.Is(err, unix.ESRCH) {
		return fmt.Errorf("signal attempt %d: %w", pr.pid, err)
	}
	return nil
}

// signalGroup sends sig to the command's process group unless the
// command has been reaped, and reports whether it did. Once the command
// is reaped its number is free, and a group signal could reach whoever
// takes it next: the attempt's processes are then signalled one by one.
func (pr *Process) signalGroup(sig syscall.Signal) (bool, error) {
	pr.groupMu.Lock()
	defer pr.groupMu.Unlock()
	if pr.reaped {
		return false, nil
	}
	return true, unix.Kill(-pr.pid, sig)
}

// signalProc sends sig to process m as a scan read it, through a pidfd
// checked against m's start time once open: a number that went to
// another process since the scan is not signalled.
func signalProc(m procInfo, sig syscall.Signal) {
	fd, err := unix.PidfdOpen(m.pid, 0)
	if err != nil {
		return // gone
	}
	defer unix.Close(fd)
	if pi, err := statProc(m.pid); err != nil || pi.start != m.start {
		return
	}
	unix.PidfdSendSignal(fd, sig, nil, 0)
}

// Kill sends SIGKILL to every process of the attempt, including those that
// left its process group, until none is left.
func (pr *Process) Kill() {
	pr.killed.Store(true)
	select {
	case pr.killReq <- struct{}{}:
	default:
	}
}

// Settled is closed once every process of the attempt is gone.
func (pr *Process) Settled() <-chan struct{} { return pr.done }

// Wait waits until every process of the attempt is gone and returns the
// command's exit state. The error is about supervision only; a command
// that failed has a non-zero ProcessState.ExitCode.
func (pr *Process) Wait() (*os.ProcessState, error) {
	<-pr.done
	return pr.state, pr.waitErr
}

// waitCommand waits for the command and records its exit state (an exit
// status is not an error of supervision), then closes exited.
func (pr *Process) waitCommand(exited chan<- struct{}) {
	// The exit first, without reaping: while the command is a zombie, its
	// number is still the attempt's (see signalGroup).
	var info unix.Siginfo
	for {
		if err := unix.Waitid(unix.P_PID, pr.pid, &info, unix.WEXITED|unix.WNOWAIT, nil); !errors.Is(err, unix.EINTR) {
			break
		}
	}
	pr.groupMu.Lock()
	pr.reaped = true
	pr.groupMu.Unlock()
	err := pr.cmd.Wait()
	pr.state = pr.cmd.ProcessState
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		err = nil
	}
	pr.waitErr = err
	close(exited)
}

// superviseTree waits for the command, reaps and (on cancel) kills the
// processes it leaves behind, and closes done once none is left.
func (pr *Process) superviseTree(ctx context.Context) {
	log := pr.policy.logger()
	exited := make(chan struct{})
	go pr.waitCommand(exited)
	sigch := make(chan os.Signal, 1)
	signal.Notify(sigch, unix.SIGCHLD)
	// While the command runs, the tree is scanned on SIGCHLD (to reap
	// adopted orphans) and once a second; after it exited or once it is
	// being killed, every 20 ms until nothing is left.
	scan := time.NewTimer(time.Second)
	var killTimer *time.Timer
	var killAt <-chan time.Time
	ctxDone, notifDone := ctx.Done(), pr.notifDone
	exitedSeen := false
	for {
		select {
		case <-ctxDone:
			ctxDone = nil
			log.Info("attempt canceled: SIGTERM to its process group", "pid", pr.pid, "grace", pr.policy.killGrace())
			pr.Signal(unix.SIGTERM)
			killTimer = time.NewTimer(pr.policy.killGrace())
			killAt = killTimer.C
		case <-killAt:
			killAt = nil
			log.Warn("attempt outlived its grace: SIGKILL to every process", "pid", pr.pid)
			pr.killed.Store(true)
		case <-pr.killReq:
		case <-exited:
			exited, exitedSeen = nil, true
		case <-notifDone:
			notifDone = nil
		case <-sigch:
		case <-scan.C:
		}
		members := pr.members()
		if pr.killed.Load() {
			pr.signalGroup(unix.SIGKILL)
			for _, m := range members {
				signalProc(m, unix.SIGKILL)
			}
		}
		pr.reap(members)
		// The filter's listener hangs up when no task uses it any more:
		// the kernel's own word that every process of the attempt is gone.
		if exitedSeen && pr.notifDoneClosed() && len(live(members)) == 0 {
			break
		}
		next := time.Second
		if exitedSeen || pr.killed.Load() {
			next = 20 * time.Millisecond
		}
		scan.Reset(next)
	}
	signal.Stop(sigch)
	scan.Stop()
	if killTimer != nil {
		killTimer.Stop()
	}
	pr.settle(log)
}

// settle releases what the attempt held once none of its processes is
// left: the notification loop and the network operations end first (they
// answer on the listener and audit), then the listener, the audit queue
// (drained for up to auditDrain), the private dirs and the IPC objects the
// attempt left; done is closed last.
func (pr *Process) settle(log *slog.Logger) {
	unregisterDirect(pr.pid, pr.started)
	pr.forgetSessions()
	unix.Close(pr.stopW) // ends the notification loop if the filter outlived the tree
	<-pr.notifDone
	pr.netOps.Wait() // they answer on the listener and audit: both stay open until they end
	pr.sealed.stop()
	unix.Close(pr.stopR)
	unix.Close(pr.listener)
	drain := time.AfterFunc(auditDrain, pr.auditStop)
	close(pr.auditQ)
	<-pr.auditDone
	drain.Stop()
	pr.auditStop()
	pr.cleanupDirs()
	pr.ipcCleanup() // the System V objects the attempt made and left
	pr.mqCleanup()  // the queues the attempt made and left
	rf := pr.Refusals()
	log.Info("guarded attempt settled", "pid", pr.pid, "refused_confined", rf.Confined, "refused_after_loss", rf.AfterLoss)
	close(pr.done)
}

func (pr *Process) notifDoneClosed() bool {
	select {
	case <-pr.notifDone:
		return true
	default:
		return false
	}
}

// resolveWritable records the real paths of the policy's writable set and
// of the temp dir, and opens the temp dir for the supervisor.
func (pr *Process) resolveWritable() error {
	for _, w := range cleanAll(pr.policy.writable()) {
		r, err := filepath.EvalSymlinks(w)
		if err != nil {
			return fmt.Errorf("policy writable path %q: %w", w, err)
		}
		pr.writableReal = append(pr.writableReal, r)
	}
	r, err := filepath.EvalSymlinks(pr.tmpDir)
	if err != nil {
		return fmt.Errorf("private temp dir: %w", err)
	}
	pr.tmpReal = r
	pr.writableReal = append(pr.writableReal, r)
	if pr.tmpFD, err = unix.Open(r, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0); err != nil {
		return fmt.Errorf("private temp dir: %w", err)
	}
	return nil
}

func (pr *Process) cleanupDirs() {
	if pr.tmpFD >= 0 {
		unix.Close(pr.tmpFD)
		pr.tmpFD = -1
	}
	for _, d := range []string{pr.tmpDir, pr.shimDir} {
		if d != "" {
			os.RemoveAll(d)
		}
	}
}

// notifyLoop answers the attempt's trapped write calls until the filter
// has no task left (every process of the attempt is gone) or the
// supervisor stops it.
func (pr *Process) notifyLoop() {
	defer close(pr.notifDone)
	runtime.LockOSThread() // one thread answers: the kernel wakes it on the trapping CPU
	// An umask of its own, set to the task's before the supervisor creates
	// something for it; the thread then ends with the loop.
	if err := unix.Unshare(unix.CLONE_FS); err == nil {
		pr.ownUmask = true
	} else {
		defer runtime.UnlockOSThread()
		pr.policy.logger().Warn("seccomp supervisor: no umask of its own: files created for the attempt after a lease loss get the supervisor's umask", "err", err)
	}
	calls := writeSyscalls()
	var n seccompNotif
	fds := []unix.PollFd{{Fd: int32(pr.listener), Events: unix.POLLIN}, {Fd: int32(pr.stopR), Events: unix.POLLIN}}
	for {
		fds[0].Revents, fds[1].Revents = 0, 0
		if _, err := unix.Poll(fds, -1); err != nil {
			if errors.Is(err, unix.EINTR) {
				continue
			}
			pr.policy.logger().Error("seccomp supervisor poll failed", "err", err)
			return
		}
		if fds[1].Revents != 0 {
			return
		}
		if fds[0].Revents&unix.POLLIN == 0 {
			if fds[0].Revents&(unix.POLLHUP|unix.POLLERR|unix.POLLNVAL) != 0 {
				return // no task uses the filter any more
			}
			continue
		}
		if err := notifRecv(pr.listener, &n); err != nil {
			continue // ENOENT: the task died while trapped; EINTR
		}
		pr.answer(&n, calls)
	}
}

// answer lets a trapped call proceed to Landlock while the lease holds and
// refuses it with EACCES once the lease is lost or unknown.
func (pr *Process) answer(n *seccompNotif, calls map[uint32]sysSpec) {
	if s, ok := calls[uint32(n.nr)]; ok && s.handle != nil {
		t := pr.newTrap(n, s)
		s.handle(t)
		t.close()
		return
	}
	resp := seccompNotifResp{id: n.id}
	var gateErr error
	if pr.gate != nil {
		_, gateErr = pr.gate.Fence()
	}
	if gateErr == nil {
		// Not an allow decision: Landlock, in the kernel, decides the call.
		resp.flags = unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE
		notifSend(pr.listener, &resp)
		return
	}
	s, ok := calls[uint32(n.nr)]
	if !ok {
		s = spec("syscall " + strconv.Itoa(int(n.nr)))
	}
	d := describe(n, s)
	if !notifValid(pr.listener, n.id) {
		return // the task is gone; what we read may belong to another
	}
	resp.error = -int32(unix.EACCES)
	if s.how >= 0 && d.haveFlags && d.rawFlags&writeOpenFlags == 0 {
		// A read-only openat2 cannot be let through without trusting
		// CONTINUE; ENOSYS makes libc and Go fall back to openat, which
		// the filter checks without a round trip.
		resp.error = -int32(unix.ENOSYS)
		notifSend(pr.listener, &resp)
		return
	}
	notifSend(pr.listener, &resp)
	pr.refused(lease.LeaseReason(gateErr))
	pr.enqueueAudit(d, gateErr)
}

// Audit reason codes of denied file writes (the git and Postgres fences'
// vocabulary).
const (
	ReasonLeaseLost    = lease.ReasonLeaseLost    // the lease is lost (revoked, expired, reclaimed)
	ReasonLeaseUnknown = lease.ReasonLeaseUnknown // the holder cannot reach the bus: fail closed
)

func (pr *Process) enqueueAudit(d denial, gateErr error) {
	pr.enqueueEvent(lease.BoundaryFile, lease.LeaseReason(gateErr),
		fmt.Sprintf("file write denied: %s: %s holds no valid lease (%v); reads continue", d, pr.policy.leaseDesc(), gateErr))
}

// auditDrain is how long the denials still queued when the process tree
// is gone may take to reach the Auditor; the rest are counted in one
// summary event.
var auditDrain = 5 * time.Second

// auditLoop writes queued denials to the Auditor, one at a time.
func (pr *Process) auditLoop() {
	defer close(pr.auditDone)
	log := pr.policy.logger()
	var last lease.AuditEvent
	for ev := range pr.auditQ {
		last = ev
		log.Warn("file write denied", "reason", ev.Reason, "detail", ev.Message)
		if pr.audit == nil {
			continue
		}
		if pr.auditCtx.Err() != nil {
			pr.dropped.Add(1) // past the drain: counted in the summary
			continue
		}
		ctx, cancel := context.WithTimeout(pr.auditCtx, 10*time.Second)
		if err := pr.audit.Record(ctx, ev); err != nil {
			log.Error("audit of a denied write failed", "err", err, "event", ev.Message)
		}
		cancel()
	}
	if n := pr.dropped.Load(); n > 0 && pr.audit != nil {
		last.Time = time.Now().UTC()
		last.Message = fmt.Sprintf("%d further file writes denied and not audited one by one (audit queue full, or the bus too slow to take them); %s", n, pr.policy.leaseDesc())
		ctx, cancel := context.WithTimeout(context.Background(), auditDrain)
		if err := pr.audit.Record(ctx, last); err != nil {
			log.Error("audit of dropped denials failed", "err", err)
		}
		cancel()
	}
}

func setEnv(env []string, key, val string) []string {
	env = slices.DeleteFunc(slices.Clone(env), func(kv string) bool { return strings.HasPrefix(kv, key+"=") })
	return append(env, key+"="+val)
}

func cleanAll(ps []string) []string {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		out = append(out, filepath.Clean(p))
	}
	return out
}

// realPaths resolves symlinks of existing paths (a hidden path must be
// hidden under the name the kernel sees) and keeps missing ones as given.
func realPaths(ps []string) ([]string, error) {
	out := make([]string, 0, len(ps))
	for _, p := range ps {
		r, err := filepath.EvalSymlinks(p)
		switch {
		case err == nil:
			out = append(out, r)
			if r != p {
				out = append(out, p)
			}
		case errors.Is(err, os.ErrNotExist):
			out = append(out, p)
		default:
			return nil, fmt.Errorf("policy hidden path %q: %w", p, err)
		}
	}
	return out, nil
}

var subreaperOnce sync.Once

// enableSubreaper makes this process the reaper of the attempts' orphans,
// so a process that double-forks away from the attempt stays in view.
func enableSubreaper() {
	subreaperOnce.Do(func() { unix.Prctl(unix.PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) })
}
