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
	isolate(t)
	url := startBus(t)
	good := writeFile(t, "p.cedar", issuePolicy)
	// A holder's and a viewer's credentials cannot set a policy: the bus
	// refuses them.
	for _, role := range []leasebus.Role{leasebus.RoleHolder, leasebus.RoleViewer} {
		t.Setenv(EnvCreds, filepath.Join(bustest.CredsDir(t), leasebus.CredsFile(role)))
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

// A protected path is not writable even under a whole-repo lease: the
// kernel guard (Landlock) never grants it, so an existing workflow cannot
// be changed and no new one created, while the rest of the checkout is
// written and committed as before.
func TestRunWholeRepoKeepsProtectedPathsUnwritable(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "https://github.com/acme/guarded.git")
	if err := os.MkdirAll(filepath.Join(co, ".github/workflows"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(co, ".github/workflows/ci.yml"), []byte("on: push\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	mustGitRun(t, co, nil, "add", "-A")
	mustGitRun(t, co, nil, "commit", "--quiet", "-m", "workflow")
	fl(t, "--nats", url, "policy", "set", "--default", "-f", writeFile(t, "p.cedar", issuePolicy)).want(t, ExitOK)
	script := `echo pwned >> .github/workflows/ci.yml 2>/dev/null && echo edit=landed || echo edit=refused
echo pwned > .github/workflows/new.yml 2>/dev/null && echo create=landed || echo create=refused
mv .github/workflows/ci.yml in/ 2>/dev/null && echo move=landed || echo move=refused
echo v2 >> in/seed && echo in=ok
echo v2 >> README.md && echo readme=ok
git -c user.name=a -c user.email=a@example.com commit -qam "agent" && echo commit=ok`
	r := runFL(t, url, "--checkout", co, "--whole-repo", "--task", "release", "--", "bash", "-c", script).want(t, ExitOK)
	got := strings.Join(strings.Fields(r.stdout), " ")
	if want := "edit=refused create=refused move=refused in=ok readme=ok commit=ok"; got != want {
		t.Fatalf("agent: %s\nwant   %s\nstderr:\n%s", got, want, r.stderr)
	}
	mustContain(t, "run stderr", r.stderr, "policy: the file guard keeps .github/workflows unwritable")
	if data, err := os.ReadFile(filepath.Join(co, ".github/workflows/ci.yml")); err != nil || string(data) != "on: push\n" {
		t.Fatalf("the workflow changed: %q %v", data, err)
	}
}

// A shadow policy protecting a path refuses nothing at the file guard and
// is audited as shadow-refused (boundary file).
func TestRunShadowPolicyAuditsWithoutRefusing(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "https://github.com/acme/shadowed.git")
	fl(t, "--nats", url, "policy", "set", "--repo", "github.com/acme/shadowed", "--mode", "shadow", "-f", writeFile(t, "p.cedar", `@id("no-readme")
forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path == "README.md" };`)).want(t, ExitOK)
	r := runFL(t, url, "--checkout", co, "--whole-repo", "--", "bash", "-c", "echo v2 >> README.md && echo readme=ok").want(t, ExitOK)
	if got := strings.TrimSpace(r.stdout); got != "readme=ok" {
		t.Fatalf("agent: %s\nstderr:\n%s", got, r.stderr)
	}
	awaitShadowFileEvent(t, url, "github.com/acme/shadowed", `README.md: policy rule "no-readme"`)
}

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
			if ev.Type == leasebus.EventShadowRefused && ev.Boundary == leasebus.BoundaryFile && strings.Contains(ev.Message, what) {
				return nil
			}
		}
		return fmt.Errorf("no shadow-refused file event with %q among %d", what, len(evs))
	})
}

