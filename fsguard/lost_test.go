//go:build linux && (amd64 || arm64)

package fsguard

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// probeRun is a guarded guardhelper probe: one line per round of
// write/mkdir/rename/unlink/read attempts inside the lease.
type probeRun struct {
	pr    *Process
	lines chan string
}

func startProbe(t *testing.T, p Policy, gate Gate, audit Auditor, dir string) *probeRun {
	t.Helper()
	helper := guardHelper(t)
	file := filepath.Join(dir, "mine.txt")
	cmd := exec.Command(helper, "probe", dir, file)
	out, w := io.Pipe()
	cmd.Stdout, cmd.Stderr = w, w
	pr, err := Start(context.Background(), p, gate, audit, cmd)
	if err != nil {
		t.Fatal(err)
	}
	r := &probeRun{pr: pr, lines: make(chan string, 4096)}
	readDone := make(chan struct{})
	go func() {
		defer close(readDone)
		defer close(r.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case r.lines <- sc.Text():
			default:
			}
		}
	}()
	t.Cleanup(func() {
		pr.Kill()
		pr.Wait()
		w.Close()
		<-readDone
	})
	return r
}

// next returns the next probe line matching want, or fails after timeout.
func (r *probeRun) next(t *testing.T, timeout time.Duration, want func(string) bool) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l, ok := <-r.lines:
			if !ok {
				t.Fatal("probe ended early")
			}
			if want(l) {
				return l
			}
		case <-deadline:
			t.Fatalf("no matching probe line within %v", timeout)
		}
	}
}

func allOK(l string) bool {
	return strings.Contains(l, "write=ok mkdir=ok rename=ok unlink=ok read=ok")
}

func allDenied(l string) bool {
	return strings.Contains(l, "write=EACCES mkdir=EACCES rename=EACCES unlink=EACCES read=ok")
}

// TestLostGateStopsWrites: the gate flips to lost mid-run; within a second
// every write-class call fails with EACCES while reads go on, and each
// denial is audited with its path.
func TestLostGateStopsWrites(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	gate := &testGate{}
	audit := &memAuditor{}
	r := startProbe(t, w.policy(), gate, audit, w.leased)
	r.next(t, 10*time.Second, allOK)
	gate.lost.Store(true)
	flipped := time.Now()
	l := r.next(t, 5*time.Second, allDenied) // generous for the race detector on two busy cores; the latency is logged
	t.Logf("after the flip (%v): %s", time.Since(flipped), l)
	r.next(t, 5*time.Second, allDenied) // and it stays so
	r.pr.Kill()
	r.pr.Wait()
	if r.pr.Denials() == 0 {
		t.Fatal("no denials counted")
	}
	evs := audit.all()
	if len(evs) == 0 {
		t.Fatal("no audit events")
	}
	ev := evs[0]
	if ev.Boundary != lease.BoundaryFile || ev.Type != lease.EventDenied || ev.LeaseID != "lease_test1" || ev.Fence != 7 ||
		!strings.Contains(ev.Message, w.leased) || ev.Reason != ReasonLeaseLost || !strings.Contains(ev.Message, "lease lost") {
		t.Errorf("audit event %+v: want a file denial naming the lease, fence, path and reason", ev)
	}
}

// TestHolderRevokedStopsWrites: the same with a real lease on a real bus,
// revoked by an operator through Client.Revoke; denials land on the audit
// stream through leasebus.Auditor.
func TestHolderRevokedStopsWrites(t *testing.T) {
	t.Parallel()
	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	nc := bustest.Connect(t, srv.ClientURL())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	svc, err := leasebus.StartService(ctx, nc, leasebus.ServiceConfig{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	client := leasebus.NewClient(nc)
	auditor, err := leasebus.NewAuditor(nc)
	if err != nil {
		t.Fatal(err)
	}

	const repo = "github.com/acme/payments"
	claim, err := scope.New([]string{"leased"}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	cred := leasebus.NewCredential()
	holder, err := client.AcquireAndHold(ctx, leasebus.AcquireRequest{Repo: repo, Scope: claim, WorkspaceMode: lease.WorkspaceShared,
		Owner: lease.Owner{TaskID: "task-1", AgentID: "agent-1", AttemptID: lease.NewAttemptID()},
		TTL:   lease.Duration(30 * time.Second), RequestID: leasebus.NewRequestID()}, cred, leasebus.HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(holder.Orphan)

	w := newWorktree(t)
	p := w.policy()
	p.Lease = holder.Lease()
	r := startProbe(t, p, holder, auditor, w.leased)
	r.next(t, 10*time.Second, allOK)
	if _, err := client.Revoke(ctx, p.Lease.LeaseID, "operator test"); err != nil {
		t.Fatal(err)
	}
	revoked := time.Now()
	r.next(t, 10*time.Second, allDenied) // generous: the race detector on two busy cores; the latency is logged below
	t.Logf("writes denied %v after Revoke returned", time.Since(revoked))
	r.pr.Kill()
	r.pr.Wait()

	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, nc, repo, 1)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Boundary == lease.BoundaryFile && ev.Type == lease.EventDenied && ev.LeaseID == p.Lease.LeaseID &&
				strings.Contains(ev.Message, w.leased) {
				return nil
			}
		}
		return fmt.Errorf("no file denial for %s among %d audit events", p.Lease.LeaseID, len(evs))
	})
}

// stuckAuditor is a bus that takes no audit events: Record blocks until
// its context ends.
type stuckAuditor struct{ calls atomic.Int64 }

func (a *stuckAuditor) Record(ctx context.Context, _ lease.AuditEvent) error {
	a.calls.Add(1)
	<-ctx.Done()
	return ctx.Err()
}

// TestStuckAuditDoesNotHoldTheExit: when the bus cannot take audit events
// (the fault that may have lost the lease), the denials still queued once
// the process tree is gone get auditDrain, not 10 s each: Wait returns.
func TestStuckAuditDoesNotHoldTheExit(t *testing.T) {
	defer func(d time.Duration) { auditDrain = d }(auditDrain)
	auditDrain = 300 * time.Millisecond
	w := newWorktree(t)
	gate := &testGate{}
	gate.lost.Store(true)
	audit := &stuckAuditor{}
	r := startProbe(t, w.policy(), gate, audit, w.leased)
	for range 3 { // several probe rounds: denials queue behind the stuck one
		r.next(t, 10*time.Second, allDenied)
	}
	r.pr.Kill()
	start := time.Now()
	r.pr.Wait()
	took := time.Since(start)
	t.Logf("Wait returned %v after Kill, %d audit calls, %d denials", took, audit.calls.Load(), r.pr.Denials())
	// Without the bound: 10 s for the event in flight, and 10 s more for
	// each queued one.
	if took > 5*time.Second {
		t.Fatalf("Wait took %v with the audit stuck: the drain is not bounded", took)
	}
	if audit.calls.Load() < 2 {
		t.Errorf("%d audit calls: want the one in flight and the summary of the rest", audit.calls.Load())
	}
}
