package runui

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// The lease bus's implementation of what the UI reads.
var _ Source = (*leasebus.UIReader)(nil)

const repo = "github.com/acme/payments"

func startUI(t *testing.T, cfg Config) (*bustest.Bus, *httptest.Server) {
	t.Helper()
	b := bustest.Start(t)
	cfg.Source = leasebus.NewUIReader(b.ConnectAs(t, leasebus.RoleViewer)) // as under bus serve --ui
	return b, serveUI(t, cfg)
}

// serveUI serves a run UI made from cfg on a test HTTP server; both close
// when the test ends.
func serveUI(t *testing.T, cfg Config) *httptest.Server {
	t.Helper()
	s, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(func() {
		s.Close()
		hs.Close()
	})
	return hs
}

func acquire(t *testing.T, b *bustest.Bus, paths ...string) (*lease.Lease, leasebus.Credential) {
	t.Helper()
	cred := leasebus.NewCredential()
	l, err := b.Client.Acquire(context.Background(), leasebus.AcquireRequest{Repo: repo, Scope: bustest.Claim(t, paths...),
		Owner: lease.Owner{TaskID: "t", AgentID: "a", AttemptID: "att"}, TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	return l, cred
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	res, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	body, _ := io.ReadAll(res.Body)
	if res.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s %s", url, res.Status, body)
	}
	if err := json.Unmarshal(body, v); err != nil {
		t.Fatalf("GET %s: %v in %s", url, err, body)
	}
}

// The JSON API answers from the bus: repos, leases (active or all), audit.
func TestAPI(t *testing.T) {
	t.Parallel()
	b, hs := startUI(t, Config{})
	l, cred := acquire(t, b, "services/billing")
	acquire(t, b, "libs")
	if _, err := b.Client.Release(context.Background(), l.LeaseID, cred); err != nil {
		t.Fatal(err)
	}

	var repos []repoInfo
	getJSON(t, hs.URL+"/api/v1/repos", &repos)
	if len(repos) != 1 || repos[0].Repo != repo || repos[0].Active != 1 {
		t.Errorf("repos: %+v, want %s with 1 active lease", repos, repo)
	}
	var active, all []lease.Lease
	getJSON(t, hs.URL+"/api/v1/leases?repo="+repo, &active)
	getJSON(t, hs.URL+"/api/v1/leases?repo="+repo+"&all=1", &all)
	if len(active) != 1 || len(all) != 2 {
		t.Errorf("leases: %d active, %d all; want 1 and 2", len(active), len(all))
	}
	// The service writes audit events just after it answers.
	testutil.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		var evs []lease.AuditEvent
		getJSON(t, hs.URL+"/api/v1/audit?repo="+repo+"&limit=2", &evs)
		if len(evs) != 2 || evs[1].Type != lease.EventRelease || evs[1].LeaseID != l.LeaseID {
			return fmt.Errorf("last 2 audit events: %+v, want the release of %s last", evs, l.LeaseID)
		}
		return nil
	})
	res, err := http.Get(hs.URL + "/api/v1/audit?limit=zero")
	if err != nil {
		t.Fatal(err)
	}
	res.Body.Close()
	if res.StatusCode != http.StatusBadRequest {
		t.Errorf("bad limit: %s, want 400", res.Status)
	}
	var page string
	res, err = http.Get(hs.URL + "/")
	if err == nil {
		body, _ := io.ReadAll(res.Body)
		res.Body.Close()
		page = string(body)
	}
	if !strings.Contains(page, `<script src="app.js">`) {
		t.Errorf("index page not served: %v %.200s", err, page)
	}
}

// Off loopback every request needs the token: as a bearer header, or as
// ?token= once, which leaves a cookie for the page's own requests.
func TestToken(t *testing.T) {
	t.Parallel()
	_, hs := startUI(t, Config{Token: "s3cret"})
	get := func(path string, header, cookie string) *http.Response {
		t.Helper()
		req, _ := http.NewRequest("GET", hs.URL+path, nil)
		if header != "" {
			req.Header.Set("Authorization", header)
		}
		if cookie != "" {
			req.AddCookie(&http.Cookie{Name: tokenCookie, Value: cookie})
		}
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res
	}
	for _, tc := range []struct {
		name, path, header, cookie string
		want                       int
	}{
		{"none", "/api/v1/leases", "", "", 401},
		{"wrong bearer", "/api/v1/leases", "Bearer nope", "", 401},
		{"wrong query", "/?token=nope", "", "", 401},
		{"bearer", "/api/v1/leases", "Bearer s3cret", "", 200},
		{"cookie", "/api/v1/leases", "", "s3cret", 200},
	} {
		if res := get(tc.path, tc.header, tc.cookie); res.StatusCode != tc.want {
			t.Errorf("%s: %s, want %d", tc.name, res.Status, tc.want)
		}
	}
	res := get("/?token=s3cret", "", "")
	if res.StatusCode != 200 || len(res.Cookies()) != 1 || res.Cookies()[0].Value != "s3cret" || !res.Cookies()[0].HttpOnly {
		t.Errorf("?token=: %s, cookies %v; want 200 and an HttpOnly token cookie", res.Status, res.Cookies())
	}
	for addr, want := range map[string]bool{"127.0.0.1:0": true, "[::1]:80": true, "localhost:1": true, "0.0.0.0:80": false, ":80": false, "10.0.0.1:80": false} {
		if Loopback(addr) != want {
			t.Errorf("Loopback(%q) = %v", addr, !want)
		}
	}
}

