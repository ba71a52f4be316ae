package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

// floodRequests publishes n requests of op (data) on nc's identity, answered to
// an inbox of nc's own that the subscription it returns reads.
func floodRequests(t *testing.T, nc *nats.Conn, op string, data []byte, n int) *nats.Subscription {
	t.Helper()
	return floodRequestsWith(t, nc, op, nil, data, n)
}

// floodRequestsWith is floodRequests with headers hdr on each request.
func floodRequestsWith(t *testing.T, nc *nats.Conn, op string, hdr nats.Header, data []byte, n int) *nats.Subscription {
	t.Helper()
	inbox := nc.NewInbox()
	sub, err := nc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	subj := requestSubject(op, IdentityOf(nc))
	for range n {
		if err := nc.PublishMsg(&nats.Msg{Subject: subj, Reply: inbox, Header: hdr, Data: data}); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	return sub
}

// nextOverload reads the next answer on sub and fails unless it refuses
// the request as an overload whose message says want.
func nextOverload(t *testing.T, sub *nats.Subscription, want string) {
	t.Helper()
	m, err := sub.NextMsg(time.Minute)
	if err != nil {
		t.Fatalf("no answer to the flood: %v", err)
	}
	var r reply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatal(err)
	}
	if err := r.Error.err(); !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "overloaded") || !strings.Contains(err.Error(), want) {
		t.Fatalf("an answer to the flood past its share: %+v (%v), want overloaded saying %q", r, err, want)
	}
}

// holdBusy keeps a's batches from running, as a slow append does, until
// the func it returns is called (or the test ends): what comes waits in
// a's queue.
func holdBusy(t *testing.T, a *actor) (release func()) {
	a.busy.Lock()
	var once sync.Once
	release = func() { once.Do(a.busy.Unlock) }
	t.Cleanup(release)
	return release
}

// waitOverloadAudited waits for an overload refusal in the name of
// identity name whose message says what.
func waitOverloadAudited(ctx context.Context, t *testing.T, b *identityBus, name, what string) {
	t.Helper()
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.svc, "", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == ReasonBusOverload && ev.RequestedBy == name && strings.Contains(ev.Message, what) {
				return nil
			}
		}
		return fmt.Errorf("no overload refusal of %s saying %q in the audit yet", name, what)
	})
}

// floodGets publishes n gets of leaseID on nc's identity (floodRequests).
func floodGets(t *testing.T, nc *nats.Conn, leaseID string, n int) *nats.Subscription {
	t.Helper()
	data, err := json.Marshal(getRequest{LeaseID: leaseID})
	if err != nil {
		t.Fatal(err)
	}
	return floodRequests(t, nc, "get", data, n)
}

// TestFloodingRunnerHoldsUpNoOther: one runner floods the repo another
// runner works in, with requests the service must queue at the repo's
// actor (gets of the other's lease, which any holder may read). The
// flood fills the flooder's own share of the queue and no more: past it
// the flooder is refused as overloaded, audited in its name, while the
// other runner's renewal and acquire are still queued and answered (on
// a queue shared first come first served, the flood filled the repo's
// queue and turned away every runner's renewal until it drained).
func TestFloodingRunnerHoldsUpNoOther(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/shared"
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	victim := NewClient(b.holders["victim"])
	cred := NewCredential()
	l, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	a, ok := b.service.existing(RepoKey(repo))
	if !ok {
		t.Fatal("no actor for the repo")
	}
	flooderID, victimID := IdentityOf(b.holders["flooder"]), IdentityOf(b.holders["victim"])

	// The actor is busy (as under a slow append): what comes waits. The
	// flood's share first, handed on by the intake to the actor: sent
	// with the rest at once, on a loaded machine the intake still held
	// its share when the rest came, and refused them itself.
	release := holdBusy(t, a)
	const over = 50
	answers := floodGets(t, b.holders["flooder"], l.LeaseID, maxQueued)
	checkFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := a.calls.lenOf(flooderID); n != maxQueued {
			return fmt.Errorf("the flooder has %d calls queued at the actor, want its share (%d)", n, maxQueued)
		}
		return nil
	})
	past := floodGets(t, b.holders["flooder"], l.LeaseID, over)
	for range over {
		nextOverload(t, past, "flooder has 4096 requests waiting for the repo of lease log "+RepoKey(repo))
	}
	if n := a.calls.lenOf(flooderID); n != maxQueued {
		t.Fatalf("the flooder has %d calls queued, want its share (%d)", n, maxQueued)
	}

	// The victim renews and acquires meanwhile: both queue.
	var wg sync.WaitGroup
	var renewErr, acquireErr error
	wg.Go(func() {
		_, renewErr = victim.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Repo: repo, Credential: cred, Version: l.Version})
	})
	wg.Go(func() {
		_, acquireErr = victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/search"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	})
	checkFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := a.calls.lenOf(victimID); n != 2 {
			return fmt.Errorf("the victim has %d calls queued beside the flood, want its renewal and its acquire", n)
		}
		return nil
	})
	release()
	wg.Wait()
	if renewErr != nil || acquireErr != nil {
		t.Fatalf("the victim's renewal (%v) or acquire (%v) failed during the flood", renewErr, acquireErr)
	}
	// The flood is answered too, in turn.
	for got := 0; got < maxQueued; got++ {
		if _, err := answers.NextMsg(time.Minute); err != nil {
			t.Fatalf("%d of the flood's %d queued gets answered: %v", got, maxQueued, err)
		}
	}

	// Each refusal is the flooder's, in the audit (counted past
	// refusalRate a second), and none is the victim's.
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.svc, "", 0)
		if err != nil {
			return err
		}
		flooder := 0
		for _, ev := range evs {
			if ev.Type != lease.EventRefused || ev.Reason != ReasonBusOverload {
				continue
			}
			if ev.RequestedBy == "" && strings.Contains(ev.Message, "more (bus-overload)") {
				continue // past refusalRate a second: counted, in no one's name
			}
			if ev.RequestedBy != b.service.name(flooderID) {
				t.Fatalf("an overload refusal in the name of %q, want only the flooder's: %+v", ev.RequestedBy, ev)
			}
			if !strings.Contains(ev.Message, "refused a get request") {
				t.Fatalf("the overload refusal does not say what was refused: %q", ev.Message)
			}
			flooder++
		}
		if flooder == 0 {
			return errors.New("no overload refusal audited yet")
		}
		return nil
	})
}

