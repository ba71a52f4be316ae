package leasebus

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// TestEndedLeasesAreForgottenByAge: a repo answers for a lease that ended
// (a repeated release, a late renewal, `lease get`) for endedKeep after it
// saw the end, and forgets it at its first write after that — in its
// snapshots and in the service's lease index (evicted) too — so what each
// instance keeps of a repo follows the repo's recent churn, not its
// history. Within the window the count bound still holds.
func TestEndedLeasesAreForgottenByAge(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/ended"
	cred := NewCredential()
	entryOf := func(id string, st lease.Status) *entry {
		return &entry{Lease: lease.Lease{LeaseID: id, Repo: repo, Status: st, Version: 1, TTL: lease.Duration(time.Minute)},
			SecretHash: cred.hash(), Holder: "runner"}
	}
	inSnapshot := func(s *repoState, id string) bool {
		return slices.ContainsFunc(s.snapshot().Leases, func(e *entry) bool { return e.LeaseID == id })
	}
	release := func(s *repoState, now time.Time, id string) (*entry, error) {
		return s.begin(now).release(&ReleaseRequest{LeaseID: id, Credential: cred, by: "runner"})
	}

	t0 := time.Now()
	s := newRepoState(repo)
	s.put(entryOf("a", lease.StatusActive), t0)
	s.put(entryOf("a", lease.StatusReleased), t0)

	// At the window's edge a write keeps it: a repeated release answers
	// its record, and snapshots carry it.
	edge := t0.Add(endedKeep)
	s.put(entryOf("b", lease.StatusActive), edge)
	if e, err := release(s, edge, "a"); err != nil || e.Status != lease.StatusReleased {
		t.Fatalf("a repeated release %s after the end: %v, %v; want the ended record", endedKeep, e, err)
	}
	if !inSnapshot(s, "a") || len(s.evicted) != 0 {
		t.Fatalf("within the window: in the snapshot %v, evicted %v; want kept", inSnapshot(s, "a"), s.evicted)
	}

	// Past it, the next write in the repo forgets it.
	past := edge.Add(time.Millisecond)
	s.put(entryOf("c", lease.StatusActive), past)
	if _, err := release(s, past, "a"); !errors.Is(err, lease.ErrNotFound) || !strings.Contains(err.Error(), endedKeep.String()) {
		t.Fatalf("a release past the window: %v; want not found, naming the window", err)
	}
	if inSnapshot(s, "a") || !slices.Equal(s.evicted, []string{"a"}) {
		t.Fatalf("past the window: in the snapshot %v, evicted %v; want forgotten and handed to the lease index", inSnapshot(s, "a"), s.evicted)
	}
	s.evicted = nil

	// Ended at once, more than maxEnded: the oldest go first.
	late := past.Add(time.Hour)
	for i := range maxEnded + 3 {
		s.put(entryOf(fmt.Sprintf("x%03d", i), lease.StatusExpired), late)
	}
	if len(s.ended) != maxEnded || len(s.endedFIFO) != maxEnded {
		t.Fatalf("%d ended leases kept (%d in order); want the bound %d", len(s.ended), len(s.endedFIFO), maxEnded)
	}
	if want := []string{"x000", "x001", "x002"}; !slices.Equal(s.evicted, want) {
		t.Fatalf("evicted %v; want the oldest %v", s.evicted, want)
	}
	for _, id := range []string{"b", "c"} {
		if s.leases[id] == nil {
			t.Fatalf("active lease %s went with the ended ones", id)
		}
	}
}
