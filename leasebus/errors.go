package leasebus

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/fenceline/fenceline/internal/scope"
)

// Sentinel errors callers branch on. Errors returned by this package wrap
// one of these (or are a *ConflictError) so errors.Is works across the bus.
var (
	// ErrConflict: the claim overlaps an active lease (see *ConflictError).
	ErrConflict = errors.New("conflicting lease")
	// ErrLeaseLost: the lease is no longer active, or its version moved on;
	// the holder must stop writing.
	ErrLeaseLost = errors.New("lease lost")
	// ErrNotOwner: the credential does not match the lease.
	ErrNotOwner = errors.New("not the lease owner")
	// ErrNotFound: no lease with that id is known.
	ErrNotFound = errors.New("lease not found")
	// ErrInvalid: the request itself is malformed.
	ErrInvalid = errors.New("invalid request")
	// ErrUnavailable: the bus or the lease service did not answer; the
	// outcome of a write may be unknown.
	ErrUnavailable = errors.New("lease bus unavailable")
)

// Conflict names one active lease that blocks a request, or (RequestID
// set, LeaseID empty) an earlier queued request for an overlapping claim.
type Conflict struct {
	LeaseID     string      `json:"leaseId,omitempty"`
	RequestID   string      `json:"requestId,omitempty"`
	Owner       Owner       `json:"owner"`
	Scope       scope.Claim `json:"scope"`
	WorkspaceID string      `json:"workspaceId"`
	ExpiresAt   time.Time   `json:"expiresAt"`
	Fence       uint64      `json:"fence"`
	// Why says what overlaps ("services/billing ⟷ services/billing/api",
	// "workspace checkout is exclusive", "waiting behind req_…").
	Why string `json:"why"`
}

// ConflictError is returned when a claim cannot be granted now.
type ConflictError struct {
	Repo      string     `json:"repo"`
	Conflicts []Conflict `json:"conflicts"`
	// Waited is true when the request waited for its deadline.
	Waited bool `json:"waited,omitempty"`
}

func (e *ConflictError) Error() string {
	var b strings.Builder
	b.WriteString("conflict in ")
	b.WriteString(e.Repo)
	if e.Waited {
		b.WriteString(" (still held at the end of --wait)")
	}
	for i, c := range e.Conflicts {
		if i == 0 {
			b.WriteString(": ")
		} else {
			b.WriteString("; ")
		}
		if c.LeaseID == "" {
			fmt.Fprintf(&b, "request %s of %s is queued first: %s", c.RequestID, c.Owner, c.Why)
			continue
		}
		fmt.Fprintf(&b, "%s held by %s (fence %d, expires %s): %s",
			c.LeaseID, c.Owner, c.Fence, c.ExpiresAt.UTC().Format(time.RFC3339), c.Why)
	}
	return b.String()
}

// Is makes errors.Is(err, ErrConflict) true for a *ConflictError.
func (e *ConflictError) Is(target error) bool { return target == ErrConflict }

// wireError is an error as it travels in a service reply.
type wireError struct {
	Code     string         `json:"code"`
	Message  string         `json:"message"`
	Conflict *ConflictError `json:"conflict,omitempty"`
}

var codes = []struct {
	code string
	err  error
}{
	{"conflict", ErrConflict},
	{"lost", ErrLeaseLost},
	{"not_owner", ErrNotOwner},
	{"not_found", ErrNotFound},
	{"invalid", ErrInvalid},
	{"store_full", ErrStoreFull}, // before unavailable: they wrap it
	{"store_read_only", ErrStoreReadOnly},
	{"jetstream_down", ErrJetStreamDown},
	{"unavailable", ErrUnavailable},
}

func toWire(err error) *wireError {
	if err == nil {
		return nil
	}
	w := &wireError{Code: "internal", Message: err.Error()}
	var ce *ConflictError
	if errors.As(err, &ce) {
		w.Conflict = ce
	}
	for _, c := range codes {
		if errors.Is(err, c.err) {
			w.Code = c.code
			break
		}
	}
	return w
}

func (w *wireError) err() error {
	if w == nil {
		return nil
	}
	if w.Conflict != nil {
		return w.Conflict
	}
	for _, c := range codes {
		if c.code == w.Code {
			return &remoteError{msg: w.Message, sentinel: c.err}
		}
	}
	return errors.New(w.Message)
}

// remoteError carries the service's message and keeps errors.Is working.
type remoteError struct {
	msg      string
	sentinel error
}

func (e *remoteError) Error() string { return e.msg }
func (e *remoteError) Unwrap() error { return e.sentinel }

// IsFenced reports whether err means the holder must stop writing: the
// lease is lost or its ownership is not proven.
func IsFenced(err error) bool {
	return errors.Is(err, ErrLeaseLost) || errors.Is(err, ErrNotOwner) || errors.Is(err, ErrNotFound)
}
