package leasebus

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/shard/record"
)

// ShardRecords is the shard store's records on the bus (shard.Records):
// the two KV buckets the lease service makes when it starts, read
// directly (through JetStream, which reaches them from either account)
// and written only through the lease service (Client.WriteShard), which
// checks each write. It returns the errors of package record
// (ErrNotFound, ErrRevisionMismatch, ErrNoBucket), each wrapping the
// bus's own. Safe for concurrent use.
type ShardRecords struct {
	js lazyJetStream
	c  *Client

	mu      sync.Mutex
	buckets map[string]jetstream.KeyValue // guarded by mu; bound once, never unbound
}

// NewShardRecords returns the shard records on nc's bus. It reaches
// nothing yet: the first read learns where JetStream is (JetStream).
func NewShardRecords(nc *nats.Conn) *ShardRecords {
	return &ShardRecords{js: lazyJetStream{nc: nc, what: "shard records"}, c: NewClient(nc), buckets: map[string]jetstream.KeyValue{}}
}

// lazyJetStream is the JetStream handle of nc's account (JetStream),
// learnt by the first call that needs it; a failed probe is tried again.
type lazyJetStream struct {
	nc   *nats.Conn
	what string // who asks, for errors

	mu sync.Mutex
	js jetstream.JetStream // guarded by mu
}

func (l *lazyJetStream) get(ctx context.Context) (jetstream.JetStream, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.js == nil {
		// Not the caller's deadline: the probe takes a timeout for an
		// import that does not answer yet (jsAPI), so a caller's deadline
		// passing mid-probe would be learnt, for good, as the fleet's API.
		js, err := JetStream(context.WithoutCancel(ctx), l.nc)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", l.what, err)
		}
		l.js = js
	}
	return l.js, nil
}

// Bucket binds bucket: record.ErrNoBucket when the bus has none.
func (r *ShardRecords) Bucket(ctx context.Context, bucket string) error {
	_, err := r.kv(ctx, bucket)
	return err
}

func (r *ShardRecords) kv(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	js, err := r.js.get(ctx)
	if err != nil {
		return nil, err
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if kv := r.buckets[bucket]; kv != nil {
		return kv, nil
	}
	kv, err := js.KeyValue(ctx, bucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		return nil, fmt.Errorf("%w %s: %w", record.ErrNoBucket, bucket, err)
	}
	if err != nil {
		return nil, err
	}
	r.buckets[bucket] = kv
	return kv, nil
}

// Get reads key's record in bucket and its revision: record.ErrNotFound
// when it has none.
func (r *ShardRecords) Get(ctx context.Context, bucket, key string) ([]byte, uint64, error) {
	kv, err := r.kv(ctx, bucket)
	if err != nil {
		return nil, 0, err
	}
	e, err := kv.Get(ctx, key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return nil, 0, fmt.Errorf("%w: %w", record.ErrNotFound, err)
	}
	if err != nil {
		return nil, 0, err
	}
	return e.Value(), e.Revision(), nil
}

// Write asks the lease service to write key's record in bucket over
// revision rev (0: the key must have none), as an operator when admin
// (Client.WriteShard), and returns the new revision. A revision that is
// no longer the record's is record.ErrRevisionMismatch.
func (r *ShardRecords) Write(ctx context.Context, bucket, key string, rev uint64, value []byte, admin bool) (uint64, error) {
	nrev, err := r.c.WriteShard(ctx, ShardWrite{Bucket: bucket, Key: key, Revision: rev, Value: value}, admin)
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return 0, fmt.Errorf("%w: %w", record.ErrRevisionMismatch, err)
	}
	return nrev, err
}

// Latest calls fn with the newest record of each key of bucket under
// keyFilter (a subject filter of keys: "*", "<repoKey>.*"), in key order,
// deleted and purged keys left out. It reads them with one ephemeral pull
// consumer: a KV watch or key listing is a push consumer, whose
// deliveries the bus's fleet account cannot receive (the streams are in
// the service account, accounts.go).
func (r *ShardRecords) Latest(ctx context.Context, bucket, keyFilter string, fn func(key string, rev uint64, value []byte)) error {
	js, err := r.js.get(ctx)
	if err != nil {
		return err
	}
	stream, err := js.Stream(ctx, "KV_"+bucket)
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return fmt.Errorf("%w %s: %w", record.ErrNoBucket, bucket, err)
	}
	if err != nil {
		return err
	}
	prefix := "$KV." + bucket + "."
	cons, err := stream.CreateConsumer(ctx, jetstream.ConsumerConfig{
		FilterSubject:     prefix + keyFilter,
		DeliverPolicy:     jetstream.DeliverLastPerSubjectPolicy,
		AckPolicy:         jetstream.AckNonePolicy,
		MemoryStorage:     true,
		InactiveThreshold: time.Minute, // gone by itself if this process dies before deleting it
	})
	if err != nil {
		return err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = stream.DeleteConsumer(dctx, cons.CachedInfo().Name)
	}()
	for pending := cons.CachedInfo().NumPending; pending > 0; {
		batch, err := cons.Fetch(int(min(pending, 256)), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return err
		}
		got := 0
		for m := range batch.Messages() {
			got++
			md, err := m.Metadata()
			if err != nil {
				return err
			}
			pending = md.NumPending
			switch m.Headers().Get(kvOperation) {
			case "DEL", "PURGE":
				continue
			}
			fn(strings.TrimPrefix(m.Subject(), prefix), md.Sequence.Stream, m.Data())
		}
		if err := batch.Error(); err != nil {
			return err
		}
		if got == 0 {
			return fmt.Errorf("bucket %s: %d records pending, none delivered within 5s", bucket, pending)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
	return nil
}

// kvOperation is the header a KV delete or purge marker carries.
const kvOperation = "KV-Operation"
