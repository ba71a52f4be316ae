// Package record is the shape of the shard store's records — a repo's pool
// of shards and its attempts — and the checks every reader and the lease
// service (which alone writes them) make of a record. It depends on
// nothing of fenceline but the repo key, so both the shard package and the
// lease service stand on it.
package record

import (
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/fenceline/fenceline/internal/repoid"
)

// State is what is known of a shard's files.
type State string

const (
	StateAbsent State = "absent" // no worktree yet
	StateClean  State = "clean"  // at Base, nothing else in it, nobody in it
	StateDirty  State = "dirty"  // anything else
)

// Status is where an attempt is in its life.
type Status string

const (
	StatusRunning   Status = "running"
	StatusSucceeded Status = "succeeded"
	StatusFailed    Status = "failed"
	StatusCancelled Status = "cancelled"
	StatusUnknown   Status = "unknown" // its runner vanished; its leases ended
)

// Shard is one worktree of a pool.
type Shard struct {
	ID     string `json:"id"`
	Path   string `json:"path"`
	Branch string `json:"branch"`
	State  State  `json:"state"`
	// Base is the commit the shard was last cleaned (or created) at.
	Base        string    `json:"base,omitempty"`
	CleanedAt   time.Time `json:"cleanedAt,omitzero"`
	LastAttempt string    `json:"lastAttempt,omitempty"`
	// Running are the attempts placed in the shard and not settled yet:
	// what Recover looks at.
	Running []string `json:"running,omitempty"`
}

// Pool is a repo's bounded set of shards, as stored.
type Pool struct {
	Repo       string  `json:"repo"`
	Checkout   string  `json:"checkout"`
	Dir        string  `json:"dir"`
	Size       int     `json:"size"`
	MaxSharers int     `json:"maxSharers"`
	Shards     []Shard `json:"shards"`
	// Revision is the KV revision the record was read at.
	Revision uint64 `json:"-"`
}

// Attempt is one run of one command, as stored.
type Attempt struct {
	AttemptID string    `json:"attemptId"`
	Repo      string    `json:"repo"`
	TaskID    string    `json:"taskId"`
	AgentID   string    `json:"agentId"`
	HostID    string    `json:"hostId,omitempty"`
	Command   []string  `json:"command"`
	Shard     string    `json:"shard"`
	Mode      string    `json:"mode"` // exclusive, shared, commit-serialized, commit-exclusive
	Leases    []string  `json:"leases"`
	Status    Status    `json:"status"`
	StartedAt time.Time `json:"startedAt"`
	SettledAt time.Time `json:"settledAt,omitzero"`
	ExitCode  *int      `json:"exitCode,omitempty"`
	// Note says why a status was set by someone else than the runner.
	Note string `json:"note,omitempty"`
	// By is the bus identity (public nkey) that wrote the attempt first,
	// set by the lease service: only it changes the attempt, but for the
	// recovery of an attempt whose leases all ended.
	By string `json:"by,omitempty"`
	// Revision is the KV revision the record was read at.
	Revision uint64 `json:"-"`
}

// ShardID is the workspace id of the pool's shard number n (1-based).
func ShardID(n int) string { return "shard-" + strconv.Itoa(n) }

// BranchOf is the branch of shard id.
func BranchOf(id string) string { return "fenceline/" + id }

// PoolKey is the key of repo's pool record.
func PoolKey(repo string) string { return repoid.Key(repo) }

// AttemptKey is the key of attempt id of repo.
func AttemptKey(repo, id string) string { return repoid.Key(repo) + "." + id }

// ErrBadRecord: a record on the bus is not one fenceline writes (damaged,
// or rewritten); it is refused, never acted on.
var ErrBadRecord = errors.New("shard record refused")

// Buckets of the shard store: one pool record per repo (key PoolKey), one
// attempt record per attempt (key AttemptKey).
const (
	PoolBucket    = "FENCELINE_SHARDS"
	AttemptBucket = "FENCELINE_ATTEMPTS"
)

