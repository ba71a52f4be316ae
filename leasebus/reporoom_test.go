package leasebus

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// startStockIdentityBus is startIdentityBus on a nats-server configured
// as an operator configures one of their own: the configuration `bus
// creds` prints, and every other setting nats-server's default (a
// message of at most 1 MB, where the embedded server takes 8).
func startStockIdentityBus(t *testing.T, cfg ServiceConfig, names ...string) *identityBus {
	t.Helper()
	dir := enrolledCreds(t, names...)
	users, err := ServerUsers(dir)
	if err != nil {
		t.Fatal(err)
	}
	conf, err := AuthConfig(users)
	if err != nil {
		t.Fatal(err)
	}
	opts := &server.Options{}
	if err := opts.ProcessConfigString("listen: 127.0.0.1:-1\njetstream { store_dir: " + strconv.Quote(t.TempDir()) + " }\n" + conf); err != nil {
		t.Fatal(err)
	}
	opts.NoLog, opts.NoSigs = true, true
	srv, err := server.NewServer(opts)
	if err != nil {
		t.Fatal(err)
	}
	srv.Start()
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	if !srv.ReadyForConnections(10 * time.Second) {
		t.Fatal("nats-server did not start")
	}
	return serveIdentityBus(t, srv.ClientURL(), dir, cfg, names...)
}

// TestOneRunnerCannotOutgrowItsRepo: a repo's whole state is one log
// record (its snapshot) and one answer (a list, which the git fence asks
// before each push), and neither may be larger than the bus's largest
// message. A runner that held ever more leases of large claims in a repo
// made its snapshot too large to write on an operator's nats-server (1 MB
// messages): every list of the repo then failed, and once the stream had
// dropped the last snapshot the repo could write, no instance could load
// it again. Each identity now holds at most a share of the repo's room,
// the room is what one record can carry, and the attacker is refused
// past its share, naming it, while the other runner works on, before and
// after a restart of the service.
func TestOneRunnerCannotOutgrowItsRepo(t *testing.T) {
	t.Parallel()
	b := startStockIdentityBus(t, ServiceConfig{}, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	room := repoRoomOf(b.svc)

	// Claims of about 30 KB each: at most 1,024 items and 32 KB a claim.
	held, refused := 0, error(nil)
	for i := range 2 * room / (30 << 10) {
		_, err := attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: padClaim(fmt.Sprintf("a%03d", i), 900, 32, "x"), Owner: owner(i), TTL: lease.Duration(time.Hour)}, NewCredential())
		if err != nil {
			refused = err
			break
		}
		held++
	}
	if refused == nil {
		t.Fatalf("the attacker was granted %d leases of 30 KB claims in one repo (its room %d KB), none refused", held, room>>10)
	}
	if !errors.Is(refused, lease.ErrUnavailable) || !strings.Contains(refused.Error(), "attacker") || !strings.Contains(refused.Error(), "share") {
		t.Fatalf("the attacker's acquire past its share: %v, want unavailable, naming the identity and its share", refused)
	}
	if held*(30<<10) > room/2 {
		t.Fatalf("the attacker held %d leases of 30 KB before a refusal: more than its share of the repo's %d KB", held, room>>10)
	}

	mine, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: padClaim("victim", 900, 32, "v"), Owner: owner(999), TTL: lease.Duration(time.Hour)}, NewCredential())
	if err != nil {
		t.Fatalf("the victim's acquire beside the attacker's leases: %v", err)
	}
	list := func() {
		t.Helper()
		ls, err := victim.List(ctx, repo, true)
		if err != nil {
			t.Fatalf("list of the repo: %v", err)
		}
		if len(ls) < held+1 {
			t.Fatalf("list of the repo: %d leases, want the attacker's %d and the victim's", len(ls), held)
		}
	}
	list()

	// Enough records that the stream keeps none from before the
	// attacker's leases: a fresh instance must load the repo from a
	// snapshot written since.
	for i := range logKeep/2 + 8 {
		cred := NewCredential()
		l, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("churn/%d", i)), Owner: owner(1000 + i), TTL: lease.Duration(time.Minute)}, cred)
		if err != nil {
			t.Fatalf("churn %d: %v", i, err)
		}
		if _, err := victim.Release(ctx, l.LeaseID, cred); err != nil {
			t.Fatalf("churn %d: %v", i, err)
		}
	}
	b.restartService(t)
	list()
	if _, err := victim.Get(ctx, mine.LeaseID); err != nil {
		t.Fatalf("the victim's lease after a restart: %v", err)
	}
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "after"), Owner: owner(2000), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatalf("an acquire after a restart: %v", err)
	}
}

