package testutil

import (
	"os"
	"testing"
)

// WantPerm fails t unless path exists with permission bits want (a
// secret file 0600, its directory 0700).
func WantPerm(t testing.TB, path string, want os.FileMode) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != want {
		t.Errorf("%s has mode %04o, want %04o", path, got, want)
	}
}
