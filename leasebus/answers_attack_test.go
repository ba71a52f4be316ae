package leasebus

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// mailboxSpy watches one identity's inbox from another connection of the
// same identity (every runner sharing holder.nk may), and learns the reply
// subjects the victim's requests use.
type mailboxSpy struct {
	mu   sync.Mutex
	last map[string]uint64 // mailbox prefix (with its dot) -> highest sequence seen
}

func spyOnInbox(t *testing.T, attacker *nats.Conn, victim string) *mailboxSpy {
	t.Helper()
	s := &mailboxSpy{last: map[string]uint64{}}
	sub, err := attacker.Subscribe(inboxPrefix(victim)+".>", func(m *nats.Msg) {
		i := strings.LastIndexByte(m.Subject, '.')
		seq, err := strconv.ParseUint(m.Subject[i+1:], 36, 64)
		if err != nil {
			return
		}
		s.mu.Lock()
		defer s.mu.Unlock()
		if p := m.Subject[:i+1]; seq > s.last[p] {
			s.last[p] = seq
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = sub.Unsubscribe() })
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	return s
}

// next returns the victim's next n reply subjects of every mailbox seen.
func (s *mailboxSpy) next(n int) []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for p, seq := range s.last {
		for i := uint64(1); i <= uint64(n); i++ {
			out = append(out, p+strconv.FormatUint(seq+i, 36))
		}
	}
	return out
}

// highest is the highest reply sequence seen (of any mailbox).
func (s *mailboxSpy) highest() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out uint64
	for _, seq := range s.last {
		out = max(out, seq)
	}
	return out
}

func (s *mailboxSpy) seen() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.last)
}

// inject has the lease service answer req (op, sent in the attacker's own
// name) onto each of subjects: the service checks only that a reply goes
// to the asker's inbox, which a shared holder identity makes the victim's.
func inject(t *testing.T, attacker *nats.Conn, op string, req any, subjects []string) {
	t.Helper()
	data, err := json.Marshal(req)
	if err != nil {
		t.Fatal(err)
	}
	for _, subj := range subjects {
		if err := attacker.PublishRequest(requestSubject(op, IdentityOf(attacker)), subj, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
}

// victimHolder acquires and holds a lease on a connection of the holder
// role, renewing every interval, and returns it with a spy on its inbox
// from a second connection of the same identity.
func victimHolder(t *testing.T, b *bus, interval time.Duration) (*Holder, *mailboxSpy, *nats.Conn) {
	t.Helper()
	url := b.srv.ClientURL()
	attacker := connectAs(t, url, RoleHolder)
	victimNC := connectAs(t, url, RoleHolder)
	spy := spyOnInbox(t, attacker, IdentityOf(victimNC))
	h, err := NewClient(victimNC).AcquireAndHold(ctxT(t), AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(10 * time.Second)},
		NewCredential(), HoldOptions{Interval: interval})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if spy.seen() == 0 {
			return errors.New("the spy has seen none of the victim's replies yet")
		}
		return nil
	})
	return h, spy, attacker
}

