package leasebus

import (
	"errors"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// wireError is an error as it travels in a service reply.
type wireError struct {
	Code     string               `json:"code"`
	Message  string               `json:"message"`
	Conflict *lease.ConflictError `json:"conflict,omitempty"`
}

var codes = []struct {
	code string
	err  error
}{
	{"policy", policy.ErrRefused}, // the security team's policy refuses it
	{"conflict", lease.ErrConflict},
	{"revision_mismatch", jetstream.ErrKeyRevisionMismatch}, // a shard record's compare-and-swap
	{"renew_again", errRenewAgain},
	{"lost", lease.ErrLeaseLost},
	{"not_owner", lease.ErrNotOwner},
	{"not_found", lease.ErrNotFound},
	{"invalid", lease.ErrInvalid},
	{"store_full", ErrStoreFull}, // before unavailable: they wrap it
	{"log_full", ErrLogFull},
	{"store_read_only", ErrStoreReadOnly},
	{"jetstream_down", ErrJetStreamDown},
	{"unavailable", lease.ErrUnavailable},
}

// errRenewAgain refuses a renewal of a lease whose version a new primary
// set past its last record (renewSlack), at a version the old primary may
// have answered: the reply carries the lease at its current version, which
// the client renews instead, proving its credential over it (Client.Renew).
// It ends nothing.
var errRenewAgain = errors.New("renew again at the lease's current version")

func toWire(err error) *wireError {
	if err == nil {
		return nil
	}
	w := &wireError{Code: "internal", Message: err.Error()}
	var ce *lease.ConflictError
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