// TestWaitingAcquiresBoundedPerIdentity: every batch of a repo looks at
// every acquire waiting there, so a runner that kept thousands waiting
// would slow each batch of the repo, the other runners' too. One
// identity has at most maxWaiting acquires waiting at a repo; the next is
// refused as overloaded (audited), and another identity's acquire still
// waits and is granted when the lease it waits for is released.
func TestWaitingAcquiresBoundedPerIdentity(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/shared"
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	flooder, victim := NewClient(b.holders["flooder"]), NewClient(b.holders["victim"])
	holdCred := NewCredential()
	held, err := flooder.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, holdCred)
	if err != nil {
		t.Fatal(err)
	}
	wait := lease.Duration(time.Minute)
	acquireRaw := func(nc *nats.Conn, path string, inbox string) {
		t.Helper()
		req := AcquireRequest{Repo: repo, Scope: claim(t, path), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: wait, RequestID: NewRequestID()}
		req.CredentialHash = NewCredential().hash()
		if err := nc.PublishRequest(requestSubject("acquire", IdentityOf(nc)), inbox, req.encode()); err != nil {
			t.Fatal(err)
		}
	}
	fnc := b.holders["flooder"]
	inbox := fnc.NewInbox()
	answers, err := fnc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	for i := range maxWaiting + 1 {
		acquireRaw(fnc, fmt.Sprintf("services/f%d", i), inbox)
	}
	m, err := answers.NextMsg(time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	var r reply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatal(err)
	}
	if err := r.Error.err(); !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "acquires waiting") {
		t.Fatalf("the acquire past the flooder's %d waiting: %+v (%v), want overloaded", maxWaiting, r, err)
	}
	if n := queued(b.service, repo); n != maxWaiting {
		t.Fatalf("%d acquires wait, want the flooder's %d", n, maxWaiting)
	}

	// The victim's acquire waits all the same, and is granted (after the
	// flooder's, which came first and overlap nothing of it) once the
	// lease it waits behind is released.
	got := make(chan error, 1)
	go func() {
		_, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(3), TTL: lease.Duration(time.Minute), Wait: wait}, NewCredential())
		got <- err
	}()
	checkFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := queued(b.service, repo); n != maxWaiting+1 {
			return fmt.Errorf("%d acquires wait, want the flooder's %d and the victim's", n, maxWaiting)
		}
		return nil
	})
	if _, err := flooder.Release(ctx, held.LeaseID, holdCred); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("the victim's waiting acquire: %v", err)
	}
	waitOverloadAudited(ctx, t, b, "flooder", "acquires waiting in repo "+repo)
}

// TestRequestsInFlightBoundedPerIdentity: the requests the service serves
// on goroutines of their own (a list, a sweep, a lease's first lookup)
// are counted by identity: a runner with maxInFlight of them waiting (a
// list of a repo whose actor is busy) has the next refused as an overload,
// audited, and another runner's list is still taken and answered.
func TestRequestsInFlightBoundedPerIdentity(t *testing.T) {
	t.Parallel()
	const repo = "github.com/acme/shared"
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	victim := NewClient(b.holders["victim"])
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	a, ok := b.service.existing(RepoKey(repo))
	if !ok {
		t.Fatal("no actor for the repo")
	}
	release := holdBusy(t, a)
	data, err := json.Marshal(listRequest{Repo: repo})
	if err != nil {
		t.Fatal(err)
	}
	const over = 20
	answers := floodRequests(t, b.holders["flooder"], "list", data, maxInFlight+over)
	for range over {
		nextOverload(t, answers, fmt.Sprintf("flooder has %d requests in flight already", maxInFlight))
	}
	listed := make(chan error, 1)
	go func() {
		ls, err := victim.List(ctx, repo, false)
		if err == nil && len(ls) != 1 {
			err = fmt.Errorf("listed %d leases, want the victim's one", len(ls))
		}
		listed <- err
	}()
	victimID := IdentityOf(b.holders["victim"])
	checkFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if n := a.calls.lenOf(victimID); n != 1 {
			return fmt.Errorf("the victim's list has %d calls queued at the repo, want 1", n)
		}
		return nil
	})
	release()
	if err := <-listed; err != nil {
		t.Fatalf("the victim's list during the flood: %v", err)
	}
	for got := 0; got < maxInFlight; got++ {
		if _, err := answers.NextMsg(time.Minute); err != nil {
			t.Fatalf("%d of the flood's %d lists in flight answered: %v", got, maxInFlight, err)
		}
	}
	waitOverloadAudited(ctx, t, b, "flooder", "refused a list request")
	// Every goroutine of the flood is counted out (each list's access
	// event written first).
	checkFor(t, time.Minute, 10*time.Millisecond, func() error {
		b.service.mu.Lock()
		defer b.service.mu.Unlock()
		if len(b.service.inFlight) != 0 {
			return fmt.Errorf("requests still counted in flight: %v", b.service.inFlight)
		}
		return nil
	})
}

