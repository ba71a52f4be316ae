package leasebus

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/sys/unix"
)

// What the bus's store can hold, and what to say when it cannot.
//
// Every stream the bus makes is bounded in bytes, in messages and in the
// size of one message, here (streamBudgets) and nowhere else. JetStream
// reserves a stream's MaxBytes against the server's store limit (its
// max_file, by default three quarters of the volume's free space when the
// server starts) when the stream is made, and refuses a stream it cannot
// reserve for. So once every stream has a MaxBytes within that limit, no
// stream can take another's room: the lease log's appends never fail
// because boundary events, a viewer's reads or a holder's bucket values
// filled the store. The lease service makes every stream (no other role
// may), so there is no stream without a reservation.
//
// A stream the service makes gets its share of what the server can still
// reserve, measured once at start (reservable), capped at the stream's
// max and at least its min; a stream that exists keeps the size it was
// made with (shrinking it would drop what it holds), except one made
// before it had a size, which gets its share now.
//
// When a write finds the disk full anyway (something outside JetStream
// filled the volume), nats-server shuts JetStream down (it stays down
// until the server restarts) and every later append goes unanswered. The
// lease service then asks a StoreProbe what is wrong, so that the
// client's refusal and the service's log name the store and the fault
// instead of a timeout.

// streamBudget bounds one stream: share is its part (in percent) of what
// the server can reserve, between min and max bytes; maxMsgSize bounds
// one message, perSubject the messages of one subject (0: no bound).
type streamBudget struct {
	share      int64
	min, max   int64
	maxMsgSize int32
	perSubject int64
	discard    jetstream.DiscardPolicy
}

// streamBudgets are the bounds of every stream the bus makes. The shares
// add up to 90: a tenth of what the server can reserve stays free (the
// file store needs room beyond its messages to compact).
//
//   - the lease log refuses an append past its size (DiscardNew: no
//     record is dropped for room); it keeps logKeep records per repo
//     (the oldest dropped as a new one comes, once audited: log.go), at
//     least one snapshot among them. A record is at most the server's
//     payload limit (8 MiB embedded).
//   - the lease audit keeps 30 days and drops its oldest past its size;
//     only the service's own lease events are on it.
//   - events (boundaries' refusals, the bus's reads and refusals) keep
//     30 days, at most eventsPerWriter per repo, boundary and writer
//     (so a writer's flood drops its own oldest events first), and drop
//     their oldest past the stream's size.
//   - the shard buckets hold one record per key of at most shardMaxValue
//     (see shardBucket).
//   - policies keep every version (a version is never pushed out) and
//     refuse a write past their size (policy.go).
//   - the primary's claim is one small record (primary.go); it takes no
//     share.
var streamBudgets = map[string]streamBudget{
	LogStream:          {share: 30, min: 2 << 20, max: 1 << 30, maxMsgSize: 8 << 20, perSubject: logKeep, discard: jetstream.DiscardNew},
	AuditStream:        {share: 25, min: auditMinBytes, max: auditMaxBytes, maxMsgSize: 8 << 20, discard: jetstream.DiscardOld},
	EventsStream:       {share: 20, min: 1 << 20, max: 512 << 20, maxMsgSize: maxEventRequest, perSubject: eventsPerWriter, discard: jetstream.DiscardOld},
	shardPoolStream:    {share: 5, min: 1 << 20, max: 256 << 20, maxMsgSize: shardMaxValue, perSubject: 1, discard: jetstream.DiscardNew},
	shardAttemptStream: {share: 9, min: 1 << 20, max: 1 << 30, maxMsgSize: shardMaxValue, perSubject: 1, discard: jetstream.DiscardOld},
	PolicyStream:       {share: 1, min: 1 << 20, max: 256 << 20, maxMsgSize: policyMaxValue, discard: jetstream.DiscardNew},
	PrimaryStream:      {share: 0, min: 64 << 10, max: 64 << 10, maxMsgSize: 1 << 10, perSubject: 1, discard: jetstream.DiscardOld},
}

const (
	auditMaxBytes = 1 << 30
	auditMinBytes = 2 << 20
	// eventsPerWriter bounds the events kept of one repo, boundary and
	// writer.
	eventsPerWriter = 1024
)

// ErrLogFull: the lease log is at its size limit (streamBudgets), so
// appends are refused (it drops nothing); it also matches ErrUnavailable.
var ErrLogFull error = &storeError{"the lease log is at its size limit"}

// errStreamStoreFailed is JetStream's "stream store failed", which it
// answers (as "maximum bytes exceeded" or "maximum messages exceeded") to a
// write past a DiscardNew stream's limits.
const errStreamStoreFailed jetstream.ErrorCode = 10077

