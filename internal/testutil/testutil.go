// Package testutil holds what fenceline's test suites share: a leak check
// that fails a test binary whose goroutines outlive its tests (every
// server, service, holder and connection a test starts must be stopped by
// it), and CheckFor, which polls for a state instead of sleeping. Use the
// leak check from TestMain:
//
//	func TestMain(m *testing.M) { testutil.Main(m) }
package testutil

import (
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	atExitMu sync.Mutex
	atExit   []func() // guarded by atExitMu
)

// AtExit registers f to run once the test binary's tests are done (by
// Main and MainWith): removing what several tests shared, such as one
// set of bus credentials.
func AtExit(f func()) {
	atExitMu.Lock()
	defer atExitMu.Unlock()
	atExit = append(atExit, f)
}

func runAtExit() {
	atExitMu.Lock()
	fs := atExit
	atExit = nil
	atExitMu.Unlock()
	for _, f := range fs {
		f()
	}
}

// Run runs the tests and then what AtExit registered, without Main's leak
// check, and returns the exit code.
func Run(m *testing.M) int {
	code := m.Run()
	runAtExit()
	return code
}

// Main runs the tests, then waits up to 5 s for every goroutine running
// fenceline or NATS code to end; any that remain are printed and fail the
// run.
func Main(m *testing.M) { MainWith(m, nil) }

// MainWith is Main for a test binary that shares a server across its
// tests: stop (when not nil) runs after the tests and before the leak check.
func MainWith(m *testing.M, stop func()) {
	code := m.Run()
	if stop != nil {
		stop()
	}
	runAtExit()
	if code == 0 {
		if leaked := Leaked(5 * time.Second); leaked != "" {
			fmt.Fprintf(os.Stderr, "leaked goroutines:\n%s\n", leaked)
			code = 1
		}
	}
	os.Exit(code)
}

// Leaked polls for up to grace and returns the stacks of goroutines still
// running fenceline or NATS code, or "" once there are none.
func Leaked(grace time.Duration) string {
	deadline := time.Now().Add(grace)
	for {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		var leaked []string
		for _, g := range strings.Split(string(buf), "\n\n") {
			ours := strings.Contains(g, "github.com/fenceline/fenceline/") &&
				!strings.Contains(g, "testutil.") && !strings.Contains(g, "testing.(*M).Run")
			if ours || strings.Contains(g, "github.com/nats-io/") {
				leaked = append(leaked, g)
			}
		}
		if len(leaked) == 0 || time.Now().After(deadline) {
			return strings.Join(leaked, "\n\n")
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// CheckFor polls f every interval until it returns nil, and fails the test
// with f's last error once timeout has passed.
func CheckFor(t testing.TB, timeout, interval time.Duration, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var err error
	for time.Now().Before(deadline) {
		if err = f(); err == nil {
			return
		}
		time.Sleep(interval)
	}
	t.Fatalf("not true after %s: %v", timeout, err)
}
