package leasebus

import (
	"encoding/json"
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	promtest "github.com/prometheus/client_golang/prometheus/testutil"
)

// promtestCount is how many beats of kind the service counted.
func promtestCount(m *ServiceMetrics, kind string) int {
	return int(promtest.ToFloat64(m.beats.WithLabelValues(kind)))
}

// holdMany has one client of b hold n leases (TTL a minute: no renewal
// during a test) over a few repos.
func holdMany(t *testing.T, c *Client, name string, n int) []*Holder {
	t.Helper()
	hs := make([]*Holder, n)
	for i := range hs {
		h, err := c.AcquireAndHold(ctxT(t), AcquireRequest{Repo: fmt.Sprintf("github.com/acme/%s-%d", name, i%4), Scope: claim(t, fmt.Sprintf("svc/%d", i)), Owner: owner(i), TTL: lease.Duration(time.Minute)}, NewCredential(), HoldOptions{})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(h.Orphan)
		hs[i] = h
	}
	return hs
}

// waitBeatsVouch waits until the service's beats vouch for every lease of
// c's session.
func waitBeatsVouch(t *testing.T, c *Client, hs []*Holder) {
	t.Helper()
	checkFor(t, 20*time.Second, 20*time.Millisecond, func() error {
		if !c.session().beatsVouch(hs, DefaultHeartbeat, 0) {
			return fmt.Errorf("the service's beats do not vouch for the session's %d leases yet", len(hs))
		}
		return nil
	})
}

// TestBeatsVouchBetweenKeepalives: a client holding many leases sends a
// keepalive every maxKeepaliveEvery, not every heartbeat, once the
// service's beats vouch for its leases; its holders still hear the service
// well within their silence all along, from the beats. (A fleet of 10,000
// holders on 1,000 connections sent 5,000 keepalives a second; beats make
// it 500, and five messages a second fanned out.)
func TestBeatsVouchBetweenKeepalives(t *testing.T) {
	t.Parallel()
	m := NewServiceMetrics()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Metrics: m}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	const holders = 20
	hs := holdMany(t, b.c, "beat", holders)
	gets := requests(m, "get", "ok") // each holder's one confirming get
	waitBeatsVouch(t, b.c, hs)

	const window = 3 * time.Second
	kept := requests(m, "keepalive", "ok")
	samples, allFresh := 0, 0
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	for end := time.Now().Add(window); time.Now().Before(end); <-tick.C {
		samples++
		fresh := 0
		for _, h := range hs {
			h.mu.Lock()
			heard := time.Since(h.heardAt)
			h.mu.Unlock()
			if _, err := h.Fence(); err == nil && heard <= DefaultSilence/2 {
				fresh++
			}
		}
		if fresh == holders {
			allFresh++
		}
	}
	keepalives := requests(m, "keepalive", "ok") - kept
	// Every heartbeat would be 15 in the window; one every
	// maxKeepaliveEvery is 1 or 2 (plus any a doubt on a slow moment asked).
	if perHeartbeat := int(window / DefaultHeartbeat); keepalives > int(window/maxKeepaliveEvery)+2 {
		t.Errorf("%d keepalives in %s while beats vouched: %d would be one every heartbeat", keepalives, window, perHeartbeat)
	}
	if keepalives == 0 {
		t.Errorf("no keepalive in %s: the service must still hear that the session lives", window)
	}
	// A holder's silence is 800 ms and the session asked every 2 s: the
	// holders heard the service within half their silence all along
	// because the beats vouched.
	if allFresh < samples*9/10 {
		t.Errorf("every holder could write, having heard the service within %s, at %d of %d samples over %s: the beats did not keep them heard", DefaultSilence/2, allFresh, samples, window)
	}
	if more := requests(m, "get", "ok") - gets; more > 0 {
		t.Errorf("%d gets while %d holders held: heartbeats went per lease", more, holders)
	}
	if n := promtestCount(m, "quiet") + promtestCount(m, "changes"); n == 0 {
		t.Error("the service counted no beat")
	}
}

