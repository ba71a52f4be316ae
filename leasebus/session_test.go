package leasebus

import (
	"encoding/json"
	"fmt"
	"strings"
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
// alive with one keepalive per heartbeat, not a request per lease (a fleet
// of 10,000 holders on 1,000 connections sends 5,000 a second, not
// 50,000), and each holder still hears the service through it.
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
	const beats = 10
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
	fleet := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	h, err := fleet.AcquireAndHold(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "notice-fleet"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential(), HoldOptions{})
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
	if _, err := b.c.Revoke(ctx, h.Lease().LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	m, err := heard.NextMsg(10 * time.Second)
	if err != nil {
		t.Fatalf("no notice of the revoke on the fleet holder's session subject: %v", err)
	}
	var got lease.Lease
	if err := json.Unmarshal(m.Data, &got); err != nil || got.LeaseID != h.Lease().LeaseID || got.Status != lease.StatusRevoked {
		t.Fatalf("notice %s (%v): want the revoked record of %s", m.Data, err, h.Lease().LeaseID)
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
