package leasebus

import (
	"encoding/json"
	"errors"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/shard/record"
)

// TestShardRecords checks the bus's shard records (what shard.Records
// promises) on a real bus, as an operator in the fleet account: reads
// reach the service account's buckets, writes go through the service,
// and each of the store's errors comes as package record's sentinel
// wrapping the bus's own.
func TestShardRecords(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	r := NewShardRecords(connectAs(t, b.srv.ClientURL(), RoleOperator))

	for _, bucket := range []string{ShardPoolBucket, ShardAttemptBucket} {
		if err := r.Bucket(ctx, bucket); err != nil {
			t.Fatalf("bucket %s: %v", bucket, err)
		}
	}
	// The service account reaches every stream: a bucket nobody made is
	// the store's ErrNoBucket there.
	if err := NewShardRecords(b.nc).Bucket(ctx, "FENCELINE_NO_SUCH_BUCKET"); !errors.Is(err, record.ErrNoBucket) || !errors.Is(err, jetstream.ErrBucketNotFound) {
		t.Fatalf("missing bucket: %v, want record.ErrNoBucket wrapping jetstream.ErrBucketNotFound", err)
	}

	const repo = "github.com/acme/records"
	key := record.PoolKey(repo)
	if _, _, err := r.Get(ctx, ShardPoolBucket, key); !errors.Is(err, record.ErrNotFound) || !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("get of a missing key: %v, want record.ErrNotFound wrapping jetstream.ErrKeyNotFound", err)
	}
	pool := func(state record.State) []byte {
		t.Helper()
		p := record.Pool{Repo: repo, Checkout: "/src/records", Dir: "/src/records.shards", Size: 1,
			Shards: []record.Shard{{ID: record.ShardID(1), Path: "/src/records.shards/shard-1", Branch: record.BranchOf("shard-1"), State: state}}}
		v, err := json.Marshal(&p)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}

	rev1, err := r.Write(ctx, ShardPoolBucket, key, 0, pool(record.StateAbsent), true)
	if err != nil {
		t.Fatalf("declare: %v", err)
	}
	if _, err := r.Write(ctx, ShardPoolBucket, key, 0, pool(record.StateAbsent), true); !errors.Is(err, record.ErrRevisionMismatch) || !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		t.Fatalf("second create: %v, want record.ErrRevisionMismatch wrapping jetstream.ErrKeyRevisionMismatch", err)
	}
	rev2, err := r.Write(ctx, ShardPoolBucket, key, rev1, pool(record.StateDirty), true)
	if err != nil || rev2 <= rev1 {
		t.Fatalf("update over revision %d: revision %d, %v; want a later revision", rev1, rev2, err)
	}
	if _, err := r.Write(ctx, ShardPoolBucket, key, rev1, pool(record.StateClean), true); !errors.Is(err, record.ErrRevisionMismatch) {
		t.Fatalf("update over the stale revision %d: %v, want record.ErrRevisionMismatch", rev1, err)
	}

	v, rev, err := r.Get(ctx, ShardPoolBucket, key)
	if err != nil || rev != rev2 || string(v) != string(pool(record.StateDirty)) {
		t.Fatalf("get: %s at %d, %v; want the dirty pool at %d", v, rev, err, rev2)
	}
	type got struct {
		key string
		rev uint64
	}
	var listed []got
	if err := r.Latest(ctx, ShardPoolBucket, "*", func(k string, rev uint64, _ []byte) { listed = append(listed, got{k, rev}) }); err != nil {
		t.Fatalf("latest: %v", err)
	}
	if len(listed) != 1 || listed[0] != (got{key, rev2}) {
		t.Fatalf("latest listed %v, want only %s at %d", listed, key, rev2)
	}
	listed = nil
	if err := r.Latest(ctx, ShardAttemptBucket, key+".*", func(k string, rev uint64, _ []byte) { listed = append(listed, got{k, rev}) }); err != nil || len(listed) != 0 {
		t.Fatalf("latest of no attempts: %v, %v; want none", listed, err)
	}
	if err := NewShardRecords(b.nc).Latest(ctx, "FENCELINE_NO_SUCH_BUCKET", "*", func(string, uint64, []byte) {}); !errors.Is(err, record.ErrNoBucket) {
		t.Fatalf("latest of a missing bucket: %v, want record.ErrNoBucket", err)
	}
}
