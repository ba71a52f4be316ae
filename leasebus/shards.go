package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/time/rate"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/shard/record"
)

// Shard records — a repo's pool of shards and its attempts (package
// shard) — are written by the lease service alone: no role may publish on
// the buckets' subjects. A runner asks the service to write one record
// (op "shard"), a compare-and-swap on the revision it read, and the
// service checks the record (record.ValidPool, record.ValidAttempt, the
// same checks every reader makes), bounds it, and checks that the asker
// may change it:
//
//   - a pool's shape (repo, checkout, directory, size, sharers) is an
//     operator's: only op "shardadmin", which the bus lets only operators
//     publish, declares or changes it;
//   - a shard's state (clean or dirty, base, running attempts) belongs to
//     whoever holds a lease in that shard: a holder changes a shard only
//     while a lease its own identity acquired is placed there (the
//     shard's workspace or its commit capacity), or marks it dirty and
//     takes settled attempts off it (a recovery: safe for anyone, and what
//     the service can confirm from the attempts' records);
//   - an attempt is its writer's (record.Attempt.By, which the service
//     sets): another identity changes it only to mark it unknown once
//     every lease it names has ended, which the service confirms.
//
// Why these: identities are per run, so a pool cannot belong to a runner;
// a lease is what the service knows a runner holds, and it is what a
// placement already requires. Refusals are audited (type refused,
// boundary shard, the identity in RequestedBy). The service writes each
// record stamped with its writer header, re-encoded from what it checked.

// Buckets of the shard store (shard.PoolBucket, shard.AttemptBucket).
const (
	ShardPoolBucket    = record.PoolBucket
	ShardAttemptBucket = record.AttemptBucket
)

// Ops of shard writes: a runner's, bound to its leases and attempts, and
// an operator's (declaring pools; bound to nothing).
const (
	opShard      = "shard"
	opShardAdmin = "shardadmin"
)

// maxShardRequest bounds a shard write's request; a larger one is refused
// before it is decoded.
const maxShardRequest = shardMaxValue + 4<<10

// shardCreateRate and shardCreateBurst bound how many attempt records one
// identity creates (per second, and at once): the attempt bucket drops
// its oldest past shardMaxAttempts, so a flood would evict others'.
const (
	shardCreateRate  = 50
	shardCreateBurst = 500
)

// Reasons of shard write refusals.
const (
	ReasonNotItsShard   = "not-its-shard"   // a shard no lease of the asker's identity occupies
	ReasonNotItsAttempt = "not-its-attempt" // another identity's attempt
	ReasonPoolShape     = "pool-shape"      // a pool's shape, which only operators change
)

// ShardWrite asks the lease service to write one shard record.
type ShardWrite struct {
	// Bucket is ShardPoolBucket or ShardAttemptBucket.
	Bucket string `json:"bucket"`
	Key    string `json:"key"`
	// Revision is the record's revision the write replaces (0: the key
	// must have no record): a compare-and-swap.
	Revision uint64          `json:"revision"`
	Value    json.RawMessage `json:"value"`
}

// WriteShard asks the lease service to write one shard record and returns
// its new revision. A revision that is no longer the record's is
// jetstream.ErrKeyRevisionMismatch (read again and retry); a write the
// asker may not make is ErrNotOwner; a record that is not one fenceline
// writes is ErrInvalid. admin asks as an operator (op shardadmin: only
// operators may publish it), which declaring a pool needs.
func (c *Client) WriteShard(ctx context.Context, w ShardWrite, admin bool) (uint64, error) {
	op := opShard
	if admin {
		op = opShardAdmin
	}
	r, err := c.request(ctx, op, w, 0)
	if err != nil {
		return 0, fmt.Errorf("write %s record %s: %w", strings.ToLower(strings.TrimPrefix(w.Bucket, "FENCELINE_")), w.Key, err)
	}
	if r.Error != nil {
		return 0, r.Error.err()
	}
	return r.Revision, nil
}

// shardStore is the service's side of the shard buckets.
type shardStore struct {
	mu      sync.Mutex
	kvs     map[string]jetstream.KeyValue // by bucket; guarded by mu
	creates map[string]*rate.Limiter      // by identity; guarded by mu
}

func (s *Service) shardKV(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	s.shards.mu.Lock()
	defer s.shards.mu.Unlock()
	if kv := s.shards.kvs[bucket]; kv != nil {
		return kv, nil
	}
	kv, err := s.js.KeyValue(ctx, bucket)
	if err != nil {
		return nil, fmt.Errorf("%w: shard bucket %s: %v", lease.ErrUnavailable, bucket, err)
	}
	if s.shards.kvs == nil {
		s.shards.kvs = map[string]jetstream.KeyValue{}
	}
	s.shards.kvs[bucket] = kv
	return kv, nil
}

