package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats-server/v2/server"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// requests is how many op requests the service answered with result.
func requests(m *ServiceMetrics, op, result string) int {
	return int(promtest.ToFloat64(m.requests.WithLabelValues(op, result)))
}

// TestOneKeepalivePerSession: a client holding many leases keeps them all
// alive with one keepalive for the session, not a request per lease, and
// each holder still hears the service through it (and through the beats
// that follow it: TestBeatsVouchBetweenKeepalives).
func TestOneKeepalivePerSession(t *testing.T) {
	t.Parallel()
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	const holders = 20
	hs := make([]*Holder, holders)
	for i := range hs {
		h, err := b.c.AcquireAndHold(ctx, AcquireRequest{Repo: fmt.Sprintf("github.com/acme/keep-%d", i%4), Scope: claim(t, fmt.Sprintf("svc/%d", i)), Owner: owner(i), TTL: lease.Duration(time.Minute)}, NewCredential(), HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer h.Orphan()
		hs[i] = h
	}
	gets := requests(m, "get", "ok") // each holder's one confirming get
	const beats = 3
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if n := requests(m, "keepalive", "ok"); n < beats {
			return fmt.Errorf("%d keepalives answered, waiting for %d", n, beats)
		}
		return nil
	})
	if more := requests(m, "get", "ok") - gets; more > 0 {
		t.Errorf("%d gets while %d holders beat: heartbeats went per lease", more, holders)
	}
	// Each beat asked after every lease: every holder heard recently.
	for _, h := range hs {
		if _, err := h.Fence(); err != nil {
			t.Errorf("holder of %s: %v", h.Lease().LeaseID, err)
		}
	}
}

// The killed runner: a real process that acquires and holds a lease, then
// is killed with SIGKILL. Its scope comes back within 15 s although its
// TTL is 5 minutes, at the service's default grace.

const (
	envHoldURL   = "FENCELINE_TEST_HOLD_URL"
	envHoldCreds = "FENCELINE_TEST_HOLD_CREDS"
	envHoldRepo  = "FENCELINE_TEST_HOLD_REPO"
)

// waitEnded waits until c's lease service says lease id is no longer
// active, and returns its record.
func waitEnded(t *testing.T, c *Client, id string, within time.Duration) *lease.Lease {
	t.Helper()
	var ended *lease.Lease
	checkFor(t, within, 50*time.Millisecond, func() error {
		l, err := c.Get(ctxT(t), id)
		if err != nil {
			return err
		}
		if l.Active() {
			return fmt.Errorf("%s still active", id)
		}
		ended = l
		return nil
	})
	return ended
}

// checkAudited waits until the repo's audit holds exactly one event of
// type typ with reason for the lease.
func checkAudited(t *testing.T, b *bus, repo, leaseID, typ, reason string) {
	t.Helper()
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctxT(t), b.nc, repo, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.LeaseID == leaseID && ev.Type == typ && ev.Reason == reason {
				n++
			}
		}
		if n != 1 {
			return fmt.Errorf("%d %s events (%s) for %s in the audit, want 1", n, typ, reason, leaseID)
		}
		return nil
	})
}

type discard struct{}

func (discard) Write(p []byte) (int, error) { return len(p), nil }

