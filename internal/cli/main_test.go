package cli

import (
	"context"
	"os"
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain fails the package if goroutines of fenceline or NATS outlive its
// tests: every command must stop what it started. Run as "hook …" — the
// demo's git server execs this binary as fenceline — it is the CLI.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "hook" {
		os.Exit(Main(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
	testutil.Main(m)
}
