package sidecar

import (
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// podRequest is the lease the pod tests acquire.
func podRequest(t *testing.T) leasebus.AcquireRequest {
	return leasebus.AcquireRequest{Repo: "github.com/acme/payments", Scope: bustest.Claim(t, "services/"+strings.ReplaceAll(t.Name(), "/", "-")),
		Owner:       lease.Owner{TaskID: "task-" + t.Name(), AgentID: "agent", AttemptID: lease.NewAttemptID()},
		WorkspaceID: "ws-" + strings.ReplaceAll(t.Name(), "/", "-"), WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second)}
}

// A *leasebus.Holder is what the pod holds.
var _ Holder = (*leasebus.Holder)(nil)

// acquiring is a PodConfig.Hold that acquires req with cred, and the
// holder it made (nil until then).
func acquiring(bus *bustest.Bus, req leasebus.AcquireRequest, cred leasebus.Credential, held **leasebus.Holder) func(context.Context, func(time.Duration, error)) (Holder, error) {
	return func(ctx context.Context, onRenew func(time.Duration, error)) (Holder, error) {
		h, err := bus.Client.AcquireAndHold(ctx, req, cred, leasebus.HoldOptions{OnRenew: onRenew})
		if err != nil {
			return nil, err
		}
		*held = h
		return h, nil
	}
}

// egressOnly is a PodConfig.Fences with the egress proxy alone.
func egressOnly(t *testing.T, bus *bustest.Bus) func(lease.Holding, lease.Auditor) (Config, error) {
	return func(h lease.Holding, audit lease.Auditor) (Config, error) {
		return Config{Lease: h, Bus: bus.Client, Audit: audit, AllowHosts: []string{"api.example.test"}, StateDir: t.TempDir()}, nil
	}
}

// newPod starts a pod with cfg on bus (Audit and quick admin timings
// filled in), closed when the test ends.
func newPod(t *testing.T, bus *bustest.Bus, cfg PodConfig) *Pod {
	t.Helper()
	cfg.Audit = bus.Auditor
	cfg.Admin.KeepAlive, cfg.Admin.Poll = 50*time.Millisecond, 20*time.Millisecond
	p, err := NewPod(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(context.Background()); err != nil {
			t.Errorf("pod close: %v", err)
		}
	})
	return p
}

// leaseStatus is the lease's status on the bus.
func leaseStatus(ctx context.Context, t *testing.T, bus *bustest.Bus, id string) lease.Status {
	t.Helper()
	l, err := bus.Client.Get(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	return l.Status
}

// TestPodServesAndReleases: a pod is not ready until it holds its lease;
// started, it serves the egress proxy, writes and returns the agent's
// environment and is ready; shut down after the agent reported its
// attempt settled, it is not ready and has released the lease.
func TestPodServesAndReleases(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bus := bustest.Start(t)
	var logs bytes.Buffer // read once the pod is closed
	var held *leasebus.Holder
	envFile := filepath.Join(t.TempDir(), "agent.env")
	p := newPod(t, bus, PodConfig{
		Hold:          acquiring(bus, podRequest(t), leasebus.NewCredential(), &held),
		Fences:        egressOnly(t, bus),
		BaseEnv:       []string{"DATABASE_URL=postgres://db.internal/app"},
		EnvFile:       envFile,
		SettleTimeout: time.Hour, // the agent reports: never waited for
		Logger:        slog.New(slog.NewTextHandler(&logs, nil)),
	})
	if code, body := testutil.HTTPGet(t, p.AdminURL()+PathHealthz, ""); code != 200 {
		t.Fatalf("healthz before the lease: %d %q", code, body)
	}
	if code, body := testutil.HTTPGet(t, p.AdminURL()+PathReadyz, ""); code != 503 {
		t.Fatalf("readyz before the lease: %d %q", code, body)
	}

	r, err := p.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id := r.Lease.LeaseID
	if id != held.Lease().LeaseID || leaseStatus(ctx, t, bus, id) != lease.StatusActive {
		t.Fatalf("started on lease %s, held %s", id, held.Lease().LeaseID)
	}
	if r.Fences.Egress == "" || r.Fences.Git != "" || r.Fences.Postgres != "" || !slices.Equal(r.Fences.EgressAllow, []string{"api.example.test:443"}) {
		t.Fatalf("fences %+v, want the egress proxy alone, tunnelling api.example.test:443", r.Fences)
	}
	if !slices.Contains(r.Env, "HTTPS_PROXY="+r.Fences.Egress) || !slices.Contains(r.Env, "DATABASE_URL=postgres://db.internal/app") {
		t.Fatalf("agent env lacks the proxy or its base:\n%s", strings.Join(r.Env, "\n"))
	}
	data, err := os.ReadFile(envFile)
	if err != nil || string(data) != strings.Join(r.Env, "\n")+"\n" {
		t.Fatalf("env file %q (%v), want the agent env", data, err)
	}
	if code, body := testutil.HTTPGet(t, p.AdminURL()+PathReadyz, ""); code != 200 || !strings.Contains(body, id) {
		t.Fatalf("readyz while held: %d %q", code, body)
	}

	postSettled(t, p.admin)
	stopped, stop := context.WithCancel(ctx)
	stop()
	if err := p.Wait(stopped); err != nil {
		t.Fatalf("wait with its context done: %v", err)
	}
	end, err := p.Shutdown(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if end.End != LeaseReleased || end.Why != "the agent reported its attempt settled" || end.Lease.LeaseID != id || end.Err != nil {
		t.Fatalf("ending %+v, want released after the settle report", end)
	}
	if st := leaseStatus(ctx, t, bus, id); st != lease.StatusReleased {
		t.Fatalf("lease %s after shutdown, want released", st)
	}
	if code, body := testutil.HTTPGet(t, p.AdminURL()+PathReadyz, ""); code != 503 {
		t.Fatalf("readyz after shutdown: %d %q", code, body)
	}
	if err := p.Close(ctx); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`msg="sidecar ready"`, `msg="sidecar stopping: not ready, draining the fences"`,
		`msg="lease released" lease=` + id, `why="the agent reported its attempt settled"`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("log lacks %s:\n%s", want, logs.String())
		}
	}
}

