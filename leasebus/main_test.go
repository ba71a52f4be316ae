package leasebus

import (
	"testing"

	"github.com/fenceline/fenceline/internal/leakcheck"
)

// TestMain fails the package if a server, service, holder or connection a
// test started is still running after the tests.
func TestMain(m *testing.M) { leakcheck.Main(m) }
