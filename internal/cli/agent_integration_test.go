//go:build integration

package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
)

// TestSidecarReleasesOnlyAfterSettle: SIGTERM to the sidecar while the
// agent — which ignores SIGTERM and has a background child — still runs:
// the sidecar stops being ready and drains its fences, but keeps the lease
// renewed past its ttl until the wrapper reports every process gone; only
// then is the lease released (invariant 6).
func TestSidecarReleasesOnlyAfterSettle(t *testing.T) {
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	gs, _ := seededGitServer(t)
	co := newCheckout(t, "")
	const ttl = 3 * time.Second
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "in", "--ttl", ttl.String(), "--settle-timeout", "1m",
		"--git-upstream", gs.URL+"/payments.git", "--state-dir", t.TempDir())
	id := leaseOfSidecar(t, sc.out.String())
	script := `trap '' TERM
(while [ ! -e stop ]; do sleep 0.05; done; echo done > in/child-done) &
echo started > in/ready
wait`
	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--kill-grace", "1m", "--", "sh", "-c", script)
	t.Cleanup(func() { os.WriteFile(filepath.Join(co, "stop"), nil, 0o644) })
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		return exists(filepath.Join(co, "in", "ready"))
	})
	sc.cancel() // what SIGTERM does to the real process
	r.cancel()  // the agent container's SIGTERM, ignored by the command
	canceled := time.Now()
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		sc.running(t)
		l, err := client.Get(context.Background(), id)
		if err != nil {
			return err
		}
		if !l.Active() {
			t.Fatalf("lease %s is %s (%s) while the agent's processes live", id, l.Status, l.Reason)
		}
		if !l.RenewedAt.After(canceled.Add(ttl)) {
			return fmt.Errorf("last renewed %s, SIGTERM at %s", l.RenewedAt.Format(time.StampMilli), canceled.Format(time.StampMilli))
		}
		return nil
	})
	if code, body := testutil.HTTPGet(t, sc.admin+"/readyz", ""); code != http.StatusServiceUnavailable || !strings.Contains(body, "shutting down") {
		t.Errorf("readyz while shutting down: %d %q", code, body)
	}

	if err := os.WriteFile(filepath.Join(co, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d, want the command's 0\n%s", code, r.errOut)
	}
	if code := sc.wait(t); code != 0 {
		t.Fatalf("sidecar exited %d\n%s", code, sc.errOut)
	}
	releasedAfterChild(t, client, id, co)
	mustContain(t, "sidecar stdout", sc.out.String(), "lease "+id+" released (the agent reported its attempt settled)")
}

// TestSidecarLeavesLeaseWithoutSettle: a wrapper is connected but never
// reports its attempt settled: on SIGTERM the sidecar waits
// --settle-timeout, then leaves the lease to expire instead of releasing
// it under processes that may still write.
func TestSidecarLeavesLeaseWithoutSettle(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, _ := seededGitServer(t)
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "in", "--settle-timeout", "300ms",
		"--git-upstream", gs.URL+"/payments.git", "--state-dir", t.TempDir())
	id := leaseOfSidecar(t, sc.out.String())
	// A wrapper's stream (a real SSE client), left open.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, sc.admin+"/api/v1/lease/events", nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc.cancel()
	if code := sc.wait(t); code != 0 {
		t.Fatalf("sidecar exited %d\n%s", code, sc.errOut)
	}
	mustContain(t, "sidecar stdout", sc.out.String(), "lease "+id+" NOT released (no settle report from the agent wrapper within the settle timeout, 300ms)")
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 1 || l[0].LeaseID != id {
		t.Fatalf("active leases %+v, want %s left to expire", l, id)
	}
}

// TestAgentOperatorShell: an operator's shell beside the agent ("fenceline
// agent --operator", what kubectl exec should run) is guarded like the
// agent, and its exit is no settle report: the sidecar still waits for the
// agent's own (the first report releases the lease on SIGTERM). Its one
// refused write is logged once, in JSON without a key twice.
func TestAgentOperatorShell(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, _ := seededGitServer(t)
	co := newCheckout(t, "")
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "in", "--git-upstream", gs.URL+"/payments.git", "--state-dir", t.TempDir())
	id := leaseOfSidecar(t, sc.out.String())
	agent := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--", "sh", "-c", "echo up > in/agent-up; while [ ! -e stop ]; do sleep 0.05; done")
	t.Cleanup(func() { os.WriteFile(filepath.Join(co, "stop"), nil, 0o644) })
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		agent.running(t)
		return exists(filepath.Join(co, "in", "agent-up"))
	})

	op := startAgent(t, "--operator", "--log-format", "json", "--sidecar", sc.admin, "--checkout", co, "--",
		"sh", "-c", "echo ok > in/operator; echo bad > out/operator")
	if code := op.wait(t); code == 0 {
		t.Fatalf("the operator's shell exited 0: its out-of-scope write was not refused\n%s", op.errOut)
	}
	if err := exists(filepath.Join(co, "in", "operator")); err != nil {
		t.Errorf("the operator's in-scope write: %v", err)
	}
	if exists(filepath.Join(co, "out", "operator")) == nil {
		t.Error("the operator's out-of-scope write landed")
	}
	mustContain(t, "operator stderr", op.errOut.String(), "no settle report")
	code, body := testutil.HTTPGet(t, sc.admin+"/api/v1/lease", "")
	if code != http.StatusOK || strings.Contains(body, `"settled":true`) {
		t.Fatalf("after the operator's shell ended the sidecar says %d %s: want the attempt not settled", code, body)
	}

	// Revoked, the operator's in-scope write is refused by the guard's
	// gate (Landlock refused the other one silently): logged once.
	fl(t, "--nats", url, "lease", "revoke", id, "--reason", "runaway agent").want(t, ExitOK)
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		if code, body := testutil.HTTPGet(t, sc.admin+"/readyz", ""); code != http.StatusServiceUnavailable {
			return fmt.Errorf("readyz %d %s after the revoke", code, body)
		}
		return nil
	})
	op = startAgent(t, "--operator", "--log-format", "json", "--sidecar", sc.admin, "--checkout", co, "--",
		"sh", "-c", "echo late > in/operator-late")
	if code := op.wait(t); code == 0 {
		t.Fatalf("the operator's shell wrote after the revoke\n%s", op.errOut)
	}
	var denials int
	for _, l := range strings.Split(strings.TrimSpace(op.errOut.String()), "\n") {
		// The shell's own message shares the stream, and may be cut by
		// a log line written between its two writes ("sh: 1: " then the
		// line, then "cannot create ...").
		i := strings.Index(l, "{")
		if i < 0 {
			continue
		}
		l = l[i:]
		var m map[string]any
		if err := json.Unmarshal([]byte(l), &m); err != nil {
			t.Fatalf("log line %q: %v", l, err)
		}
		if m["msg"] == "file write denied" {
			denials++
		}
		for _, k := range []string{`"msg":`, `"lease":`, `"fence":`} {
			if strings.Count(l, k) > 1 {
				t.Errorf("%s twice in %s", k, l)
			}
		}
	}
	if denials != 1 {
		t.Errorf("%d log lines for the one refused write, want 1:\n%s", denials, op.errOut)
	}

	agent.cancel() // the kubelet's SIGTERM
	agent.wait(t)
	mustContain(t, "agent stderr", agent.errOut.String(), "attempt settled and reported to the sidecar")
	if _, body := testutil.HTTPGet(t, sc.admin+"/api/v1/lease", ""); !strings.Contains(body, `"settled":true`) {
		t.Errorf("after the agent settled the sidecar says %s", body)
	}
}