// TestBeatNamesAChangedLease: a beat names the bucket of every lease that
// changed since the last, so beats never vouch for a lease past its end.
// The attack is a revoke whose notice the holder never hears (here its
// session's notice subscription is gone): the next beat names the lease,
// the session asks, and the holder is Lost; in any case it cannot write
// once its silence has run from the revoke. The session's other holder
// stays held throughout.
func TestBeatNamesAChangedLease(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	c := NewClient(connect(t, b.srv.ClientURL()))
	hs := holdMany(t, c, "named", 2)
	waitBeatsVouch(t, c, hs)
	sess := c.session()
	sess.watchMu.Lock()
	if err := sess.notices.Unsubscribe(); err != nil {
		t.Fatal(err)
	}
	sess.watchMu.Unlock()
	if err := c.nc.Flush(); err != nil {
		t.Fatal(err)
	}

	if _, err := b.c.Revoke(ctxT(t), hs[0].Lease().LeaseID, "test"); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	// However late the holder's own goroutines run, its last word from
	// the service predates the revoke: no write once its silence has run.
	// (The session's keepalive every maxKeepaliveEvery would tell it too,
	// later: beats that vouched on would let it write until then.)
	<-time.After(time.Until(revoked.Add(DefaultSilence + 10*time.Millisecond)))
	if f, err := hs[0].Fence(); err == nil {
		t.Fatalf("the holder of a lease revoked %s ago may still write with fence %d", time.Since(revoked), f)
	}
	select {
	case <-hs[0].Lost():
	case <-time.After(10 * time.Second):
		st, err := hs[0].State()
		t.Fatalf("the holder of a lease revoked, its notice unheard, is %s after 10 s: %v", st, err)
	}
	if st, err := hs[1].State(); st != lease.Held {
		t.Errorf("the other holder of the session is %s: %v", st, err)
	}
}