// entrySize bounds what an entry takes in a record (the room's
// accounting rests on it): here one with every field at its longest and
// in characters the encoder escapes.
func TestEntrySizeBoundsItsRecord(t *testing.T) {
	long := strings.Repeat("&\"\u2028", maxIDField/6)
	c := padClaim("d", MaxClaimItems/2, 24, "&")
	e := &entry{
		Lease: lease.Lease{LeaseID: long, Repo: strings.Repeat("<", maxRepoName), Scope: c, WorkspaceID: long, WorkspaceMode: "exclusive",
			Owner: lease.Owner{TaskID: long, AgentID: long, AttemptID: long, HostID: long}, Status: lease.StatusRevoked, Version: 1 << 62, Fence: 1 << 62,
			AcquiredAt: time.Now(), RenewedAt: time.Now(), ExpiresAt: time.Now(), EndedAt: time.Now(), TTL: lease.Duration(MaxTTL), Reason: strings.Repeat("\\", maxRevokeReason)},
		SecretHash: strings.Repeat("f", 64), RequestID: long, RenewID: long, Holder: strings.Repeat("U", 56), Session: long,
	}
	if got, bound := len(e.storedJSON()), entrySize(e); got > bound {
		t.Fatalf("an entry takes %d bytes in a record, entrySize says at most %d", got, bound)
	}
}

// A repo forgets the ended leases it remembers past its room, oldest
// first; a batch's grants count against the room and the identity's
// share as they are made, and another identity's grant still fits.
func TestRepoRoomForgetsEndedAndSharesTheRest(t *testing.T) {
	now := time.Now()
	st := newRepoState(repo)
	st.room = 64 << 10
	for i := range 40 {
		e := &entry{Lease: lease.Lease{LeaseID: fmt.Sprintf("L%02d", i), Repo: repo, Scope: padClaim(fmt.Sprintf("e%02d", i), 100, 24, "x"), Status: lease.StatusReleased}, Holder: "A"}
		st.put(e, now)
		if st.bytes > st.room {
			t.Fatalf("after %d ended leases the repo remembers %d bytes of them, past its room %d", i+1, st.bytes, st.room)
		}
	}
	if _, ok := st.ended["L00"]; ok {
		t.Fatal("the oldest ended lease is remembered past the room")
	}
	if _, ok := st.ended["L39"]; !ok {
		t.Fatal("the newest ended lease is forgotten")
	}

	tx := st.begin(now)
	ask := func(by string, i int) error {
		r := &AcquireRequest{Repo: repo, Scope: padClaim(fmt.Sprintf("%s%02d", by, i), 100, 24, "y"), Owner: owner(i), TTL: lease.Duration(time.Minute)}
		r.by, r.byName = by, "runner-"+by
		cr := claimRequest{scope: r.Scope}
		if err := tx.roomFor(r, cr, func(*txn, string, int) (int, int, bool) { return 0, 0, true }); err != nil {
			return err
		}
		tx.grant(r, cr)
		return nil
	}
	granted := 0
	var err error
	for ; granted < 100; granted++ {
		if err = ask("A", granted); err != nil {
			break
		}
	}
	if err == nil || !errors.Is(err, lease.ErrUnavailable) || !strings.Contains(err.Error(), "runner-A") || !strings.Contains(err.Error(), "share") {
		t.Fatalf("A's grants past its share: %v after %d, want unavailable naming runner-A and its share", err, granted)
	}
	if taken := tx.addedBy["A"]; taken > st.room/roomShare {
		t.Fatalf("A's grants in the batch take %d bytes, past its share %d", taken, st.room/roomShare)
	}
	if err := ask("B", 0); err != nil {
		t.Fatalf("B's grant beside A's: %v", err)
	}
	// Many identities together fill the repo's room, not more.
	var full error
	for _, by := range []string{"C", "D", "E", "F", "G"} {
		for i := range 100 {
			if err := ask(by, i); err != nil {
				if !strings.Contains(err.Error(), "share") {
					full = err
				}
				break
			}
		}
	}
	if full == nil || !strings.Contains(full.Error(), "active leases of repo") {
		t.Fatalf("grants of many identities past the repo's room: %v, want a refusal naming the repo's room", full)
	}
	if used := st.active + tx.added; used > st.room {
		t.Fatalf("the batch's grants take the repo's leases to %d bytes, past its room %d", used, st.room)
	}
}

