package shard

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/shard/record"
)

// Buckets of the records (Records).
const (
	PoolBucket    = record.PoolBucket
	AttemptBucket = record.AttemptBucket
)

// BoundaryShard is the audit boundary of shard cleaning and recovery.
const BoundaryShard = "shard"

// Audit event types of this package.
const (
	EventCleaned   = "cleaned"   // a shard returned to its base
	EventCreated   = "created"   // a shard's worktree was added
	EventRecovered = "recovered" // a crashed attempt became unknown, its shard dirty
)

// State is what is known of a shard's files.
type State = record.State

const (
	StateAbsent = record.StateAbsent // no worktree yet
	StateClean  = record.StateClean  // at Base, nothing else in it, nobody in it
	StateDirty  = record.StateDirty  // anything else
)

// Status is where an attempt is in its life.
type Status = record.Status

const (
	StatusRunning   = record.StatusRunning
	StatusSucceeded = record.StatusSucceeded
	StatusFailed    = record.StatusFailed
	StatusCancelled = record.StatusCancelled
	StatusUnknown   = record.StatusUnknown // its runner vanished; its leases ended
)

// Shard is one worktree of a pool.
type Shard = record.Shard

// Pool is a repo's bounded set of shards, as stored (record.Pool, with
// what a runner does with it).
type Pool record.Pool

// ShardIDs are the workspace ids of the pool's shards, in order.
func (p *Pool) ShardIDs() []string {
	ids := make([]string, len(p.Shards))
	for i, s := range p.Shards {
		ids[i] = s.ID
	}
	return ids
}

// Shard returns the shard with id, or nil.
func (p *Pool) Shard(id string) *Shard {
	for i := range p.Shards {
		if p.Shards[i].ID == id {
			return &p.Shards[i]
		}
	}
	return nil
}

// Worktree is the git side of shard id.
func (p *Pool) Worktree(id string) (*Worktree, error) {
	s := p.Shard(id)
	if s == nil {
		return nil, fmt.Errorf("pool of %s has no shard %s (shards: %s)", p.Repo, id, strings.Join(p.ShardIDs(), ", "))
	}
	return &Worktree{Checkout: p.Checkout, Dir: p.Dir, ID: s.ID, Path: s.Path, Branch: s.Branch}, nil
}

// Attempt is one run of one command, as stored.
type Attempt = record.Attempt

// ShardID is the workspace id of the pool's shard number n (1-based).
func ShardID(n int) string { return record.ShardID(n) }

// BranchOf is the branch of shard id.
func BranchOf(id string) string { return record.BranchOf(id) }

// DefaultDir is where a checkout's shards live by default:
// <parent>/<name>.shards.
func DefaultDir(checkout string) string {
	return filepath.Join(filepath.Dir(checkout), filepath.Base(checkout)+".shards")
}

// Records keeps the pool and attempt records: JSON values by key in two
// buckets (PoolBucket, AttemptBucket), each with a revision that every
// write changes. *leasebus.ShardRecords is the lease bus's: read from the
// bus, written only through the lease service, which checks each write.
type Records interface {
	// Bucket checks that bucket exists: ErrNoBucket when it does not.
	Bucket(ctx context.Context, bucket string) error
	// Get reads key's record in bucket and its revision: ErrNotFound when
	// the key has none.
	Get(ctx context.Context, bucket, key string) (value []byte, rev uint64, err error)
	// Write writes key's record in bucket over revision rev (0: the key
	// must have none) and returns its new revision: ErrRevisionMismatch
	// when rev is no longer the record's. admin asks as an operator, which
	// declaring a pool needs (Config.Admin).
	Write(ctx context.Context, bucket, key string, rev uint64, value []byte, admin bool) (uint64, error)
	// Latest calls fn with the newest record of each key of bucket that
	// keyFilter matches ("*" every key, "<repoKey>.*" one repo's
	// attempts), in key order, deleted keys left out: ErrNoBucket when
	// the bucket does not exist.
	Latest(ctx context.Context, bucket, keyFilter string, fn func(key string, rev uint64, value []byte)) error
}