// TestKeepaliveReadsSharedByIdentity: a keepalive naming leases no view
// covers reads their logs, in one of maxKeptReaders places. A runner
// whose keepalives name made-up leases in a repo kept busy holds at most
// maxKeptReadersEach of them (each for as long as its reads wait), and
// another runner's keepalive still reads: its made-up lease is Missing,
// from the log, not Unknown for want of a place (when one runner could
// take every place, the other's holders went Unknown beat after beat).
func TestKeepaliveReadsSharedByIdentity(t *testing.T) {
	t.Parallel()
	const busy, other = "github.com/acme/shared", "github.com/acme/other"
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	victim := NewClient(b.holders["victim"])
	for _, r := range []string{busy, other} { // both repos have a log
		if _, err := victim.Acquire(ctx, AcquireRequest{Repo: r, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
			t.Fatal(err)
		}
	}
	a, ok := b.service.existing(RepoKey(busy))
	if !ok {
		t.Fatal("no actor for the busy repo")
	}
	release := holdBusy(t, a)
	madeUp := make([]keptLease, maxKeptReads)
	for i := range madeUp {
		madeUp[i] = keptLease{LeaseID: newLeaseID(RepoKey(busy), time.Now()), Repo: busy, Fence: 1, Version: 1}
	}
	data, err := json.Marshal(keepaliveRequest{Session: NewClient(b.holders["flooder"]).SessionID(), Leases: madeUp})
	if err != nil {
		t.Fatal(err)
	}
	answers := floodRequests(t, b.holders["flooder"], "keepalive", data, maxKeptReaders)
	// Every one of the flood's keepalives is answered (Unknown: no place)
	// or holds a place, reading.
	answered := 0
	checkFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		for {
			if _, err := answers.NextMsg(time.Millisecond); err != nil {
				break
			}
			answered++
		}
		if reading := len(b.service.keptReads); answered+reading != maxKeptReaders {
			return fmt.Errorf("of the flood's %d keepalives %d answered, %d reading", maxKeptReaders, answered, reading)
		}
		return nil
	})
	if reading := len(b.service.keptReads); reading != maxKeptReadersEach {
		t.Fatalf("the flooder's keepalives read in %d places, want its share (%d)", reading, maxKeptReadersEach)
	}
	// (The flooder's places stay taken meanwhile: each of its keepalives
	// reads 16 leases of the busy repo, each read waiting maxKeptWait.
	// The victim's read, of a repo not busy, is asked again should it
	// time out on a loaded machine: Unknown is what no place gives too.)
	victimLease := keptLease{LeaseID: newLeaseID(RepoKey(other), time.Now()), Repo: other, Fence: 1, Version: 1}
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		r, err := victim.request(ctx, "keepalive", &keepaliveRequest{Session: victim.SessionID(), Leases: []keptLease{victimLease}}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Kept) != 1 || !r.Kept[0].Missing {
			return fmt.Errorf("the victim's keepalive beside the flood: %+v, want its made-up lease Missing, read from its log", r.Kept)
		}
		return nil
	})
	release()
	checkFor(t, time.Minute, 10*time.Millisecond, func() error {
		b.service.keptMu.Lock()
		defer b.service.keptMu.Unlock()
		if n := len(b.service.keptReads); n != 0 || len(b.service.keptReaders) != 0 {
			return fmt.Errorf("%d places still taken (%v)", n, b.service.keptReaders)
		}
		return nil
	})
}

