package attempt

import (
	"testing"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain lets the test binary play the file guard's guarded child and
// git shim (fsguard.Init never returns then), and fails the package if
// goroutines outlive its tests.
func TestMain(m *testing.M) {
	fsguard.Init()
	testutil.Main(m)
}
