package test

import (
	"testing"

	"github.com/fenceline/fenceline/internal/testutil"
)

func TestMain(m *testing.M) { testutil.Main(m) }