// TestSessionsBoundedPerIdentity: a runner keeps one session a process;
// one that makes up sessions by the thousand (each keepalive a new
// session id) gets maxSessionsEach of them kept, and the rest refused as
// an overload, audited, and not kept: an instance's memory and its
// digest to the others do not grow with the flood. Another runner's new
// session is still kept.
func TestSessionsBoundedPerIdentity(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	fnc := b.holders["flooder"]
	inbox := fnc.NewInbox()
	answers, err := fnc.SubscribeSync(inbox)
	if err != nil {
		t.Fatal(err)
	}
	if err := answers.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	const over = 30
	subj := requestSubject("keepalive", IdentityOf(fnc))
	for i := range maxSessionsEach + over {
		data, err := json.Marshal(keepaliveRequest{Session: fmt.Sprintf("%s%032x", sessionPrefix, i)})
		if err != nil {
			t.Fatal(err)
		}
		if err := fnc.PublishRequest(subj, inbox, data); err != nil {
			t.Fatal(err)
		}
	}
	kept, refused := 0, 0
	for kept+refused < maxSessionsEach+over {
		m, err := answers.NextMsg(time.Minute)
		if err != nil {
			t.Fatalf("%d kept and %d refused of the flood's %d keepalives: %v", kept, refused, maxSessionsEach+over, err)
		}
		var r reply
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Fatal(err)
		}
		switch err := r.Error.err(); {
		case err == nil:
			kept++
		case errors.Is(err, lease.ErrUnavailable) && strings.Contains(err.Error(), fmt.Sprintf("has %d sessions alive", maxSessionsEach)):
			refused++
		default:
			t.Fatalf("a keepalive of the flood: %v", err)
		}
	}
	if kept != maxSessionsEach || refused != over {
		t.Fatalf("%d of the flood's sessions kept and %d refused, want %d and %d", kept, refused, maxSessionsEach, over)
	}
	b.service.live.mu.Lock()
	n := b.service.live.sessions[IdentityOf(fnc)]
	b.service.live.mu.Unlock()
	if n != maxSessionsEach {
		t.Fatalf("the instance keeps %d of the flooder's sessions, want %d", n, maxSessionsEach)
	}
	// A kept session keeps alive as before; the victim's new one is kept.
	m, err := fnc.Request(subj, []byte(fmt.Sprintf(`{"session":"%s%032x"}`, sessionPrefix, 0)), 10*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	var again reply
	if err := json.Unmarshal(m.Data, &again); err != nil {
		t.Fatal(err)
	}
	if err := again.Error.err(); err != nil {
		t.Fatalf("a kept session's next keepalive: %v", err)
	}
	// An acquire bound to one more new session is refused before it is
	// granted (its keepalives would be refused).
	flooder := NewClient(fnc)
	if _, err := flooder.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/shared", Scope: claim(t, "x"), Owner: owner(1), TTL: lease.Duration(time.Minute), Session: fmt.Sprintf("%s%032x", sessionPrefix, maxSessionsEach+over)}, NewCredential()); !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "sessions alive") {
		t.Fatalf("an acquire bound to a session past the flooder's bound: %v, want overloaded", err)
	}
	victim := NewClient(b.holders["victim"])
	if _, err := victim.request(ctx, "keepalive", &keepaliveRequest{Session: victim.SessionID()}, 0); err != nil {
		t.Fatalf("the victim's keepalive beside the flood: %v", err)
	}
	waitOverloadAudited(ctx, t, b, "flooder", "refused a keepalive of a new session")
}