func (s *Service) allowCreate(id string) bool {
	s.shards.mu.Lock()
	defer s.shards.mu.Unlock()
	if s.shards.creates == nil {
		s.shards.creates = map[string]*rate.Limiter{}
	}
	l := s.shards.creates[id]
	if l == nil {
		l = rate.NewLimiter(shardCreateRate, shardCreateBurst)
		s.shards.creates[id] = l
	}
	return l.Allow()
}

// shardRefusal is a write the asker may not make: its reason and repo.
type shardRefusal struct {
	reason, repo, msg string
}

func (e *shardRefusal) Error() string { return e.msg }
func (e *shardRefusal) Unwrap() error { return lease.ErrNotOwner }

func refuseShard(reason, repo, format string, args ...any) error {
	return &shardRefusal{reason: reason, repo: repo, msg: fmt.Sprintf(format, args...)}
}

// writeShard checks and writes w for identity id (admin: an operator's).
func (s *Service) writeShard(ctx context.Context, id string, admin bool, w ShardWrite) reply {
	rev, err := s.checkAndWriteShard(ctx, id, admin, w)
	var ref *shardRefusal
	if errors.As(err, &ref) {
		s.auditShardRefusal(id, ref)
	}
	if err != nil {
		return reply{Error: toWire(err)}
	}
	return reply{Revision: rev}
}

func (s *Service) checkAndWriteShard(ctx context.Context, id string, admin bool, w ShardWrite) (uint64, error) {
	if len(w.Value) > shardMaxValue {
		return 0, fmt.Errorf("%w: a shard record of %d bytes: at most %d", lease.ErrInvalid, len(w.Value), shardMaxValue)
	}
	if w.Bucket != ShardPoolBucket && w.Bucket != ShardAttemptBucket {
		return 0, fmt.Errorf("%w: bucket %q is not a shard bucket (want %s or %s)", lease.ErrInvalid, w.Bucket, ShardPoolBucket, ShardAttemptBucket)
	}
	kv, err := s.shardKV(ctx, w.Bucket)
	if err != nil {
		return 0, err
	}
	var old []byte
	if w.Revision > 0 {
		e, err := kv.GetRevision(ctx, w.Key, w.Revision)
		switch {
		case errors.Is(err, jetstream.ErrKeyNotFound):
			return 0, fmt.Errorf("%w: %s has no record at revision %d any more", jetstream.ErrKeyRevisionMismatch, w.Key, w.Revision)
		case err != nil:
			return 0, fmt.Errorf("%w: read shard record %s: %v", lease.ErrUnavailable, w.Key, err)
		}
		old = e.Value()
	}
	var data []byte
	if w.Bucket == ShardPoolBucket {
		data, err = s.checkPool(ctx, id, admin, w, old)
	} else {
		data, err = s.checkAttempt(ctx, kv, id, admin, w, old)
	}
	if err != nil {
		return 0, err
	}
	msg := nats.NewMsg("$KV." + w.Bucket + "." + w.Key)
	msg.Header.Set(writerHeader, s.store.writer)
	msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, strconv.FormatUint(w.Revision, 10))
	msg.Data = data
	ack, err := s.js.PublishMsg(ctx, msg)
	switch {
	case err != nil && isCASMismatch(err):
		return 0, fmt.Errorf("%w: %s changed since revision %d", jetstream.ErrKeyRevisionMismatch, w.Key, w.Revision)
	case err != nil:
		return 0, fmt.Errorf("%w: write shard record %s: %w", lease.ErrUnavailable, w.Key, streamFull("KV_"+w.Bucket, err))
	}
	return ack.Sequence, nil
}

// decodeOld decodes the record a write replaces; one that is not valid
// (written before the service checked, or damaged) counts as none.
func decodeOld[T any](old []byte, valid func(*T) error) *T {
	if old == nil {
		return nil
	}
	v := new(T)
	if json.Unmarshal(old, v) != nil || valid(v) != nil {
		return nil
	}
	return v
}

func (s *Service) checkPool(ctx context.Context, id string, admin bool, w ShardWrite, old []byte) ([]byte, error) {
	var p record.Pool
	if err := json.Unmarshal(w.Value, &p); err != nil {
		return nil, fmt.Errorf("%w: decode pool record %s: %v", lease.ErrInvalid, w.Key, err)
	}
	if err := record.ValidPool(&p, w.Key); err != nil {
		return nil, fmt.Errorf("%w: %w", lease.ErrInvalid, err)
	}
	if admin {
		return json.Marshal(&p)
	}
	prev := decodeOld(old, func(o *record.Pool) error { return record.ValidPool(o, w.Key) })
	if prev == nil {
		return nil, refuseShard(ReasonPoolShape, p.Repo, "declaring the pool of %s is an operator's (fenceline shard pool): %s may change only the state of shards its leases occupy", p.Repo, s.name(id))
	}
	if prev.Checkout != p.Checkout || prev.Dir != p.Dir || prev.Size != p.Size || prev.MaxSharers != p.MaxSharers {
		return nil, refuseShard(ReasonPoolShape, p.Repo, "the pool of %s (checkout %s, dir %s, %d shards, %d sharers) is an operator's to change: %s asked for checkout %s, dir %s, %d shards, %d sharers",
			p.Repo, prev.Checkout, prev.Dir, prev.Size, prev.MaxSharers, s.name(id), p.Checkout, p.Dir, p.Size, p.MaxSharers)
	}
	var mine []*lease.Lease // the asker's active leases of the repo, read once
	read := false
	for i := range p.Shards {
		was, is := &prev.Shards[i], &p.Shards[i]
		if shardEqual(was, is) {
			continue
		}
		if !read {
			var err error
			if mine, err = s.leasesOf(ctx, p.Repo, id); err != nil {
				return nil, err
			}
			read = true
		}
		if slices.ContainsFunc(mine, func(l *lease.Lease) bool {
			return l.WorkspaceID == is.ID || strings.HasPrefix(l.WorkspaceID, is.ID+"/")
		}) {
			continue
		}
		ok, err := s.recovery(ctx, p.Repo, was, is)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, refuseShard(ReasonNotItsShard, p.Repo, "%s of the pool of %s: %s holds no lease there (only the holder of a lease in a shard changes it; anyone may mark it dirty and take settled attempts off it)", is.ID, p.Repo, s.name(id))
		}
	}
	return json.Marshal(&p)
}

func shardEqual(a, b *record.Shard) bool {
	return a.State == b.State && a.Base == b.Base && a.CleanedAt.Equal(b.CleanedAt) && a.LastAttempt == b.LastAttempt && slices.Equal(a.Running, b.Running)
}

// recovery reports whether is differs from was only as a recovery does:
// marked dirty, and attempts that are not running (settled, unknown, or
// gone) taken off its running list.
func (s *Service) recovery(ctx context.Context, repo string, was, is *record.Shard) (bool, error) {
	if (is.State != was.State && is.State != record.StateDirty) || is.Base != was.Base || !is.CleanedAt.Equal(was.CleanedAt) || is.LastAttempt != was.LastAttempt {
		return false, nil
	}
	kv, err := s.shardKV(ctx, ShardAttemptBucket)
	if err != nil {
		return false, err
	}
	for _, aid := range is.Running {
		if !slices.Contains(was.Running, aid) {
			return false, nil // added
		}
	}
	for _, aid := range was.Running {
		if slices.Contains(is.Running, aid) {
			continue
		}
		key := record.AttemptKey(repo, aid)
		e, err := kv.Get(ctx, key)
		if errors.Is(err, jetstream.ErrKeyNotFound) {
			continue
		}
		if err != nil {
			return false, fmt.Errorf("%w: read attempt %s: %v", lease.ErrUnavailable, aid, err)
		}
		a := decodeOld(e.Value(), func(a *record.Attempt) error { return record.ValidAttempt(a, key) })
		if a != nil && a.Status == record.StatusRunning {
			return false, nil
		}
	}
	return true, nil
}

func (s *Service) checkAttempt(ctx context.Context, kv jetstream.KeyValue, id string, admin bool, w ShardWrite, old []byte) ([]byte, error) {
	var a record.Attempt
	if err := json.Unmarshal(w.Value, &a); err != nil {
		return nil, fmt.Errorf("%w: decode attempt record %s: %v", lease.ErrInvalid, w.Key, err)
	}
	if err := record.ValidAttempt(&a, w.Key); err != nil {
		return nil, fmt.Errorf("%w: %w", lease.ErrInvalid, err)
	}
	prev := decodeOld(old, func(o *record.Attempt) error { return record.ValidAttempt(o, w.Key) })
	switch {
	case prev == nil && old != nil && !admin:
		return nil, refuseShard(ReasonNotItsAttempt, a.Repo, "attempt %s of %s: its record is not one fenceline writes; only an operator replaces it", a.AttemptID, a.Repo)
	case prev == nil:
		if !s.allowCreate(id) {
			return nil, fmt.Errorf("%w: %s creates attempt records faster than %d a second (bursts of %d)", lease.ErrUnavailable, s.name(id), shardCreateRate, shardCreateBurst)
		}
		if !admin {
			if err := s.attemptNotOthers(ctx, id, &a); err != nil {
				return nil, err
			}
		}
		a.By = id
	case admin || prev.By == id:
		a.By = prev.By
	default:
		ok, err := s.recovers(ctx, prev, &a)
		if err != nil {
			return nil, err
		}
		if !ok {
			return nil, refuseShard(ReasonNotItsAttempt, a.Repo, "attempt %s of %s is %s's (owner %s/%s): %s may only mark it unknown once every lease it names has ended", a.AttemptID, a.Repo, s.name(prev.By), prev.TaskID, prev.AgentID, s.name(id))
		}
		a.By = prev.By
	}
	return json.Marshal(&a)
}

// attemptNotOthers refuses identity id's creation of attempt record a when
// the first granted of the active leases whose owner names a's attempt is
// another identity's: that attempt is the other's to record. A lease's
// owner is public (every holder hears the grants) and self-declared, and
// a runner records its attempt only after its lease is granted, with an
// attempt id nobody knew before: without this another runner could
// record it first and own the record, failing the other's run and
// writing its status (an attacker's review found it); and a lease of its
// own naming that attempt, taken after it saw the grant, is not the
// first.
func (s *Service) attemptNotOthers(ctx context.Context, id string, a *record.Attempt) error {
	all, err := s.leasesOf(ctx, a.Repo, "")
	if err != nil {
		return err
	}
	var first *lease.Lease
	for _, l := range all {
		if l.Owner.AttemptID == a.AttemptID && (first == nil || l.Fence < first.Fence) { // a repo's fences rise with every grant; clocks need not
			first = l
		}
	}
	if first == nil {
		return nil
	}
	own, err := s.leasesOf(ctx, a.Repo, id)
	if err != nil {
		return err
	}
	if slices.ContainsFunc(own, func(l *lease.Lease) bool { return l.LeaseID == first.LeaseID }) {
		return nil
	}
	return refuseShard(ReasonNotItsAttempt, a.Repo, "attempt %s of %s: %s may not record it: it is the attempt of another identity's lease %s (owner %s, fence %d), granted first of those that name it",
		a.AttemptID, a.Repo, s.name(id), first.LeaseID, first.Owner, first.Fence)
}

// recovers reports whether is is was marked unknown (its note aside) and
// every lease was names has ended.
func (s *Service) recovers(ctx context.Context, was, is *record.Attempt) (bool, error) {
	if was.Status != record.StatusRunning || is.Status != record.StatusUnknown || len(was.Leases) == 0 {
		return false, nil
	}
	x, y := *was, *is
	x.Status, x.Note, x.By, x.Revision = y.Status, y.Note, y.By, y.Revision
	xb, _ := json.Marshal(&x)
	yb, _ := json.Marshal(&y)
	if string(xb) != string(yb) {
		return false, nil
	}
	active, err := s.leasesOf(ctx, was.Repo, "")
	if err != nil {
		return false, err
	}
	for _, l := range active {
		if slices.Contains(was.Leases, l.LeaseID) {
			return false, nil
		}
	}
	return true, nil
}

// leasesOf returns the active leases of repo that identity holder
// acquired (every active lease when holder is empty), from a fresh read
// of the repo's log.
func (s *Service) leasesOf(ctx context.Context, repo, holder string) ([]*lease.Lease, error) {
	a, err := s.actorIfLogged(ctx, repo)
	if err != nil || a == nil {
		return nil, err
	}
	r := a.ask(ctx, &call{op: "list", req: &listRequest{Repo: repo, holder: holder}})
	if r.Error != nil {
		return nil, r.Error.err()
	}
	return r.Leases, nil
}

// auditShardRefusal writes a refused shard write to the events stream
// (boundary shard, in the asker's name), within the asker's rate of
// boundary events.
func (s *Service) auditShardRefusal(id string, r *shardRefusal) {
	if !s.boundary.allow(id, r.repo, "") {
		return
	}
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: lease.EventRefused, Boundary: boundaryShard, Repo: r.repo, Reason: r.reason,
		RequestedBy: s.name(id), Message: clip("shard record write refused: "+r.msg, maxEventMessage)}
	if err := s.writeEvent(s.ctx, eventsSubjectFor(r.repo, boundaryShard, id), ev); err != nil {
		s.log.Warn("audit event of a refused shard write not written", "repo", r.repo, "requested_by", ev.RequestedBy, "err", err)
	}
}