// A running attempt whose guard grants a path a new policy protects loses
// its writes within a second, without a restart (Landlock cannot take a
// right back, so the supervisor refuses every write from then on). The
// agent tries every 50 ms from the moment the policy is set, for at most
// a second.
func TestRunLosesWritesANewPolicyRemoves(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "https://github.com/acme/live.git")
	goFile := filepath.Join(t.TempDir(), "go")
	script := `echo v1 >> README.md && echo one=ok
for i in $(seq 600); do [ -e ` + goFile + ` ] && break; sleep 0.05; done
for i in $(seq 20); do echo v2 >> in/seed 2>/dev/null || { echo two=refused; exit 0; }; sleep 0.05; done
echo two=still-writing-after-1s`
	run := startRun(t, url, "--checkout", co, "--whole-repo", "--", "bash", "-c", script)
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(run.out.String(), "one=ok") {
			return fmt.Errorf("the agent has not written yet:\n%s\n%s", run.out, run.errOut)
		}
		return nil
	})
	fl(t, "--nats", url, "policy", "set", "--repo", "github.com/acme/live", "-f", writeFile(t, "p.cedar", `@id("readme-frozen")
forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path == "README.md" };`)).want(t, ExitOK)
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := run.wait(t); code != ExitOK {
		t.Fatalf("run exited %d:\n%s", code, run.errOut)
	}
	if got := strings.Join(strings.Fields(run.out.String()), " "); got != "one=ok two=refused" {
		t.Fatalf("agent: %s\nwant its writes refused within a second of the policy\nstderr:\n%s", got, run.errOut)
	}
	mustContain(t, "run stderr", run.errOut.String(), "the policy now protects README.md")
}

// In a pod's layout (the sidecar follows the policy, the agent's wrapper
// has no bus) the file guard keeps what the policy protects unwritable
// inside the claim, as under run, and follows a change: once a new
// version protects a path the guard was started granting, every write is
// refused within a second. The shadow version before it is audited from
// the wrapper as shadow-refused.
func TestAgentKeepsProtectedPathsUnwritable(t *testing.T) {
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	if err := os.MkdirAll(filepath.Join(co, "in", "locked"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(co, "in", "locked", "keys"), []byte("v1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	fl(t, "--nats", url, "policy", "set", "--repo", testRepo, "-f", writeFile(t, "p.cedar", `@id("locked")
forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path like "in/locked*" };`)).want(t, ExitOK)
	fl(t, "--nats", url, "policy", "set", "--repo", testRepo, "--mode", "shadow", "-f", writeFile(t, "s.cedar", `@id("seed-watched")
forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path == "in/seed" };`)).want(t, ExitOK)
	gs, _ := seededGitServer(t)
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "in", "--git-upstream", gs.URL+"/payments.git", "--state-dir", t.TempDir())
	goFile := filepath.Join(t.TempDir(), "go")
	script := `echo v2 >> in/locked/keys 2>/dev/null && echo edit=landed || echo edit=refused
echo x > in/locked/new 2>/dev/null && echo create=landed || echo create=refused
echo v2 >> in/seed && echo seed=ok
for i in $(seq 600); do [ -e ` + goFile + ` ] && break; sleep 0.05; done
for i in $(seq 20); do echo v3 >> in/seed 2>/dev/null || { echo later=refused; exit 0; }; sleep 0.05; done
echo later=still-writing-after-1s`
	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--", "bash", "-c", script)
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.out.String(), "seed=") {
			return fmt.Errorf("the agent has not written yet:\n%s\n%s", r.out, r.errOut)
		}
		return nil
	})
	fl(t, "--nats", url, "policy", "set", "--repo", testRepo, "-f", writeFile(t, "p2.cedar", `@id("locked")
forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path like "in/locked*" || resource.path == "in/seed" };`)).want(t, ExitOK)
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d\n%s", code, r.errOut)
	}
	if got, want := strings.Join(strings.Fields(r.out.String()), " "), "edit=refused create=refused seed=ok later=refused"; got != want {
		t.Fatalf("agent: %s\nwant   %s\nstderr:\n%s", got, want, r.errOut)
	}
	mustContain(t, "agent stderr", r.errOut.String(), "in/locked")
	mustContain(t, "agent stderr", r.errOut.String(), "the policy now protects in/seed")
	if data, err := os.ReadFile(filepath.Join(co, "in", "locked", "keys")); err != nil || string(data) != "v1\n" {
		t.Fatalf("the protected file changed: %q %v", data, err)
	}
	awaitShadowFileEvent(t, url, testRepo, `in/seed: policy rule "seed-watched"`)
}
