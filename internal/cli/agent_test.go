package cli

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// anAgent is fenceline agent going on in-process.
type anAgent struct {
	cancel      context.CancelFunc
	done        chan int
	out, errOut *syncBuffer
}

func startAgent(t *testing.T, args ...string) *anAgent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &anAgent{cancel: cancel, done: make(chan int, 1), out: &syncBuffer{}, errOut: &syncBuffer{}}
	cfg := cfgOf(t)
	go func() {
		r.done <- run(ctx, append([]string{"agent", "--log-format", "text"}, args...), r.out, r.errOut, closedURL(t), cfg)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(30 * time.Second):
			t.Error("fenceline agent did not stop")
		}
	})
	return r
}

func (r *anAgent) running(t *testing.T) {
	t.Helper()
	select {
	case code := <-r.done:
		r.done <- code
		t.Fatalf("fenceline agent exited %d early\nstdout:\n%s\nstderr:\n%s", code, r.out, r.errOut)
	default:
	}
}

func (r *anAgent) wait(t *testing.T) int {
	t.Helper()
	select {
	case code := <-r.done:
		r.done <- code
		return code
	case <-time.After(30 * time.Second):
		t.Fatalf("fenceline agent did not end\nstdout:\n%s\nstderr:\n%s", r.out, r.errOut)
		return -1
	}
}

// podProbe writes in its claim and outside it and reads a file every
// round, until a file named stop appears.
const podProbe = `n=0
while [ ! -e stop ]; do
  n=$((n+1))
  if err=$( (echo $n > in/probe) 2>&1 ); then w=ok; else w="refused($err)"; fi
  if (echo $n > out/probe) 2>/dev/null; then o=ok; else o=refused; fi
  if [ "$(cat in/seed)" = seed ]; then r=ok; else r=refused; fi
  echo "round $n write=$w out=$o read=$r"
  sleep 0.02
done`

// TestAgentWritesFollowTheSidecar: in a pod's layout — a sidecar holding
// the lease, the agent under "fenceline agent" with no bus access — the
// agent writes its claim while the sidecar says held, never outside it,
// and every write is refused within a second of an operator revoking the
// lease while reads go on; the denials reach the audit stream under the
// sidecar's lease and its metrics, and the sidecar is no longer ready.
func TestAgentWritesFollowTheSidecar(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	_, nc := busClient(t, url)
	gs, _ := seededGitServer(t)
	co := newCheckout(t, "")
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "in", "--git-upstream", gs.URL+"/payments.git", "--state-dir", t.TempDir())
	id := leaseOfSidecar(t, sc.out.String())

	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--grace", "1s", "--", "sh", "-c", podProbe)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.out.String(), "write=ok out=refused read=ok") {
			return errors.New("the agent has not written yet")
		}
		return nil
	})
	mark := revokeAndSeeRefused(t, url, id, r.out, filepath.Join(co, "in", "probe"))
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		after := r.out.String()[mark:]
		if n := strings.Count(after[strings.Index(after, "write=refused"):], "\n"); n < 3 {
			return fmt.Errorf("%d rounds since the first refusal", n)
		}
		return nil
	})
	after := r.out.String()[mark:]
	rest := after[strings.Index(after, "write=refused"):]
	if strings.Contains(rest, "write=ok") || strings.Contains(rest, "read=refused") || !strings.Contains(rest, "Permission denied") {
		t.Errorf("after the revoke, want every write refused with EACCES and every read ok:\n%s", rest)
	}
	if code, body := testutil.HTTPGet(t, sc.admin+"/readyz", ""); code != http.StatusServiceUnavailable || !strings.Contains(body, "runaway agent") {
		t.Errorf("sidecar readyz after the revoke: %d %q", code, body)
	}

	if err := os.WriteFile(filepath.Join(co, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d, want the command's 0\n%s", code, r.errOut)
	}
	mustContain(t, "agent stderr", r.errOut.String(), "attempt settled and reported to the sidecar")
	evs, err := leasebus.ReadAudit(context.Background(), nc, testRepo, 0)
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryFile && ev.Type == lease.EventDenied && ev.LeaseID == id && strings.Contains(ev.Message, filepath.Join(co, "in", "probe")) {
			found = true
			break
		}
	}
	if !found {
		t.Errorf("no audited file denial for %s among %d events", id, len(evs))
	}
	_, metrics := testutil.HTTPGet(t, sc.admin+"/metrics", "")
	if n := sample(metrics, "fenceline_fsguard_denials_total"); n < 1 {
		t.Errorf("fenceline_fsguard_denials_total = %v after refused writes", n)
	}
}

// TestAgentFailsClosedWithoutSidecar: a wrapper that never reaches its
// sidecar runs the command with every write refused and reads going on.
func TestAgentFailsClosedWithoutSidecar(t *testing.T) {
	t.Parallel()
	isolate(t)
	co := newCheckout(t, "")
	nowhere := strings.Replace(closedURL(t), "nats://", "http://", 1)
	script := `if (echo x > in/x) 2>/dev/null; then echo write=ok; else echo write=refused; fi; cat in/seed`
	r := startAgent(t, "--sidecar", nowhere, "--checkout", co, "--scope", "in", "--wait", "100ms", "--", "sh", "-c", script)
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d\n%s", code, r.errOut)
	}
	if got := strings.Fields(r.out.String()); len(got) != 2 || got[0] != "write=refused" || got[1] != "seed" {
		t.Fatalf("without a sidecar: %q, want the write refused and the read done\n%s", r.out.String(), r.errOut)
	}
	mustContain(t, "agent stderr", r.errOut.String(), "no word from the sidecar", "settle report not delivered")
}

// TestAgentRootIsCheckout: --root, the old name of --checkout, still
// names the checkout, with a warning on stderr (not on stdout, which is
// CMD's); given beside a different --checkout it is a usage error.
func TestAgentRootIsCheckout(t *testing.T) {
	t.Parallel()
	isolate(t)
	co := newCheckout(t, "")
	nowhere := strings.Replace(closedURL(t), "nats://", "http://", 1)
	r := startAgent(t, "--sidecar", nowhere, "--root", co, "--wait", "100ms", "--", "cat", "in/seed")
	if code := r.wait(t); code != 0 || strings.TrimSpace(r.out.String()) != "seed" {
		t.Fatalf("agent --root: exit %d, stdout %q\n%s", code, r.out.String(), r.errOut)
	}
	mustContain(t, "agent stderr", r.errOut.String(), "--root is deprecated: use --checkout")
	u := fl(t, "agent", "--sidecar", nowhere, "--root", co, "--checkout", t.TempDir(), "--", "true").want(t, ExitUsage)
	mustContain(t, "agent stderr", u.stderr, "--root is the old name of --checkout, and they differ")
}

// leaseOfSidecar is the lease id a sidecar announced.
func leaseOfSidecar(t *testing.T, stdout string) string {
	t.Helper()
	_, rest, ok := strings.Cut(stdout, "sidecar: lease ")
	if !ok {
		t.Fatalf("no lease announced:\n%s", stdout)
	}
	id, _, _ := strings.Cut(rest, " ")
	return id
}