// Errors callers branch on.
var (
	// ErrNoPool: no pool is declared for the repo (or the buckets do not
	// exist yet: nobody declared any pool on this bus).
	ErrNoPool = errors.New("no shard pool declared")
	// ErrInUse: a change would drop a shard an attempt occupies.
	ErrInUse = errors.New("shard in use")
)

// Errors of Records.
var (
	// ErrNotFound: the key has no record (Records.Get).
	ErrNotFound = record.ErrNotFound
	// ErrRevisionMismatch: a write's revision is no longer the record's
	// (Records.Write): read again and retry.
	ErrRevisionMismatch = record.ErrRevisionMismatch
	// ErrNoBucket: the records have no such bucket (a bus whose lease
	// service is older than the shard store).
	ErrNoBucket = record.ErrNoBucket
)

// Config configures a Store. The zero value works: no audit, no logs. The
// buckets are the lease service's (it makes them when it starts).
type Config struct {
	// Audit receives cleaning and recovery events (nil: not recorded).
	Audit lease.Auditor
	// Logger receives operational logs (nil: discard).
	Logger *slog.Logger
	// Admin asks for every write as an operator (the lease service's
	// shardadmin op, which the bus lets only operators publish): writes
	// bound to no lease or attempt of the store's identity. Declare always
	// asks so; a runner's store leaves it false.
	Admin bool
}

// Validate reports a configuration that cannot work.
func (c *Config) Validate() error { return nil }

// Store reads and writes pool and attempt records.
type Store struct {
	rec   Records
	cfg   Config
	log   *slog.Logger
	mu    sync.Mutex
	bound bool // both buckets exist; guarded by mu, set once
}

// Open returns a store of rec's records. It creates nothing: the buckets
// are the lease service's; without them Pool reports ErrNoPool.
func Open(rec Records, cfg Config) (*Store, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if rec == nil {
		return nil, errors.New("shard store: no records")
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Store{rec: rec, cfg: cfg, log: log}, nil
}

// write writes key's record in bucket over revision rev (0: none yet), as
// an operator when admin or Config.Admin.
func (s *Store) write(ctx context.Context, bucket, key string, b []byte, rev uint64, admin bool) (uint64, error) {
	return s.rec.Write(ctx, bucket, key, rev, b, admin || s.cfg.Admin)
}

// buckets checks that both buckets exist: ErrNoPool when one does not,
// or, when create is set (declaring), an error saying why.
func (s *Store) buckets(ctx context.Context, create bool) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.bound {
		return nil
	}
	// The lease service makes both buckets when it starts (with bounded
	// records, no rollups and no purges): nobody else may create streams.
	for _, b := range []struct{ name, desc string }{
		{PoolBucket, "fenceline shard pools, one record per repo"},
		{AttemptBucket, "fenceline attempts, one record per attempt"},
	} {
		err := s.rec.Bucket(ctx, b.name)
		switch {
		case errors.Is(err, ErrNoBucket) && create:
			return fmt.Errorf("the bus has no %s bucket (%s), which its lease service makes when it starts: is the bus's `fenceline bus serve` as new as this fenceline? %w", b.name, b.desc, err)
		case errors.Is(err, ErrNoBucket):
			return ErrNoPool
		case err != nil:
			return fmt.Errorf("bucket %s: %w", b.name, err)
		}
	}
	s.bound = true
	return nil
}

// Spec declares a pool.
type Spec struct {
	Repo     string // bus identity of the repo
	Checkout string // absolute path of the local checkout
	Dir      string // where shards live (default DefaultDir(Checkout))
	Size     int
	// MaxSharers bounds the shared leases of one shard (0: no bound).
	MaxSharers int
}

