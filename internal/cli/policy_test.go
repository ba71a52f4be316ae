package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// issuePolicy is issue 30's example policy, verbatim.
const issuePolicy = `@id("no-workflows")
forbid (principal, action, resource is Fenceline::Path)
when { resource.path like ".github/workflows*" };

@id("ledger-read-only")
forbid (principal, action == Fenceline::Action::"sql_write", resource is Fenceline::Table)
when { resource.name like "ledger.*" };

@id("whole-repo-release-only")
forbid (principal, action == Fenceline::Action::"claim", resource)
when { context.whole_repo } unless { principal.task == "release" };
`

func writeFile(t *testing.T, name, text string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestPolicySchemaValidateAndTest(t *testing.T) {
	t.Parallel()
	isolate(t)
	out := fl(t, "policy", "schema").want(t, ExitOK).stdout
	mustContain(t, "schema", out, "namespace Fenceline", "action sql_opaque", `"whole_repo": Bool`)

	good := writeFile(t, "p.cedar", issuePolicy)
	mustContain(t, "validate", fl(t, "policy", "validate", "-f", good).want(t, ExitOK).stdout, "valid, 3 rules", "sha256:")

	bad := writeFile(t, "bad.cedar", issuePolicy+"\n@id(\"typo\")\nforbid (principal, action, resource is Fenceline::Path)\nwhen { resource.paht == \"x\" };\n")
	r := fl(t, "policy", "validate", "-f", bad).want(t, ExitUsage)
	mustContain(t, "validate's error", r.stderr, bad+":13:1: ", `rule "typo"`, "paht")

	cases := writeFile(t, "cases.json", `[
	  {"name": "no workflow writes", "request": {"agent": "a", "task": "t", "repo": "r", "action": "write", "resource": {"kind": "Path", "name": ".github/workflows/ci.yml"}}, "expect": "deny", "rule": "no-workflows"},
	  {"name": "release claims the whole repo", "request": {"agent": "a", "task": "release", "action": "claim", "resource": {"kind": "Path", "name": ""}, "context": {"whole_repo": true}}, "expect": "allow"}
	]`)
	mustContain(t, "test", fl(t, "policy", "test", "-f", good, "--cases", cases).want(t, ExitOK).stdout, "2 cases, 0 failed")
	wrong := writeFile(t, "wrong.json", `[
	  {"name": "ledger writes allowed (wrong)", "request": {"agent": "a", "action": "sql_write", "resource": {"kind": "Table", "name": "ledger.entries"}}, "expect": "allow"}
	]`)
	r = fl(t, "policy", "test", "-f", good, "--cases", wrong).want(t, ExitError)
	mustContain(t, "a failing test", r.stdout, "FAIL  ledger writes allowed (wrong)", `"ledger-read-only"`)
}

func TestPolicySetGetHistory(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	good := writeFile(t, "p.cedar", issuePolicy)
	// A holder's and a viewer's credentials cannot set a policy: the bus
	// refuses them.
	for _, role := range []leasebus.Role{leasebus.RoleHolder, leasebus.RoleViewer} {
		setCfg(t, func(c *config) { c.Creds = filepath.Join(bustest.CredsDir(t), leasebus.CredsFile(role)) })
		r := fl(t, "--nats", url, "policy", "set", "-f", good, "--default").want(t, ExitConflict)
		mustContain(t, string(role)+"'s refusal", r.stderr, "not permitted")
	}
	useTestCreds(t)
	r := fl(t, "--nats", url, "policy", "set", "-f", good, "--default").want(t, ExitOK)
	mustContain(t, "set", r.stdout, "policy set: default (enforce)", "version: 1", "sha256:", "set by: operator")
	fl(t, "--nats", url, "policy", "set", "-f", good, "--repo", "https://github.com/acme/payments.git", "--mode", "shadow").want(t, ExitOK)
	// A stale version is refused.
	r = fl(t, "--nats", url, "policy", "set", "-f", good, "--default", "--version", "0").want(t, ExitError)
	mustContain(t, "stale set", r.stderr, "version 1, not 0")
	fl(t, "--nats", url, "policy", "set", "-f", writeFile(t, "empty.cedar", ""), "--default").want(t, ExitOK)

	mustContain(t, "get", fl(t, "--nats", url, "policy", "get", "--repo", testRepo, "--mode", "shadow").want(t, ExitOK).stdout,
		"# github.com/acme/payments policy (shadow), version 1", `@id("no-workflows")`)
	mustContain(t, "get of a removed policy", fl(t, "--nats", url, "policy", "get", "--default").want(t, ExitOK).stdout, "no default policy")
	h := fl(t, "--nats", url, "policy", "history", "--default").want(t, ExitOK).stdout
	if strings.Count(h, "\n") != 2 || !strings.Contains(h, "version 2") || !strings.Contains(h, "(removed)") {
		t.Errorf("history:\n%s\nwant versions 1 and 2, the second a removal", h)
	}
	fl(t, "--nats", url, "policy", "get").want(t, ExitUsage)
}

const noExampleAPI = `@id("no-example-api")
forbid (principal, action == Fenceline::Action::"connect", resource is Fenceline::Host)
when { resource.name == "api.example.test" };
`

// awaitShadowFileEvent waits for a shadow-refused file event of repo whose
// message holds what.
func awaitShadowFileEvent(t *testing.T, url, repo, what string) {
	t.Helper()
	_, nc := busClient(t, url)
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		evs, err := leasebus.ReadAudit(ctx, nc, repo, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == leasebus.EventShadowRefused && ev.Boundary == lease.BoundaryFile && strings.Contains(ev.Message, what) {
				return nil
			}
		}
		return fmt.Errorf("no shadow-refused file event with %q among %d", what, len(evs))
	})
}
