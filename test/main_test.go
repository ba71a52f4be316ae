package test

import (
	"testing"

	"github.com/fenceline/fenceline/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }
