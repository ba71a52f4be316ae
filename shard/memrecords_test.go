package shard

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/fenceline/fenceline/internal/repoid"
)

// memRecords is Records in memory, for the store's decisions that need no
// bus (the bus's own, leasebus.ShardRecords, is what every other test of
// this package uses). Only the buckets in it exist. beforeWrite, when set,
// runs before each write is applied, outside the lock: a concurrent
// writer.
type memRecords struct {
	mu          sync.Mutex
	buckets     map[string]map[string]memRecord // guarded by mu
	rev         uint64                          // guarded by mu
	beforeWrite func(bucket, key string)
}

type memRecord struct {
	value []byte
	rev   uint64
}

var _ Records = (*memRecords)(nil)

func newMemRecords(buckets ...string) *memRecords {
	m := &memRecords{buckets: map[string]map[string]memRecord{}}
	for _, b := range buckets {
		m.buckets[b] = map[string]memRecord{}
	}
	return m
}

func (m *memRecords) Bucket(_ context.Context, bucket string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.buckets[bucket] == nil {
		return fmt.Errorf("%w %s", ErrNoBucket, bucket)
	}
	return nil
}

func (m *memRecords) Get(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	if err := m.Bucket(ctx, bucket); err != nil {
		return nil, 0, err
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	r, ok := m.buckets[bucket][key]
	if !ok {
		return nil, 0, fmt.Errorf("%w: %s", ErrNotFound, key)
	}
	return slices.Clone(r.value), r.rev, nil
}

func (m *memRecords) Write(ctx context.Context, bucket, key string, rev uint64, value []byte, _ bool) (uint64, error) {
	if err := m.Bucket(ctx, bucket); err != nil {
		return 0, err
	}
	if m.beforeWrite != nil {
		m.beforeWrite(bucket, key)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.buckets[bucket][key].rev != rev {
		return 0, fmt.Errorf("%w: %s is at %d, not %d", ErrRevisionMismatch, key, m.buckets[bucket][key].rev, rev)
	}
	m.rev++
	m.buckets[bucket][key] = memRecord{value: slices.Clone(value), rev: m.rev}
	return m.rev, nil
}

func (m *memRecords) Latest(ctx context.Context, bucket, keyFilter string, fn func(key string, rev uint64, value []byte)) error {
	if err := m.Bucket(ctx, bucket); err != nil {
		return err
	}
	m.mu.Lock()
	var keys []string
	for k := range m.buckets[bucket] {
		if subjectMatch(keyFilter, k) {
			keys = append(keys, k)
		}
	}
	slices.Sort(keys)
	recs := make([]memRecord, len(keys))
	for i, k := range keys {
		recs[i] = m.buckets[bucket][k]
	}
	m.mu.Unlock()
	for i, k := range keys {
		fn(k, recs[i].rev, recs[i].value)
	}
	return nil
}

// subjectMatch matches key against a subject filter's tokens ("*" one
// token, ">" the rest).
func subjectMatch(filter, key string) bool {
	f, k := strings.Split(filter, "."), strings.Split(key, ".")
	for i, t := range f {
		switch {
		case t == ">":
			return len(k) > i
		case i >= len(k):
			return false
		case t != "*" && t != k[i]:
			return false
		}
	}
	return len(f) == len(k)
}

// TestStoreWithoutBuckets: on records without the store's buckets (a bus
// whose lease service predates them) there is no pool, declaring says
// why, and nothing is written.
func TestStoreWithoutBuckets(t *testing.T) {
	ctx := context.Background()
	for _, have := range [][]string{nil, {PoolBucket}, {AttemptBucket}} {
		t.Run(fmt.Sprint(have), func(t *testing.T) {
			st, err := Open(newMemRecords(have...), Config{})
			if err != nil {
				t.Fatal(err)
			}
			if _, err := st.Pool(ctx, "github.com/acme/x"); !errors.Is(err, ErrNoPool) {
				t.Errorf("Pool: %v, want ErrNoPool", err)
			}
			if ps, err := st.Pools(ctx); err != nil || ps != nil {
				t.Errorf("Pools: %v, %v; want none", ps, err)
			}
			if _, err := st.Begin(ctx, Attempt{AttemptID: "a1", Repo: "github.com/acme/x"}); !errors.Is(err, ErrNoPool) {
				t.Errorf("Begin: %v, want ErrNoPool", err)
			}
			co := t.TempDir()
			_, err = st.Declare(ctx, Spec{Repo: "github.com/acme/x", Checkout: co, Size: 1}, nil)
			if !errors.Is(err, ErrNoBucket) || !strings.Contains(err.Error(), "fenceline bus serve") {
				t.Errorf("Declare: %v, want ErrNoBucket saying the bus's service is older", err)
			}
		})
	}
}

// TestUpdatePoolStartsOverOnAConflict: a write that lost its revision to
// another is read again and fn applied to the newer record: no update
// is lost, and fn sees the other's change.
func TestUpdatePoolStartsOverOnAConflict(t *testing.T) {
	ctx := context.Background()
	rec := newMemRecords(PoolBucket, AttemptBucket)
	st, err := Open(rec, Config{Admin: true})
	if err != nil {
		t.Fatal(err)
	}
	co := t.TempDir()
	const repo = "github.com/acme/conflict"
	if _, err := st.Declare(ctx, Spec{Repo: repo, Checkout: co, Size: 2}, nil); err != nil {
		t.Fatal(err)
	}
	other, err := Open(rec, Config{})
	if err != nil {
		t.Fatal(err)
	}
	raced := false
	rec.beforeWrite = func(bucket, key string) {
		if raced {
			return
		}
		raced = true // the other writer gets in between our read and our write, once
		if _, err := other.SetShard(ctx, repo, "shard-2", func(sh *Shard) { sh.State = StateDirty }); err != nil {
			t.Errorf("the other writer: %v", err)
		}
	}
	calls := 0
	p, err := st.SetShard(ctx, repo, "shard-1", func(sh *Shard) { calls++; sh.State = StateDirty; sh.LastAttempt = "a1" })
	if err != nil {
		t.Fatal(err)
	}
	if calls != 2 {
		t.Errorf("fn ran %d times, want 2 (once more after the conflict)", calls)
	}
	if p.Shards[0].State != StateDirty || p.Shards[0].LastAttempt != "a1" || p.Shards[1].State != StateDirty {
		t.Errorf("pool after both writes: %+v, want both shards dirty", p.Shards)
	}
	got, err := st.Pool(ctx, repo)
	if err != nil || got.Revision != p.Revision {
		t.Fatalf("Pool: %+v, %v; want revision %d", got, err, p.Revision)
	}
}

// TestBeginNeverReusesAnAttemptID: a second Begin of one attempt id is
// refused, the first record kept.
func TestBeginNeverReusesAnAttemptID(t *testing.T) {
	ctx := context.Background()
	st, err := Open(newMemRecords(PoolBucket, AttemptBucket), Config{})
	if err != nil {
		t.Fatal(err)
	}
	const repo = "github.com/acme/once"
	first, err := st.Begin(ctx, Attempt{AttemptID: "a1", Repo: repo, AgentID: "first", Command: []string{"true"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := st.Begin(ctx, Attempt{AttemptID: "a1", Repo: repo, AgentID: "second", Command: []string{"true"}}); err == nil || !strings.Contains(err.Error(), "exists already") {
		t.Fatalf("second Begin: %v, want refused as existing", err)
	}
	a, err := st.Attempt(ctx, repo, "a1")
	if err != nil || a.AgentID != "first" || a.Revision != first.Revision {
		t.Fatalf("attempt after the refusal: %+v, %v; want the first's", a, err)
	}
	if _, err := st.Attempt(ctx, repo, "a2"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("attempt never begun: %v, want ErrNotFound", err)
	}
	as, err := st.Attempts(ctx, repo)
	if err != nil || len(as) != 1 || as[0].AttemptID != "a1" {
		t.Fatalf("Attempts: %v, %v; want a1 only", as, err)
	}
	if as, err := st.Attempts(ctx, repoid.Normalize(repo)+"-other"); err != nil || len(as) != 0 {
		t.Fatalf("Attempts of another repo: %v, %v; want none", as, err)
	}
}
