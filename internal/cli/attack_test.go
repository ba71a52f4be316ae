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
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", strings.Join(script, "; ")).want(t, ExitOK)
	if strings.Contains(r.stdout, "SEED") {
		t.Fatalf("the agent read bus credentials:\n%s", r.stdout)
	}
	for _, role := range leasebus.Roles {
		mustContain(t, "agent stdout", r.stdout, string(role)+"-unreadable")
	}
}

// TestRunAgentCannotReadParentSecrets: what the agent's environment leaves
// out (the upstream git credential) and what fenceline run holds in memory
// or open stays out of reach through /proc: Landlock keeps a sandboxed
// process from ptrace-class access (environ, mem, fd, maps) to processes
// outside its domain, and the agent inherits no descriptor but stdio.
func TestRunAgentCannotReadParentSecrets(t *testing.T) {
	isolate(t)
	url := startBus(t)
	const secret = "fenceline-attack-upstream-secret-4242"
	t.Setenv("FENCELINE_GIT_UPSTREAM_HEADER", "Authorization: Basic "+secret)
	co := newCheckout(t, "")
	script := `for p in /proc/[0-9]*; do
  [ "$p" = /proc/$$ ] && continue
  cat $p/environ 2>/dev/null | tr '\0' '\n' | grep -a ` + secret + ` && echo "environ-of-$p"
  for f in $p/fd/*; do cat "$f" 2>/dev/null | head -c 65536 | grep -a -q ` + secret + ` && echo "fd-$f"; done
  dd if=$p/mem bs=1 count=1 2>/dev/null >/dev/null && echo "mem-of-$p"
done
ls -l /proc/self/fd/ | sed "s/^/fd: /"; env | grep -i -a "secret\|nk\|creds" | sed "s/^/env: /"
echo probed`
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", script).want(t, ExitOK)
	mustContain(t, "agent stdout", r.stdout, "probed")
	if strings.Contains(r.stdout, "environ-of") || strings.Contains(r.stdout, "fd-/proc") || strings.Contains(r.stdout, secret) {
		t.Fatalf("the agent read a secret of another process:\n%s", r.stdout)
	}
	t.Logf("agent: %s", r.stdout)
}
