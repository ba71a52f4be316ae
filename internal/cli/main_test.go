package cli

import (
	"testing"

	"github.com/fenceline/fenceline/internal/leakcheck"
)

// TestMain fails the package if goroutines of fenceline or NATS outlive its
// tests: every command must stop what it started.
func TestMain(m *testing.M) { leakcheck.Main(m) }
