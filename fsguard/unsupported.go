//go:build !linux || !(amd64 || arm64)

package fsguard

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"syscall"
)

// Process is a guarded attempt (not supported on this platform).
type Process struct{}

// Init does nothing on this platform.
func Init() {}

// Available reports that this platform has no Landlock.
func Available() (int, error) {
	return 0, fmt.Errorf("%w: fsguard needs Linux on amd64 or arm64, this is %s/%s", ErrNoLandlock, runtime.GOOS, runtime.GOARCH)
}

// Start refuses: there is no guard on this platform.
func Start(ctx context.Context, p Policy, gate Gate, audit Auditor, cmd *exec.Cmd) (*Process, error) {
	_, err := Available()
	return nil, err
}

func (pr *Process) Pid() int                        { return 0 }
func (pr *Process) Guarded() bool                   { return false }
func (pr *Process) TempDir() string                 { return "" }
func (pr *Process) Denials() uint64                 { return 0 }
func (pr *Process) Refusals() Refusals              { return Refusals{} }
func (pr *Process) Signal(sig syscall.Signal) error { return nil }
func (pr *Process) Kill()                           {}
func (pr *Process) Settled() <-chan struct{}        { return nil }
func (pr *Process) Wait() (*os.ProcessState, error) { return nil, nil }
