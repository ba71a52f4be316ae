package leasebus

import (
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// bigClaim is a claim of n paths under dir, each of about width bytes,
// built as scope.New would (sorted, none under another).
func bigClaim(dir string, n, width int) scope.Claim {
	return padClaim(dir, n, width, "x")
}

// padClaim is bigClaim with its paths padded with pad (a byte a record
// may encode as six: '&').
func padClaim(dir string, n, width int, pad string) scope.Claim {
	pad = strings.Repeat(pad, max(width-len(dir)-8, 1))
	c := scope.Claim{Kind: scope.KindPaths, Tables: []string{}}
	for i := range n {
		c.Paths = append(c.Paths, fmt.Sprintf("%s/%s%06d", dir, pad, i))
	}
	return c
}

// TestOversizedAcquireFailsNoOtherRequest: a runner's acquire is in its
// repo's next log record (the lease, or the refusal that quotes its claim
// and the conflict), and a record too large to append failed every
// request of its batch, whoever sent it. A runner that kept sending
// acquires of a few megabytes of paths overlapping a lease made every
// batch of that repo fail — another runner's renewals included, until its
// lease was lost. Such a request is now refused as invalid before it
// reaches the repo, naming the bound, and the other runner renews on.
func TestOversizedAcquireFailsNoOtherRequest(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	cred := NewCredential()
	l, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// Each field the record carries, past its bound.
	huge := bigClaim("z", 60000, 75) // 4.5 MB: its refusal's record was over the log's 8 MB
	huge.Paths = append([]string{"a"}, huge.Paths...)
	// The largest claim taken, of bytes a record encodes as six each,
	// overlapping the victim's: its refusals are clipped.
	most := padClaim("z", 40, 140, "&")
	most.Paths = append([]string{"a"}, most.Paths...)
	if _, size := claimSize(most); size > MaxClaimBytes || size < MaxClaimBytes*3/4 {
		t.Fatalf("the largest claim is %d bytes as recorded: want within %d", size, MaxClaimBytes)
	}
	long := strings.Repeat("t", maxIDField+1)
	for what, req := range map[string]AcquireRequest{
		"a claim of 4.5 MB":           {Scope: huge},
		"a claim of too many paths":   {Scope: bigClaim("y", MaxClaimItems+1, 8)},
		"a claim of too many bytes":   {Scope: bigClaim("y", 100, MaxClaimBytes/100+10)},
		"an owner's task of 257 B":    {Scope: claim(t, "b"), Owner: lease.Owner{TaskID: long}},
		"an owner's host of 257 B":    {Scope: claim(t, "b"), Owner: lease.Owner{HostID: long}},
		"a request id of 257 B":       {Scope: claim(t, "b"), RequestID: long},
		"a workspace of 257 B":        {Scope: claim(t, "b"), WorkspaceID: long},
		"a candidate workspace 257 B": {Scope: claim(t, "b"), Workspaces: []string{long}},
	} {
		req.Repo, req.TTL = repo, lease.Duration(time.Minute)
		if req.Owner == (lease.Owner{}) {
			req.Owner = owner(2)
		}
		_, err := attacker.Acquire(ctx, req, NewCredential())
		if !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "at most") {
			t.Errorf("acquire with %s: %v, want it refused as invalid, naming the bound", what, err)
		}
	}
	// A refusal names who asked: the owner in the request is the asker's
	// word (here the victim's task), the identity is the bus's.
	if _, err := attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("a conflicting acquire: %v", err)
	}
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.svc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == "conflict" {
				if ev.RequestedBy != "attacker" {
					return fmt.Errorf("the conflict's refusal names %q as its asker, want attacker: %+v", ev.RequestedBy, ev)
				}
				return nil
			}
		}
		return errors.New("no conflict refusal audited yet")
	})
	// The attack itself, beside the victim's renewals: every one lands.
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			default:
			}
			_, _ = attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: huge, Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
			if _, err := attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: most, Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential()); !errors.Is(err, lease.ErrConflict) {
				t.Errorf("the largest claim overlapping the victim's: %v, want a conflict", err)
				return
			}
		}
	})
	version := l.Version
	for i := range 20 {
		got, err := victim.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: version})
		if err != nil {
			close(stop)
			wg.Wait()
			t.Fatalf("renewal %d beside the oversized acquires: %v", i, err)
		}
		version = got.Version
	}
	close(stop)
	wg.Wait()
}