// TestOneRunnerCannotHoldEveryRepo: repo names are the asker's to choose,
// so a share of each repo's room bounds nothing across repos: a runner
// could grow every instance's memory one made-up repo at a time, by the
// leases it holds and by those it released, which each repo remembers
// for a while. What one identity's leases take across repos is bounded
// (MaxHeldBytes), released ones included until their repos forget them;
// past it its acquires are refused, naming it, and another runner's are
// not.
func TestOneRunnerCannotHoldEveryRepo(t *testing.T) {
	t.Parallel()
	const most = 256 << 10
	b := startIdentityBusWith(t, ServiceConfig{MaxHeldBytes: most}, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	cycles := 0
	var refused error
	for i := range 2 * most / (30 << 10) {
		cred := NewCredential()
		l, err := attacker.Acquire(ctx, AcquireRequest{Repo: fmt.Sprintf("made-up-%d", i), Scope: padClaim("a", 900, 32, "x"), Owner: owner(i), TTL: lease.Duration(time.Hour)}, cred)
		if err != nil {
			refused = err
			break
		}
		if i%2 == 1 { // every other one released: it holds half, and the repo remembers the rest
			if _, err := attacker.Release(ctx, l.LeaseID, cred); err != nil {
				t.Fatal(err)
			}
		}
		cycles++
	}
	if refused == nil || !errors.Is(refused, lease.ErrUnavailable) || !strings.Contains(refused.Error(), "attacker") || !strings.Contains(refused.Error(), "across its repos") {
		t.Fatalf("the attacker's acquire past what an identity may hold, after %d leases of 30 KB: %v, want unavailable naming it", cycles, refused)
	}
	if cycles*(30<<10) > most {
		t.Fatalf("the attacker held or had released %d leases of 30 KB across repos, past the %d KB an identity may", cycles, most>>10)
	}
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: "made-up-0", Scope: padClaim("v", 900, 32, "v"), Owner: owner(999), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
		t.Fatalf("the victim's acquire beside the attacker's leases: %v", err)
	}
	// Once the repos forget what it released, it has room again.
	for _, a := range b.service.allActors() {
		a.busy.Lock()
		a.forgetEnded(time.Now().Add(endedKeep + time.Second))
		a.busy.Unlock()
	}
	if _, err := attacker.Acquire(ctx, AcquireRequest{Repo: "made-up-again", Scope: padClaim("a", 900, 32, "x"), Owner: owner(1000), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
		t.Fatalf("the attacker's acquire once its repos forgot its released leases: %v", err)
	}
}

// A list of every repo can be larger than the bus's largest message (a
// fleet's leases on a NATS server's default 1 MB): the asker is told so,
// and what to ask instead, rather than left to time out.
func TestListTooLargeForTheBusSaysSo(t *testing.T) {
	t.Parallel()
	b := startStockIdentityBus(t, ServiceConfig{}, "runner")
	ctx := ctxT(t)
	c := NewClient(b.holders["runner"])
	for i := range 40 {
		if _, err := c.Acquire(ctx, AcquireRequest{Repo: fmt.Sprintf("repo-%d", i), Scope: padClaim("a", 900, 32, "x"), Owner: owner(i), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
			t.Fatal(err)
		}
	}
	began := time.Now()
	_, err := c.List(ctx, "", false)
	if !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "largest message") || !strings.Contains(err.Error(), "one repo") {
		t.Fatalf("a list of every repo, about 1.2 MB: %v, want invalid, saying it is larger than the bus takes and what to ask", err)
	}
	if d := time.Since(began); d > c.Timeout/2 {
		t.Fatalf("the too-large list was answered after %s: the asker waited for its timeout", d)
	}
	if ls, err := c.List(ctx, "repo-0", false); err != nil || len(ls) != 1 {
		t.Fatalf("a list of one repo: %d leases, %v", len(ls), err)
	}
}

// A renewal's id is in the lease's record from then on, and no renewal
// checks the repo's room again: one of 256 '<' (six bytes each as the
// record escapes them) grew a lease by 1.5 KB after its grant was
// counted. Renewal ids are now what a client makes: short, and of
// characters the record carries as they are.
func TestRenewalIDCannotGrowALease(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "runner")
	ctx := ctxT(t)
	c := NewClient(b.holders["runner"])
	cred := NewCredential()
	l, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range []string{strings.Repeat("<", 60), strings.Repeat("r", maxRenewID+1), "renew me"} {
		if _, err := c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version, RenewID: id}); !errors.Is(err, lease.ErrInvalid) {
			t.Fatalf("a renewal with id %q: %v, want invalid", id, err)
		}
	}
	if _, err := c.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: cred, Version: l.Version}); err != nil {
		t.Fatalf("a renewal with the client's own id: %v", err)
	}
}