// TestSessionNoticesOneSubscription: the holders of one session hear the
// service's change notices on one subscription under their identity's
// inbox, none on their leases' own change subjects (a subscription per
// held lease is propagated to every server of a cluster), and a notice
// there reaches the holder of the lease it names alone: a revoke makes
// that holder lost, and a notice the service contradicts leaves the
// other held after its re-check.
func TestSessionNoticesOneSubscription(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	c := NewClient(connect(t, b.srv.ClientURL())) // in the service account, where the test may forge a notice
	// What holder 0's OnChange says: its state and why.
	type change struct {
		state lease.HolderState
		why   string
	}
	changes := make(chan change, 64)
	hs := make([]*Holder, 3)
	for i := range hs {
		opts := HoldOptions{}
		if i == 0 {
			opts.OnChange = func(s lease.HolderState, err error) {
				why := ""
				if err != nil {
					why = err.Error()
				}
				changes <- change{s, why}
			}
		}
		h, err := c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("notice-%d", i)), Owner: owner(1), TTL: lease.Duration(time.Minute)},
			NewCredential(), opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.Orphan)
		hs[i] = h
	}
	subs := func(subject string) int {
		t.Helper()
		sz, err := b.srv.Subsz(&server.SubszOptions{Subscriptions: true, Test: subject, Limit: 1024})
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for _, s := range sz.Subs {
			if s.Queue == "" && s.Cid == clientID(t, c) {
				n++
			}
		}
		return n
	}
	notices := sessionNotices(inboxBase(c.nc), c.SessionID())
	if n := subs(notices); n != 1 {
		t.Fatalf("%d subscriptions of the client hear %s: want one for the session", n, notices)
	}
	for _, h := range hs {
		l := h.Lease()
		if n := subs(ChangedSubject(l.Repo, l.LeaseID)); n != 0 {
			t.Fatalf("%d subscriptions of the client on %s: a session's holder needs none of its own", n, ChangedSubject(l.Repo, l.LeaseID))
		}
	}

	// A forged notice on the session's subject (here from the service's
	// own connection, which may publish anywhere): holder 0 doubts, asks,
	// and is held again; the others hear nothing.
	forged := hs[0].Lease()
	forged.Status, forged.Version, forged.Reason = lease.StatusRevoked, forged.Version+1000, "forged by a test"
	data, err := json.Marshal(forged)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.nc.Publish(notices, data); err != nil {
		t.Fatal(err)
	}
	// (A loaded machine may make the holder doubt for a late keepalive
	// too: what counts is the doubt the notice caused, then Held.)
	timeout := time.After(10 * time.Second)
	for doubted := false; ; {
		select {
		case ch := <-changes:
			switch {
			case ch.state == lease.Unknown && strings.Contains(ch.why, "announced revoked"):
				doubted = true
			case ch.state == lease.Lost:
				t.Fatalf("a notice the service contradicts lost the holder its lease: %s", ch.why)
			}
			if !doubted || ch.state != lease.Held {
				continue
			}
		case <-timeout:
			st, err := hs[0].State()
			t.Fatalf("the notice on the session's subject did not make holder 0 doubt and then hold again: it is %s (%v)", st, err)
		}
		break
	}

	// A revoke makes its holder lost, and only it.
	if _, err := b.c.Revoke(ctx, hs[1].Lease().LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-hs[1].Lost():
	case <-time.After(10 * time.Second):
		st, err := hs[1].State()
		t.Fatalf("holder of a revoked lease is %s: %v", st, err)
	}
	for _, i := range []int{0, 2} {
		if st, err := hs[i].State(); st != lease.Held {
			t.Errorf("holder %d is %s after another lease's notices: %v", i, st, err)
		}
	}

	// In the fleet account, as a runner: the service's notice of a revoke
	// arrives on the holder identity's session subject.
	// A renewal sends nothing there: a holder acts only on a lease's end,
	// and a fleet's renewals would be most of what it is sent.
	fleet := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	cred := NewCredential()
	h, err := fleet.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "notice-fleet"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, cred, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	heard, err := fleet.nc.SubscribeSync(sessionNotices(inboxBase(fleet.nc), fleet.SessionID()))
	if err != nil {
		t.Fatal(err)
	}
	if err := fleet.nc.Flush(); err != nil {
		t.Fatal(err)
	}
	renewed, err := fleet.Renew(ctx, RenewRequest{LeaseID: h.Lease().LeaseID, Repo: repo, Credential: cred, Version: h.Lease().Version})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.c.Revoke(ctx, h.Lease().LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	m, err := heard.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("no notice of the revoke on the fleet holder's session subject: %v", err)
	}
	var got lease.Lease
	if err := json.Unmarshal(m.Data, &got); err != nil || got.LeaseID != h.Lease().LeaseID || got.Status != lease.StatusRevoked || got.Version <= renewed.Version {
		t.Fatalf("first notice on the session's subject %s (%v): want the revoked record of %s after version %d (a renewal's record is not announced there)",
			m.Data, err, h.Lease().LeaseID, renewed.Version)
	}
}

