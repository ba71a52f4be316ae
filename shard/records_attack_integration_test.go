//go:build integration

package shard

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestShardRecordsOnlyTheServiceWrites (issue 28): shard records are
// written by the lease service alone. A holder publishing a rewritten pool
// record straight to the bucket is refused by NATS and the record stays
// as it was; a holder asking the service to change a shard another
// identity's lease occupies, or another identity's attempt, is refused
// (ErrNotOwner) and audited; the holder that holds the shard's lease still
// changes it.
func TestShardRecordsOnlyTheServiceWrites(t *testing.T) {
	t.Parallel()
	b, _, co, _ := poolFixture(t, 3, 2, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	key := leasebus.RepoKey(co)

	// The victim: an operator's lease in shard-1, with an attempt of its own.
	victim := openStore(t, b)
	vcred := leasebus.NewCredential()
	vl, err := b.Operator.Acquire(ctx, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive,
		Owner: lease.Owner{TaskID: "t", AgentID: "victim", AttemptID: "att_victim"}, TTL: lease.Duration(time.Minute)}, vcred)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := victim.Begin(ctx, Attempt{AttemptID: "att_victim", Repo: co, TaskID: "t", AgentID: "victim", Command: []string{"true"}, Shard: "shard-1", Mode: ModeExclusive, Leases: []string{vl.LeaseID}}); err != nil {
		t.Fatal(err)
	}
	before, err := victim.Pool(ctx, co)
	if err != nil {
		t.Fatal(err)
	}

	// 1. Straight to the bucket, as a holder: NATS refuses the publish.
	hnc := b.ConnectAs(t, leasebus.RoleHolder)
	js, err := leasebus.JetStream(context.Background(), hnc)
	if err != nil {
		t.Fatal(err)
	}
	kv, err := js.KeyValue(ctx, PoolBucket)
	if err != nil {
		t.Fatal(err)
	}
	rewritten := *before
	rewritten.Shards = append([]Shard(nil), before.Shards...)
	rewritten.Shards[0].State, rewritten.Shards[0].Running = StateClean, nil
	data, err := json.Marshal(rewritten)
	if err != nil {
		t.Fatal(err)
	}
	pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
	_, err = kv.Put(pctx, key, data)
	pcancel()
	if err == nil {
		t.Fatal("a holder's direct write of the pool record landed")
	}
	t.Logf("direct write refused: %v", err)
	if p, err := victim.Pool(ctx, co); err != nil || p.Revision != before.Revision {
		t.Fatalf("pool record after the direct write: %+v, %v; want revision %d unchanged", p, err, before.Revision)
	}

	// 2. Through the service, as a holder that holds no lease in shard-1.
	attacker, err := Open(leasebus.NewShardRecords(hnc), Config{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = attacker.SetShard(ctx, co, "shard-1", func(sh *Shard) { sh.State, sh.Running = StateClean, nil })
	if !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("a holder changing a shard another identity's lease occupies: %v, want %v", err, lease.ErrNotOwner)
	}
	_, err = attacker.UpdateAttempt(ctx, co, "att_victim", func(a *Attempt) bool { a.Status = StatusSucceeded; return true })
	if !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("a holder settling another identity's attempt: %v, want %v", err, lease.ErrNotOwner)
	}
	_, err = attacker.UpdatePool(ctx, co, false, func(p *Pool) error { p.MaxSharers = 9; return nil })
	if !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("a holder changing a pool's shape: %v, want %v", err, lease.ErrNotOwner)
	}
	if p, err := victim.Pool(ctx, co); err != nil || p.Revision != before.Revision {
		t.Fatalf("pool record after the refused writes: %+v, %v; want revision %d unchanged", p, err, before.Revision)
	}
	if a, err := victim.Attempt(ctx, co, "att_victim"); err != nil || a.Status != StatusRunning {
		t.Fatalf("victim's attempt: %+v, %v", a, err)
	}
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.Conn, co, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Boundary == BoundaryShard && ev.RequestedBy == "holder" {
				n++
			}
		}
		if n < 3 {
			return fmt.Errorf("%d refused shard events by the holder, want 3", n)
		}
		return nil
	})

	// 3. The holder of shard-2's lease changes shard-2.
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-2", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	holderStore, err := Open(leasebus.NewShardRecords(b.Client.Conn()), Config{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := holderStore.SetShard(ctx, co, "shard-2", func(sh *Shard) { sh.State = StateDirty; sh.LastAttempt = "att_2" }); err != nil {
		t.Fatalf("the lease's holder changing its own shard: %v", err)
	}
	_ = l
}

// TestAttemptIsItsLeasesToRecord: a runner records its attempt after its
// lease is granted, and the grant, owner and attempt id included, is heard
// by every holder. Another runner that recorded that attempt first owned
// its record (failing the run, and writing its status); one that took a
// lease of its own naming the same attempt after it heard the grant did
// too. Both are refused by name and audited; the lease's holder records
// its attempt.
func TestAttemptIsItsLeasesToRecord(t *testing.T) {
	t.Parallel()
	b, attacker, co, _ := poolFixture(t, 3, 3, 0)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	vnc := b.ConnectAs(t, leasebus.RoleOperator)
	victim, err := Open(leasebus.NewShardRecords(vnc), Config{}) // not as an operator: as the runner it stands for
	if err != nil {
		t.Fatal(err)
	}
	aid := lease.NewAttemptID()
	vcred := leasebus.NewCredential()
	vl, err := leasebus.NewClient(vnc).Acquire(ctx, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive,
		Owner: lease.Owner{TaskID: "t", AgentID: "victim", AttemptID: aid}, TTL: lease.Duration(time.Minute)}, vcred)
	if err != nil {
		t.Fatal(err)
	}
	grab := Attempt{AttemptID: aid, Repo: co, TaskID: "t", AgentID: "thief", Command: []string{"true"}, Shard: "shard-1", Mode: ModeExclusive, Leases: []string{vl.LeaseID}}
	if _, err := attacker.Begin(ctx, grab); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("another identity recording the victim's attempt first: %v, want %v", err, lease.ErrNotOwner)
	}
	// A lease of its own naming the victim's attempt, taken after the grant.
	al := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-2", WorkspaceMode: lease.WorkspaceExclusive,
		Owner: lease.Owner{TaskID: "t", AgentID: "thief", AttemptID: aid}, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	grab.Shard, grab.Leases = "shard-2", []string{al.Lease().LeaseID}
	if _, err := attacker.Begin(ctx, grab); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("another identity recording the victim's attempt under a later lease of its own naming it: %v, want %v", err, lease.ErrNotOwner)
	}
	a, err := victim.Begin(ctx, Attempt{AttemptID: aid, Repo: co, TaskID: "t", AgentID: "victim", Command: []string{"true"}, Shard: "shard-1", Mode: ModeExclusive, Leases: []string{vl.LeaseID}})
	if err != nil {
		t.Fatalf("the lease's holder recording its attempt: %v", err)
	}
	if a.AgentID != "victim" {
		t.Fatalf("the attempt's record: %+v", a)
	}
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.Conn, co, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Boundary == BoundaryShard && ev.Reason == leasebus.ReasonNotItsAttempt && ev.RequestedBy == "holder" {
				n++
			}
		}
		if n < 2 {
			return fmt.Errorf("%d refused attempt records by the holder audited, want 2", n)
		}
		return nil
	})
}
