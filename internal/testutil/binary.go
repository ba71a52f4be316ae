package testutil

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sync"
	"testing"
)

// BinEnv names a fenceline binary already built for this run (.ci/run
// builds ./cmd/fenceline once and sets it). Unset, FencelineBinary builds
// one itself.
const BinEnv = "FENCELINE_BIN"

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// FencelineBinary returns the path of the fenceline command for tests that
// run it as separate processes: $FENCELINE_BIN when set, else
// ./cmd/fenceline of this module built once per test binary into a
// temporary directory anyone may read (removed at exit by Main). Callers
// must not write beside it: with FENCELINE_BIN it is shared by every
// package of the run.
func FencelineBinary(t testing.TB) string {
	t.Helper()
	binOnce.Do(func() {
		if p := os.Getenv(BinEnv); p != "" {
			if _, err := os.Stat(p); err != nil {
				binErr = fmt.Errorf("%s: %w", BinEnv, err)
				return
			}
			binPath = p
			return
		}
		_, here, _, ok := runtime.Caller(0)
		if !ok {
			binErr = fmt.Errorf("testutil: cannot locate the module")
			return
		}
		dir, err := os.MkdirTemp("", "fenceline-bin-")
		if err != nil {
			binErr = err
			return
		}
		AtExit(func() { os.RemoveAll(dir) })
		if err := os.Chmod(dir, 0o755); err != nil {
			binErr = err
			return
		}
		bin := filepath.Join(dir, "fenceline")
		cmd := exec.Command("go", "build", "-o", bin, "./cmd/fenceline")
		cmd.Dir = filepath.Join(filepath.Dir(here), "..", "..")
		if out, err := cmd.CombinedOutput(); err != nil {
			binErr = fmt.Errorf("go build ./cmd/fenceline: %w\n%s", err, out)
			return
		}
		binPath = bin
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}
