//go:build integration

package leasebus

import (
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Answers sent onto log subjects of made-up repos: the audit catch-up,
// which accounts for every log stream sequence, and a restarting service,
// which loads every log subject, would start an actor (a goroutine) for
// each. Neither does for a log that holds nothing the service wrote.
// (Since the bus has accounts only an identity of the service account can
// have them stored (replytrick_attack_test.go); it stands in here for any
// other writer, so the readers' own check stays tested.)
func TestJunkLogsStartNoActors(t *testing.T) {
	t.Parallel() // waits on TTLs and elections: runs beside the others (own servers, no shared state)
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	hasJunk := func() bool {
		b.svc.mu.Lock()
		defer b.svc.mu.Unlock()
		for i := range 10 {
			if _, ok := b.svc.actors[fmt.Sprintf("junk%d", i)]; ok {
				return true
			}
		}
		return false
	}
	attacker := connectAs(t, url, RoleService)
	for i := range 10 {
		if err := attacker.PublishRequest("$JS.API.STREAM.INFO.KV_FENCELINE_ATTEMPTS", logSubjectFor(fmt.Sprintf("junk%d", i)), nil); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	var last uint64
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		if last = logLastSeq(t, b); last < 11 {
			return fmt.Errorf("the log holds %d messages, want the grant and 10 answers", last)
		}
		return nil
	})
	// The catch-up accounts for them within two periods.
	checkFor(t, 4*auditCatchUpEvery+time.Second, 50*time.Millisecond, func() error {
		b.svc.audit.seenMu.Lock()
		floor := b.svc.audit.floor
		b.svc.audit.seenMu.Unlock()
		if floor < last {
			return fmt.Errorf("the audit catch-up accounted up to %d, want %d", floor, last)
		}
		return nil
	})
	if hasJunk() {
		t.Fatal("the audit catch-up started actors for logs of made-up repos")
	}
	b.svc.Stop()
	var err error
	if b.svc, err = StartService(ctx, b.nc, ServiceConfig{}); err != nil {
		t.Fatal(err)
	}
	if hasJunk() {
		t.Fatal("a restarted service started actors for logs of made-up repos")
	}
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "b"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
}
