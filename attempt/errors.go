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

// FieldError is an error in one field of the caller's Spec or PodSpec,
// named as the struct names it ("Paths", "Workspace", "AllowHosts",
// "Sidecar.PGUpstream"), with the value at fault when there is one. A CLI
// reports it under the flag that filled the field. It matches ErrInvalid
// when it is the caller's mistake rather than a failure while running.
type FieldError struct {
	Field   string
	Value   string
	Err     error
	invalid bool
}

func (e *FieldError) Error() string {
	if e.Value != "" {
		return fmt.Sprintf("%s %s: %v", e.Field, e.Value, e.Err)
	}
	return fmt.Sprintf("%s: %v", e.Field, e.Err)
}

func (e *FieldError) Unwrap() error        { return e.Err }
func (e *FieldError) Is(target error) bool { return e.invalid && target == ErrInvalid }

// fieldInvalid is a FieldError that is the caller's mistake.
func fieldInvalid(field, value string, err error) error {
	return &FieldError{Field: field, Value: value, Err: err, invalid: true}
}

// ErrHostNotAllowed is the error of a PodSpec.AllowHosts host the
// sidecar's egress proxy does not allow: the sidecar must allow it.
var ErrHostNotAllowed = errors.New("the sidecar's egress proxy does not allow it")
