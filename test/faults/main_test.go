//go:build integration

package faults

import (
	"os"
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestMain removes the fenceline binary the tests built (when
// FENCELINE_BIN did not name one).
func TestMain(m *testing.M) { os.Exit(testutil.Run(m)) }
