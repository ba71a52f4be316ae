//go:build integration

package cli

import (
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/demo"
	"github.com/fenceline/fenceline/internal/testutil"
)

// TestDemo runs the whole demo with its run UI, checks the story's
// expectations on its output, and that the UI served the demo bus's leases
// and audit trail until the demo was stopped.
func TestDemo(t *testing.T) {
	isolate(t)
	start := time.Now()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	cfg := cfgOf(t)
	// An unreachable default bus proves the demo needs none.
	go func() { done <- run(ctx, []string{"demo", "--ui", "127.0.0.1:0"}, &out, &errOut, closedURL(t), cfg) }()
	uiUp := regexp.MustCompile(`the run UI stays up at (\S+);`)
	var uiURL string
	checkFor(t, 3*time.Minute, 20*time.Millisecond, func() error {
		select {
		case code := <-done:
			t.Fatalf("demo exited %d before stopped:\n%s\nstderr:\n%s", code, out.String(), errOut.String())
		default:
		}
		m := uiUp.FindStringSubmatch(out.String())
		if m == nil {
			return errors.New("the story is not told yet")
		}
		uiURL = m[1]
		return nil
	})
	t.Logf("demo took %s:\n%s", time.Since(start), out.String())
	mustContain(t, "demo", out.String(),
		"run UI: http://127.0.0.1:",
		"== 1. Two agents race", "winner: agent-", "loser:  agent-", "conflict in "+demo.Repo,
		"== 2. A disjoint scope", "agent-c got lease_",
		"== 3. A crashed holder", "reclaimed: lease_",
		"== 4. Fence tokens rise", "strictly increasing",
		"== 5. An operator revokes", "agent-c's holder saw it after",
		"== 6. The audit trail",
		"== 7. The git fence", "== 8. The Postgres fence",
		"== 9. A pool of worktree shards",
		"== 10. A zombie at the file guard", "Permission denied (refused at the system call)", "audit: denied file lease_",
		"demo complete")
	if strings.Count(out.String(), " grant ") < 5 {
		t.Errorf("audit trail should show at least 5 grants")
	}

	// The run UI serves what the demo did.
	if code, body := testutil.HTTPGet(t, uiURL+"api/v1/leases?repo="+demo.Repo+"&all=1", ""); code != 200 || !strings.Contains(body, `"agentId":"agent-c"`) {
		t.Errorf("run UI leases: %d %.300q", code, body)
	}
	if code, body := testutil.HTTPGet(t, uiURL+"api/v1/audit?repo="+demo.Repo+"&limit=1000", ""); code != 200 || !strings.Contains(body, `"type":"reclaimed"`) {
		t.Errorf("run UI audit: %d %.300q", code, body)
	}
	cancel()
	select {
	case code := <-done:
		if code != ExitOK {
			t.Errorf("demo exited %d when stopped:\n%s", code, errOut.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("demo did not stop within 15s of Ctrl-C")
	}
	if errOut.String() != "" {
		t.Errorf("stderr: %s", errOut.String())
	}
}
