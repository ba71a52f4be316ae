package attempt

import (
	"errors"
	"fmt"
)

// ErrInvalid marks an error in what the caller asked for (a path that is
// not a checkout, a claim through a symlink, a port out of range), as
// opposed to a failure while running: a CLI maps it to a usage error.
var ErrInvalid = errors.New("invalid attempt")

// invalidError is an error in the caller's input; it reads as its message
// alone and matches ErrInvalid.
type invalidError struct{ msg string }

func (e *invalidError) Error() string        { return e.msg }
func (e *invalidError) Is(target error) bool { return target == ErrInvalid }

func invalidf(format string, args ...any) error {
	return &invalidError{msg: fmt.Sprintf(format, args...)}
}

// errNoStateDir is Run's and RunInPod's error for a spec without
// FencelineStateDir: the caller's mistake, not the user's.
func errNoStateDir(spec string) error {
	return fmt.Errorf("attempt: %s.FencelineStateDir is empty: fenceline's state dir must be hidden from the agent", spec)
}
