package shard

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestRewrittenPoolRecordSendsNoRunnerElsewhere (issue 28.3): another
// runner's holder credential rewrites the pool record on the bus so that a
// shard lies in a directory of its choosing — a victim holding files — by
// every route a record offers: the shard's path, the pool's directory (all
// paths consistent), another checkout, another pool's record and marker, a
// branch, a base, a size. A runner that places an attempt from such a
// record would move the victim aside, git init it, check out there and let
// its agent write. Every one is refused (ErrBadRecord) before anything is
// touched; the victim stays as it was; declaring the pool again repairs
// the record.
func TestRewrittenPoolRecordSendsNoRunnerElsewhere(t *testing.T) {
	t.Parallel()
	b, st, co, _ := poolFixture(t, 3, 2, 0)
	ctx := context.Background()
	key := leasebus.RepoKey(co)

	// Another checkout with a pool of its own: its directory has a marker.
	other := newRepo(t, 1)
	otherPool := declare(t, openStore(t, b), other, 1, 0)

	victimDir := t.TempDir()
	victim := filepath.Join(victimDir, "shard-1")
	if err := os.MkdirAll(victim, 0o755); err != nil {
		t.Fatal(err)
	}
	precious := filepath.Join(victim, "precious")
	if err := os.WriteFile(precious, []byte("keep me\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	// The rewrite: straight into the bucket (only the lease service may
	// write there, and it writes only records that pass these checks:
	// TestShardRecordsOnlyTheServiceWrites; readers check anyway).
	js, err := leasebus.JetStream(context.Background(), b.Conn)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, PoolBucket)
	if err != nil {
		t.Fatal(err)
	}
	read := func() Pool {
		e, err := kv.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		var p Pool
		if err := json.Unmarshal(e.Value(), &p); err != nil {
			t.Fatal(err)
		}
		return p
	}
	honest := read()
	moveTo := func(p *Pool, dir string) {
		p.Dir = dir
		for i := range p.Shards {
			p.Shards[i].Path = filepath.Join(dir, p.Shards[i].ID)
		}
	}
	cases := []struct {
		name    string
		rewrite func(p *Pool)
	}{
		{"shard path", func(p *Pool) { p.Shards[0].Path = victim }},
		{"pool dir", func(p *Pool) { moveTo(p, victimDir) }},
		{"another checkout", func(p *Pool) { p.Checkout = victimDir; moveTo(p, DefaultDir(victimDir)) }},
		{"another pool's dir and marker", func(p *Pool) { moveTo(p, otherPool.Dir) }},
		{"another pool's record", func(p *Pool) { *p = *otherPool }},
		{"branch", func(p *Pool) { p.Shards[0].Branch = "main" }},
		{"base", func(p *Pool) { p.Shards[0].Base = "--upload-pack=touch /tmp/x" }},
		{"size", func(p *Pool) { p.Size = 3 }},
		{"dir inside the checkout", func(p *Pool) { moveTo(p, filepath.Join(co, "src")) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := honest
			p.Shards = append([]Shard(nil), honest.Shards...)
			tc.rewrite(&p)
			b2, err := json.Marshal(p)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := kv.Put(ctx, key, b2); err != nil {
				t.Fatal(err)
			}

			// What a runner does (attempt.OpenPool, then Place).
			err = func() error {
				pool, err := st.Pool(ctx, co)
				if err != nil {
					return err
				}
				if err := pool.Owns(co); err != nil {
					return err
				}
				l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "src"), WorkspaceID: "shard-1",
					WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
				defer l.Close(ctx)
				pl, err := st.Place(ctx, pool, *l.Record, ModeExclusive, Attempt{AttemptID: lease.NewAttemptID(), AgentID: "victim", Command: []string{"true"}}, l)
				if err == nil {
					_ = pl.Settle(ctx, StatusSucceeded, 0)
				}
				return err
			}()
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("placed from the rewritten record (err %v), want it refused as %v", err, ErrBadRecord)
			}
			t.Logf("refused: %v", err)
			if b, err := os.ReadFile(precious); err != nil || string(b) != "keep me\n" {
				t.Fatalf("the victim's file: %q, %v", b, err)
			}
			if _, err := os.Stat(filepath.Join(victim, ".git")); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("the victim directory got a .git: %v", err)
			}
			ents, _ := os.ReadDir(victimDir)
			for _, e := range ents {
				if strings.Contains(e.Name(), "orphan") {
					t.Fatalf("the victim was moved aside: %s", e.Name())
				}
			}
		})
	}

	// Declaring again (on the checkout's host) replaces the record.
	declare(t, openStore(t, b), co, 2, 0)
	if p, err := st.Pool(ctx, co); err != nil || p.Owns(co) != nil || p.Dir != DefaultDir(co) {
		t.Fatalf("after declaring again: %+v, %v", p, err)
	}
}

// TestPoolRecordRewrittenDuringAnAttempt: a record rewritten (validly: a
// directory with no marker) while an attempt runs is refused when the
// attempt settles, rather than taken as the pool's new place.
func TestPoolRecordRewrittenDuringAnAttempt(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 1, 0)
	ctx := context.Background()
	if err := pool.Owns(co); err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "src"), WorkspaceID: "shard-1",
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pl, err := st.Place(ctx, pool, *l.Record, ModeExclusive, Attempt{AttemptID: lease.NewAttemptID(), AgentID: "a", Command: []string{"true"}}, l)
	if err != nil {
		t.Fatal(err)
	}
	elsewhere := t.TempDir()
	if _, err := openStore(t, b).UpdatePool(ctx, co, false, func(p *Pool) error { // an operator's
		p.Dir = elsewhere
		for i := range p.Shards {
			p.Shards[i].Path = filepath.Join(elsewhere, p.Shards[i].ID)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := pl.Settle(ctx, StatusSucceeded, 0); !errors.Is(err, ErrBadRecord) {
		t.Fatalf("settle after the record moved the pool: %v, want %v", err, ErrBadRecord)
	}
	if pl.Pool.Dir != pool.Dir {
		t.Fatalf("the placement took the rewritten pool dir %s", pl.Pool.Dir)
	}
}
