package testutil

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Permanent wraps an error that stops Retry at once: waiting longer
// cannot help (the process being waited for has exited).
func Permanent(err error) error { return &permanentError{err} }

type permanentError struct{ err error }

func (p *permanentError) Error() string { return p.err.Error() }
func (p *permanentError) Unwrap() error { return p.err }

// Retry calls f every interval until it returns nil or an error made by
// Permanent (then it returns that error's cause), or ctx ends: then it
// returns ctx's error together with f's last, which says what was still
// not true. CheckFor is the same wait for a test that fails outright.
func Retry(ctx context.Context, interval time.Duration, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		var p *permanentError
		if errors.As(err, &p) {
			return p.err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %w)", ctx.Err(), err)
		case <-time.After(interval):
		}
	}
}

// SyncBuffer is a bytes.Buffer safe for a writer and a poller: a process
// or command writes it while a test reads it.
type SyncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (b *SyncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *SyncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}
