package leasebus

import (
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/natstest"
	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// scriptedRenewals stands in for a lease service that has just changed
// hands, on a real NATS server: each renewal it gets is answered by
// answer (nil: dropped, as an answer lost on the way back), and every one
// is kept, in order, for the test to read. It also answers get with the
// lease as held, for Hold's confirming read.
type scriptedRenewals struct {
	mu     sync.Mutex
	sent   []RenewRequest
	answer func(n int, r RenewRequest) *reply // n counts from 1
	held   lease.Lease
}

func scriptRenewals(t *testing.T, srv *natstest.Server, s *scriptedRenewals) {
	t.Helper()
	nc := connectNATS(t, srv)
	respond := func(m *nats.Msg, r *reply) {
		data, err := json.Marshal(r)
		if err != nil {
			t.Error(err)
			return
		}
		out := &nats.Msg{Subject: m.Reply, Data: data, Header: nats.Header{nonceHeader: []string{m.Header.Get(nonceHeader)}}}
		_ = nc.PublishMsg(out)
	}
	if _, err := nc.Subscribe(requestSubject("renew", "*"), func(m *nats.Msg) {
		var r RenewRequest
		if err := unmarshalRequest(m.Data, &r); err != nil {
			t.Errorf("a renewal that does not decode: %v", err)
			return
		}
		s.mu.Lock()
		s.sent = append(s.sent, r)
		a := s.answer(len(s.sent), r)
		s.mu.Unlock()
		if a != nil {
			respond(m, a)
		}
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := nc.Subscribe(requestSubject("get", "*"), func(m *nats.Msg) {
		s.mu.Lock()
		l := s.held
		s.mu.Unlock()
		respond(m, &reply{Lease: &l})
	}); err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
}

func (s *scriptedRenewals) requests() []RenewRequest {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]RenewRequest(nil), s.sent...)
}

// renewAgainAt is the service's answer to a renewal of a version the last
// primary may have answered: renew this one.
func renewAgainAt(l lease.Lease, version uint64) *reply {
	l.Version = version
	return &reply{Lease: &l, Error: toWire(fmt.Errorf("renew %s: %w: version %d (test)", l.LeaseID, errRenewAgain, version))}
}

func renewedTo(l lease.Lease, version uint64) *reply {
	l.Version = version
	return &reply{Lease: &l}
}

func scriptedLease(t *testing.T, version uint64) lease.Lease {
	return lease.Lease{LeaseID: "lease_renewagain", Repo: repo, Scope: claim(t, "a"), WorkspaceID: "w", WorkspaceMode: lease.WorkspaceShared,
		Owner: owner(1), Status: lease.StatusActive, Version: version, Fence: 7, TTL: lease.Duration(30 * time.Second)}
}

// TestRenewAgainIsFollowedOnceAndOnlyUp: told to renew the lease's current
// version instead, a client proves that version afresh (never resending
// its old proof) — once, and only to a version a takeover can have set
// (at most renewSlack+1 past its own), of the same lease, still active.
// Any other such answer is returned as the error it is.
func TestRenewAgainIsFollowedOnceAndOnlyUp(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, "")
	held := scriptedLease(t, 6)
	s := &scriptedRenewals{held: held}
	scriptRenewals(t, srv, s)
	c := NewClient(connectNATS(t, srv))
	c.Tries, c.Timeout = 1, 10*time.Second // the answers come at once: no try times out
	cred := NewCredential()
	ctx := ctxT(t)

	for _, tc := range []struct {
		name    string
		current func() *reply // the answer to the first try
		follow  bool          // the client proves the current version
	}{
		{"at the farthest a takeover sets", func() *reply { return renewAgainAt(held, 6+renewSlack+1) }, true},
		{"one past the farthest", func() *reply { return renewAgainAt(held, 6+renewSlack+2) }, false},
		{"back", func() *reply { return renewAgainAt(held, 5) }, false},
		{"the same version", func() *reply { return renewAgainAt(held, 6) }, false},
		{"another lease", func() *reply {
			r := renewAgainAt(held, 10)
			r.Lease.LeaseID = "lease_other"
			return r
		}, false},
		{"ended", func() *reply {
			r := renewAgainAt(held, 10)
			r.Lease.Status = lease.StatusRevoked
			return r
		}, false},
	} {
		s.mu.Lock()
		s.sent = nil
		first := tc.current()
		// The re-proved renewal is answered renew-again too: the client
		// must not follow a service that keeps moving the version.
		s.answer = func(n int, r RenewRequest) *reply {
			if n == 1 {
				return first
			}
			return renewAgainAt(held, r.Version+1)
		}
		s.mu.Unlock()
		_, err := c.Renew(ctx, RenewRequest{LeaseID: held.LeaseID, Repo: repo, Credential: cred, Version: 6})
		if !errors.Is(err, errRenewAgain) {
			t.Fatalf("%s: %v; want the renew-again error returned", tc.name, err)
		}
		got := s.requests()
		want := 1
		if tc.follow {
			want = 2
		}
		if len(got) != want {
			t.Fatalf("%s: %d renewals sent; want %d", tc.name, len(got), want)
		}
		if !tc.follow {
			continue
		}
		again := got[1]
		switch cur := first.Lease.Version; {
		case again.Version != cur:
			t.Fatalf("%s: the second try renews v%d; want the current v%d", tc.name, again.Version, cur)
		case again.RenewID == got[0].RenewID:
			t.Fatalf("%s: the second try reuses the first's renewal id", tc.name)
		case !again.proves(cred.hash()) || again.Proof == got[0].Proof:
			t.Fatalf("%s: the second try does not prove the current version with the credential", tc.name)
		}
	}
}

