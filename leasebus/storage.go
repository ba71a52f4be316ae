package leasebus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sys/unix"
)

// What the bus's store can hold, and what to say when it cannot.
//
// JetStream reserves a stream's MaxBytes against the server's store limit
// when the stream is created, so a fixed 1 GiB audit stream cannot start
// on a small volume at all. The audit stream asks for auditMaxBytes and
// halves the request while the server says it has no room for it, down to
// auditMinBytes; a stream that exists keeps the size it was created with
// (shrinking it would drop old audit events).
//
// When a write finds the disk full, nats-server shuts JetStream down (it
// stays down until the server restarts) and every later append goes
// unanswered. The lease service then asks a StoreProbe what is wrong, so
// that the client's refusal and the service's log name the store and the
// fault instead of a timeout.

const (
	auditMaxBytes = 1 << 30
	auditMinBytes = 4 << 20
)

// errStorageExceeded is JetStream's "insufficient storage resources
// available": the server cannot reserve what a stream asks for.
const errStorageExceeded jetstream.ErrorCode = 10047

// ensureAuditStream creates the audit stream with the largest MaxBytes the
// server can reserve (at most cfg.MaxBytes), or updates an existing one
// keeping its size.
func ensureAuditStream(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig) (jetstream.Stream, error) {
	if s, err := js.Stream(ctx, cfg.Name); err == nil {
		cfg.MaxBytes = s.CachedInfo().Config.MaxBytes
		return js.UpdateStream(ctx, cfg)
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, err
	}
	want := cfg.MaxBytes
	for {
		s, err := js.CreateStream(ctx, cfg)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Another service instance made it meanwhile, maybe with
			// another size: keep that.
			return ensureAuditStream(ctx, js, cfg)
		}
		var apiErr *jetstream.APIError
		if err == nil || !errors.As(err, &apiErr) || apiErr.ErrorCode != errStorageExceeded {
			return s, err
		}
		if cfg.MaxBytes/2 < auditMinBytes {
			return nil, fmt.Errorf("the bus's store cannot hold even %d MiB of audit events (asked %d MiB first): give the store a larger volume: %w", cfg.MaxBytes>>20, want>>20, err)
		}
		cfg.MaxBytes /= 2
	}
}

// StoreProbe tells what is wrong with the bus's store, or nil when it finds
// nothing wrong. The lease service calls it when a write to the bus fails
// or goes unanswered.
type StoreProbe func(ctx context.Context) error

// ErrStoreFull and ErrStoreReadOnly name the two store faults a probe
// recognises; both also match ErrUnavailable.
var (
	ErrStoreFull     error = &storeError{"the bus's store is full"}
	ErrStoreReadOnly error = &storeError{"the bus's store is read-only"}
	// ErrJetStreamDown: the embedded server's JetStream is stopped (it
	// stops itself when a write finds its disk full); embedded.KeepStore restarts it.
	ErrJetStreamDown error = &storeError{"JetStream is stopped on the bus"}
)

// storeError is a store fault; it is also ErrUnavailable.
type storeError struct{ msg string }

func (e *storeError) Error() string        { return e.msg }
func (e *storeError) Is(target error) bool { return target == ErrUnavailable }

// minFreeBytes is how little free room a probe calls full: JetStream
// writes in blocks, so a volume with a few KiB left already fails.
const minFreeBytes = 1 << 20

// StatStore looks at a local store directory with statfs alone (cheap
// enough to run every storeCheckInterval): read-only when its filesystem is
// mounted read-only, full when less than 1 MiB is free.
func StatStore(dir string) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return fmt.Errorf("%w: bus store %s: %w", ErrUnavailable, dir, err)
	}
	if st.Flags&unix.ST_RDONLY != 0 {
		return readOnly(dir, syscall.EROFS)
	}
	if st.Bavail*uint64(st.Bsize) < minFreeBytes {
		return storeFull(dir)
	}
	return nil
}

