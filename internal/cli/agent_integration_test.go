//go:build integration

package cli

import (
	"context"
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