// TestConflictAnswersFitTheBus: a refusal for conflicts quoted each
// conflicting lease's whole claim and every pair that overlaps, so a
// runner holding a couple of dozen leases of long claims (within its
// share of the repo) made another runner's whole-repo acquire answer
// larger than a NATS server's 1 MB: the victim was told its request was
// invalid instead of that it conflicts. Answers now list a bounded number
// of conflicts, each clipped, and say how many more.
func TestConflictAnswersFitTheBus(t *testing.T) {
	t.Parallel()
	b := startStockIdentityBus(t, ServiceConfig{}, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	held := 0
	for i := range 40 {
		c := scope.Claim{Kind: scope.KindPaths, Tables: []string{}}
		for j := range MaxClaimItems {
			c.Paths = append(c.Paths, fmt.Sprintf("%c%04d", 'a'+i%26, j+i/26*MaxClaimItems))
		}
		if _, err := attacker.Acquire(ctx, AcquireRequest{Repo: repo, Scope: c, Owner: owner(i), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
			break
		}
		held++
	}
	if held < 20 {
		t.Fatalf("the attacker holds %d leases of %d paths: too few for the attack", held, MaxClaimItems)
	}
	_, err := victim.Acquire(ctx, AcquireRequest{Repo: repo, Scope: scope.Claim{Kind: scope.KindWholeRepo}, Owner: owner(100), TTL: lease.Duration(time.Minute)}, NewCredential())
	var ce *lease.ConflictError
	if !errors.As(err, &ce) {
		t.Fatalf("a whole-repo acquire beside %d leases of long claims: %v, want a conflict", held, err)
	}
	listed := len(ce.Conflicts) + ce.More
	if listed != held {
		t.Fatalf("the conflict names %d leases (%d listed, %d more), want the attacker's %d", listed, len(ce.Conflicts), ce.More, held)
	}
	for _, c := range ce.Conflicts {
		if n := len(c.Scope.Paths) + len(c.Scope.Tables); n > maxConflictItems || len(c.Why) > maxConflictWhy+64 {
			t.Fatalf("a conflict quotes %d paths and %d bytes of why: want at most %d and about %d", n, len(c.Why), maxConflictItems, maxConflictWhy)
		}
	}
}

// Batches of many repos run at once, each checking an identity's
// holdings across repos: checked against the lease index alone, each saw
// the same total and all of them granted up to the bound. They reserve
// what they grant, under one lock, until the index counts it; the same
// for acquires queued to wait.
func TestReservationsBoundConcurrentBatches(t *testing.T) {
	s := &Service{}
	if _, ok := s.reserveHeld("A", 600, 1000); !ok {
		t.Fatal("a first batch's 600 of 1000 refused")
	}
	if _, ok := s.reserveHeld("A", 600, 1000); ok {
		t.Fatal("a second batch at once took the identity to 1200 of 1000")
	}
	if _, ok := s.reserveHeld("B", 600, 1000); !ok {
		t.Fatal("another identity's batch refused")
	}
	s.unreserve(map[string]int{"A": 600, "B": 600}, nil)
	if len(s.reserved) != 0 {
		t.Fatalf("reservations left after every batch returned its own: %v", s.reserved)
	}
	var ws []*waiter
	for range maxWaitingAcross {
		if _, ok := s.reserveWait("A"); !ok {
			t.Fatalf("waiting acquire %d of %d refused", len(ws)+1, maxWaitingAcross)
		}
		ws = append(ws, &waiter{c: &call{by: "A"}})
	}
	if _, ok := s.reserveWait("A"); ok {
		t.Fatalf("a waiting acquire past %d queued", maxWaitingAcross)
	}
	// The batches commit: their waiters are the actors' now.
	s.waitersChanged(nil, ws)
	s.unreserve(nil, map[string]int{"A": maxWaitingAcross})
	if n, ok := s.reserveWait("A"); ok || n != maxWaitingAcross {
		t.Fatalf("with %d waiting at the actors: %d counted, refused %v", maxWaitingAcross, n, !ok)
	}
	s.waitersChanged(ws, ws[1:]) // one answered
	if _, ok := s.reserveWait("A"); !ok {
		t.Fatal("a waiting acquire refused after one was answered")
	}
	s.unreserve(nil, map[string]int{"A": 1})
	s.waitersChanged(ws[1:], nil)
	if len(s.waitingBy) != 0 || len(s.parking) != 0 {
		t.Fatalf("counts left with nothing waiting: %v %v", s.waitingBy, s.parking)
	}
}

// settled waits until svc holds no reservation of a batch and counts
// want waiting acquires: a batch returns what it reserved however it ends.
func settled(t *testing.T, svc *Service, want int) {
	t.Helper()
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		svc.mu.Lock()
		defer svc.mu.Unlock()
		waiting := 0
		for _, n := range svc.waitingBy {
			waiting += n
		}
		if len(svc.reserved) != 0 || len(svc.parking) != 0 || waiting != want {
			return fmt.Errorf("reserved %v, parking %v, waiting %v (want %d)", svc.reserved, svc.parking, svc.waitingBy, want)
		}
		return nil
	})
}