// streamFull names err when it is stream's refusal of a write past its
// limits (only the lease log's is ErrLogFull); else it returns err.
func streamFull(stream string, err error) error {
	var apiErr *jetstream.APIError
	if err == nil || !errors.As(err, &apiErr) || apiErr.ErrorCode != errStreamStoreFailed || !strings.Contains(apiErr.Description, "maximum") {
		return err
	}
	b := streamBudgets[stream]
	if stream == LogStream {
		return fmt.Errorf("%w (%s, about %d%% of what the store could reserve, at most %d MiB): lease writes that would grow it are refused (each repo keeps its last records, new ones replacing the oldest); give the bus a larger store: %v",
			ErrLogFull, stream, b.share, b.max>>20, err)
	}
	return fmt.Errorf("%w: stream %s is at its size limit: %v", lease.ErrUnavailable, stream, err)
}

// errStorageExceeded is JetStream's "insufficient storage resources
// available": the server cannot reserve what a stream asks for.
const errStorageExceeded jetstream.ErrorCode = 10047

// noRoom reports whether err is JetStream's refusal of a stream it cannot
// reserve the bytes of: on one server, insufficient storage; on a
// cluster, no peers for placement because of it.
func noRoom(err error) bool {
	var apiErr *jetstream.APIError
	if !errors.As(err, &apiErr) {
		return false
	}
	return apiErr.ErrorCode == errStorageExceeded ||
		(apiErr.ErrorCode == errNoPeers && strings.Contains(apiErr.Description, "insufficient storage"))
}

// measurePrefix names the streams measureReservable makes.
const measurePrefix = "FENCELINE_MEASURE_"

// errNoPeers is JetStream's "no suitable peers for placement".
const errNoPeers jetstream.ErrorCode = 10005

// bound applies the stream's budget to cfg, with MaxBytes its share of
// reservable (within its min and max).
func bound(cfg jetstream.StreamConfig, reservable int64) jetstream.StreamConfig {
	b := streamBudgets[cfg.Name]
	cfg.MaxBytes = min(max(reservable/100*b.share, b.min), b.max)
	cfg.MaxMsgSize = b.maxMsgSize
	cfg.Discard = b.discard
	if b.perSubject > 0 {
		cfg.MaxMsgsPerSubject = b.perSubject
	}
	return cfg
}

// ensureBounded creates or updates the streams cfgs within their budgets:
// a new stream, or one without a MaxBytes, gets its share of what the
// server can reserve; an existing one keeps its size. The streams are
// looked up, then made, side by side: on a cluster each new replicated
// stream elects its leader (seconds), and one after another the elections
// took a new three-node cluster about 30 s to start. The first error in
// cfgs' order is returned.
func ensureBounded(ctx context.Context, js jetstream.JetStream, cfgs []jetstream.StreamConfig) error {
	found := make([]jetstream.Stream, len(cfgs))
	errs := make([]error, len(cfgs))
	var wg sync.WaitGroup
	for i, cfg := range cfgs {
		wg.Go(func() {
			s, err := js.Stream(ctx, cfg.Name)
			switch {
			case errors.Is(err, jetstream.ErrStreamNotFound):
			case err != nil:
				errs[i] = fmt.Errorf("look up stream %s: %w", cfg.Name, err)
			default:
				found[i] = s
			}
		})
	}
	wg.Wait()
	if err := firstError(errs); err != nil {
		return err
	}
	var reservable int64 = -1
	for i := range cfgs {
		if found[i] == nil || found[i].CachedInfo().Config.MaxBytes == 0 {
			var err error
			if reservable, err = measureReservable(ctx, js, cfgs[i].Replicas); err != nil {
				return err
			}
			break
		}
	}
	for i, cfg := range cfgs {
		wg.Go(func() { errs[i] = ensureBound(ctx, js, cfg, found[i], reservable) })
	}
	wg.Wait()
	return firstError(errs)
}

// firstError is the first of errs that is not nil.
func firstError(errs []error) error {
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// ensureBound creates the stream cfg (s nil) or updates s to cfg, within
// its budget (see ensureBounded).
func ensureBound(ctx context.Context, js jetstream.JetStream, cfg jetstream.StreamConfig, s jetstream.Stream, reservable int64) error {
	if s != nil && s.CachedInfo().Config.MaxBytes > 0 {
		keep := bound(cfg, 0)
		keep.MaxBytes = s.CachedInfo().Config.MaxBytes
		if _, err := js.UpdateStream(ctx, keep); err != nil {
			return fmt.Errorf("update stream %s: %w", cfg.Name, err)
		}
		return nil
	}
	bounded := bound(cfg, reservable)
	var err error
	if s != nil {
		_, err = js.UpdateStream(ctx, bounded)
	} else {
		_, err = js.CreateStream(ctx, bounded)
		if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
			// Another service instance made it meanwhile: keep its size.
			if s, err = js.Stream(ctx, cfg.Name); err != nil {
				return fmt.Errorf("look up stream %s: %w", cfg.Name, err)
			}
			return ensureBound(ctx, js, cfg, s, reservable)
		}
	}
	if noRoom(err) {
		return fmt.Errorf("the bus's store cannot reserve %d MiB for stream %s (its least; %d MiB were reservable): give the store a larger volume (or JetStream a larger max_file): %w",
			bounded.MaxBytes>>20, cfg.Name, reservable>>20, err)
	}
	if err != nil {
		return fmt.Errorf("create stream %s: %w", cfg.Name, err)
	}
	return nil
}

