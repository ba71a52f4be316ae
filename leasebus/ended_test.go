package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
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

// endedService is a lease service without a bus, enough for an actor's
// view, the lease index and a clock the test moves: a standby (an
// election, no term).
func endedService(now *time.Time) *Service {
	clock := func() time.Time { return *now }
	return &Service{cfg: ServiceConfig{Now: clock}, log: slog.New(slog.DiscardHandler),
		index: map[string]*indexed{}, actors: map[string]*actor{},
		beats: newBeater(*now, DefaultSessionGrace), prim: &primacy{term: time.Second}}
}

// TestQuietRepoForgetsItsEndedLeases: a repo that writes nothing more after
// its last lease ended forgets that lease all the same, from its view and
// from the lease index: its actor wakes for it within endedSlack of it
// falling due, with nothing else to do (a standby's warm view here, whose
// batches write nothing).
func TestQuietRepoForgetsItsEndedLeases(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/quiet"
	t0 := time.Now()
	now := t0
	s := endedService(&now)
	a := s.newActor(RepoKey(repo), repo)
	a.warm = &warmAudit{}
	x := &entry{Lease: lease.Lease{LeaseID: "x", Repo: repo, Status: lease.StatusReleased, Version: 2, TTL: lease.Duration(time.Minute)}}
	a.state.put(x, t0)
	s.indexLeases(a.key, []*entry{x})

	wake := a.wakeAt(t0)
	if due := t0.Add(endedKeep); wake.Before(due) || wake.After(due.Add(endedSlack+time.Millisecond)) {
		t.Fatalf("a repo with one ended lease and nothing else wakes at %v after its end; want between %v and %v", wake.Sub(t0), endedKeep, endedKeep+endedSlack)
	}
	now = wake
	a.process(context.Background(), nil) // what the timer's batch runs
	if a.state.ended["x"] != nil || s.index["x"] != nil {
		t.Fatalf("%v after its end the quiet repo still holds the ended lease (in its view %v, indexed %v)", wake.Sub(t0), a.state.ended["x"] != nil, s.index["x"] != nil)
	}
	if a.wakeAt(now).Before(now.Add(time.Hour - time.Millisecond)) {
		t.Fatalf("nothing left to forget, yet the actor wakes at %v", a.wakeAt(now).Sub(now))
	}
}

// TestBrokenViewHandedOverVouchesForNothing: a standby whose view missed a
// record reads the log afresh when it takes over. Until then the old view
// must not answer for any lease through the lease index (cached gets and
// keepalives answer from it): it may hold as active a lease the primary
// has since ended — and, past endedKeep, forgotten, so that the fresh read
// would never correct it.
func TestBrokenViewHandedOverVouchesForNothing(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/broken"
	now := time.Now()
	s := endedService(&now)
	a := s.newActor(RepoKey(repo), repo)
	stale := &entry{Lease: lease.Lease{LeaseID: "x", Repo: repo, Status: lease.StatusActive, Version: 1, TTL: lease.Duration(time.Hour)}}
	ended := &entry{Lease: lease.Lease{LeaseID: "y", Repo: repo, Status: lease.StatusReleased, Version: 2, TTL: lease.Duration(time.Hour)}}
	a.state.put(stale, now)
	a.state.put(ended, now)
	s.indexLeases(a.key, []*entry{stale, ended})
	a.warm = &warmAudit{broken: true}

	a.handOver(context.Background())
	for _, id := range []string{"x", "y"} {
		if s.index[id] != nil {
			t.Fatalf("lease %s is still indexed from the view handed over: a cached get or a keepalive would answer for it from there", id)
		}
	}
	if len(a.state.leases)+len(a.state.ended) != 0 || a.warm != nil {
		t.Fatal("the view was not dropped for a fresh read")
	}
}

// TestSnapshotKeepsTheOrderOfEnds: an instance that reads a repo from its
// snapshot (a standby warming up, a restart, a view read afresh) forgets
// its ended leases in the order the writer does, so both remember the
// same ones. Leases ending in an order their ids do not sort in, read back
// from a snapshot that listed them by id, made the reader forget the
// lease that ended last at the next end past maxEnded, while the writer
// forgot the one that ended first.
func TestSnapshotKeepsTheOrderOfEnds(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/ended-order"
	ended := func(id string) *entry {
		return &entry{Lease: lease.Lease{LeaseID: id, Repo: repo, Status: lease.StatusReleased, Version: 2, TTL: lease.Duration(time.Minute)}, Holder: "runner"}
	}
	now := time.Now()
	writer := newRepoState(repo)
	for i := range maxEnded {
		writer.put(ended(fmt.Sprintf("lease_%03d", maxEnded-i)), now) // the highest id ends first
	}
	writer.put(&entry{Lease: lease.Lease{LeaseID: "lease_active", Repo: repo, Status: lease.StatusActive, Version: 1, TTL: lease.Duration(time.Minute)}, Holder: "runner"}, now)

	// As written to the log and read back.
	data, err := writer.snapshot().encode()
	if err != nil {
		t.Fatal(err)
	}
	var snap logRecord
	if err := json.Unmarshal(data, &snap); err != nil {
		t.Fatal(err)
	}
	reader := newRepoState(repo)
	reader.observe(&snap, 1, now)
	order := func(s *repoState) []string {
		var ids []string
		for _, x := range s.endedFIFO {
			ids = append(ids, x.id)
		}
		return ids
	}
	if w, r := order(writer), order(reader); !slices.Equal(w, r) {
		t.Fatalf("the reader's ended leases, oldest first, start %v; the writer's %v", r[:3], w[:3])
	}
	if reader.leases["lease_active"] == nil {
		t.Fatal("the active lease was not read from the snapshot")
	}

	// One more end: each forgets its oldest, the same one.
	writer.put(ended("lease_new"), now)
	reader.put(ended("lease_new"), now)
	if !slices.Equal(writer.evicted, reader.evicted) || len(writer.evicted) != 1 {
		t.Fatalf("past %d ended leases the writer forgot %v and the reader %v; want the same one", maxEnded, writer.evicted, reader.evicted)
	}
	if want := fmt.Sprintf("lease_%03d", maxEnded); writer.evicted[0] != want {
		t.Fatalf("the writer forgot %s; want %s, which ended first", writer.evicted[0], want)
	}
}
