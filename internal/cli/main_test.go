package cli

import (
	"context"
	"os"
	"os/signal"
	"syscall"
	"testing"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain fails the package if goroutines of fenceline or NATS outlive its
// tests: every command must stop what it started.
//
// The test binary also plays what fenceline re-executes or is executed as:
// the file guard's guarded child and git shim (fsguard.Init never returns
// then), the demo's pre-receive hook ("hook …"), and, with
// FENCELINE_TEST_RUN_AS_CLI=1, the fenceline command itself (so a test can
// SIGKILL a real runner).
func TestMain(m *testing.M) {
	fsguard.Init()
	if os.Getenv(runAsCLIEnv) == "1" || isHookCall(os.Args[1:]) {
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := Main(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	testutil.Main(m)
}

// isHookCall: the binary was run as a hook ("hook …", or with global bus
// flags first, as hook install writes them: "--nats URL --creds F hook …").
func isHookCall(args []string) bool {
	for len(args) >= 2 && (args[0] == "--nats" || args[0] == "--creds") {
		args = args[2:]
	}
	return len(args) > 0 && args[0] == "hook"
}