// TestBeatBreaksOnAGap: a session follows beats only as a chain from its
// anchor. A beat that skips a number, names every lease, or whose clock
// ran back or ahead of the holders' drops the anchor and sends a keepalive
// (spread over a beat for one naming every lease); one that names a lease
// takes that lease off the anchor; another epoch's (instance or term) is
// nothing either way; a quiet next beat vouches, as of the anchor's send
// time plus how far the service's clock ran, less its allowed drift.
// Messages that are not beats, on the beat subject, are nothing.
func TestBeatBreaksOnAGap(t *testing.T) {
	const lid = "ls_0123456789abcdef0123456789abcdef"
	sent := time.Unix(1000, 0)
	fresh := func() *session {
		s := &session{again: make(chan struct{}, 1), holders: map[*Holder]struct{}{}}
		s.anchor = &anchored{beatAnchor: beatAnchor{Epoch: "i1", Seq: 4, Clock: 10e9},
			now: func() time.Time { return sent.Add(time.Second) }, sent: sent, at: sent.Add(time.Millisecond),
			leases: map[string]keptLease{lid: {LeaseID: lid, Version: 3}}, buckets: map[uint16]struct{}{beatBucket(lid): {}}}
		return s
	}
	send := func(s *session, b beat, reply string) {
		data, err := json.Marshal(beatMsg{Beat: &b})
		if err != nil {
			t.Fatal(err)
		}
		m := nats.NewMsg(beatSubject)
		m.Reply, m.Data = reply, data
		m.Header.Set(writerHeader, "i1")
		s.heardBeat(m)
	}
	kicked := func(s *session) bool {
		select {
		case <-s.again:
			return true
		default:
			return false
		}
	}
	other := beatBucket(lid) + 1
	for _, tc := range []struct {
		name string
		b    beat
	}{
		{"gap", beat{Epoch: "i1", Seq: 6, Clock: 10.4e9}},
		{"clock back", beat{Epoch: "i1", Seq: 5, Clock: 9e9}},
		{"clock ahead of the holders'", beat{Epoch: "i1", Seq: 5, Clock: 12e9}},
	} {
		s := fresh()
		send(s, tc.b, "")
		if s.anchor != nil || !kicked(s) {
			t.Errorf("%s: anchor kept (%v) or no keepalive asked (%v)", tc.name, s.anchor != nil, !kicked(s))
		}
	}
	// Every lease named: the fleet's sessions ask within a beat's
	// interval, not all at once.
	s := fresh()
	send(s, beat{Epoch: "i1", Seq: 5, Clock: 10.2e9, All: true}, "")
	if s.anchor != nil {
		t.Error("a beat naming every lease kept the anchor")
	}
	select {
	case <-s.again:
	case <-time.After(10 * time.Second):
		t.Error("a beat naming every lease asked for no keepalive")
	}
	// A beat naming the bucket of an anchored lease takes it off the
	// anchor: no later beat vouches for it (the session asks at its next
	// heartbeat); the chain goes on for the others.
	s = fresh()
	const lid2 = "ls_fedcba9876543210fedcba9876543210"
	s.anchor.leases[lid2] = keptLease{LeaseID: lid2, Version: 8}
	s.anchor.buckets[beatBucket(lid2)] = struct{}{}
	kept := s.anchor.leases
	send(s, beat{Epoch: "i1", Seq: 5, Clock: 10.2e9, Buckets: []uint16{other, beatBucket(lid)}}, "")
	if s.anchor == nil || kicked(s) {
		t.Fatal("a beat naming one anchored lease dropped the whole anchor, or asked at once")
	}
	if _, ok := s.anchor.leases[lid]; ok || len(s.anchor.leases) != 1 || s.anchor.vouched.IsZero() {
		t.Errorf("after a beat naming %s the anchor holds %v (vouched %v): want only %s, vouched", lid, s.anchor.leases, !s.anchor.vouched.IsZero(), lid2)
	}
	if len(kept) != 2 {
		t.Error("the anchor's lease set was changed in place: a vouch under way reads it")
	}
	send(s, beat{Epoch: "i1", Seq: 6, Clock: 10.4e9}, "")
	if _, ok := s.anchor.leases[lid]; ok {
		t.Error("a later beat vouched again for a lease named before")
	}
	// Another epoch's beat (another instance, or a term) says nothing of
	// this anchor: nothing vouched, nothing asked; the anchor's own chain
	// goes on.
	s = fresh()
	send(s, beat{Epoch: "i1.7", Seq: 5, Clock: 10.2e9}, "")
	if s.anchor == nil || !s.anchor.vouched.IsZero() || kicked(s) {
		t.Error("another epoch's beat moved the anchor or asked")
	}

	s = fresh()
	send(s, beat{Epoch: "i1", Seq: 4, Clock: 10e9}, "") // the anchor's own: nothing
	send(s, beat{Epoch: "i1", Seq: 5, Clock: 10.2e9, Buckets: []uint16{other}}, "")
	if s.anchor == nil || kicked(s) {
		t.Fatal("a next beat naming only others' buckets broke the anchor")
	}
	want := sent.Add(200*time.Millisecond - 200*time.Millisecond/beatDrift)
	if !s.anchor.vouched.Equal(want) || s.anchor.Seq != 5 {
		t.Errorf("vouched as of %s at beat %d, want %s at 5", s.anchor.vouched.Sub(sent), s.anchor.Seq, want.Sub(sent))
	}
	// Not beats: an answer aimed at the subject (it has a reply, or other
	// fields, or no writer's header, or JetStream's), a beat with no
	// number.
	send(s, beat{Epoch: "i1", Seq: 6, Clock: 10.4e9}, "_INBOX.x")
	next := `{"beat":{"epoch":"i1","seq":6,"clock":10400000000}}`
	for _, m := range []*nats.Msg{
		{Subject: beatSubject, Data: []byte(next)}, // no header: a direct get's payload with no_hdr
		{Subject: beatSubject, Data: []byte(next), Header: nats.Header{writerHeader: {"i1"}, "Nats-Stream": {"KV_X"}}},
		{Subject: beatSubject, Data: []byte(`{"beat":{"epoch":"i1","seq":6,"clock":1},"keptRest":{"age":0}}`), Header: nats.Header{writerHeader: {"i1"}}},
		{Subject: beatSubject, Data: []byte(`{"beat":{"epoch":"i1","clock":1}}`), Header: nats.Header{writerHeader: {"i1"}}},
		{Subject: beatSubject, Data: []byte(`{"error":{"code":"x"}}`), Header: nats.Header{writerHeader: {"i1"}}},
	} {
		s.heardBeat(m)
	}
	if data, err := json.Marshal(reply{Beat: &beatAnchor{Epoch: "i1", Seq: 6, Clock: 1}}); err != nil {
		t.Fatal(err)
	} else if _, ok := decodeBeat(data); ok {
		t.Errorf("a keepalive's answer %s reads as a beat", data)
	}
	if s.anchor == nil || s.anchor.Seq != 5 || kicked(s) {
		t.Error("a message that is not a beat moved the anchor")
	}
	// An anchor older than maxAnchorAge is not followed.
	s.anchor.now = func() time.Time { return sent.Add(maxAnchorAge + time.Second) }
	send(s, beat{Epoch: "i1", Seq: 6, Clock: 10.4e9}, "")
	if s.anchor != nil || !kicked(s) {
		t.Error("an anchor past maxAnchorAge still followed")
	}
}

