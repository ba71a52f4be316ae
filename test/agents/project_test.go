//go:build integration

package agents

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestClaudeProjectHookNamed: Claude Code under the README's recipe, in
// the user's own checkout (no pool), writes a SessionStart hook into its
// claim's .claude/settings.local.json — a file Claude Code keeps out of
// git, so no diff shows it. It is the agent's work and stays; run's
// settle names it for review. The user's next plain claude started there
// runs it, unguarded: what the review line is for.
func TestClaudeProjectHookNamed(t *testing.T) {
	w := newWorld(t)
	argv := w.agentArgv(t, "claude")
	w.seedState("claude")
	dir := filepath.Join(w.co, "services", "billing")
	ran := filepath.Join(w.base, "project-hook-ran")
	settings := filepath.Join(dir, ".claude", "settings.local.json")
	hook := `{"hooks": {"SessionStart": [{"hooks": [{"type": "command", "command": "touch ` + ran + `"}]}]}}`
	w.model.SetSteps([]Step{{Name: "plant", Cmd: "( mkdir -p " + filepath.Dir(settings) + " && printf '%s\\n' '" + hook + "' > " + settings +
		" && echo STEP plant=landed || echo STEP plant=refused ) 2>&1"}})

	args := append([]string{w.fl, "--nats", w.busURL, "run", "--checkout", w.co, "--ttl", "2m",
		"--scope", "services/billing", "--workspace", "exclusive",
		"--allow-host", w.modelHost(), "--egress-resolve", w.modelHost() + "=127.0.0.1:" + w.modelPt}, w.stateFlags("claude")...)
	p := w.start(w.co, w.agentEnv(), nil, append(append(args, "--"), argv...)...)
	code := p.wait(t, 4*time.Minute)
	logs := p.errOut.String()
	t.Logf("claude under fenceline run exited %d:\n%s", code, logs)
	if code != 0 || !w.model.Finished() || marker(w.model.Results()[0], "plant") != "landed" {
		t.Fatalf("the guarded run: exit %d, finished %v, plant %q", code, w.model.Finished(), gist(w.model.Results()[0]))
	}
	want := `project settings: REVIEW added hooks.SessionStart[0].hooks[0] in services/billing/.claude/settings.local.json: command = "touch ` + ran + `"`
	if !strings.Contains(logs, want) {
		t.Errorf("run's stderr does not name the planted hook: want %q", want)
	}
	if _, err := os.Lstat(ran); err == nil {
		t.Fatalf("the hook ran during the guarded run")
	}

	w.model.SetSteps(nil)
	plain := w.start(dir, w.plainEnv(), nil, w.plainArgv(t, "claude")...)
	if pcode := plain.wait(t, 2*time.Minute); pcode != 0 {
		t.Fatalf("the plain run: exit %d\n%s%s", pcode, plain.out.String(), plain.errOut.String())
	}
	if _, err := os.Lstat(ran); err != nil {
		t.Errorf("the user's plain claude in %s did not run the project hook (%v): then the review line warns of nothing; the test proves nothing", dir, err)
	}
}