// Validate reports a spec that cannot be declared.
func (sp *Spec) Validate() error {
	switch {
	case sp.Repo == "":
		return errors.New("pool: repo is empty")
	case !filepath.IsAbs(sp.Checkout):
		return fmt.Errorf("pool: checkout %q is not an absolute path", sp.Checkout)
	case sp.Dir != "" && !filepath.IsAbs(sp.Dir):
		return fmt.Errorf("pool: dir %q is not an absolute path", sp.Dir)
	case sp.Dir != "" && (record.Within(filepath.Clean(sp.Dir), filepath.Clean(sp.Checkout)) || record.Within(filepath.Clean(sp.Checkout), filepath.Clean(sp.Dir))):
		return fmt.Errorf("pool: dir %s and checkout %s overlap: put the shards beside the checkout", sp.Dir, sp.Checkout)
	case sp.Size < 1 || sp.Size > maxPoolSize:
		return fmt.Errorf("pool: size %d: want 1 to %d shards", sp.Size, maxPoolSize)
	case sp.MaxSharers < 0:
		return fmt.Errorf("pool: max-sharers %d is negative", sp.MaxSharers)
	}
	return nil
}

// Declare creates the repo's pool or resizes it. Shards beyond a smaller
// size are dropped from the record only when no active lease occupies
// them (ErrInUse names who does); their worktrees stay on disk, and a
// later grow adopts them as dirty. leases may be nil when nothing shrinks.
func (s *Store) Declare(ctx context.Context, sp Spec, leases lease.View) (*Pool, error) {
	if err := sp.Validate(); err != nil {
		return nil, err
	}
	sp.Checkout = filepath.Clean(sp.Checkout)
	if sp.Dir == "" {
		sp.Dir = DefaultDir(sp.Checkout)
	}
	sp.Dir = filepath.Clean(sp.Dir)
	if err := s.buckets(ctx, true); err != nil {
		return nil, err
	}
	// Declared on the checkout's host: the directory says whose it is, for
	// runners to check (Owns) against what the record on the bus says.
	if err := markPoolDir(sp.Repo, sp.Checkout, sp.Dir); err != nil {
		return nil, fmt.Errorf("declare the pool of %s: %w", sp.Repo, err)
	}
	return s.UpdatePool(ctx, sp.Repo, true, func(p *Pool) error {
		if p.Repo != "" && p.Dir != sp.Dir {
			// A new place: new worktrees; the old ones stay on disk.
			if err := s.checkUnused(ctx, sp.Repo, 0, p.Shards, leases); err != nil {
				return fmt.Errorf("move the pool of %s from %s to %s: %w", sp.Repo, p.Dir, sp.Dir, err)
			}
			p.Shards = nil
		}
		p.Repo, p.Checkout, p.Dir, p.MaxSharers = sp.Repo, sp.Checkout, sp.Dir, sp.MaxSharers
		if sp.Size < len(p.Shards) {
			if err := s.checkUnused(ctx, sp.Repo, sp.Size, p.Shards[sp.Size:], leases); err != nil {
				return err
			}
			p.Shards = p.Shards[:sp.Size]
		}
		for n := len(p.Shards) + 1; n <= sp.Size; n++ {
			id := ShardID(n)
			p.Shards = append(p.Shards, Shard{ID: id, Path: filepath.Join(sp.Dir, id), Branch: BranchOf(id), State: StateAbsent})
		}
		p.Size = sp.Size
		return nil
	})
}

