package leasebus

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

// startStockIdentityBus is startIdentityBus on a nats-server configured
// as an operator configures one of their own: the configuration `bus
// creds` prints, and every other setting nats-server's default (a
// message of at most 1 MB, where the embedded server takes 8).
func startStockIdentityBus(t *testing.T, cfg ServiceConfig, names ...string) *identityBus {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	if _, err := EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if _, _, err := EnrollIdentity(dir, n, RoleHolder, ""); err != nil {
			t.Fatal(err)
		}
	}
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
	b := &identityBus{url: srv.ClientURL(), dir: dir, holders: map[string]*nats.Conn{}, cfg: cfg}
	b.svc = connectFile(t, b.url, filepath.Join(dir, CredsFile(RoleService)))
	cfg.Names = NamesIn(dir)
	svc, err := StartService(context.Background(), b.svc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.service.Stop() })
	b.service = svc
	for _, n := range names {
		b.holders[n] = connectFile(t, b.url, filepath.Join(HoldersDir(dir), n+".nk"))
	}
	return b
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
		if err := tx.roomFor(r, cr, func(string) (int, int) { return 0, 0 }); err != nil {
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
// could grow every instance's memory one made-up repo at a time. What one
// identity holds across repos is bounded too (MaxHeldBytes); past it its
// acquires are refused, naming it, another runner's are not, and a
// release makes room again.
func TestOneRunnerCannotHoldEveryRepo(t *testing.T) {
	t.Parallel()
	const most = 256 << 10
	b := startIdentityBusWith(t, ServiceConfig{MaxHeldBytes: most}, "victim", "attacker")
	ctx := ctxT(t)
	victim, attacker := NewClient(b.holders["victim"]), NewClient(b.holders["attacker"])
	type held struct {
		id   string
		cred Credential
	}
	var mine []held
	var refused error
	for i := range 2 * most / (30 << 10) {
		cred := NewCredential()
		l, err := attacker.Acquire(ctx, AcquireRequest{Repo: fmt.Sprintf("made-up-%d", i), Scope: padClaim("a", 900, 32, "x"), Owner: owner(i), TTL: lease.Duration(time.Hour)}, cred)
		if err != nil {
			refused = err
			break
		}
		mine = append(mine, held{l.LeaseID, cred})
	}
	if refused == nil || !errors.Is(refused, lease.ErrUnavailable) || !strings.Contains(refused.Error(), "attacker") || !strings.Contains(refused.Error(), "across its repos") {
		t.Fatalf("the attacker's acquire past what an identity may hold, after %d leases of 30 KB: %v, want unavailable naming it", len(mine), refused)
	}
	if len(mine)*(30<<10) > most {
		t.Fatalf("the attacker held %d leases of 30 KB across repos, past the %d KB an identity may", len(mine), most>>10)
	}
	if _, err := victim.Acquire(ctx, AcquireRequest{Repo: "made-up-0", Scope: padClaim("v", 900, 32, "v"), Owner: owner(999), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
		t.Fatalf("the victim's acquire beside the attacker's leases: %v", err)
	}
	if _, err := attacker.Release(ctx, mine[0].id, mine[0].cred); err != nil {
		t.Fatal(err)
	}
	if _, err := attacker.Acquire(ctx, AcquireRequest{Repo: "made-up-again", Scope: padClaim("a", 900, 32, "x"), Owner: owner(1000), TTL: lease.Duration(time.Hour)}, NewCredential()); err != nil {
		t.Fatalf("the attacker's acquire after a release made room: %v", err)
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
