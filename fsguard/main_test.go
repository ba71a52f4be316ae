package fsguard

import (
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain lets the test binary serve as the guarded child and the git
// shim (Init), then fails the run if a test leaves goroutines behind.
func TestMain(m *testing.M) {
	Init()
	testutil.Main(m)
}