func (s *Store) checkUnused(ctx context.Context, repo string, size int, drop []Shard, leases lease.View) error {
	if leases == nil {
		return fmt.Errorf("shrink pool of %s: cannot tell which shards are in use", repo)
	}
	active, err := leases.List(ctx, repo, false)
	if err != nil {
		return fmt.Errorf("shrink pool of %s: list leases: %w", repo, err)
	}
	var busy []string
	for _, sh := range drop {
		for _, l := range active {
			if l.WorkspaceID == sh.ID || strings.HasPrefix(l.WorkspaceID, sh.ID+"/") {
				busy = append(busy, fmt.Sprintf("%s: lease %s held by %s, fence %d, expires %s", sh.ID, l.LeaseID, l.Owner, l.Fence, l.ExpiresAt.UTC().Format(time.RFC3339)))
			}
		}
	}
	if len(busy) > 0 {
		return fmt.Errorf("%w: the pool of %s cannot drop shards %s..%s (to %d shards) while these are occupied:\n  %s\nwait for them to end, or shrink less", ErrInUse, repo, drop[0].ID, drop[len(drop)-1].ID, size, strings.Join(busy, "\n  "))
	}
	return nil
}

// Pool reads the repo's pool; ErrNoPool when none is declared.
func (s *Store) Pool(ctx context.Context, repo string) (*Pool, error) {
	if err := s.buckets(ctx, false); err != nil {
		return nil, err
	}
	key := record.PoolKey(repo)
	value, rev, err := s.rec.Get(ctx, PoolBucket, key)
	if errors.Is(err, ErrNotFound) {
		return nil, ErrNoPool
	}
	if err != nil {
		return nil, fmt.Errorf("read pool of %s: %w", repo, err)
	}
	var p Pool
	if err := json.Unmarshal(value, &p); err != nil {
		return nil, fmt.Errorf("%w: decode pool of %s: %w", ErrBadRecord, repo, err)
	}
	if err := validPool(&p, key); err != nil {
		return nil, err
	}
	p.Revision = rev
	return &p, nil
}

// Pools reads every declared pool, by repo.
func (s *Store) Pools(ctx context.Context) ([]*Pool, error) {
	if err := s.buckets(ctx, false); err != nil {
		if errors.Is(err, ErrNoPool) {
			return nil, nil
		}
		return nil, err
	}
	var out []*Pool
	err := s.rec.Latest(ctx, PoolBucket, "*", func(key string, rev uint64, value []byte) {
		var p Pool
		err := json.Unmarshal(value, &p)
		if err == nil {
			err = validPool(&p, key)
		}
		if err != nil {
			s.log.Warn("pool record refused", "key", key, "err", err)
			return
		}
		p.Revision = rev
		out = append(out, &p)
	})
	if err != nil {
		return nil, fmt.Errorf("list pools: %w", err)
	}
	slices.SortFunc(out, func(a, b *Pool) int { return cmp.Compare(a.Repo, b.Repo) })
	return out, nil
}

// casTries bounds compare-and-swap retries of one change.
const casTries = 100

// UpdatePool applies fn to the repo's pool record and writes it with a
// compare-and-swap, retrying on a concurrent change. With create, a
// missing record starts empty; else it is ErrNoPool.
func (s *Store) UpdatePool(ctx context.Context, repo string, create bool, fn func(*Pool) error) (*Pool, error) {
	if err := s.buckets(ctx, create); err != nil {
		return nil, err
	}
	key := record.PoolKey(repo)
	valid := func(p *Pool) error { return validPool(p, key) }
	// Declaring replaces a record refused on reading (see records.go); any
	// other change refuses to build on it.
	write := func(ctx context.Context, b []byte, rev uint64) (uint64, error) {
		return s.write(ctx, PoolBucket, key, b, rev, create) // only operators declare
	}
	p, rev, err := casJSON(ctx, s.rec, PoolBucket, key, "pool of "+repo, valid, create, write, func(p *Pool, found bool) (bool, error) {
		if !found && !create {
			return false, ErrNoPool
		}
		return true, fn(p)
	})
	if err != nil {
		return nil, err
	}
	p.Revision = rev
	return p, nil
}