// TestHolderRetriesTheReprovedRenewal: a holder told to renew the current
// version whose answer to that renewal is lost retries it as it last sent
// it (the current version, the same renewal id), so a service that did
// renew recognises the retry; going back to the version it holds would be
// a renewal of a version the service has moved past.
func TestHolderRetriesTheReprovedRenewal(t *testing.T) {
	t.Parallel()
	srv := natstest.Start(t, "")
	const cur = 6 + renewSlack // where the new primary set the lease
	held := scriptedLease(t, 6)
	s := &scriptedRenewals{held: held}
	// Guarded by s.mu (answer runs under it).
	var droppedID string
	var wentBack bool
	s.answer = func(_ int, r RenewRequest) *reply {
		switch {
		case r.Version == 6 && droppedID == "":
			return renewAgainAt(held, cur) // a retry of it (its answer late) gets the same
		case r.Version == 6:
			wentBack = true // after the re-proved renewal: the test fails below
			return renewedTo(held, 7)
		case r.Version == cur && droppedID == "":
			droppedID = r.RenewID // renewed, but the answer is lost
			return nil
		case r.Version == cur && r.RenewID == droppedID:
			return renewedTo(held, cur+1) // the retry, recognised
		case r.Version > cur:
			return renewedTo(held, r.Version+1) // renewing on from there
		}
		return renewAgainAt(held, cur+1) // another id at the current version: the test fails below
	}
	scriptRenewals(t, srv, s)
	c := NewClient(connectNATS(t, srv))
	c.Tries, c.Timeout = 1, 300*time.Millisecond
	cred := NewCredential()
	h, err := c.Hold(ctxT(t), &held, cred, time.Now(), HoldOptions{Interval: 500 * time.Millisecond, Margin: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	checkFor(t, 20*time.Second, 10*time.Millisecond, func() error {
		s.mu.Lock()
		back := wentBack
		s.mu.Unlock()
		if back {
			t.Fatal("after the re-proved renewal went unanswered, the holder renewed the version it held again")
		}
		// Past the re-proved renewal: validity counts from the first
		// try's send, so after a slow recovery the holder renews on at
		// once and may not be seen at v cur+1 itself.
		if v := h.Lease().Version; v <= cur {
			return fmt.Errorf("the holder is at v%d; want past v%d", v, cur)
		}
		return nil
	})
	// Every try at the current version is the re-proved renewal: its id,
	// proven; and it was sent again after its answer was lost.
	tries := 0
	for _, r := range s.requests() {
		if r.Version != cur {
			continue
		}
		if r.RenewID != droppedID || !r.proves(cred.hash()) {
			t.Fatalf("a try at v%d with id %s (proven: %v); want only the re-proved renewal's id %s, proven", cur, r.RenewID, r.proves(cred.hash()), droppedID)
		}
		tries++
	}
	if tries < 2 {
		t.Fatalf("the re-proved renewal was sent %d times; want it sent again after its answer was lost", tries)
	}
	if st, err := h.State(); st == lease.Lost {
		t.Fatalf("the holder lost the lease: %v", err)
	}
}
