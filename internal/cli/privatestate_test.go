package cli

import (
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/attempt"
)

// TestPrivateStateFlag: --private-state names paths in HOME; an
// --allow-write that would make the originals writable is a usage error.
func TestPrivateStateFlag(t *testing.T) {
	t.Parallel()
	home := t.TempDir()
	claude := filepath.Join(home, ".claude")
	os.Mkdir(claude, 0o700)
	cache := t.TempDir()

	spec, err := privateState(home, []string{claude, filepath.Join(home, ".claude.json")}, []string{cache})
	if err != nil || spec.Home != home || !slices.Equal(spec.Paths, []string{claude, filepath.Join(home, ".claude.json")}) {
		t.Errorf("privateState = %+v, %v", spec, err)
	}
	for _, tc := range []struct {
		paths, allowWrite []string
		says              string
	}{
		{[]string{"/etc"}, nil, "not beneath HOME"},
		{[]string{claude}, []string{claude}, "--allow-write " + claude + " makes your own " + claude + " writable"},
		{[]string{claude}, []string{home}, "drop the --allow-write"},
		{[]string{claude}, []string{filepath.Join(claude, "projects")}, "drop the --allow-write"},
	} {
		_, err := privateState(home, tc.paths, tc.allowWrite)
		var ue *usageError
		if err == nil || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("privateState(%q, %q) = %v, want an error saying %q", tc.paths, tc.allowWrite, err, tc.says)
		} else if !errors.As(err, &ue) && !errors.Is(err, attempt.ErrInvalid) {
			t.Errorf("privateState(%q, %q) = %T, want a usage error", tc.paths, tc.allowWrite, err)
		}
	}
}