// sse reads server-sent events from a response body.
type sse struct{ r *bufio.Reader }

func (s sse) next(t *testing.T) (event string, data []byte) {
	t.Helper()
	for {
		line, err := s.r.ReadString('\n')
		if err != nil {
			t.Fatalf("event stream ended: %v", err)
		}
		line = strings.TrimRight(line, "\n")
		switch {
		case strings.HasPrefix(line, "event: "):
			event = line[len("event: "):]
		case strings.HasPrefix(line, "data: "):
			data = []byte(line[len("data: "):])
		case line == "" && event != "":
			return event, data
		}
	}
}

// The event stream starts with a snapshot, then carries every lease record
// and audit event the bus commits, in order; it ends when the server closes.
func TestEventStream(t *testing.T) {
	t.Parallel()
	b, hs := startUI(t, Config{})
	held, _ := acquire(t, b, "services/billing")
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, "GET", hs.URL+"/api/v1/events?repo="+repo, nil)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	if ct := res.Header.Get("Content-Type"); ct != "text/event-stream" {
		t.Fatalf("content type %q", ct)
	}
	s := sse{bufio.NewReader(res.Body)}
	ev, data := s.next(t)
	var snap snapshot
	if err := json.Unmarshal(data, &snap); ev != "snapshot" || err != nil || len(snap.Leases) != 1 || snap.Leases[0].LeaseID != held.LeaseID {
		t.Fatalf("first event %s %s (%v), want a snapshot with %s", ev, data, err, held.LeaseID)
	}
	// The grant's change notice still in flight when the stream subscribed
	// (it races the Acquire reply): the snapshot holds that record, so the
	// stream must not send it again. Flushed, it reaches the stream before
	// anything the live part below does.
	stale, err := json.Marshal(held)
	if err != nil {
		t.Fatal(err)
	}
	if err := b.Conn.Publish(leasebus.ChangedSubject(repo, held.LeaseID), stale); err != nil {
		t.Fatal(err)
	}
	if err := b.Conn.Flush(); err != nil {
		t.Fatal(err)
	}
	// The backlog: the grant's audit event.
	if ev, data := s.next(t); ev != "audit" || !strings.Contains(string(data), held.LeaseID) {
		t.Fatalf("backlog: %s %s, want the audit event of %s's grant", ev, data, held.LeaseID)
	}
	// Live: a new grant arrives as a lease record and an audit event.
	l, _ := acquire(t, b, "libs")
	seen := map[string]bool{}
	for !seen["lease"] || !seen["audit"] {
		ev, data := s.next(t)
		if !strings.Contains(string(data), l.LeaseID) {
			t.Fatalf("%s event %s, want one about %s", ev, data, l.LeaseID)
		}
		seen[ev] = true
	}
	// Another repo's leases are not in this repo's stream.
	other := leasebus.NewCredential()
	if _, err := b.Client.Acquire(ctx, leasebus.AcquireRequest{Repo: "github.com/acme/other", Scope: bustest.Claim(t, "x"),
		Owner: lease.Owner{TaskID: "t"}, TTL: lease.Duration(time.Minute)}, other); err != nil {
		t.Fatal(err)
	}
	l3, _ := acquire(t, b, "docs")
	for {
		ev, data := s.next(t)
		if strings.Contains(string(data), "acme/other") {
			t.Fatalf("%s event of another repo in a filtered stream: %s", ev, data)
		}
		if strings.Contains(string(data), l3.LeaseID) {
			break
		}
	}
}

// A client that falls behind gets a fresh snapshot instead of a gap.
func TestStreamOverflow(t *testing.T) {
	st := newStream(2)
	for i := range 3 {
		st.push("lease", i)
	}
	if items, over := st.take(); !over || len(items) != 0 {
		t.Fatalf("after overflow: %v, %v; want no items and overflowed", items, over)
	}
	st.push("lease", 4)
	if items, over := st.take(); over || len(items) != 1 || fmt.Sprint(items[0].v) != "4" {
		t.Fatalf("after a take: %v, %v; want item 4", items, over)
	}
}

