package shard

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/leasebus"
)

// Records on the bus are not the runner's word: any holder credential may
// write them (the buckets are shared by every runner of the bus). A record
// is therefore checked each time it is read (validPool, validAttempt), and
// a runner places an attempt only in a pool whose checkout is its own and
// whose directory is one it knows to be that checkout's pool (Owns): a
// rewritten record must never send a runner's git init, reset --hard or
// clean -ffdx, or an agent's writes, into a directory of the attacker's
// choosing.

// ErrBadRecord: a record on the bus is not one fenceline writes (damaged,
// or rewritten by another holder); it is refused, never acted on.
var ErrBadRecord = errors.New("shard record refused")

// PoolMarker is the file, in a pool's directory, that says which checkout
// the directory serves. Declare writes it (on the checkout's host); a
// runner trusts a pool directory other than DefaultDir only when it holds
// the runner's own repo and checkout.
const PoolMarker = ".fenceline-pool"

// poolMark is PoolMarker's content.
type poolMark struct {
	Repo     string `json:"repo"`
	Checkout string `json:"checkout"`
}

var (
	shardIDPattern   = regexp.MustCompile(`^shard-[1-9][0-9]{0,3}$`)
	attemptIDPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)
	commitPattern    = regexp.MustCompile(`^([0-9a-f]{40}|[0-9a-f]{64})$`)
)

// cleanAbs reports whether p is an absolute, clean path.
func cleanAbs(p string) bool {
	return filepath.IsAbs(p) && filepath.Clean(p) == p && !strings.ContainsRune(p, 0)
}

// within reports whether p is dir or below it.
func within(p, dir string) bool {
	rel, err := filepath.Rel(dir, p)
	return err == nil && rel != ".." && !strings.HasPrefix(rel, "../")
}

// validPool checks a pool record read under key: the shape Declare and
// the placements write, nothing else.
func validPool(p *Pool, key string) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: pool record %s: %s (re-declare the pool with \"fenceline shard pool\" to replace it)", ErrBadRecord, key, fmt.Sprintf(format, args...))
	}
	switch {
	case p.Repo == "" || leasebus.RepoKey(p.Repo) != key:
		return bad("it names repo %q, which is not the record's key", p.Repo)
	case !cleanAbs(p.Checkout):
		return bad("checkout %q is not a clean absolute path", p.Checkout)
	case !cleanAbs(p.Dir) || p.Dir == "/":
		return bad("dir %q is not a clean absolute path", p.Dir)
	case within(p.Dir, p.Checkout) || within(p.Checkout, p.Dir):
		return bad("dir %s and checkout %s overlap", p.Dir, p.Checkout)
	case p.Size < 1 || p.Size > maxPoolSize || p.Size != len(p.Shards):
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

// validAttempt checks an attempt record read under key.
func validAttempt(a *Attempt, key string) error {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: attempt record %s: %s", ErrBadRecord, key, fmt.Sprintf(format, args...))
	}
	switch {
	case !attemptIDPattern.MatchString(a.AttemptID) || a.Repo == "" || attemptKey(a.Repo, a.AttemptID) != key:
		return bad("it names attempt %q of repo %q, which is not the record's key", a.AttemptID, a.Repo)
	case a.Shard != "" && !shardIDPattern.MatchString(a.Shard):
		return bad("shard %q", a.Shard)
	case !slices.Contains([]Status{StatusRunning, StatusSucceeded, StatusFailed, StatusCancelled, StatusUnknown}, a.Status):
		return bad("status %q", a.Status)
	}
	return nil
}

// maxPoolSize bounds a pool (Spec.Validate).
const maxPoolSize = 1000

// Owns reports why a runner working in checkout must not place an attempt
// in p (nil when it may). A pool of this very checkout in its default
// directory is the runner's own; any other — another checkout of the repo
// (a second clone working in the first one's pool), or a directory given
// with --dir — only when the directory's PoolMarker, written by Declare on
// this host, names p's repo and p's checkout. Both are facts of the
// runner's own host, which a record rewritten on the bus cannot change.
func (p *Pool) Owns(checkout string) error {
	if filepath.Clean(checkout) == p.Checkout && p.Dir == DefaultDir(p.Checkout) {
		return nil
	}
	b, err := os.ReadFile(filepath.Join(p.Dir, PoolMarker))
	if err != nil {
		return fmt.Errorf("%w: the pool of %s (checkout %s) keeps its shards in %s, which holds no %s from declaring it on this host: %v (a record rewritten on the bus, or a pool declared elsewhere: re-declare it here with \"fenceline shard pool\")", ErrBadRecord, p.Repo, p.Checkout, p.Dir, PoolMarker, err)
	}
	var m poolMark
	if err := json.Unmarshal(b, &m); err != nil || m.Repo != p.Repo || m.Checkout != p.Checkout {
		return fmt.Errorf("%w: %s says the directory serves checkout %q of %q, not checkout %s of %s as the pool record on the bus says", ErrBadRecord, filepath.Join(p.Dir, PoolMarker), m.Checkout, m.Repo, p.Checkout, p.Repo)
	}
	return nil
}

// markPoolDir makes the pool's directory and its PoolMarker.
func markPoolDir(repo, checkout, dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("pool dir: %w", err)
	}
	b, err := json.Marshal(poolMark{Repo: repo, Checkout: checkout})
	if err != nil {
		return err
	}
	path := filepath.Join(dir, PoolMarker)
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("pool dir marker: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("pool dir marker: %w", err)
	}
	return nil
}
