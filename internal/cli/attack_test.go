package cli

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/leasebus"
)

// TestRunHidesSiblingBusCredentials: $FENCELINE_CREDS may name one file
// (the holder's, used for every command) in a credentials directory that
// holds the other roles' files too, as `bus serve --store` writes them.
// Hiding only the named file left the service's and the operator's seeds
// beside it readable: a guarded agent could then act as the lease service.
func TestRunHidesSiblingBusCredentials(t *testing.T) {
	isolate(t)
	url := startBus(t)
	dir := bustest.CredsDir(t)
	t.Setenv(EnvCreds, filepath.Join(dir, leasebus.CredsFile(leasebus.RoleHolder)))
	co := newCheckout(t, "")
	var script []string
	for _, role := range leasebus.Roles {
		p := filepath.Join(dir, leasebus.CredsFile(role))
		if data, err := os.ReadFile(p); err != nil || !strings.Contains(string(data), "NKEY SEED") {
			t.Fatalf("%s: %v", p, err) // readable outside the guard
		}
		script = append(script, fmt.Sprintf("cat %s || echo %s-unreadable", p, role))
	}
	r := runFL(t, url, "--repo", co, "--scope", "in", "--", "sh", "-c", strings.Join(script, "; ")).want(t, ExitOK)
	if strings.Contains(r.stdout, "SEED") {
		t.Fatalf("the agent read bus credentials:\n%s", r.stdout)
	}
	for _, role := range leasebus.Roles {
		mustContain(t, "agent stdout", r.stdout, string(role)+"-unreadable")
	}
}
