package shard

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"

	"github.com/fenceline/fenceline/shard/record"
)

// Records on the bus are written by the lease service alone, which checks
// each write (leasebus/shards.go: the same checks as below, and whose
// record a write may change). A record is still checked each time it is
// read (validPool, validAttempt), and
// a runner places an attempt only in a pool whose checkout is its own and
// whose directory is one it knows to be that checkout's pool (Owns): a
// rewritten record must never send a runner's git init, reset --hard or
// clean -ffdx, or an agent's writes, into a directory of the attacker's
// choosing.

// ErrBadRecord: a record on the bus is not one fenceline writes (damaged,
// or rewritten); it is refused, never acted on.
var ErrBadRecord = record.ErrBadRecord

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

// validPool checks a pool record read under key (record.ValidPool).
func validPool(p *Pool, key string) error { return record.ValidPool((*record.Pool)(p), key) }

// validAttempt checks an attempt record read under key.
func validAttempt(a *Attempt, key string) error { return record.ValidAttempt(a, key) }

// maxPoolSize bounds a pool (Spec.Validate).
const maxPoolSize = record.MaxPoolSize

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