// casJSON reads key's JSON record (a zero T when there is none), checks it
// with valid, applies fn, and — when fn says so — writes it back with a
// compare-and-swap on the revision it read, starting over on a concurrent
// change. It returns the record and its revision. A record that does not
// decode or is not valid is refused, or with replace handed to fn as a
// zero T that was not found (the write then replaces it, still on its
// revision).
func casJSON[T any](ctx context.Context, rec Records, bucket, key, what string, valid func(*T) error, replace bool,
	put func(ctx context.Context, b []byte, rev uint64) (uint64, error), fn func(v *T, found bool) (write bool, err error)) (*T, uint64, error) {
	for range casTries {
		v := new(T)
		var rev uint64
		found := false
		value, vrev, err := rec.Get(ctx, bucket, key)
		switch {
		case errors.Is(err, ErrNotFound):
		case err != nil:
			return nil, 0, fmt.Errorf("read %s: %w", what, err)
		default:
			rev, found = vrev, true
			err := json.Unmarshal(value, v)
			if err != nil {
				err = fmt.Errorf("%w: decode %s: %w", ErrBadRecord, what, err)
			} else {
				err = valid(v)
			}
			if err != nil && !replace {
				return nil, 0, err
			}
			if err != nil {
				v, found = new(T), false
			}
		}
		write, err := fn(v, found)
		if err != nil || !write {
			return v, rev, err
		}
		b, err := json.Marshal(v)
		if err != nil {
			return nil, 0, fmt.Errorf("encode %s: %w", what, err)
		}
		nrev, err := put(ctx, b, rev)
		if errors.Is(err, ErrRevisionMismatch) {
			continue
		}
		if err != nil {
			return nil, 0, fmt.Errorf("write %s: %w", what, err)
		}
		return v, nrev, nil
	}
	return nil, 0, fmt.Errorf("write %s: still contended after %d compare-and-swap tries", what, casTries)
}

// SetShard changes one shard of the repo's pool with fn (compare-and-swap).
func (s *Store) SetShard(ctx context.Context, repo, id string, fn func(*Shard)) (*Pool, error) {
	return s.UpdatePool(ctx, repo, false, func(p *Pool) error {
		sh := p.Shard(id)
		if sh == nil {
			return fmt.Errorf("pool of %s has no shard %s any more (resized?)", repo, id)
		}
		fn(sh)
		return nil
	})
}

func attemptKey(repo, id string) string { return record.AttemptKey(repo, id) }

// Begin writes a new attempt record; its status is running.
func (s *Store) Begin(ctx context.Context, a Attempt) (*Attempt, error) {
	if err := s.buckets(ctx, false); err != nil {
		return nil, err
	}
	if a.AttemptID == "" || a.Repo == "" {
		return nil, fmt.Errorf("attempt: id %q and repo %q are both required", a.AttemptID, a.Repo)
	}
	a.Status = StatusRunning
	if a.StartedAt.IsZero() {
		a.StartedAt = time.Now().UTC()
	}
	if err := validAttempt(&a, attemptKey(a.Repo, a.AttemptID)); err != nil {
		return nil, err
	}
	b, err := json.Marshal(&a)
	if err != nil {
		return nil, fmt.Errorf("encode attempt %s: %w", a.AttemptID, err)
	}
	rev, err := s.write(ctx, AttemptBucket, attemptKey(a.Repo, a.AttemptID), b, 0, false)
	if errors.Is(err, ErrRevisionMismatch) {
		return nil, fmt.Errorf("attempt %s exists already: attempt ids are never reused", a.AttemptID)
	}
	if err != nil {
		return nil, fmt.Errorf("write attempt %s: %w", a.AttemptID, err)
	}
	a.Revision = rev
	return &a, nil
}

