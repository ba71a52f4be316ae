package leasebus

import (
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain fails the package if a server, service, holder or connection a
// test started is still running after the tests.
func TestMain(m *testing.M) { testutil.Main(m) }