// clientID is the server's id of c's connection.
func clientID(t *testing.T, c *Client) uint64 {
	t.Helper()
	id, err := c.nc.GetClientID()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

// TestKeepaliveSettlesSilence: a holder that stopped vouching because the
// service was silent is Held again on the session's next keepalive, with
// no renewal: renewing every doubting lease, a write apiece, is what turned
// a slow moment of a fleet's bus into a storm of appends.
func TestKeepaliveSettlesSilence(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	c := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	var offset atomic.Int64 // the holder's clock runs ahead of the real one by this
	clock := func() time.Time { return time.Now().Add(time.Duration(offset.Load())) }
	var renewals atomic.Int64
	changes := make(chan lease.HolderState, 64)
	h, err := c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "settle"), Owner: owner(1), TTL: lease.Duration(10 * time.Minute)}, NewCredential(),
		HoldOptions{Now: clock, Heartbeat: 5 * time.Second, Silence: 15 * time.Second,
			OnRenew:  func(time.Duration, error) { renewals.Add(1) },
			OnChange: func(s lease.HolderState, _ error) { changes <- s }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	version := h.Lease().Version
	// Past the silence on the holder's clock: the next write is refused.
	// (Should the session's own beat have just been answered, go further.)
	for tries := 0; ; tries++ {
		offset.Add(int64(20 * time.Second))
		if _, err := h.Fence(); errors.Is(err, lease.ErrLeaseUnknown) && strings.Contains(err.Error(), "no answer from the lease service") {
			break
		} else if tries == 5 {
			t.Fatalf("Fence after %s of silence: %v, want the silence refusal", time.Duration(offset.Load()), err)
		}
	}
	timeout := time.After(10 * time.Second)
	for held := false; !held; {
		select {
		case s := <-changes:
			held = s == lease.Held
		case <-timeout:
			st, err := h.State()
			t.Fatalf("the session's keepalive did not settle the silence within 10 s: %s (%v)", st, err)
		}
	}
	if _, err := h.Fence(); err != nil {
		t.Fatalf("Fence once settled: %v", err)
	}
	if n, v := renewals.Load(), h.Lease().Version; n != 0 || v != version {
		t.Fatalf("%d renewals (version %d, was %d): the keepalive alone was to settle the silence", n, v, version)
	}
}

// TestSettleOnlyOnALaterView: a keepalive's answer settles a doubt only
// if the view it vouches from was confirmed after the doubt arose, about
// the very record the holder holds.
func TestSettleOnlyOnALaterView(t *testing.T) {
	t.Parallel()
	now := time.Now()
	held := lease.Lease{LeaseID: "lease_test", Repo: repo, Status: lease.StatusActive, Version: 3, Fence: 7, TTL: lease.Duration(time.Minute)}
	h := &Holder{opts: HoldOptions{Now: time.Now, Silence: time.Second}, lease: held, state: lease.Held, validUntil: now.Add(time.Hour), lost: make(chan struct{})}
	state := func() lease.HolderState { // (State asks the connection too; this holder has none)
		h.mu.Lock()
		defer h.mu.Unlock()
		return h.state
	}
	h.mu.Lock()
	h.softDoubtLocked(errors.New("a doubt raised by the test"))
	at := h.doubtAt
	h.mu.Unlock()
	other := held
	other.Version++
	k := func(l lease.Lease) keptLease {
		return keptLease{LeaseID: l.LeaseID, Repo: l.Repo, Fence: l.Fence, Version: l.Version}
	}
	for _, c := range []struct {
		name      string
		l         lease.Lease
		confirmed time.Time
	}{
		{"a view confirmed before the doubt", held, at.Add(-time.Millisecond)},
		{"a view confirmed as the doubt arose", held, at},
		{"another version of the lease", other, at.Add(time.Second)},
	} {
		h.settle(k(c.l), c.confirmed)
		if st := state(); st != lease.Unknown {
			t.Fatalf("%s settled the doubt: %s", c.name, st)
		}
	}
	h.settle(k(held), at.Add(time.Millisecond))
	if st := state(); st != lease.Held {
		t.Fatalf("a later view of the held record did not settle the doubt: %s", st)
	}
}