// UpdateAttempt applies fn to an attempt record with a compare-and-swap.
// fn returning false leaves the record as it is.
func (s *Store) UpdateAttempt(ctx context.Context, repo, id string, fn func(*Attempt) bool) (*Attempt, error) {
	if err := s.buckets(ctx, false); err != nil {
		return nil, err
	}
	key := attemptKey(repo, id)
	valid := func(a *Attempt) error { return validAttempt(a, key) }
	write := func(ctx context.Context, b []byte, rev uint64) (uint64, error) {
		return s.write(ctx, AttemptBucket, key, b, rev, false)
	}
	a, rev, err := casJSON(ctx, s.rec, AttemptBucket, key, "attempt "+id, valid, false, write, func(a *Attempt, found bool) (bool, error) {
		if !found {
			return false, fmt.Errorf("read attempt %s: %w", id, ErrNotFound)
		}
		return fn(a), nil
	})
	if err != nil {
		return nil, err
	}
	a.Revision = rev
	return a, nil
}

// Settle records how an attempt ended: status and exit code, settled now.
// It is the runner's word and overrides an "unknown" that Recover wrote
// while the runner could not renew its lease.
func (s *Store) Settle(ctx context.Context, repo, id string, st Status, code int) (*Attempt, error) {
	return s.UpdateAttempt(ctx, repo, id, func(a *Attempt) bool {
		if a.Status != StatusRunning && a.Status != StatusUnknown {
			return false // settled already
		}
		if a.Status == StatusUnknown {
			a.Note = "marked unknown while its leases were inactive: " + a.Note
		}
		a.Status, a.SettledAt = st, time.Now().UTC()
		a.ExitCode = &code
		return true
	})
}

// Attempt reads one attempt record.
func (s *Store) Attempt(ctx context.Context, repo, id string) (*Attempt, error) {
	if err := s.buckets(ctx, false); err != nil {
		return nil, err
	}
	key := attemptKey(repo, id)
	value, rev, err := s.rec.Get(ctx, AttemptBucket, key)
	if err != nil {
		return nil, fmt.Errorf("read attempt %s: %w", id, err)
	}
	var a Attempt
	if err := json.Unmarshal(value, &a); err != nil {
		return nil, fmt.Errorf("%w: decode attempt %s: %w", ErrBadRecord, id, err)
	}
	if err := validAttempt(&a, key); err != nil {
		return nil, err
	}
	a.Revision = rev
	return &a, nil
}

// Attempts lists the repo's attempts, oldest first (one listing of the
// repo's keys, not a read per attempt).
func (s *Store) Attempts(ctx context.Context, repo string) ([]*Attempt, error) {
	if err := s.buckets(ctx, false); err != nil {
		return nil, err
	}
	var out []*Attempt
	err := s.rec.Latest(ctx, AttemptBucket, repoid.Key(repo)+".*", func(key string, rev uint64, value []byte) {
		var a Attempt
		err := json.Unmarshal(value, &a)
		if err == nil {
			err = validAttempt(&a, key)
		}
		if err != nil {
			s.log.Warn("attempt record refused", "key", key, "err", err)
			return
		}
		a.Revision = rev
		out = append(out, &a)
	})
	if err != nil {
		return nil, fmt.Errorf("list attempts of %s: %w", repo, err)
	}
	slices.SortFunc(out, func(a, b *Attempt) int { return a.StartedAt.Compare(b.StartedAt) })
	return out, nil
}