// TestDigestInParts: an instance's digest of the sessions it heard goes
// to the others in parts of at most maxDigestPart bytes, each of whole
// lines, so a fleet's (10,000 sessions are about 1 MB, a NATS server's
// default limit for a message) is not refused by the server whole,
// leaving the others counting this instance late and giving every silent
// session three graces. Here 20,000 sessions reach a listener, every one
// of them.
func TestDigestInParts(t *testing.T) {
	data := []byte("a.1\nbb.22\nccc.333\n")
	for _, max := range []int{1, 4, 6, 9, 10, 18, 100} {
		parts := digestParts(data, max)
		var joined []byte
		for _, p := range parts {
			if len(p) > max {
				t.Errorf("max %d: a part of %d bytes", max, len(p))
			}
			if max >= len("ccc.333\n") && (len(p) == 0 || p[len(p)-1] != '\n') { // every line fits
				t.Errorf("max %d: part %q does not end a line", max, p)
			}
			joined = append(joined, p...)
		}
		if string(joined) != string(data) {
			t.Errorf("max %d: parts join to %q, want %q", max, joined, data)
		}
	}
	if parts := digestParts(nil, 10); len(parts) != 1 || len(parts[0]) != 0 {
		t.Errorf("an empty digest is %d parts, want one empty part", len(parts))
	}
	if got := digestPartMax(1 << 20); got != maxDigestPart {
		t.Errorf("a part on a server taking 1 MB: %d bytes, want %d", got, maxDigestPart)
	}
	if got := digestPartMax(64 << 10); got != 60<<10 {
		t.Errorf("a part on a server taking 64 KB: %d bytes, want %d", got, 60<<10)
	}

	t.Run("published", func(t *testing.T) {
		t.Parallel()
		b := startBus(t)
		want := map[string]bool{}
		var mu sync.Mutex
		largest := 0
		sub, err := b.nc.Subscribe(sessionsSubject, func(m *nats.Msg) {
			if m.Header.Get(writerHeader) != b.svc.store.writer {
				return
			}
			mu.Lock()
			defer mu.Unlock()
			largest = max(largest, len(m.Data))
			for line := range strings.Lines(string(m.Data)) {
				delete(want, strings.TrimSuffix(line, "\n"))
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Unsubscribe()
		if err := b.nc.Flush(); err != nil {
			t.Fatal(err)
		}
		mu.Lock()
		b.svc.tailing.Store(true) // as when it follows other instances: it publishes
		now := b.svc.cfg.Now()
		for i := range 20_000 {
			k := sessionKey(fmt.Sprintf("U%055d", i/1000), fmt.Sprintf("%s%032x", sessionPrefix, i))
			if !b.svc.live.heard(k, now) {
				t.Fatalf("session %d not kept", i)
			}
			want[k] = true
		}
		mu.Unlock()
		checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
			mu.Lock()
			defer mu.Unlock()
			if len(want) > 0 {
				return fmt.Errorf("%d of 20,000 sessions not in any digest part yet", len(want))
			}
			return nil
		})
		mu.Lock()
		defer mu.Unlock()
		if largest > maxDigestPart {
			t.Errorf("a digest part of %d bytes, over %d", largest, maxDigestPart)
		}
	})
}

// TestOverloadRefusalsLeaveRoomForOthers: a flood's overload refusals are
// queued for the audit at most refusalRate a second (the writer writes no
// more than that one by one), the rest counted at once, so they do not
// fill the queue the bus's other refusals (a forged request, a denied
// publish) share: the next of those is still written as itself.
func TestOverloadRefusalsLeaveRoomForOthers(t *testing.T) {
	s := &Service{refusals: make(chan busRefusal, 256)} // no writer: nothing drains it
	for range 5000 {
		s.refuse(ReasonBusOverload, "flooder", "refused a get request")
	}
	if n := len(s.refusals); n != refusalRate {
		t.Fatalf("%d overload refusals queued, want %d (the rest counted)", n, refusalRate)
	}
	if n := s.overloadsDropped.Load(); n != 5000-refusalRate {
		t.Fatalf("%d overload refusals counted, want %d", n, 5000-refusalRate)
	}
	s.refuse(ReasonBusForged, "", "witness")
	if s.refusalsDropped.Load() != 0 || len(s.refusals) != refusalRate+1 {
		t.Fatalf("the forged request's refusal was not queued beside the flood's (queued %d, dropped %d)", len(s.refusals), s.refusalsDropped.Load())
	}
}

// heavyInvalidAcquire is an acquire request that costs the service a
// full decode of a claim of many paths (about 4.6 KB) and is then
// refused as invalid (it names no repo): answered at once by whatever
// reads it.
func heavyInvalidAcquire(t *testing.T) []byte {
	t.Helper()
	paths := make([]string, 200)
	for i := range paths {
		paths[i] = fmt.Sprintf("services/flood-%04d/", i)
	}
	data, err := json.Marshal(AcquireRequest{Scope: claim(t, paths...), Owner: owner(9), TTL: lease.Duration(time.Minute)})
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// TestFloodedSubscriptionHoldsUpNoOther: every runner's requests of one
// kind reach the service on one subscription. A runner that floods it
// with requests costly to read (each a full decode) must not make
// another runner's request of the same kind wait behind the whole flood:
// requests are sorted by their asker as they are read off the
// connection, which costs next to nothing, and served in turns. On a
// subscription served first come first served, the other runner's
// acquire was answered only after every one of the flood's requests.
func TestFloodedSubscriptionHoldsUpNoOther(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	flooder, victim := b.holders["flooder"], NewClient(b.holders["victim"])
	// Warm the victim's repo up: its acquire below then costs one append.
	first, err := victim.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/victim", Scope: claim(t, "docs/"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}

	const n = 3000
	var answered atomic.Int64
	inbox := flooder.NewInbox()
	sub, err := flooder.Subscribe(inbox, func(*nats.Msg) { answered.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	if err := sub.SetPendingLimits(-1, -1); err != nil {
		t.Fatal(err)
	}
	data, subj := heavyInvalidAcquire(t), requestSubject("acquire", IdentityOf(flooder))
	for range n {
		if err := flooder.PublishRequest(subj, inbox, data); err != nil {
			t.Fatal(err)
		}
	}
	if err := flooder.Flush(); err != nil { // the server has the whole flood
		t.Fatal(err)
	}
	l, err := victim.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/victim", Scope: claim(t, "services/billing/"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	before := answered.Load()
	if l.Fence <= first.Fence && l.LeaseID == first.LeaseID {
		t.Fatalf("the victim's second lease %+v is its first", l)
	}
	checkFor(t, time.Minute, 10*time.Millisecond, func() error {
		if got := answered.Load(); got < n {
			return fmt.Errorf("%d of the flood's %d requests answered", got, n)
		}
		return nil
	})
	if before > n/2 {
		t.Fatalf("the victim's acquire was answered after %d of the flood's %d requests, want fewer than half: it waited behind the flood", before, n)
	}
	t.Logf("the victim's acquire was answered after %d of the flood's %d requests", before, n)
}

// holdIntakes keeps the service's intakes of op from serving, as a slow
// request does, until the func it returns is called (or the test ends):
// what comes waits in them.
func holdIntakes(t *testing.T, s *Service, op string) (release func()) {
	t.Helper()
	s.mu.Lock()
	var held []*intake
	for _, in := range s.intakes {
		if in.op == op {
			held = append(held, in)
		}
	}
	s.mu.Unlock()
	if len(held) == 0 {
		t.Fatalf("no intake of %s", op)
	}
	for _, in := range held {
		// Taken between two requests: one being served (the test's own
		// last request, whose answer can come before its serving ends)
		// finishes first.
		checkFor(t, 30*time.Second, time.Millisecond, func() error {
			in.mu.Lock()
			defer in.mu.Unlock()
			if in.busy {
				return fmt.Errorf("the intake of %s is serving", op)
			}
			in.busy = true
			return nil
		})
	}
	var once sync.Once
	release = func() {
		once.Do(func() {
			for _, in := range held {
				in.mu.Lock()
				in.busy = false
				in.mu.Unlock()
				in.wake()
			}
		})
	}
	t.Cleanup(release)
	return release
}

// intakeWaiting is how many requests of op identity id has waiting in
// the service's intakes.
func intakeWaiting(s *Service, op, id string) int {
	n, _ := intakeHolds(s, op, id)
	return n
}

// intakeHolds is how many requests of op identity id has waiting in the
// service's intakes, and their size (every identity's with id "*").
func intakeHolds(s *Service, op, id string) (n, size int) {
	s.mu.Lock()
	intakes := s.intakes
	s.mu.Unlock()
	for _, in := range intakes {
		if in.op != op {
			continue
		}
		in.mu.Lock()
		if id == "*" {
			n, size = n+in.q.len(), size+in.q.total()
		} else {
			n, size = n+in.q.lenOf(id), size+in.q.sizeOf(id)
		}
		in.mu.Unlock()
	}
	return n, size
}

// settledOverloads waits until every one of the n requests identity id
// flooded op with either waits in the intake or was answered on answers
// (refused past its share), and returns how many wait.
func settledOverloads(t *testing.T, s *Service, op, id string, answers *nats.Subscription, n int) int {
	t.Helper()
	waiting := 0
	checkFor(t, time.Minute, 5*time.Millisecond, func() error {
		answered, _, err := answers.Pending()
		if err != nil {
			return err
		}
		waiting = intakeWaiting(s, op, id)
		if waiting+answered != n {
			return fmt.Errorf("%d of %d requests wait and %d are answered", waiting, n, answered)
		}
		return nil
	})
	return waiting
}

// acquireWhileHeld acquires services/billing/ in the victim's repo with
// victim (the client of b's "victim") while the acquire intakes are held,
// waits until the acquire waits in them, then calls release and returns
// what the acquire got.
func acquireWhileHeld(ctx context.Context, t *testing.T, b *identityBus, victim *Client, release func()) (*lease.Lease, error) {
	t.Helper()
	var l *lease.Lease
	var err error
	var wg sync.WaitGroup
	wg.Go(func() {
		l, err = victim.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/victim", Scope: claim(t, "services/billing/"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	})
	checkFor(t, 30*time.Second, 5*time.Millisecond, func() error {
		if n := intakeWaiting(b.service, "acquire", IdentityOf(b.holders["victim"])); n != 1 {
			return fmt.Errorf("the victim has %d acquires waiting", n)
		}
		return nil
	})
	release()
	wg.Wait()
	return l, err
}

// TestIntakeBoundedPerIdentity: while a subscription's requests wait to
// be served, one identity keeps at most maxIntakeQueued of them, or
// maxIntakeBytes, waiting; its next is refused at once as an overload,
// audited in its name, without being read. Another identity's request
// still waits, and is served in its turn: second, not after the flood.
func TestIntakeBoundedPerIdentity(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "flooder", "bulky", "padded", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	flooder, victim := b.holders["flooder"], NewClient(b.holders["victim"])
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/victim", Scope: claim(t, "docs/"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	flooderID := IdentityOf(flooder)

	release := holdIntakes(t, b.service, "acquire")
	const over = 50
	answers := floodRequests(t, flooder, "acquire", []byte(`{}`), maxIntakeQueued+over)
	for range over {
		nextOverload(t, answers, fmt.Sprintf("flooder has %d acquire requests", maxIntakeQueued))
	}
	if n := intakeWaiting(b.service, "acquire", flooderID); n != maxIntakeQueued {
		t.Fatalf("the flooder has %d requests waiting, want its share (%d)", n, maxIntakeQueued)
	}
	// Large requests fill an identity's share by their bytes first, as
	// they came on the wire, headers too.
	heavy := heavyInvalidAcquire(t)
	bulkyID := IdentityOf(b.holders["bulky"])
	bulky := floodRequests(t, b.holders["bulky"], "acquire", heavy, maxIntakeBytes/len(heavy)+over)
	fit := settledOverloads(t, b.service, "acquire", bulkyID, bulky, maxIntakeBytes/len(heavy)+over)
	_, size := intakeHolds(b.service, "acquire", bulkyID)
	if size > maxIntakeBytes || size+size/fit <= maxIntakeBytes {
		t.Fatalf("bulky has %d requests of %d bytes waiting: want its share of %d bytes full", fit, size, maxIntakeBytes)
	}
	for range maxIntakeBytes/len(heavy) + over - fit {
		nextOverload(t, bulky, fmt.Sprintf("bulky has %d acquire requests (%d bytes) waiting to be read already (at most %d requests and %d bytes an identity)", fit, size, maxIntakeQueued, maxIntakeBytes))
	}
	// Headers count, and are bounded on their own: nats.go holds them
	// in maps larger than on the wire.
	padded := floodRequestsWith(t, b.holders["padded"], "acquire", nats.Header{"Pad": []string{strings.Repeat("p", 3<<10)}}, heavy, 200)
	if n := settledOverloads(t, b.service, "acquire", IdentityOf(b.holders["padded"]), padded, 200); n != 200 {
		t.Fatalf("padded has %d of its 200 requests waiting", n)
	}
	if _, size := intakeHolds(b.service, "acquire", IdentityOf(b.holders["padded"])); size < 200*(len(heavy)+3<<10) {
		t.Fatalf("padded's 200 requests of %d bytes and 3 KB of headers count %d bytes, want their headers counted", len(heavy), size)
	}
	overHeaders := floodRequestsWith(t, b.holders["padded"], "acquire", nats.Header{"Pad": []string{strings.Repeat("p", maxRequestHeaders)}}, []byte(`{}`), 1)
	if m, err := overHeaders.NextMsg(time.Minute); err != nil {
		t.Fatal(err)
	} else if r := decodeReply(t, m); !errors.Is(r.Error.err(), lease.ErrInvalid) || !strings.Contains(r.Error.err().Error(), "request headers of") {
		t.Fatalf("a request with %d bytes of headers answered %v, want refused as invalid for its headers", maxRequestHeaders, r.Error.err())
	}

	l, acquireErr := acquireWhileHeld(ctx, t, b, victim, release)
	if acquireErr != nil {
		t.Fatalf("the victim's acquire failed behind the flood: %v", acquireErr)
	}
	if got, _, err := answers.Pending(); err != nil || got > maxIntakeQueued/2 {
		t.Fatalf("the victim's acquire was answered after %d of the flood's %d waiting requests (%v), want fewer than half: it was fourth in turn", got, maxIntakeQueued, err)
	}
	if l.Owner != owner(2) {
		t.Fatalf("the victim's lease %+v is not the one it asked for", l)
	}
	// The floods are served too, in turn: each refused as invalid.
	for got := range maxIntakeQueued + fit + 200 {
		sub := answers
		switch {
		case got >= maxIntakeQueued+fit:
			sub = padded
		case got >= maxIntakeQueued:
			sub = bulky
		}
		m, err := sub.NextMsg(time.Minute)
		if err != nil {
			t.Fatalf("%d of the floods' %d waiting requests answered: %v", got, maxIntakeQueued+fit+200, err)
		}
		var r reply
		if err := json.Unmarshal(m.Data, &r); err != nil {
			t.Fatal(err)
		}
		if err := r.Error.err(); !errors.Is(err, lease.ErrInvalid) {
			t.Fatalf("a waiting flood request answered %v, want it refused as invalid (it names no repo)", err)
		}
	}
	waitOverloadAudited(ctx, t, b, b.service.name(flooderID), fmt.Sprintf("flooder has %d acquire requests", maxIntakeQueued))
}

// TestWaitingKeepalivesHoldBackOnlyTheirIdentity: keepalives read and
// not yet served wait in the intake by identity, and the reaper gives the
// longer grace only to the sessions of an identity with keepalives
// waiting (one of them may be the session's). A runner that floods the
// keepalives holds back no other runner's reclaim: a dead runner's scope
// comes back after the grace while the flood waits, and the flooder's
// own session, whose keepalives wait behind its flood, is not reclaimed
// for it. (Waiting in nats.go's subscription, unsorted, such a backlog
// gave every silent session the longer grace.)
func TestWaitingKeepalivesHoldBackOnlyTheirIdentity(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	m := NewServiceMetrics()
	b := startIdentityBusWith(t, ServiceConfig{Metrics: m, SessionGrace: grace}, "flooder", "victim")
	ctx := ctxFor(t, 2*time.Minute)
	c := NewClient(b.holders["victim"])
	hs := holdEach(ctx, t, b, 2, "flooder", "victim")
	defer hs[0].Orphan()
	flooding, dead := hs[0].Lease(), hs[1].Lease()
	silence := func(l lease.Lease) time.Duration {
		b.service.mu.Lock()
		ix := b.service.index[l.LeaseID]
		b.service.mu.Unlock()
		return b.service.live.silent(sessionKey(ix.e.Holder, ix.e.Session), time.Now())
	}

	hs[1].Orphan() // the victim's runner dies
	stopped := time.Now()
	// Its last keepalive is served, not caught in the hold below: a
	// keepalive of another session sent after it on the same connection
	// is answered (an identity's requests are served in the order they
	// came).
	probe := &keepaliveRequest{Session: sessionPrefix + strings.Repeat("0", 31) + "1"}
	if _, err := NewClient(hs[1].c.nc).request(ctx, "keepalive", probe, 0); err != nil {
		t.Fatal(err)
	}
	release := holdIntakes(t, b.service, "keepalive")
	held := time.Now() // the flooder's keepalives wait from here on
	answers := floodRequests(t, b.holders["flooder"], "keepalive", []byte(`{}`), 2*keepaliveBacklog)
	checkFor(t, 30*time.Second, 5*time.Millisecond, func() error {
		if n := intakeWaiting(b.service, "keepalive", IdentityOf(b.holders["flooder"])); n < 2*keepaliveBacklog {
			return fmt.Errorf("%d of the flood's keepalives wait in the intake, want all %d", n, 2*keepaliveBacklog)
		}
		return nil
	})
	ended := waitEnded(t, c, dead.LeaseID, time.Minute)
	took := time.Since(stopped)
	if ended.Status != lease.StatusReclaimed {
		t.Fatalf("the dead runner's lease ended %s (%s), want reclaimed", ended.Status, ended.Reason)
	}
	if took >= massGraces*grace-time.Second {
		t.Errorf("the dead runner's scope came back %s after it died, with a grace of %s: held back by another runner's waiting keepalives", took.Round(time.Millisecond), grace)
	}
	if n := reclaimsHeld(m, "backlog"); n > 0 {
		t.Errorf("%d looks of the reaper counted the instance behind, for one runner's flood", n)
	}
	// The flooder's session, silent past the grace and a reaper's look
	// or two, is not reclaimed: its keepalives wait.
	checkFor(t, time.Minute, 20*time.Millisecond, func() error {
		if d := silence(flooding); d < grace+2*reapEvery {
			return fmt.Errorf("the flooder's session is silent for %s", d)
		}
		return nil
	})
	// (A machine stalled past the longer grace may have reclaimed it
	// since: then only after that.)
	if l, err := c.Get(ctx, flooding.LeaseID); err != nil || !l.Active() && l.EndedAt.Sub(held) < massGraces*grace-time.Second {
		t.Errorf("the flooder's lease, whose keepalives wait behind its flood, is %+v (%v) %s after its session was last served: want active, in the longer grace", l, err, silence(flooding).Round(time.Millisecond))
	}
	release()
	for got := range 2 * keepaliveBacklog {
		if _, err := answers.NextMsg(time.Minute); err != nil {
			t.Fatalf("%d of the flood's %d keepalives answered: %v", got, 2*keepaliveBacklog, err)
		}
	}
}

// TestIntakeBoundedInAll: many identities flooding one intake together
// fill maxIntakeTotal bytes; past that an identity is taken only within
// its fair share of it (the total over the identities waiting), so one
// more flooder is refused as an overload at its share, and another
// runner with nothing waiting is still taken, and served: a crowd of
// flooders cannot lock it out.
func TestIntakeBoundedInAll(t *testing.T) {
	t.Parallel()
	padders := []string{"pad-0", "pad-1", "pad-2", "pad-3", "pad-4"}
	b := startIdentityBus(t, append([]string{"victim"}, padders...)...)
	ctx := ctxFor(t, 2*time.Minute)
	victim := NewClient(b.holders["victim"])
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: "github.com/acme/victim", Scope: claim(t, "docs/"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err)
	}
	release := holdIntakes(t, b.service, "acquire")
	const each = 16 // of 1 MB each: one more than an identity's share
	data := []byte(strings.Repeat("p", 1<<20))
	fair := 0
	var floods []*nats.Subscription
	for i, name := range padders {
		answers := floodRequests(t, b.holders[name], "acquire", data, each)
		floods = append(floods, answers)
		n := settledOverloads(t, b.service, "acquire", IdentityOf(b.holders[name]), answers, each)
		for range each - n {
			err := decodeReply(t, nextMsg(t, answers)).Error.err()
			if !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "overloaded") {
				t.Fatalf("%s's request past the bound answered %v, want refused as an overload", name, err)
			}
			if strings.Contains(err.Error(), "at most a fair share") {
				fair++
			}
		}
		if _, total := intakeHolds(b.service, "acquire", "*"); i == len(padders)-1 && (total <= maxIntakeTotal || n >= each-1) {
			t.Fatalf("%d of the last flooder's requests taken, %d bytes waiting in all: want the total past %d and the last flooder held to its fair share", n, total, maxIntakeTotal)
		}
	}
	_, total := intakeHolds(b.service, "acquire", "*")
	if fair == 0 || total > 2*maxIntakeTotal {
		t.Fatalf("%d bytes wait in all, %d requests refused at their fair share: want refusals, and at most twice %d", total, fair, maxIntakeTotal)
	}

	// The victim has nothing waiting: its acquire is taken past the bound.
	l, acquireErr := acquireWhileHeld(ctx, t, b, victim, release)
	if acquireErr != nil || l.Owner != owner(2) {
		t.Fatalf("the victim's acquire behind the floods: %+v, %v", l, acquireErr)
	}
	// Served, every flood's request leaves the intake's count with it.
	checkFor(t, time.Minute, 10*time.Millisecond, func() error {
		if n, size := intakeHolds(b.service, "acquire", "*"); n > 0 || size != 0 {
			return fmt.Errorf("%d requests of %d bytes still wait", n, size)
		}
		return nil
	})
	for _, answers := range floods {
		_ = answers.Unsubscribe()
	}
}

// nextMsg is the next message on sub.
func nextMsg(t *testing.T, sub *nats.Subscription) *nats.Msg {
	t.Helper()
	m, err := sub.NextMsg(time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	return m
}

// decodeReply is the service's answer in m.
func decodeReply(t *testing.T, m *nats.Msg) reply {
	t.Helper()
	var r reply
	if err := json.Unmarshal(m.Data, &r); err != nil {
		t.Fatalf("an answer %q: %v", m.Data, err)
	}
	return r
}