// CheckStoreDir reports whether dir takes writes, by writing and syncing a
// probe file and then as StatStore does: nil, or an error matching
// ErrStoreFull or ErrStoreReadOnly that names dir and says what to do, or
// another error naming dir.
func CheckStoreDir(dir string) error {
	f, err := os.CreateTemp(dir, ".fenceline-probe-*")
	if err == nil {
		name := f.Name()
		_, err = f.Write(make([]byte, 4096))
		if err == nil {
			err = f.Sync()
		}
		f.Close()
		os.Remove(name)
	}
	switch {
	case errors.Is(err, syscall.EROFS), errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return readOnly(dir, err)
	case errors.Is(err, syscall.ENOSPC), errors.Is(err, syscall.EDQUOT):
		return storeFull(dir)
	case err != nil:
		return fmt.Errorf("bus store %s: %w", dir, err)
	}
	return StatStore(dir)
}

func readOnly(dir string, err error) error {
	var pe *os.PathError
	if errors.As(err, &pe) {
		err = pe.Err
	}
	return fmt.Errorf("%w: cannot write to %s (%v): remount it read-write or give the bus a writable --store", ErrStoreReadOnly, dir, err)
}

func storeFull(dir string) error {
	free := "no room"
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err == nil {
		free = fmt.Sprintf("%d KiB free of %d MiB", st.Bavail*uint64(st.Bsize)>>10, st.Blocks*uint64(st.Bsize)>>20)
	}
	abs, _ := filepath.Abs(dir)
	return fmt.Errorf("%w: %s has %s; free space on that volume (or move the store); lease writes are refused until then, and an embedded bus resumes by itself within a second of having room", ErrStoreFull, abs, free)
}

// storeCheckInterval is how often a service with a StoreProbe, and
// embedded.KeepStore, look at the store.
const storeCheckInterval = 100 * time.Millisecond

// watchStore asks the probe about the store every storeCheckInterval until
// ctx ends, keeps the answer for storeFault, and logs each change.
func (s *Service) watchStore(ctx context.Context) {
	t := time.NewTicker(storeCheckInterval)
	defer t.Stop()
	var last error
	for {
		pctx, cancel := context.WithTimeout(ctx, storeCheckInterval)
		err := s.cfg.StoreProbe(pctx)
		cancel()
		if ctx.Err() != nil {
			return
		}
		switch {
		case err != nil && (last == nil || err.Error() != last.Error()):
			s.log.Error("bus store fault: lease writes are refused until it is fixed", "err", err)
		case err == nil && last != nil:
			s.log.Info("bus store takes writes again")
		}
		last = err
		if err == nil {
			s.storeErr.Store(nil)
		} else {
			s.storeErr.Store(&err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// storeFault is the store fault the last probe found, or nil.
func (s *Service) storeFault() error {
	if p := s.storeErr.Load(); p != nil {
		return *p
	}
	return nil
}

// diagnose turns a failed write to the bus into what is wrong with the
// store, when the probe or JetStream can tell; otherwise it returns err.
func (s *Service) diagnose(ctx context.Context, err error) error {
	if err == nil || errors.Is(err, errCAS) {
		return err
	}
	if s.cfg.StoreProbe != nil {
		if perr := s.cfg.StoreProbe(ctx); perr != nil {
			return fmt.Errorf("%w (%v)", perr, err)
		}
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == errStorageExceeded || apiErr.Code == 507) {
		return fmt.Errorf("%w: the bus has no room for the write (%v): free space in its store or raise its JetStream limits", ErrUnavailable, err)
	}
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, context.DeadlineExceeded) {
		// Is JetStream still there? A server that found its disk full has
		// shut it down.
		if _, jerr := s.js.AccountInfo(ctx); errors.Is(jerr, jetstream.ErrJetStreamNotEnabled) || errors.Is(jerr, jetstream.ErrJetStreamNotEnabledForAccount) {
			return fmt.Errorf("%w: JetStream is disabled on the bus, which a server does when its store's disk fills or fails (see the bus's log); free space and restart it: %v", ErrUnavailable, err)
		}
	}
	return err
}

// diagnoseSoon is diagnose bounded to a second, for the request path.
func (s *Service) diagnoseSoon(ctx context.Context, err error) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	return s.diagnose(ctx, err)
}