// Errors of the shard store's records, whatever keeps them: the shard
// package branches on them (as shard.ErrNotFound, shard.ErrRevisionMismatch,
// shard.ErrNoBucket), and the lease bus's implementation returns them.
var (
	// ErrNotFound: the key has no record.
	ErrNotFound = errors.New("no shard record")
	// ErrRevisionMismatch: a compare-and-swap named a revision that is no
	// longer the record's (read again and retry).
	ErrRevisionMismatch = errors.New("shard record changed meanwhile")
	// ErrNoBucket: the store has no such bucket (a bus whose lease service
	// predates it: the service makes the buckets when it starts).
	ErrNoBucket = errors.New("no shard bucket")
)

// MaxPoolSize bounds a pool's shards.
const MaxPoolSize = 1000

var (
	shardIDPattern   = regexp.MustCompile(`^shard-[1-9][0-9]{0,3}$`)
	attemptIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)
	commitPattern    = regexp.MustCompile(`^([0-9a-f]{40}|[0-9a-f]{64})$`)
)

// ValidAttemptID reports whether id can name an attempt.
func ValidAttemptID(id string) bool { return attemptIDPattern.MatchString(id) }

// cleanAbs reports whether p is an absolute, clean path.
func cleanAbs(p string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && !strings.ContainsRune(p, 0)
}

// Within reports whether p is dir or below it.
func Within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// ValidPool checks a pool record read under key: the shape Declare and
// the placements write, nothing else.
func ValidPool(p *Pool, key string) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: pool record %s: %s (re-declare the pool with \"fenceline shard pool\" to replace it)", ErrBadRecord, key, fmt.Sprintf(format, args...))
	}
	switch {
	case p.Repo == "" || PoolKey(p.Repo) != key:
		return bad("it names repo %q, which is not the record's key", p.Repo)
	case !cleanAbs(p.Checkout):
		return bad("checkout %q is not a clean absolute path", p.Checkout)
	case !cleanAbs(p.Dir) || p.Dir == "/":
		return bad("dir %q is not a clean absolute path", p.Dir)
	case Within(p.Dir, p.Checkout) || Within(p.Checkout, p.Dir):
		return bad("dir %s and checkout %s overlap", p.Dir, p.Checkout)
	case p.Size < 1 || p.Size > MaxPoolSize || p.Size != len(p.Shards):
		return bad("size %d with %d shards", p.Size, len(p.Shards))
	case p.MaxSharers < 0:
		return bad("max sharers %d", p.MaxSharers)
	}
	for i, s := range p.Shards {
		switch {
		case s.ID != ShardID(i+1):
			return bad("shard %d is %q, want %s", i+1, s.ID, ShardID(i+1))
		case s.Path != filepath.Join(p.Dir, s.ID):
			return bad("shard %s is at %q, not %s", s.ID, s.Path, filepath.Join(p.Dir, s.ID))
		case s.Branch != BranchOf(s.ID):
			return bad("shard %s has branch %q, not %s", s.ID, s.Branch, BranchOf(s.ID))
		case s.State != StateAbsent && s.State != StateClean && s.State != StateDirty:
			return bad("shard %s has state %q", s.ID, s.State)
		case s.Base != "" && !commitPattern.MatchString(s.Base):
			return bad("shard %s has base %q, not a commit id", s.ID, s.Base)
		case s.LastAttempt != "" && !attemptIDPattern.MatchString(s.LastAttempt):
			return bad("shard %s names attempt %q", s.ID, s.LastAttempt)
		}
		for _, id := range s.Running {
			if !attemptIDPattern.MatchString(id) {
				return bad("shard %s lists running attempt %q", s.ID, id)
			}
		}
	}
	return nil
}

// ValidAttempt checks an attempt record read under key.
func ValidAttempt(a *Attempt, key string) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: attempt record %s: %s", ErrBadRecord, key, fmt.Sprintf(format, args...))
	}
	switch {
	case !attemptIDPattern.MatchString(a.AttemptID) || a.Repo == "" || AttemptKey(a.Repo, a.AttemptID) != key:
		return bad("it names attempt %q of repo %q, which is not the record's key", a.AttemptID, a.Repo)
	case a.Shard != "" && !shardIDPattern.MatchString(a.Shard):
		return bad("shard %q", a.Shard)
	case !slices.Contains([]Status{StatusRunning, StatusSucceeded, StatusFailed, StatusCancelled, StatusUnknown}, a.Status):
		return bad("status %q", a.Status)
	}
	return nil
}