// TestBeaterNumbersAnchorsBeforeChanges: an anchor read after a change was
// marked names the beat the change was in, or a later one never names it
// again; a deposed term's epoch never comes back.
func TestBeaterNumbersAnchorsBeforeChanges(t *testing.T) {
	now := time.Unix(0, 0)
	b := newBeater(now, DefaultSessionGrace)
	if _, ok := b.cut("e2", 2, now); !ok {
		t.Fatal("no beat")
	}
	b.mark("ls_a")
	a, ok := b.anchor("e2", 2, now)
	if !ok || a.Seq != 1 {
		t.Fatalf("anchor %+v, %v: want the last beat cut, 1", a, ok)
	}
	bt, _ := b.cut("e2", 2, now.Add(beatEvery))
	if bt.Seq != 2 || len(bt.Buckets) != 1 || bt.Buckets[0] != beatBucket("ls_a") || bt.Clock != int64(beatEvery) {
		t.Errorf("beat %+v: want number 2 naming ls_a's bucket at %d", bt, beatEvery)
	}
	if bt, _ := b.cut("e2", 2, now); len(bt.Buckets) != 0 {
		t.Errorf("a change named twice: %+v", bt)
	}
	if _, ok := b.anchor("e1", 1, now); ok {
		t.Error("an older term's epoch anchored again")
	}
	if bt, ok := b.cut("e3", 3, now); !ok || bt.Seq != 1 {
		t.Errorf("a new term's first beat %+v, %v: want number 1", bt, ok)
	}
	for i := range 4 * maxBeatBuckets {
		b.mark(fmt.Sprintf("ls_%d", i))
	}
	if bt, _ := b.cut("e3", 3, now); !bt.All || len(bt.Buckets) != 0 {
		t.Errorf("past %d buckets the beat is %d buckets, all %v: want all", maxBeatBuckets, len(bt.Buckets), bt.All)
	}
}

// FuzzDecodeBeat: the hand-written beat reader agrees with encoding/json
// on every beat it accepts, and accepts every beat json.Marshal writes.
func FuzzDecodeBeat(f *testing.F) {
	for _, b := range []beat{
		{Epoch: "i1", Seq: 1, Clock: 0},
		{Epoch: "NUIDNUIDNUID.12", Seq: 1 << 40, Clock: 1 << 62, Buckets: []uint16{0, 7, 65535}},
		{Epoch: "e", Seq: 3, Clock: 5, All: true},
	} {
		data, err := json.Marshal(beatMsg{Beat: &b})
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte(`{"beat":{"epoch":"i1","seq":6,"clock":1},"keptRest":{"age":0}}`))
	f.Add([]byte(`{"anchor":{"epoch":"i1","seq":6,"clock":1,"every":"2s"}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		b, ok := decodeBeat(data)
		if !ok {
			return
		}
		var m beatMsg
		if err := json.Unmarshal(data, &m); err != nil || m.Beat == nil {
			t.Fatalf("decodeBeat read %s as %+v; encoding/json: %v", data, b, err)
		}
		if m.Beat.Epoch != b.Epoch || m.Beat.Seq != b.Seq || m.Beat.Clock != b.Clock || m.Beat.All != b.All || !slices.Equal(m.Beat.Buckets, b.Buckets) {
			t.Fatalf("decodeBeat read %s as %+v; encoding/json as %+v", data, b, m.Beat)
		}
		again, err := json.Marshal(beatMsg{Beat: b})
		if err != nil {
			t.Fatal(err)
		}
		if b2, ok := decodeBeat(again); !ok || b2.Seq != b.Seq || !slices.Equal(b2.Buckets, b.Buckets) {
			t.Fatalf("decodeBeat does not read back %s", again)
		}
	})
}

// TestSnapshotDropsWhatItLeavesOut: a snapshot that replaces a view leaves
// out the ended leases it no longer keeps, and the view may have held one
// of them active (it missed its end). The service's lease index must drop
// such a lease, and the next beat name it: an index entry left behind
// would vouch, as active, for a lease long ended.
func TestSnapshotDropsWhatItLeavesOut(t *testing.T) {
	now := time.Unix(1000, 0)
	mk := func(id string) *entry {
		return &entry{Lease: lease.Lease{LeaseID: id, Repo: "r", Scope: claim(t, id), Status: lease.StatusActive, Version: 1, Fence: 1, TTL: lease.Duration(time.Minute)}}
	}
	s := newRepoState("r")
	s.observe(&logRecord{Kind: recordDelta, Repo: "r", Leases: []*entry{mk("ls_a"), mk("ls_b")}}, 1, now)
	s.observe(&logRecord{Kind: recordSnapshot, Repo: "r", Leases: []*entry{mk("ls_b")}}, 9, now)
	if !slices.Equal(s.evicted, []string{"ls_a"}) {
		t.Fatalf("evicted %v after a snapshot without ls_a: want [ls_a]", s.evicted)
	}

	svc := &Service{index: map[string]*indexed{}, beats: newBeater(now, DefaultSessionGrace)}
	svc.indexLeases("r", []*entry{mk("ls_a")})
	if _, ok := svc.beats.cut("e", 0, now); !ok {
		t.Fatal("no beat")
	}
	svc.unindex(s.evicted)
	bt, _ := svc.beats.cut("e", 0, now)
	if _, ok := svc.index["ls_a"]; ok || !slices.Contains(bt.Buckets, beatBucket("ls_a")) {
		t.Errorf("after unindexing ls_a the index has it: %v; the next beat names %v, want its bucket %d", ok, bt.Buckets, beatBucket("ls_a"))
	}
}
