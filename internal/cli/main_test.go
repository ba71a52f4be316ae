package cli

import (
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain fails the package if goroutines of fenceline or NATS outlive its
// tests: every command must stop what it started.
func TestMain(m *testing.M) { testutil.Main(m) }