// TestRecordBudgetSplitsBatches: a repo's batch stops taking requests once
// its log record reaches its budget (ServiceConfig.MaxRecordBytes), and
// puts the rest back for the next batch; a release that frees many
// waiters grants them over as many batches as their records take, one
// right after another. Every request is answered as if the batch had
// been one, and no record is much past the budget.
func TestRecordBudgetSplitsBatches(t *testing.T) {
	t.Parallel()
	const budget = 16 << 10
	names := []string{"holder", "r1", "r2", "r3"}
	b := startIdentityBusWith(t, ServiceConfig{MaxRecordBytes: budget}, names...)
	ctx := ctxFor(t, time.Minute)
	js, err := jetstream.New(b.svc)
	if err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	from := info.State.LastSeq
	holder := NewClient(b.holders["holder"])
	cred := NewCredential()
	whole := AcquireRequest{Repo: repo, Scope: scope.Claim{Kind: scope.KindWholeRepo, Paths: []string{}, Tables: []string{}},
		WorkspaceMode: lease.WorkspaceExclusive, Owner: owner(0), TTL: lease.Duration(time.Minute)}
	l, err := holder.Acquire(ctx, whole, cred)
	if err != nil {
		t.Fatal(err)
	}
	// 36 acquires of claims of '&'s (about 5 KB each as recorded, a sixth
	// of that raw) wait behind the whole-repo lease.
	var wg sync.WaitGroup
	errs := make(chan error, 36)
	for _, n := range names[1:] {
		c := NewClient(b.holders[n])
		for i := range 12 {
			wg.Go(func() {
				_, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: padClaim(fmt.Sprintf("%s-%d", n, i), 20, 50, "&"),
					Owner: owner(i), TTL: lease.Duration(time.Minute), Wait: lease.Duration(40 * time.Second)}, NewCredential())
				if err != nil {
					errs <- fmt.Errorf("%s's waiting acquire %d: %w", n, i, err)
				}
			})
		}
	}
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		if n := queued(b.service, repo); n < 36 {
			return fmt.Errorf("%d acquires wait", n)
		}
		return nil
	})
	released := time.Now()
	if _, err := holder.Release(ctx, l.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if took := time.Since(released); took > 20*time.Second {
		t.Errorf("the freed waiters took %s to be granted: the batches did not follow one another", took)
	}
	// And 36 more that need not wait, sent at once: batches cut short put
	// the rest back.
	for _, n := range names[1:] {
		c := NewClient(b.holders[n])
		for i := range 12 {
			wg.Go(func() {
				_, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: padClaim(fmt.Sprintf("%s-now-%d", n, i), 20, 50, "&"),
					Owner: owner(i), TTL: lease.Duration(time.Minute)}, NewCredential())
				if err != nil {
					errs <- fmt.Errorf("%s's acquire %d: %w", n, i, err)
				}
			})
		}
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	info, err = stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	records, largest := 0, 0
	for seq := from + 1; seq <= info.State.LastSeq; seq++ {
		m, err := stream.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if strings.HasPrefix(m.Subject, logSubject+".") {
			records++
			largest = max(largest, len(m.Data))
		}
	}
	// A record holds what reached the budget and one request past it (a
	// grant here is about 11 KB as recorded; counted raw, about 3 KB, and
	// the waiters' records were five grants).
	if largest > 2*budget {
		t.Errorf("the largest of %d records is %d bytes: want at most about the budget (%d) and one request", records, largest, budget)
	}
	if records < 10 {
		t.Errorf("74 grants of 5 KB claims took %d records within a budget of %d bytes: want them split", records, budget)
	}
	t.Logf("%d records, the largest %d bytes (budget %d)", records, largest, budget)
}
