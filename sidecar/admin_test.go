package sidecar

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func startAdmin(t *testing.T, cfg AdminConfig) *Admin {
	t.Helper()
	a, err := StartAdmin(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := a.Close(ctx); err != nil {
			t.Errorf("admin close: %v", err)
		}
	})
	return a
}

// eventStream is a real SSE client of /api/v1/lease/events.
type eventStream struct {
	views  chan LeaseView
	cancel context.CancelFunc
	done   chan struct{}
}

func openEvents(t *testing.T, base, token string) *eventStream {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, base+PathEvents, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		cancel()
		t.Fatal(err)
	}
	if resp.StatusCode != http.StatusOK || !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		cancel()
		t.Fatalf("events: %s %s", resp.Status, resp.Header.Get("Content-Type"))
	}
	es := &eventStream{views: make(chan LeaseView, 1024), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(es.done)
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok {
				var v LeaseView
				if err := json.Unmarshal([]byte(data), &v); err != nil {
					t.Errorf("bad event %q: %v", data, err)
					return
				}
				select {
				case es.views <- v:
				default:
				}
			}
		}
	}()
	t.Cleanup(func() { es.cancel(); <-es.done })
	return es
}

// next returns the next view, failing after timeout.
func (es *eventStream) next(t *testing.T, timeout time.Duration) LeaseView {
	t.Helper()
	select {
	case v := <-es.views:
		return v
	case <-time.After(timeout):
		t.Fatal("no event from the sidecar")
		return LeaseView{}
	}
}

// TestAdminReadinessFollowsTheLease: /readyz is 503 before the sidecar has
// a lease, 200 while it is held, and 503 — for good — once an operator
// revokes it; the events stream says the same, first the state, then every
// change, then keep-alives.
func TestAdminReadinessFollowsTheLease(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	m := NewMetrics()
	a := startAdmin(t, AdminConfig{Metrics: m, KeepAlive: 50 * time.Millisecond, Poll: 20 * time.Millisecond})
	base := a.URL()
	if code, body := testutil.HTTPGet(t, base+PathHealthz, ""); code != 200 {
		t.Fatalf("healthz %d %s", code, body)
	}
	if code, body := testutil.HTTPGet(t, base+PathReadyz, ""); code != 503 || !strings.Contains(body, "no lease yet") {
		t.Fatalf("readyz before a lease: %d %q", code, body)
	}
	es := openEvents(t, base, "")
	if v := es.next(t, 5*time.Second); v.State != lease.Unknown || v.Ready {
		t.Fatalf("first event before a lease: %+v", v)
	}

	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "services/billing"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{OnRenew: m.ObserveRenew})
	m.TrackLease(l.Holder)
	a.SetLease(l.Holder, Fences{Git: "http://127.0.0.1:1", GitUpstream: "http://git.internal"})
	code, body := testutil.HTTPGet(t, base+PathReadyz, "")
	if code != 200 || !strings.Contains(body, l.Record.LeaseID) {
		t.Fatalf("readyz while held: %d %q", code, body)
	}
	for v := es.next(t, 5*time.Second); !v.Ready; v = es.next(t, 5*time.Second) {
	}
	_, body = testutil.HTTPGet(t, base+PathLease, "")
	var v LeaseView
	if err := json.Unmarshal([]byte(body), &v); err != nil {
		t.Fatal(err)
	}
	if v.State != lease.Held || v.Lease == nil || v.Lease.LeaseID != l.Record.LeaseID || v.Fence != l.Record.Fence || v.Fences.Git != "http://127.0.0.1:1" {
		t.Fatalf("GET %s = %s", PathLease, body)
	}
	if _, body := testutil.HTTPGet(t, base+PathMetrics, ""); !strings.Contains(body, "fenceline_leases_held 1\n") {
		t.Fatalf("metrics while held:\n%s", grepMetrics(body, "fenceline_leases_held"))
	}

	if _, err := bus.Operator.Revoke(context.Background(), l.Record.LeaseID, "runaway agent"); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	var lost LeaseView
	for lost = es.next(t, 5*time.Second); lost.State != lease.Lost; lost = es.next(t, 5*time.Second) {
	}
	t.Logf("lost event %v after the revoke", time.Since(revoked))
	if lost.Ready || !strings.Contains(lost.Reason, "revoked") || !strings.Contains(lost.Reason, "runaway agent") {
		t.Fatalf("lost event: %+v", lost)
	}
	code, body = testutil.HTTPGet(t, base+PathReadyz, "")
	if code != 503 || !strings.Contains(body, "lost") || !strings.Contains(body, "runaway agent") {
		t.Fatalf("readyz after the revoke: %d %q", code, body)
	}
	// Never back: the next keep-alives and probes still say lost.
	for range 5 {
		if v := es.next(t, 5*time.Second); v.State != lease.Lost || v.Ready || v.Seq != lost.Seq {
			t.Fatalf("after lost: %+v", v)
		}
		if code, _ := testutil.HTTPGet(t, base+PathReadyz, ""); code != 503 {
			t.Fatalf("readyz back to %d after the lease was lost", code)
		}
	}
	if _, body := testutil.HTTPGet(t, base+PathMetrics, ""); !strings.Contains(body, "fenceline_leases_held 0\n") {
		t.Fatalf("metrics after lost:\n%s", grepMetrics(body, "fenceline_leases_held"))
	}
}