// With a shard store, the API and the stream carry the pools and attempts;
// the stream sends them again after each lease record.
func TestShards(t *testing.T) {
	t.Parallel()
	b := bustest.Start(t)
	st, err := shard.Open(leasebus.NewShardRecords(b.ConnectAs(t, leasebus.RoleOperator)), shard.Config{}) // declares pools
	if err != nil {
		t.Fatal(err)
	}
	// The UI reads as a viewer, as under bus serve --ui.
	vnc := b.ConnectAs(t, leasebus.RoleViewer)
	vst, err := shard.Open(leasebus.NewShardRecords(vnc), shard.Config{})
	if err != nil {
		t.Fatal(err)
	}
	hs := serveUI(t, Config{Source: leasebus.NewUIReader(vnc), Shards: StoreSource(vst)})
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()

	var none ShardsView
	getJSON(t, hs.URL+"/api/v1/shards?repo="+repo, &none)
	if len(none.Pools) != 0 || len(none.Attempts) != 0 {
		t.Fatalf("no pool declared: %+v", none)
	}
	if _, err := st.Declare(ctx, shard.Spec{Repo: repo, Checkout: "/src/payments", Size: 2, MaxSharers: 3}, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Begin(ctx, shard.Attempt{AttemptID: "att_1", Repo: repo, TaskID: "t", AgentID: "a", Command: []string{"true"}, Shard: "shard-1", Mode: "shared"}); err != nil {
		t.Fatal(err)
	}
	var v ShardsView
	getJSON(t, hs.URL+"/api/v1/shards?repo="+repo, &v)
	if len(v.Pools) != 1 || v.Pools[0].Size != 2 || len(v.Pools[0].Shards) != 2 || len(v.Attempts) != 1 || v.Attempts[0].AttemptID != "att_1" {
		t.Fatalf("shards of %s: %+v", repo, v)
	}

	req, _ := http.NewRequestWithContext(ctx, "GET", hs.URL+"/api/v1/events?repo="+repo, nil)
	res, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer res.Body.Close()
	sr := sse{bufio.NewReader(res.Body)}
	if ev, data := sr.next(t); ev != "snapshot" || !strings.Contains(string(data), `"attemptId":"att_1"`) {
		t.Fatalf("snapshot %s %s, want the attempt", ev, data)
	}
	if _, err := st.Settle(ctx, repo, "att_1", shard.StatusSucceeded, 0); err != nil {
		t.Fatal(err)
	}
	acquire(t, b, "services/billing") // a lease record: the shards follow
	for {
		ev, data := sr.next(t)
		if ev == "shards" {
			if !strings.Contains(string(data), `"status":"succeeded"`) {
				t.Fatalf("shards event after the settle: %s", data)
			}
			break
		}
	}
}

// Streams that learn of one lease change share one shard listing; a change
// learned later gets a fresh one.
func TestShardsListingShared(t *testing.T) {
	t.Parallel()
	b := bustest.Start(t)
	var calls atomic.Int32
	release := make(chan struct{})
	s, err := New(Config{Source: leasebus.NewUIReader(b.Conn), Shards: func(ctx context.Context, repo string) (any, error) {
		n := calls.Add(1)
		<-release
		return n, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	ctx := context.Background()
	since := time.Now()
	got := make(chan any, 2)
	go func() { v, _ := s.shardsSince(ctx, repo, since); got <- v }()
	testutil.CheckFor(t, 5*time.Second, time.Millisecond, func() error {
		if calls.Load() != 1 {
			return errors.New("the first listing has not started")
		}
		return nil
	})
	go func() { v, _ := s.shardsSince(ctx, repo, since); got <- v }()
	close(release)
	if a, b := <-got, <-got; a != int32(1) || b != int32(1) {
		t.Fatalf("two streams for one change got listings %v and %v, want both the first", a, b)
	}
	if v, _ := s.shardsSince(ctx, repo, time.Now()); v != int32(2) || calls.Load() != 2 {
		t.Fatalf("a later change got listing %v (%d calls), want a fresh one", v, calls.Load())
	}
	// A repo's listing finished longer ago than anyone asks about is
	// dropped when another starts; a recent one, or one still running
	// (streams wait on it), stays.
	s.fmu.Lock()
	s.flights["github.com/acme/gone"] = &shardsFlight{started: time.Now().Add(-2 * flightKept), done: release}
	s.flights["github.com/acme/slow"] = &shardsFlight{started: time.Now().Add(-2 * flightKept), done: make(chan struct{})}
	s.fmu.Unlock()
	if _, err := s.shardsSince(ctx, "github.com/acme/other", time.Now()); err != nil {
		t.Fatal(err)
	}
	s.fmu.Lock()
	defer s.fmu.Unlock()
	var kept []string
	for r := range s.flights {
		kept = append(kept, r)
	}
	slices.Sort(kept)
	if want := []string{"github.com/acme/other", repo, "github.com/acme/slow"}; !slices.Equal(kept, want) {
		t.Fatalf("flights after another repo's listing: %v, want %v", kept, want)
	}
}

// TestAuditSkipsOwnReadsBackwards: when the stream's last messages are the
// UI's own list reads (filtered out), the audit API reads further back
// rather than answer with fewer events than asked for.
func TestAuditSkipsOwnReadsBackwards(t *testing.T) {
	t.Parallel()
	b, hs := startUI(t, Config{})
	l, cred := acquire(t, b, "services/billing")
	if _, err := b.Client.Release(context.Background(), l.LeaseID, cred); err != nil {
		t.Fatal(err)
	}
	audited := func(typ string, n int) {
		t.Helper()
		testutil.CheckFor(t, 10*time.Second, 5*time.Millisecond, func() error {
			evs, err := leasebus.ReadAudit(context.Background(), b.Conn, repo, 1)
			if err != nil {
				return err
			}
			got := 0
			for _, ev := range evs {
				if ev.Type == typ {
					got++
				}
			}
			if got < n {
				return fmt.Errorf("%d %s events audited, waiting for %d", got, typ, n)
			}
			return nil
		})
	}
	audited(lease.EventRelease, 1)
	for range 8 { // each list is audited, after the release
		var ls []lease.Lease
		getJSON(t, hs.URL+"/api/v1/leases?repo="+repo, &ls)
	}
	audited(lease.EventList, 8)
	var evs []lease.AuditEvent
	getJSON(t, hs.URL+"/api/v1/audit?repo="+repo+"&limit=2", &evs)
	if len(evs) != 2 || evs[1].Type != lease.EventRelease || evs[1].LeaseID != l.LeaseID {
		t.Fatalf("last 2 audit events: %+v, want the grant and the release of %s", evs, l.LeaseID)
	}
}

// The policy view lists the policies in force for a repository (the
// default's and its own), every version, and shadow refusals.
func TestPolicyView(t *testing.T) {
	b, hs := startUI(t, Config{})
	ctx := context.Background()
	oc := leasebus.NewClient(b.ConnectAs(t, leasebus.RoleOperator))
	text := `@id("no-workflows") forbid (principal, action, resource is Fenceline::Path) when { resource.path like ".github/workflows*" };`
	for _, w := range []leasebus.PolicyWrite{
		{Default: true, Text: text},
		{Default: true, Text: text + "\n", Version: 1},
		{Repo: repo, Mode: "shadow", Text: text},
	} {
		if _, err := oc.SetPolicy(ctx, w); err != nil {
			t.Fatal(err)
		}
	}
	aud, err := leasebus.NewAuditor(b.ConnectAs(t, leasebus.RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	if err := aud.Record(ctx, lease.AuditEvent{Time: time.Now().UTC(), Type: leasebus.EventShadowRefused, Boundary: lease.BoundaryFile,
		Repo: repo, LeaseID: "lease_x", Message: `shadow policy: write .github/workflows/ci.yml would be refused by policy rule "no-workflows"`}); err != nil {
		t.Fatal(err)
	}
	checkFor := func(f func() error) {
		t.Helper()
		testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, f)
	}
	checkFor(func() error {
		var v struct {
			InForce []struct {
				Repo    string
				Mode    string
				Version uint64
			}
			History       map[string][]json.RawMessage
			ShadowRefused []lease.AuditEvent
		}
		getJSON(t, hs.URL+"/api/v1/policy?repo="+repo, &v)
		if len(v.InForce) != 2 || v.InForce[0].Repo != "" || v.InForce[0].Version != 2 || v.InForce[1].Repo != repo || v.InForce[1].Mode != "shadow" {
			return fmt.Errorf("in force: %+v", v.InForce)
		}
		if len(v.History["default enforce"]) != 2 || len(v.History[repo+" shadow"]) != 1 {
			return fmt.Errorf("history: %v", v.History)
		}
		if len(v.ShadowRefused) != 1 || !strings.Contains(v.ShadowRefused[0].Message, "no-workflows") {
			return fmt.Errorf("shadow refusals: %+v", v.ShadowRefused)
		}
		return nil
	})
}