// TestPodLeavesTheLease: a pod whose agent wrapper connected but never
// reported leaves its lease to expire; one attached to a lease leaves it
// to its owner; neither releases it.
func TestPodLeavesTheLease(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bus := bustest.Start(t)

	t.Run("agent silent", func(t *testing.T) {
		var held *leasebus.Holder
		p := newPod(t, bus, PodConfig{Hold: acquiring(bus, podRequest(t), leasebus.NewCredential(), &held),
			Fences: egressOnly(t, bus), SettleTimeout: 50 * time.Millisecond})
		r, err := p.Start(ctx)
		if err != nil {
			t.Fatal(err)
		}
		es := openEvents(t, p.AdminURL(), "")
		for v := es.next(t, 5*time.Second); !v.Ready; v = es.next(t, 5*time.Second) {
		}
		end, err := p.Shutdown(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if end.End != LeaseLeftToExpire || end.Why != "no settle report from the agent wrapper within the settle timeout, 50ms" {
			t.Fatalf("ending %+v, want left to expire for want of a settle report", end)
		}
		if st := leaseStatus(ctx, t, bus, r.Lease.LeaseID); st != lease.StatusActive {
			t.Fatalf("lease %s after shutdown, want still active (left to expire)", st)
		}
		if code, body := testutil.HTTPGet(t, p.AdminURL()+PathReadyz, ""); code != 503 {
			t.Fatalf("readyz after shutdown: %d %q", code, body)
		}
	})

	t.Run("attached", func(t *testing.T) {
		cred := leasebus.NewCredential()
		l, err := bus.Client.Acquire(ctx, podRequest(t), cred)
		if err != nil {
			t.Fatal(err)
		}
		p := newPod(t, bus, PodConfig{Fences: egressOnly(t, bus),
			Hold: func(ctx context.Context, onRenew func(time.Duration, error)) (Holder, error) {
				h, err := bus.Client.AttachAndHold(ctx, l.LeaseID, cred, leasebus.HoldOptions{OnRenew: onRenew})
				if err != nil {
					return nil, err
				}
				return h, nil
			}})
		r, err := p.Start(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if r.Lease.LeaseID != l.LeaseID || r.Lease.Fence != l.Fence {
			t.Fatalf("attached to %s (fence %d), want %s (fence %d)", r.Lease.LeaseID, r.Lease.Fence, l.LeaseID, l.Fence)
		}
		end, err := p.Shutdown(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if end.End != LeaseLeftToOwner {
			t.Fatalf("ending %+v, want left to its owner", end)
		}
		if st := leaseStatus(ctx, t, bus, l.LeaseID); st != lease.StatusActive {
			t.Fatalf("attached lease %s after shutdown, want still active", st)
		}
	})
}

// TestPodStartFails: a lease refused is Start's error as is; fences that
// cannot start release the lease taken for them; an admin address taken
// is an *AdminError.
func TestPodStartFails(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bus := bustest.Start(t)

	t.Run("conflict", func(t *testing.T) {
		req := podRequest(t)
		if _, err := bus.Client.Acquire(ctx, req, leasebus.NewCredential()); err != nil {
			t.Fatal(err)
		}
		var held *leasebus.Holder
		p := newPod(t, bus, PodConfig{Hold: acquiring(bus, req, leasebus.NewCredential(), &held), Fences: egressOnly(t, bus)})
		var ce *lease.ConflictError
		if _, err := p.Start(ctx); !errors.As(err, &ce) {
			t.Fatalf("start on a taken scope: %v, want a *ConflictError", err)
		}
		if code, body := testutil.HTTPGet(t, p.AdminURL()+PathReadyz, ""); code != 503 {
			t.Fatalf("readyz without a lease: %d %q", code, body)
		}
	})

	t.Run("fences", func(t *testing.T) {
		var held *leasebus.Holder
		bad := errors.New("no fences today")
		p := newPod(t, bus, PodConfig{Hold: acquiring(bus, podRequest(t), leasebus.NewCredential(), &held),
			Fences: func(lease.Holding, lease.Auditor) (Config, error) { return Config{}, bad }})
		if _, err := p.Start(ctx); !errors.Is(err, bad) {
			t.Fatalf("start with failing fences: %v, want %v", err, bad)
		}
		if st := leaseStatus(ctx, t, bus, held.Lease().LeaseID); st != lease.StatusReleased {
			t.Fatalf("lease %s after the fences failed, want released", st)
		}
	})

	t.Run("admin address taken", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		var held *leasebus.Holder
		ui := &countedUI{}
		_, err = NewPod(PodConfig{Audit: bus.Auditor, UI: ui, Admin: AdminConfig{Listen: ln.Addr().String()},
			Hold: acquiring(bus, podRequest(t), leasebus.NewCredential(), &held), Fences: egressOnly(t, bus)})
		var ae *AdminError
		if !errors.As(err, &ae) || !strings.Contains(err.Error(), ln.Addr().String()) {
			t.Fatalf("pod on a taken admin address: %v, want an *AdminError naming it", err)
		}
		if held != nil {
			t.Fatal("the lease was taken although the admin server did not start")
		}
		if n := ui.closed.Load(); n != 1 {
			t.Fatalf("run UI closed %d times after NewPod failed, want once (the pod owns it)", n)
		}
	})
}

// TestPodShutdownAfterRevoke: a pod whose lease an operator revoked says
// so at shutdown (the lease had ended: revoked), not that it released it,
// even though the agent reported its attempt settled.
func TestPodShutdownAfterRevoke(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bus := bustest.Start(t)
	var logs bytes.Buffer // read once the pod is closed
	var held *leasebus.Holder
	p := newPod(t, bus, PodConfig{
		Hold:          acquiring(bus, podRequest(t), leasebus.NewCredential(), &held),
		Fences:        egressOnly(t, bus),
		SettleTimeout: time.Hour,
		Logger:        slog.New(slog.NewTextHandler(&logs, nil)),
	})
	r, err := p.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id := r.Lease.LeaseID
	if _, err := bus.Operator.Revoke(ctx, id, "runaway agent"); err != nil {
		t.Fatal(err)
	}
	select {
	case <-held.Lost():
	case <-ctx.Done():
		t.Fatal("the holder never heard of the revoke")
	}
	postSettled(t, p.admin)
	end, err := p.Shutdown(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if end.End != LeaseEnded || end.Err == nil || !strings.Contains(end.Err.Error(), "revoked") {
		t.Fatalf("ending %+v (err %v), want the lease ended before shutdown: revoked", end, end.Err)
	}
	if st := leaseStatus(ctx, t, bus, id); st != lease.StatusRevoked {
		t.Fatalf("lease %s after shutdown, want revoked", st)
	}
	if err := p.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if strings.Contains(logs.String(), `msg="lease released"`) || !strings.Contains(logs.String(), `msg="lease had already ended: nothing to release"`) {
		t.Errorf("log says the lease was released, or not that it had ended:\n%s", logs.String())
	}
}

// countedUI is a run UI that answers every request with its path and
// counts its closes.
type countedUI struct{ closed atomic.Int32 }

func (u *countedUI) Handler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "run ui at "+r.URL.Path) })
}

func (u *countedUI) Close() { u.closed.Add(1) }

// TestPodServesItsUI: the run UI handed to the pod is served under /ui/
// (/ redirects there) and closed with the pod, once.
func TestPodServesItsUI(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	ui := &countedUI{}
	var held *leasebus.Holder
	p, err := NewPod(PodConfig{Audit: bus.Auditor, UI: ui, Admin: AdminConfig{Listen: "127.0.0.1:0"},
		Hold: acquiring(bus, podRequest(t), leasebus.NewCredential(), &held), Fences: egressOnly(t, bus)})
	if err != nil {
		t.Fatal(err)
	}
	if code, body := testutil.HTTPGet(t, p.AdminURL()+PathUI+"leases", ""); code != 200 || body != "run ui at /leases" {
		t.Fatalf("GET %sleases: %d %q, want the run UI's answer", PathUI, code, body)
	}
	if err := p.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if n := ui.closed.Load(); n != 1 {
		t.Fatalf("run UI closed %d times with the pod, want once", n)
	}
}
