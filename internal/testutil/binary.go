package testutil

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
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
// ./cmd/fenceline of this module as the go command's build cache holds it
// (linked once per change of the module, not once per run: go run caches
// the executables it links), copied into a temporary directory anyone may
// read (removed at exit by Main). Callers must not write beside it: with
// FENCELINE_BIN it is shared by every package of the run.
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
		cached, err := cachedBinary(filepath.Join(filepath.Dir(here), "..", ".."))
		if err != nil {
			binErr = err
			return
		}
		bin := filepath.Join(dir, "fenceline")
		if binErr = copyFile(cached, bin, 0o755); binErr == nil {
			binPath = bin
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

// cachedBinary is the path of ./cmd/fenceline of the module in root as the
// build cache holds it: "go run -exec echo" links it (or finds it linked)
// and prints where. A first link prints the path in go run's work
// directory, gone once it returns; the second asks the cache, which holds
// it by then.
func cachedBinary(root string) (string, error) {
	for range 2 {
		cmd := exec.Command("go", "run", "-exec", "echo", "./cmd/fenceline")
		cmd.Dir = root
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("go run -exec echo ./cmd/fenceline: %w\n%s", err, stderr.Bytes())
		}
		p := strings.TrimSpace(string(out))
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("go run -exec echo ./cmd/fenceline: the build cache holds no fenceline after linking it (GOCACHE off?)")
}

func copyFile(from, to string, mode os.FileMode) error {
	src, err := os.Open(from)
	if err != nil {
		return err
	}
	defer src.Close()
	dst, err := os.OpenFile(to, os.O_WRONLY|os.O_CREATE|os.O_EXCL, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(dst, src); err != nil {
		dst.Close()
		return err
	}
	return dst.Close()
}