// Recover finds the repo's attempts still "running" whose leases are all
// no longer active — their runner is gone — and marks each "unknown" and
// its shard dirty, with an audit event. It looks at the attempts the pool
// record lists as running in its shards (what runners call before they
// place an attempt: cost in proportion to the running attempts); with
// all, at every attempt of the repo (shard list), which also catches a
// runner that died between writing its attempt and placing it. It returns
// the attempts it changed.
func (s *Store) Recover(ctx context.Context, repo string, leases lease.View, all bool) ([]*Attempt, error) {
	pool, err := s.Pool(ctx, repo)
	if err != nil {
		return nil, err
	}
	var cands []*Attempt
	if all {
		if cands, err = s.Attempts(ctx, repo); err != nil {
			return nil, err
		}
	} else {
		for _, sh := range pool.Shards {
			for _, id := range sh.Running {
				a, err := s.Attempt(ctx, repo, id)
				if errors.Is(err, ErrNotFound) {
					a = &Attempt{AttemptID: id, Shard: sh.ID, Status: StatusUnknown}
				} else if err != nil {
					return nil, err
				}
				cands = append(cands, a)
			}
		}
	}
	var out []*Attempt
	drop := map[string]bool{} // attempt ids to take off the shards' running lists
	dirty := map[string]bool{}
	for _, a := range cands {
		if a.Status != StatusRunning {
			drop[a.AttemptID] = true // settled; its runner died before saying so in the pool
			continue
		}
		why, err := ended(ctx, leases, a.Leases)
		if err != nil {
			return out, err
		}
		if why == "" {
			continue
		}
		note := "its runner is gone: " + why
		na, err := s.UpdateAttempt(ctx, repo, a.AttemptID, func(a *Attempt) bool {
			if a.Status != StatusRunning {
				return false
			}
			a.Status, a.Note = StatusUnknown, note
			return true
		})
		if err != nil {
			return out, err
		}
		if na.Status != StatusUnknown || na.Note != note {
			continue // settled meanwhile
		}
		drop[a.AttemptID] = true
		if a.Shard != "" {
			dirty[a.Shard] = true
		}
		s.audit(ctx, lease.AuditEvent{
			Type: EventRecovered, Repo: repo, LeaseID: first(a.Leases),
			Owner:   lease.Owner{TaskID: a.TaskID, AgentID: a.AgentID, AttemptID: a.AttemptID, HostID: a.HostID},
			Reason:  note,
			Message: fmt.Sprintf("attempt %s (%s, %s) in %s is unknown: %s; %s marked dirty, cleaned before an exclusive attempt uses it", a.AttemptID, a.AgentID, strings.Join(a.Command, " "), a.Shard, why, a.Shard),
		})
		out = append(out, na)
	}
	if len(drop) == 0 && len(dirty) == 0 {
		return out, nil
	}
	_, err = s.UpdatePool(ctx, repo, false, func(p *Pool) error {
		for i := range p.Shards {
			sh := &p.Shards[i]
			sh.Running = slices.DeleteFunc(sh.Running, func(id string) bool { return drop[id] })
			if dirty[sh.ID] {
				sh.State = StateDirty
			}
		}
		return nil
	})
	return out, err
}

// ended says why every one of ids is no longer active, or "" when one is.
func ended(ctx context.Context, leases lease.View, ids []string) (string, error) {
	if len(ids) == 0 {
		return "", nil // placed before any lease: cannot judge
	}
	var whys []string
	for _, id := range ids {
		l, err := leases.Get(ctx, id)
		switch {
		case errors.Is(err, lease.ErrNotFound):
			whys = append(whys, "lease "+id+" is gone")
		case err != nil:
			return "", fmt.Errorf("check lease %s: %w", id, err)
		case l.Active():
			return "", nil
		default:
			whys = append(whys, fmt.Sprintf("lease %s %s (%s)", id, l.Status, l.Reason))
		}
	}
	return strings.Join(whys, ", "), nil
}

func first(ss []string) string {
	if len(ss) == 0 {
		return ""
	}
	return ss[0]
}

func (s *Store) audit(ctx context.Context, ev lease.AuditEvent) {
	if s.cfg.Audit == nil {
		return
	}
	ev.Boundary = BoundaryShard
	if err := s.cfg.Audit.Record(context.WithoutCancel(ctx), ev); err != nil {
		s.log.Warn("audit shard event", "type", ev.Type, "err", err)
	}
}

// Audit records ev at the shard boundary (nothing without Config.Audit).
func (s *Store) Audit(ctx context.Context, ev lease.AuditEvent) { s.audit(ctx, ev) }