// measureReservable finds about how many bytes (within 1/32) the server
// can still reserve for a file stream of replicas, by asking it to make
// (and at once deleting) a stream of that size: JetStream tells no client
// its store limit, only whether a stream fits.
func measureReservable(ctx context.Context, js jetstream.JetStream, replicas int) (int64, error) {
	// A measuring stream an earlier try made and could not delete (its
	// deadline passed) would hold its reservation for ever. One made in the
	// last minute may be another instance's, measuring now (every node of
	// a cluster starts a service): left alone.
	names := js.StreamNames(ctx)
	for n := range names.Name() {
		made, err := strconv.ParseInt(strings.TrimPrefix(n, measurePrefix), 36, 64)
		if strings.HasPrefix(n, measurePrefix) && (err != nil || time.Since(time.Unix(0, made)) > time.Minute) {
			if err := js.DeleteStream(ctx, n); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				return 0, fmt.Errorf("delete stream %s: %w", n, err)
			}
		}
	}
	if err := names.Err(); err != nil {
		return 0, fmt.Errorf("list streams: %w", err)
	}
	name := measurePrefix + strconv.FormatInt(time.Now().UnixNano(), 36)
	fits := func(n int64) (bool, error) {
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"$JS.EVENT.FENCELINE.measure." + name},
			Storage: jetstream.FileStorage, Replicas: replicas, MaxBytes: n})
		switch {
		case err == nil:
			if err := js.DeleteStream(ctx, name); err != nil && !errors.Is(err, jetstream.ErrStreamNotFound) {
				return true, fmt.Errorf("delete stream %s: %w", name, err)
			}
			return true, nil
		case noRoom(err):
			return false, nil
		}
		return false, fmt.Errorf("measure the bus's store: %w", err)
	}
	// Enough for every stream's max: no need to know more.
	var most int64
	for _, b := range streamBudgets {
		most += b.max
	}
	most = most / 9 * 10
	if ok, err := fits(most); ok || err != nil {
		return most, err
	}
	lo, hi := int64(0), int64(most)
	for hi-lo > max(hi>>5, 1<<20) {
		mid := lo + (hi-lo)/2
		ok, err := fits(mid)
		if err != nil {
			return 0, err
		}
		if ok {
			lo = mid
		} else {
			hi = mid
		}
	}
	return lo, nil
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
func (e *storeError) Is(target error) bool { return target == lease.ErrUnavailable }

// minFreeBytes is how little free room a probe calls full: JetStream
// writes in blocks, so a volume with a few KiB left already fails.
const minFreeBytes = 1 << 20

// StatStore looks at a local store directory with statfs alone (cheap
// enough to run every storeCheckInterval): read-only when its filesystem is
// mounted read-only, full when less than 1 MiB is free.
func StatStore(dir string) error {
	var st syscall.Statfs_t
	if err := syscall.Statfs(dir, &st); err != nil {
		return fmt.Errorf("%w: bus store %s: %w", lease.ErrUnavailable, dir, err)
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
	return fmt.Errorf("%w: cannot write to %s (%v): remount it read-write or give the bus a writable store directory", ErrStoreReadOnly, dir, err)
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
	if err == nil || errors.Is(err, errCAS) || errors.Is(err, ErrLogFull) {
		return err
	}
	if s.cfg.StoreProbe != nil {
		if perr := s.cfg.StoreProbe(ctx); perr != nil {
			return fmt.Errorf("%w (%v)", perr, err)
		}
	}
	var apiErr *jetstream.APIError
	if errors.As(err, &apiErr) && (apiErr.ErrorCode == errStorageExceeded || apiErr.Code == 507) {
		return fmt.Errorf("%w: the bus has no room for the write (%v): free space in its store or raise its JetStream limits", lease.ErrUnavailable, err)
	}
	if errors.Is(err, jetstream.ErrNoStreamResponse) || errors.Is(err, nats.ErrNoResponders) || errors.Is(err, context.DeadlineExceeded) {
		// Is JetStream still there? A server that found its disk full has
		// shut it down.
		if _, jerr := s.js.AccountInfo(ctx); errors.Is(jerr, jetstream.ErrJetStreamNotEnabled) || errors.Is(jerr, jetstream.ErrJetStreamNotEnabledForAccount) {
			return fmt.Errorf("%w: JetStream is disabled on the bus, which a server does when its store's disk fills or fails (see the bus's log); free space and restart it: %v", lease.ErrUnavailable, err)
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