// TestAdminDrainingNotReady: a sidecar shutting down is not ready though
// its lease is held, and a settle report closes Settled.
func TestAdminDrainingNotReady(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	a := startAdmin(t, AdminConfig{})
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "a"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	a.SetLease(l.Holder, Fences{})
	if code, _ := testutil.HTTPGet(t, a.URL()+PathReadyz, ""); code != 200 {
		t.Fatalf("readyz %d", code)
	}
	a.SetDraining("shutting down")
	if code, body := testutil.HTTPGet(t, a.URL()+PathReadyz, ""); code != 503 || !strings.Contains(body, "shutting down") {
		t.Fatalf("readyz while draining: %d %q", code, body)
	}
	if ever, _ := a.AgentConnected(); ever {
		t.Fatal("no agent wrapper connected, yet AgentConnected says one did")
	}
	resp, err := http.Post(a.URL()+PathSettled, "application/json", strings.NewReader(`{"exitCode":0,"denials":2}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusNoContent {
		t.Fatalf("settled: %s", resp.Status)
	}
	select {
	case <-a.Settled():
	default:
		t.Fatal("Settled not closed after the report")
	}
	if !a.View().Settled {
		t.Fatal("view does not say settled")
	}
}

// TestAdminTokenOffLoopback: bound off loopback the admin server refuses
// to start without a token; with one, the API and metrics want it and the
// probes do not.
func TestAdminTokenOffLoopback(t *testing.T) {
	t.Parallel()
	if _, err := StartAdmin(AdminConfig{Listen: "0.0.0.0:0"}); err == nil || !strings.Contains(err.Error(), "needs a bearer token") {
		t.Fatalf("off loopback without a token: %v", err)
	}
	const token = "0123456789abcdef0123"
	a := startAdmin(t, AdminConfig{Listen: "0.0.0.0:0", Token: token})
	port := a.Addr().(*net.TCPAddr).Port
	base := fmt.Sprintf("http://127.0.0.1:%d", port)
	for _, p := range []string{PathLease, PathMetrics, PathEvents} {
		if code, body := testutil.HTTPGet(t, base+p, ""); code != 401 || !strings.Contains(body, "Bearer") {
			t.Errorf("GET %s without a token: %d %q", p, code, body)
		}
		if code, _ := testutil.HTTPGet(t, base+p, "wrong-token-wrong-token"); code != 401 {
			t.Errorf("GET %s with a wrong token: %d", p, code)
		}
	}
	resp, err := http.Post(base+PathSettled, "application/json", strings.NewReader(`{}`))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != 401 {
		t.Errorf("POST %s without a token: %s", PathSettled, resp.Status)
	}
	for _, p := range []string{PathLease, PathMetrics} {
		if code, _ := testutil.HTTPGet(t, base+p, token); code != 200 {
			t.Errorf("GET %s with the token: %d", p, code)
		}
	}
	if code, _ := testutil.HTTPGet(t, base+PathHealthz, ""); code != 200 {
		t.Errorf("healthz needs no token, got %d", code)
	}
	if code, _ := testutil.HTTPGet(t, base+PathReadyz, ""); code != 503 {
		t.Errorf("readyz needs no token (and no lease: 503), got %d", code)
	}
	// On loopback without a token the API is open.
	open := startAdmin(t, AdminConfig{})
	if code, _ := testutil.HTTPGet(t, open.URL()+PathLease, ""); code != 200 {
		t.Errorf("loopback API without a token: %d", code)
	}
	if _, err := StartAdmin(AdminConfig{Token: "short"}); err == nil {
		t.Error("a 5-character token was accepted")
	}
}

// TestAdminAuditForward: a file denial posted by the agent wrapper is
// recorded on the audit stream under the sidecar's lease (whatever lease
// the post named) and counted.
func TestAdminAuditForward(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	m := NewMetrics()
	a := startAdmin(t, AdminConfig{Metrics: m, Audit: bus.Auditor})
	l := bus.Acquire(t, leasebus.AcquireRequest{Repo: "github.com/acme/audit", Scope: bustest.Claim(t, "a"),
		WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	a.SetLease(l.Holder, Fences{})
	post := func(ev lease.AuditEvent) int {
		b, _ := json.Marshal(ev)
		resp, err := http.Post(a.URL()+PathAudit, "application/json", strings.NewReader(string(b)))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := post(lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryGit}); code != 400 {
		t.Fatalf("a git event from the wrapper: %d, want 400", code)
	}
	ev := lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile, LeaseID: "lease_forged",
		Reason: "lease-lost", Message: "file write denied: openat /w/in/probe: lease lost: revoked"}
	if code := post(ev); code != 204 {
		t.Fatalf("file denial: %d", code)
	}
	evs, err := leasebus.ReadAudit(context.Background(), bus.Conn, "github.com/acme/audit", 0)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, e := range evs {
		if e.Boundary == lease.BoundaryFile && e.LeaseID == l.Record.LeaseID && e.Owner == l.Record.Owner && strings.Contains(e.Message, "/w/in/probe") {
			found = true
		}
		if e.LeaseID == "lease_forged" {
			t.Fatalf("the wrapper's lease id was trusted: %+v", e)
		}
	}
	if !found {
		t.Fatalf("forwarded denial not on the audit stream: %+v", evs)
	}
	_, body := testutil.HTTPGet(t, a.URL()+PathMetrics, "")
	if metricValue(body, "fenceline_fsguard_denials_total") != 1 || !strings.Contains(body, `fenceline_refusals_total{boundary="file",reason="lease-lost"} 1`) {
		t.Fatalf("metrics:\n%s", grepMetrics(body, "fenceline_"))
	}
}

// metricValue is the value of the unlabelled sample name in an exposition
// body (-1 when absent).
func metricValue(body, name string) float64 {
	for line := range strings.Lines(body) {
		if rest, ok := strings.CutPrefix(line, name+" "); ok {
			var v float64
			if _, err := fmt.Sscan(rest, &v); err == nil {
				return v
			}
		}
	}
	return -1
}

func grepMetrics(body, prefix string) string {
	var out []string
	for line := range strings.Lines(body) {
		if strings.HasPrefix(line, prefix) {
			out = append(out, strings.TrimSpace(line))
		}
	}
	if len(out) == 0 {
		return "(no " + prefix + " samples)"
	}
	return strings.Join(out, "\n")
}