// What an identity holds and has waiting across repos is counted as its
// leases and waiters come and go, whichever way a waiter ends.
func TestHeldAndWaitingCountedThroughTheirEnds(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "a", "b")
	ctx := ctxT(t)
	ca, cb := NewClient(b.holders["a"]), NewClient(b.holders["b"])
	cred := NewCredential()
	l, err := ca.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "x"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	settled(t, b.service, 0)
	b.service.mu.Lock()
	h := b.service.heldBy[IdentityOf(b.holders["a"])]
	b.service.mu.Unlock()
	if h == 0 {
		t.Fatal("a's lease is not counted as held")
	}
	// b waits behind it: once until its wait ends, once until a releases.
	if _, err := cb.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "x"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(300 * time.Millisecond)}, NewCredential()); !errors.Is(err, lease.ErrConflict) {
		t.Fatalf("b's acquire behind a's lease: %v, want a conflict after its wait", err)
	}
	settled(t, b.service, 0)
	done := make(chan error, 1)
	go func() {
		_, err := cb.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "x"), Owner: owner(2), TTL: lease.Duration(time.Minute), Wait: lease.Duration(time.Minute)}, NewCredential())
		done <- err
	}()
	settled(t, b.service, 1)
	if _, err := ca.Release(ctx, l.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("b's acquire once a released: %v", err)
	}
	settled(t, b.service, 0)
	held := func(name string) int {
		b.service.mu.Lock()
		defer b.service.mu.Unlock()
		return b.service.heldBy[IdentityOf(b.holders[name])]
	}
	if held("a") == 0 {
		t.Fatal("a's released lease is not counted while its repo remembers it")
	}
	if held("b") == 0 {
		t.Fatal("b's lease is not counted as held")
	}
	a := b.service.actor(RepoKey(repo), repo)
	a.busy.Lock()
	a.forgetEnded(time.Now().Add(endedKeep + time.Second))
	a.busy.Unlock()
	if h := held("a"); h != 0 {
		t.Fatalf("a's released lease still counted once its repo forgot it: %d bytes", h)
	}
	if held("b") == 0 {
		t.Fatal("b's lease is not counted as held")
	}
}

// An acquire that waits, and any call queued at a repo, keeps its request
// in the service's memory, and a request could be padded with fields
// nobody reads up to the bus's largest message (8 MB embedded), thousands
// of them a repo: requests past what their kind takes are refused as
// invalid, naming the bound.
func TestPaddedAcquireRefused(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "runner")
	ctx := ctxT(t)
	c := NewClient(b.holders["runner"])
	req := AcquireRequest{Repo: repo, Scope: claim(t, "a"), Owner: owner(1), TTL: lease.Duration(time.Minute), CredentialHash: NewCredential().hash(), RequestID: NewRequestID()}
	padded := struct {
		AcquireRequest
		Pad string `json:"pad"`
	}{req, strings.Repeat("x", maxAcquireRequest)}
	r, err := c.request(ctx, "acquire", padded, 0)
	if err == nil {
		err = r.Error.err()
	}
	if !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "at most 128 KB") {
		t.Fatalf("an acquire padded past %d KB: %v, want invalid naming the bound", maxAcquireRequest>>10, err)
	}
	if r, err := c.request(ctx, "acquire", req, 0); err != nil || r.Error != nil {
		t.Fatalf("the same acquire unpadded: %v %v", err, r.Error)
	}
	// So is a call that names a lease, which waits in its repo's queue.
	release := struct {
		ReleaseRequest
		Pad string `json:"pad"`
	}{ReleaseRequest{LeaseID: "lease_x", Repo: repo}, strings.Repeat("x", maxLeaseRequest)}
	r, err = c.request(ctx, "release", release, 0)
	if err == nil {
		err = r.Error.err()
	}
	if !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "at most 16 KB") {
		t.Fatalf("a release padded past %d KB: %v, want invalid naming the bound", maxLeaseRequest>>10, err)
	}
}