// TestCompactKeepaliveAnswer: the answer to a compact keepalive lists only
// the leases it has more to say about (ended, another version, unknown to
// the service) and vouches for the rest in one KeptRest; an old-style
// keepalive still gets one answer per lease.
func TestCompactKeepaliveAnswer(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	c := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	var ls []*lease.Lease
	for i := range 3 {
		l, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, fmt.Sprintf("compact-%d", i)), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
	}
	if _, err := b.c.Revoke(ctx, ls[0].LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	missing := strings.Replace(ls[2].LeaseID, ls[2].LeaseID[len(ls[2].LeaseID)-4:], "0000", 1)
	req := keepaliveRequest{Session: c.SessionID(), Compact: true, Leases: []keptLease{
		{LeaseID: ls[0].LeaseID, Repo: repo, Fence: ls[0].Fence, Version: ls[0].Version}, // revoked since
		{LeaseID: ls[1].LeaseID, Repo: repo, Fence: ls[1].Fence, Version: ls[1].Version}, // as held
		{LeaseID: ls[2].LeaseID, Repo: repo, Fence: ls[2].Fence, Version: ls[2].Version}, // as held
		{LeaseID: missing, Repo: repo, Fence: 1, Version: 1},                             // no such lease
	}}
	r, err := c.request(ctx, "keepalive", &req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if r.KeptRest == nil {
		t.Fatalf("compact answer %+v: no KeptRest", r)
	}
	listed := map[string]keptAnswer{}
	for _, k := range r.Kept {
		listed[k.LeaseID] = k
	}
	if k, ok := listed[ls[0].LeaseID]; !ok || k.Lease == nil || k.Lease.Status != lease.StatusRevoked {
		t.Errorf("the revoked lease is not listed as revoked: %+v", k)
	}
	if k, ok := listed[missing]; !ok || !k.Missing && !k.Unknown {
		t.Errorf("a lease the service does not have is not listed as missing or unknown: %+v", k)
	}
	if len(r.Kept) != 2 {
		t.Errorf("compact answer lists %d leases (%+v), want the revoked one and the missing one only", len(r.Kept), r.Kept)
	}
	req.Compact = false
	r, err = c.request(ctx, "keepalive", &req, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(r.Kept) != 4 || r.KeptRest != nil {
		t.Errorf("old-style answer %+v: want one answer per lease and no KeptRest", r)
	}
}

// busWithGrace starts a single-node bus whose sessions have grace, with
// its service's metrics.
func busWithGrace(t *testing.T, grace time.Duration) (*bus, *ServiceMetrics) {
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m, SessionGrace: grace}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	return b, m
}

// reclaimsHeld is how many looks of the session reaper held off, for why.
func reclaimsHeld(m *ServiceMetrics, why string) int {
	return int(promtest.ToFloat64(m.held.WithLabelValues(why)))
}

// massRunners are the identities of the runners in the reaper's tests:
// enough that their sessions falling silent together can be many
// (massSilentIdentities).
var massRunners = []string{"runner-0", "runner-1", "runner-2", "runner-3"}

// holdEach acquires and holds, for each of names in turn, one lease in a
// session of its own (a client on a connection of its own), n in all.
func holdEach(ctx context.Context, t *testing.T, b *identityBus, n int, names ...string) []*Holder {
	t.Helper()
	hs := make([]*Holder, n)
	for i := range hs {
		c := NewClient(b.connectHolder(t, names[i%len(names)]))
		h, err := c.AcquireAndHold(ctx, AcquireRequest{Repo: fmt.Sprintf("github.com/acme/mass-%d", i%4), Scope: claim(t, fmt.Sprintf("svc/%s/%d", names[i%len(names)], i)), Owner: owner(i), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		hs[i] = h
	}
	return hs
}

// holdIn acquires and holds a lease on scope in repo, in c's session,
// for 5 minutes: longer than any reaper test waits.
func holdIn(ctx context.Context, t *testing.T, c *Client, repo, scope string) *Holder {
	t.Helper()
	h, err := c.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, scope), Owner: owner(1), TTL: lease.Duration(5 * time.Minute)}, NewCredential(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return h
}

// TestManySilentSessionsGetTheLongerGrace: one session falling silent
// among many that beat is reclaimed after the grace, as ever; many of
// several runners falling silent at once (a bus hiccup, a reconnect
// storm, not a fleet dying together) are held off and reclaimed only
// after massGraces times the grace — their holders stopped writing long
// before either way.
func TestManySilentSessionsGetTheLongerGrace(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	m := NewServiceMetrics()
	b := startIdentityBusWith(t, ServiceConfig{Metrics: m, SessionGrace: grace}, massRunners...)
	c := NewClient(b.holders[massRunners[0]])
	ctx := ctxFor(t, 3*time.Minute)
	held := func() int { return reclaimsHeld(m, "mass") }
	// Many without any one runner's (massSilentBesides): 31 silent of
	// four runners, 23 without the one with the most.
	hs := holdEach(ctx, t, b, 2*massSilentMin, massRunners...)

	lone := hs[0].Lease()
	orphaned := time.Now()
	hs[0].Orphan()
	if ended := waitEnded(t, c, lone.LeaseID, time.Minute); ended.Status != lease.StatusReclaimed {
		t.Fatalf("the one silent session's lease ended %s (%s), want reclaimed", ended.Status, ended.Reason)
	}
	// Taken for many, it would have waited the longer grace. (A hiccup of
	// the machine may make the others look silent for a moment too, and
	// a load may delay the reclaim: only both together mean the bug.)
	if took := time.Since(orphaned); took >= massGraces*grace && held() > 0 {
		t.Errorf("one silent session among %d that beat was taken for many: reclaimed after %s, %d looks held off", len(hs)-1, took.Round(time.Millisecond), held())
	}
	heldBefore := held()

	var ids []string
	for _, h := range hs[1:] {
		ids = append(ids, h.Lease().LeaseID)
	}
	stopped := time.Now() // before the first falls silent: each is silent from a heartbeat before its Orphan on
	var wg sync.WaitGroup
	for _, h := range hs[1:] {
		wg.Go(h.Orphan) // together, as a reconnect storm silences them
	}
	wg.Wait()
	checkFor(t, time.Minute, 20*time.Millisecond, func() error {
		if held() == heldBefore {
			return errors.New("the reaper has not yet found the silent sessions many")
		}
		return nil
	})
	// Found due at the grace, and held off: none is reclaimed before the
	// longer grace (checked only while the look is surely before it; a
	// keepalive may have been heard up to a heartbeat before stopped).
	for _, id := range ids {
		l, err := c.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if time.Since(stopped) < massGraces*grace-time.Second && !l.Active() {
			t.Errorf("%s ended (%s %s) %s after %d sessions fell silent at once, before the longer grace", id, l.Status, l.Reason, time.Since(stopped).Round(time.Millisecond), len(ids))
		}
	}
	for _, id := range ids {
		ended := waitEnded(t, c, id, 2*time.Minute)
		if ended.Status != lease.StatusReclaimed || !strings.Contains(ended.Reason, "keepalive") {
			t.Errorf("%s ended %s (%s), want reclaimed for its silent session", id, ended.Status, ended.Reason)
		}
	}
	if took := time.Since(stopped); took < massGraces*grace-DefaultHeartbeat {
		t.Errorf("reclaimed %s after the sessions fell silent, before the longer grace %s", took, massGraces*grace)
	}
}

// TestOneRunnerCannotHoldBackReclaims: the attack on the reaper's
// hold-offs. A runner (one bus identity) holding many sessions lets them
// all fall silent at the moment another runner dies, so that the reaper
// would take the silence for a bus hiccup and give every session the
// longer grace — the dead runners' scopes held three times as long. Here
// two runners die, so that with the attacker's the silence is of three
// identities, as a storm's may be. One identity's sessions are never
// many, nor do they make others' many (massSilentBesides): the dead
// runners' scopes are back after the grace, and the attacker's own
// sessions are reclaimed then too.
func TestOneRunnerCannotHoldBackReclaims(t *testing.T) {
	t.Parallel()
	const grace = 3 * time.Second
	m := NewServiceMetrics()
	b := startIdentityBusWith(t, ServiceConfig{Metrics: m, SessionGrace: grace}, "attacker", "victim", "victim2")
	ctx := ctxFor(t, 3*time.Minute)
	c := NewClient(b.holders["victim"])
	attacker := holdEach(ctx, t, b, massSilentMin+4, "attacker")
	victims := holdEach(ctx, t, b, 2, "victim", "victim2")

	stopped := time.Now()
	var wg sync.WaitGroup
	for _, h := range append(attacker, victims...) {
		wg.Go(h.Orphan)
	}
	wg.Wait()
	var ended *lease.Lease
	for _, v := range victims {
		ended = waitEnded(t, c, v.Lease().LeaseID, time.Minute)
		if ended.Status != lease.StatusReclaimed {
			t.Fatalf("a dead runner's lease ended %s (%s), want reclaimed", ended.Status, ended.Reason)
		}
	}
	took := time.Since(stopped)
	if n := reclaimsHeld(m, "mass"); n > 0 {
		t.Errorf("one runner's %d sessions falling silent were taken for many: %d looks gave every session the longer grace; the dead runner's scope came back after %s", len(attacker), n, took.Round(time.Millisecond))
	}
	if took >= massGraces*grace-time.Second {
		t.Errorf("the dead runner's scope came back %s after it died, with a grace of %s: held back by another runner's silence", took.Round(time.Millisecond), grace)
	}
	for _, h := range attacker {
		if ended := waitEnded(t, c, h.Lease().LeaseID, time.Minute); ended.Status != lease.StatusReclaimed {
			t.Errorf("the attacker's %s ended %s (%s), want reclaimed", h.Lease().LeaseID, ended.Status, ended.Reason)
		}
	}
}

func TestMassSilentBesidesTheMost(t *testing.T) {
	fleet := func(falling ...int) map[string]*silentCount {
		each := map[string]*silentCount{}
		for i, f := range falling {
			each[fmt.Sprint("runner-", i)] = &silentCount{sessions: max(f, 10), falling: f}
		}
		return each
	}
	for _, c := range []struct {
		name string
		each map[string]*silentCount
		want bool
	}{
		{"none", fleet(), false},
		{"a storm over eight runners", fleet(10, 10, 10, 10, 10, 10, 10, 10), true},
		{"one runner's forty beside two dead runners", fleet(40, 1, 1, 0, 0, 0), false},
		{"one runner's thousand beside two dead runners", fleet(1000, 1, 1), false},
		{"a storm over four runners, one with most", fleet(40, 6, 6, 6), true},
	} {
		if _, _, got := massSilentBesides(c.each); got != c.want {
			t.Errorf("%s: many = %v, want %v", c.name, got, c.want)
		}
	}
}

func TestMassSilent(t *testing.T) {
	for _, c := range []struct {
		silent, sessions, identities int
		want                         bool
	}{
		{0, 0, 0, false},
		{1, 1, 1, false}, // a lone runner killed: its scope back after the grace
		{massSilentMin - 1, massSilentMin - 1, massSilentIdentities, false},
		{massSilentMin, massSilentMin, massSilentIdentities, true},
		{massSilentMin, massSilentMin, massSilentIdentities - 1, false}, // a runner or two, however many sessions
		{5000, 5000, 1, false},
		{massSilentMin, massSilentMin * massSilentShare, massSilentIdentities, false}, // a tenth of a large fleet: a host's runners
		{massSilentMin, massSilentMin*massSilentShare - 1, massSilentIdentities, true},
		{5000, 10000, 8, true},
	} {
		if got := massSilent(c.silent, c.sessions, c.identities); got != c.want {
			t.Errorf("massSilent(%d of %d, %d identities) = %v, want %v", c.silent, c.sessions, c.identities, got, c.want)
		}
	}
}

// TestReapStalledForgivesThePause: an instance whose reaper ran late (its
// process or machine paused) did not hear the keepalives sent meanwhile:
// it reclaims nothing on that look, and the pause does not count as any
// session's silence; a session never heard counts from the instance's
// start, less the pause, too.
func TestReapStalledForgivesThePause(t *testing.T) {
	t0 := time.Now()
	s := &Service{live: newLiveness(10*time.Second, t0), log: slog.New(slog.NewTextHandler(discard{}, nil))}
	s.live.heard("id.sess", t0)
	if s.reapStalled(t0.Add(time.Second)) {
		t.Fatal("the first look counted as a stall")
	}
	if s.reapStalled(t0.Add(2 * time.Second)) {
		t.Fatal("a look on time counted as a stall")
	}
	const paused = 5 * time.Second
	s.lastReap = time.Now().Add(-(reapEvery + paused)) // the ticks stopped for a while
	now := t0.Add(8 * time.Second)
	if !s.reapStalled(now) {
		t.Fatal("a look after a pause did not count as a stall")
	}
	for _, key := range []string{"id.sess", "id.never-heard"} {
		if d := s.live.silent(key, now); d < 3*time.Second-100*time.Millisecond || d > 3*time.Second+100*time.Millisecond {
			t.Errorf("silence of %s after a %s pause, 8 s after it was last heard: %s, want about 3 s", key, paused, d)
		}
	}
}

// TestReclaimWaitsForUnreadKeepalives: while keepalives wait unread in the
// instance's subscriptions (it is behind, and a session's keepalive may be
// among them), the reaper reclaims only sessions silent for the longer
// grace — and does reclaim them, however long the backlog stands: a runner
// can flood the subscriptions, and must not hold a dead runner's scope by
// it. Once they are read, a silent session goes after the grace again.
func TestReclaimWaitsForUnreadKeepalives(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	b, m := busWithGrace(t, grace)
	ctx := ctxFor(t, 2*time.Minute)
	hold := func(scope string) *Holder { return holdIn(ctx, t, b.c, "github.com/acme/backlog", scope) }
	h := hold("billing")
	held := h.Lease()

	// A subscription of the instance's keepalives that nobody reads: a
	// backlog the size of a slow moment's, or of a flood.
	nc := connectAs(t, b.srv.ClientURL(), RoleService)
	unread, err := nc.SubscribeSync(apiPrefix + ".test-backlog")
	if err != nil {
		t.Fatal(err)
	}
	b.svc.mu.Lock()
	b.svc.keepaliveSubs = append(b.svc.keepaliveSubs, unread)
	b.svc.mu.Unlock()
	for range keepaliveBacklog + 1 {
		if err := nc.Publish(apiPrefix+".test-backlog", []byte("k")); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	stopped := time.Now()
	h.Orphan() // the session falls silent
	heldOff := func() int { return reclaimsHeld(m, "backlog") }
	checkFor(t, time.Minute, 20*time.Millisecond, func() error {
		if heldOff() < int(2*grace/reapEvery) { // past the grace, looked at and held off
			return fmt.Errorf("%d looks held off so far", heldOff())
		}
		return nil
	})
	if l, err := b.c.Get(ctx, held.LeaseID); err != nil || !l.Active() && time.Since(stopped) < massGraces*grace-time.Second {
		t.Fatalf("reclaimed %s after its session fell silent, while keepalives waited unread, before the longer grace: %v %v", time.Since(stopped).Round(time.Millisecond), l, err)
	}
	ended := waitEnded(t, b.c, held.LeaseID, time.Minute)
	if ended.Status != lease.StatusReclaimed {
		t.Errorf("ended %s (%s) while behind, want reclaimed after the longer grace", ended.Status, ended.Reason)
	}
	if took := time.Since(stopped); took < massGraces*grace-DefaultHeartbeat {
		t.Errorf("reclaimed %s after its session fell silent, while behind: before the longer grace %s", took, massGraces*grace)
	}
	if msgs, _, err := unread.Pending(); err != nil || msgs <= keepaliveBacklog {
		t.Fatalf("the backlog is gone (%d pending, %v): the reclaim above proves nothing", msgs, err)
	}

	if err := unread.Unsubscribe(); err != nil { // read (gone): the instance is caught up
		t.Fatal(err)
	}
	h = hold("ledger")
	before := heldOff()
	h.Orphan()
	if ended := waitEnded(t, b.c, h.Lease().LeaseID, time.Minute); ended.Status != lease.StatusReclaimed {
		t.Errorf("ended %s (%s) once caught up, want reclaimed", ended.Status, ended.Reason)
	}
	if n := heldOff() - before; n > 0 {
		t.Errorf("%d looks still counted the instance behind after its backlog was read", n)
	}
}

// TestReapQueuedPastAFullQueue: a runner can keep a repo's request queue
// full (maxQueued calls); the reaper's reclaim is queued past the bound
// all the same — one at a time — and the dead session's lease is
// reclaimed once the actor gets to it.
func TestReapQueuedPastAFullQueue(t *testing.T) {
	t.Parallel()
	const grace = 2 * time.Second
	b, _ := busWithGrace(t, grace)
	ctx := ctxFor(t, 2*time.Minute)
	h := holdIn(ctx, t, b.c, "github.com/acme/full", "billing")
	dead := h.Lease()
	a, ok := b.svc.existing(RepoKey(dead.Repo))
	if !ok {
		t.Fatal("no actor for the lease's repo")
	}
	a.busy.Lock() // the actor is busy: what comes waits in its queue
	locked := true
	defer func() {
		if locked {
			a.busy.Unlock()
		}
	}()
	for a.calls.push(&call{op: "sync", req: &syncRequest{}, at: time.Now()}) {
	}
	if n := a.calls.len(); n != maxQueued {
		t.Fatalf("%d calls queued, want the queue full (%d)", n, maxQueued)
	}
	h.Orphan()
	checkFor(t, time.Minute, 20*time.Millisecond, func() error {
		if !a.reaping.Load() {
			return errors.New("no reap queued yet")
		}
		return nil
	})
	// Asked again while one waits: still the one reap queued.
	a.reap(grace, time.Now())
	if n := a.calls.len(); n != maxQueued+1 {
		t.Fatalf("%d calls queued past the full queue's %d: want the one reap", n-maxQueued, maxQueued)
	}
	locked = false
	a.busy.Unlock()
	if ended := waitEnded(t, b.c, dead.LeaseID, time.Minute); ended.Status != lease.StatusReclaimed {
		t.Errorf("ended %s (%s), want reclaimed", ended.Status, ended.Reason)
	}
}

// TestKeepaliveLogReadsBounded: a keepalive naming leases no view covers
// reads their logs on a goroutine of its own; while maxKeptReaders such
// reads run, another keepalive is answered at once, the leases Unknown (its
// holder asks again a beat later), and starts nothing.
func TestKeepaliveLogReadsBounded(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	c := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	if _, err := c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "bounded"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatal(err) // the repo has a log: a made-up lease in it is Missing
	}
	madeUp := newLeaseID(RepoKey(repo), time.Now())
	ask := func() keptAnswer {
		t.Helper()
		r, err := c.request(ctx, "keepalive", &keepaliveRequest{Session: c.SessionID(), Leases: []keptLease{{LeaseID: madeUp, Repo: repo, Fence: 1, Version: 1}}}, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(r.Kept) != 1 {
			t.Fatalf("keepalive answered %+v: want one answer", r)
		}
		return r.Kept[0]
	}
	for range maxKeptReaders { // as many reading as may
		b.svc.keptReads <- struct{}{}
	}
	if k := ask(); !k.Unknown || k.Missing {
		t.Errorf("with %d keepalives reading logs, a made-up lease was answered %+v: want Unknown, read nowhere", maxKeptReaders, k)
	}
	for range maxKeptReaders {
		<-b.svc.keptReads
	}
	if k := ask(); !k.Missing {
		t.Errorf("with no keepalive reading logs, a made-up lease was answered %+v: want Missing, from its repo's log", k)
	}
}

// TestLatePeerDoesNotStopReclaims: an instance counts on every other's
// digest of the sessions it heard, and one whose digests come late may have
// heard a keepalive this one has not: the reaper then gives sessions the
// longer grace. An instance whose digests come late for good (a peer
// flapping, slowed by a flood on its connection) still lets a dead
// session's lease be reclaimed, after the longer grace.
func TestLatePeerDoesNotStopReclaims(t *testing.T) {
	t.Parallel()
	const grace = peerLate + time.Second // a peer is late after peerLate, gone after the grace
	b, m := busWithGrace(t, grace)
	ctx := ctxFor(t, 2*time.Minute)
	h := holdIn(ctx, t, b.c, "github.com/acme/late-peer", "billing")
	dead := h.Lease()
	late := func() { // a peer whose last digest came late, not so late it is gone
		b.svc.live.mu.Lock()
		b.svc.live.peers["late-peer"] = time.Now().Add(-peerLate - 500*time.Millisecond)
		b.svc.live.mu.Unlock()
	}
	late()
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(100 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				late()
			}
		}
	}()
	defer func() { close(stop); <-done }()
	stopped := time.Now()
	h.Orphan()
	ended := waitEnded(t, b.c, dead.LeaseID, time.Minute)
	if ended.Status != lease.StatusReclaimed {
		t.Fatalf("ended %s (%s), want reclaimed", ended.Status, ended.Reason)
	}
	if took := time.Since(stopped); took < massGraces*grace-DefaultHeartbeat {
		t.Errorf("reclaimed %s after its session fell silent while a peer's digest was late: before the longer grace %s", took, massGraces*grace)
	}
	if reclaimsHeld(m, "peers") == 0 {
		t.Error("no look counted the late peer")
	}
}