// stays fails the test if the victim's holder, for d, is ever not Held or
// changes what it holds.
func stays(t *testing.T, h *Holder, want lease.Lease, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) {
		st, err := h.State()
		got := h.Lease()
		if st == lease.Lost {
			t.Fatalf("the victim's holder is lost by an injected answer (the service says active): %v", err)
		}
		if got.LeaseID != want.LeaseID || got.Fence != want.Fence || got.Repo != want.Repo || got.Scope.String() != want.Scope.String() || got.TTL != want.TTL {
			t.Fatalf("the victim's holder took an injected answer as its lease: holds %s fence %d %s %s ttl %s, had %s fence %d %s",
				got.LeaseID, got.Fence, got.Repo, got.Scope, time.Duration(got.TTL), want.LeaseID, want.Fence, want.Scope)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// notOurs refuses every answer a renewal cannot get from the service.
func TestNotOurs(t *testing.T) {
	t.Parallel()
	held := lease.Lease{LeaseID: "lease_a", Repo: repo, Scope: claim(t, "a"), WorkspaceID: "w", WorkspaceMode: lease.WorkspaceShared,
		Owner: owner(1), Status: lease.StatusActive, Version: 4, Fence: 7, TTL: lease.Duration(time.Minute)}
	sent := RenewRequest{LeaseID: held.LeaseID, Version: 4}
	ok := held
	ok.Version = 5
	if why := notOurs(held, sent, &ok); why != "" {
		t.Fatalf("the service's own answer refused: %s", why)
	}
	for name, change := range map[string]func(*lease.Lease){
		"lease":     func(l *lease.Lease) { l.LeaseID = "lease_b" },
		"repo":      func(l *lease.Lease) { l.Repo = "github.com/evil/r" },
		"fence":     func(l *lease.Lease) { l.Fence = 999999 },
		"owner":     func(l *lease.Lease) { l.Owner = owner(2) },
		"claim":     func(l *lease.Lease) { l.Scope = claim(t, "a", "b") },
		"workspace": func(l *lease.Lease) { l.WorkspaceMode = lease.WorkspaceExclusive },
		"ttl":       func(l *lease.Lease) { l.TTL = lease.Duration(MaxTTL) },
		"same":      func(l *lease.Lease) { l.Version = 4 },
		"far":       func(l *lease.Lease) { l.Version = 1 << 40 },
		"ended":     func(l *lease.Lease) { l.Status = lease.StatusRevoked },
	} {
		got := ok
		got.Scope = claim(t, "a")
		change(&got)
		if notOurs(held, sent, &got) == "" {
			t.Errorf("%s: an answer the renewal cannot get was taken", name)
		}
	}
}

// A viewer listing (and a holder cancelling in) repos nobody ever leased
// in starts no actor for them: each used to leave a goroutine and its
// state behind for good.
func TestListOfUnknownReposStartsNothing(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	if _, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	before := len(b.svc.allActors())
	viewer := NewClient(connectAs(t, url, RoleViewer))
	holder := NewClient(connectAs(t, url, RoleHolder))
	for i := range 200 {
		made := fmt.Sprintf("github.com/nobody/r%d", i)
		ls, err := viewer.List(ctx, made, false)
		if err != nil || len(ls) != 0 {
			t.Fatalf("list %s: %v %v", made, ls, err)
		}
		if _, err := holder.request(ctx, "cancel", cancelRequest{Repo: made, RequestID: NewRequestID(), Credential: NewCredential()}, 0); err != nil {
			t.Fatalf("cancel in %s: %v", made, err)
		}
	}
	if after := len(b.svc.allActors()); after != before {
		t.Fatalf("%d actors after listing 200 unknown repos, %d before", after, before)
	}
	// A repo with a log is listed as before.
	if ls, err := viewer.List(ctx, repo, false); err != nil || len(ls) != 1 {
		t.Fatalf("list %s: %v %v", repo, ls, err)
	}
}

// A renewal travels as a proof for that one renewal, never as the
// credential: a captured renewal (a stream made over the request
// subjects) renews nothing else and releases nothing.
func TestRenewalCarriesNoCredential(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	cred := NewCredential()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// What the service receives, heard on its own request subjects.
	captured := make(chan *nats.Msg, 4)
	sub, err := b.nc.ChanSubscribe(requestSubject("renew", "*"), captured)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	renewed, err := b.c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version})
	if err != nil {
		t.Fatal(err)
	}
	var m *nats.Msg
	select {
	case m = <-captured:
	case <-time.After(5 * time.Second):
		t.Fatal("no renewal heard")
	}
	if strings.Contains(string(m.Data), string(cred)) || strings.Contains(string(m.Data), cred.hash()) {
		t.Fatalf("the renewal carries the credential or its hash: %s", m.Data)
	}
	var r RenewRequest
	if err := decode(m.Data, &r); err != nil || r.Proof == "" {
		t.Fatalf("captured renewal %s: %v", m.Data, err)
	}
	// Replayed for the next version: refused as not the owner's.
	r.Version = renewed.Version
	attacker := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	if _, err := attacker.leaseOp(ctx, "renew", &r); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("a captured proof replayed for version %d: %v, want not the owner", r.Version, err)
	}
	// And it releases nothing: a release needs the credential itself.
	if _, err := attacker.Release(ctx, l.LeaseID, Credential(r.Proof)); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("release with the captured proof: %v", err)
	}
	if got, err := b.c.Get(ctx, l.LeaseID); err != nil || !got.Active() || got.Version != renewed.Version {
		t.Fatalf("after the replays: %+v %v", got, err)
	}
}
