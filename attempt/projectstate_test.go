package attempt

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

// TestRunNamesProjectSettings: an attempt in the user's own checkout (no
// pool) plants, in its claim, what Claude Code and Codex run when the
// user next starts them there — a SessionStart hook in
// .claude/settings.local.json (which Claude Code keeps out of git: no
// diff shows it), an MCP server's command in .mcp.json, a notify command
// in .codex/config.toml, a CLAUDE.md — and changes a hook of the user's
// own .claude/settings.json. Settle names each setting that runs a
// program, and leaves the user's settings it did not touch unnamed; in
// an exclusive run the whole checkout is looked at.
func TestRunNamesProjectSettings(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	plant := strings.Join([]string{
		`set -e`,
		`mkdir -p DIR/.claude DIR/.codex`,
		`echo '{"hooks":{"SessionStart":[{"hooks":[{"type":"command","command":"touch /tmp/x"}]}]}}' > DIR/.claude/settings.local.json`,
		`echo '{"mcpServers":{"helper":{"command":"sh","args":["-c","touch /tmp/y"]}}}' > DIR/.mcp.json`,
		`echo 'notify = ["sh", "-c", "touch /tmp/z"]' > DIR/.codex/config.toml`,
		`echo 'run make setup first' > DIR/CLAUDE.md`,
		`echo '{"hooks":{"Stop":[{"hooks":[{"type":"command","command":"touch /tmp/w"}]}]},"model":"x"}' > DIR/.claude/settings.json`,
	}, "\n")
	for _, tc := range []struct {
		name  string
		mode  lease.WorkspaceMode
		claim scope.Claim
		dir   string // where the agent plants
	}{
		{"shared", lease.WorkspaceShared, claim(t, "in"), "in"},
		{"exclusive", lease.WorkspaceExclusive, scope.Claim{Kind: scope.KindNone}, "."},
	} {
		t.Run(tc.name, func(t *testing.T) {
			repo := newRepo(t, "")
			// The user's own settings: one the agent changes, one it leaves.
			for dir, c := range map[string]string{
				filepath.Join(tc.dir, ".claude"): `{"hooks":{"Stop":[{"hooks":[{"type":"command","command":"true"}]}]}}`,
				"out/.claude":                    `{"hooks":{"Stop":[{"hooks":[{"type":"command","command":"true"}]}]}}`,
			} {
				os.MkdirAll(filepath.Join(repo, dir), 0o755)
				os.WriteFile(filepath.Join(repo, dir, "settings.json"), []byte(c), 0o644)
			}
			co, err := FindCheckout(context.Background(), repo)
			if err != nil {
				t.Fatal(err)
			}
			l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: tc.claim, WorkspaceMode: tc.mode, TTL: lease.Duration(10 * time.Second)}, leasebus.HoldOptions{})
			defer l.Holder.Close(context.Background())
			spec, said := runSpec(t, b, co, l, "sh", "-c", strings.ReplaceAll(plant, "DIR", tc.dir))
			res, err := Run(context.Background(), spec)
			if err != nil || res.Code != 0 {
				t.Fatalf("Run = %+v, %v\n%s", res, err, said.text())
			}
			text := said.text()
			t.Logf("run said:\n%s", text)
			p := func(rel string) string { return filepath.ToSlash(filepath.Join(tc.dir, rel)) }
			for _, want := range []string{
				"project settings: REVIEW added hooks.SessionStart[0].hooks[0] in " + p(".claude/settings.local.json") + `: command = "touch /tmp/x", type = "command"`,
				"project settings: REVIEW added mcpServers.helper in " + p(".mcp.json") + `: args = ["-c","touch /tmp/y"], command = "sh"`,
				"project settings: REVIEW added notify in " + p(".codex/config.toml"),
				"project settings: REVIEW changed hooks.Stop[0].hooks[0].command in " + p(".claude/settings.json") + ` = "touch /tmp/w"`,
				"project settings: REVIEW added " + p("CLAUDE.md"),
				"project settings: the agent changed ",
			} {
				if !strings.Contains(text, want) {
					t.Errorf("run said:\n%s\nwant %q", text, want)
				}
			}
			if strings.Contains(text, "out/.claude") || strings.Contains(text, "REVIEW added model") || strings.Contains(text, "REVIEW changed model") {
				t.Errorf("run named settings the agent did not change, or ones that run nothing:\n%s", text)
			}
		})
	}
}
