//go:build integration

package cli

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// A runner's flag cannot loosen the policy: --allow-host of a host the
// policy forbids exits 2 naming the rule, before any lease is taken.
func TestRunFlagCannotLoosenPolicy(t *testing.T) {
	isolate(t)
	url := startBus(t)
	w := newEgressWorld(t)
	fl(t, "--nats", url, "policy", "set", "--default", "-f", writeFile(t, "p.cedar", noExampleAPI+issuePolicy)).want(t, ExitOK)
	r := runFL(t, url, append(w.args(), "--", "true")...).want(t, ExitUsage)
	mustContain(t, "run's refusal", r.stderr, "--allow-host api.example.test:443", `policy rule "no-example-api" (default policy, version 1)`, "flags only narrow")
	r = runFL(t, url, "--checkout", w.co, "--whole-repo", "--", "true").want(t, ExitUsage)
	mustContain(t, "run's refusal", r.stderr, "--whole-repo", `"whole-repo-release-only"`)
	r = runFL(t, url, "--checkout", w.co, "--scope", ".github/workflows", "--", "true").want(t, ExitUsage)
	mustContain(t, "run's refusal", r.stderr, "--scope .github/workflows", `"no-workflows"`)
	if ls := listJSON(t, url, "--repo", "git.example.test:"+w.gitPort+"/payments", "--all"); len(ls) != 0 {
		t.Fatalf("a lease was taken: %+v", ls)
	}
	// The release task may claim the whole repo.
	runFL(t, url, "--checkout", w.co, "--whole-repo", "--task", "release", "--", "true").want(t, ExitOK)
}

// A policy change reaches a running `fenceline run` without a restart:
// the egress proxy refuses a host the new version forbids, naming the
// rule and version in the agent's own output and in the audit.
func TestRunFollowsPolicyChange(t *testing.T) {
	isolate(t)
	url := startBus(t)
	w := newEgressWorld(t)
	goFile := filepath.Join(t.TempDir(), "go")
	script := `curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/one && echo one=ok || echo one=failed
for i in $(seq 600); do [ -e ` + goFile + ` ] && break; sleep 0.05; done
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/two && echo two=reached || echo two=refused`
	run := startRun(t, url, append(w.args(), "--", "bash", "-c", script)...)
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(run.out.String(), "one=ok") {
			return fmt.Errorf("the agent has not reached the api yet:\n%s\n%s", run.out, run.errOut)
		}
		return nil
	})
	fl(t, "--nats", url, "policy", "set", "--repo", "git.example.test:"+w.gitPort+"/payments", "-f", writeFile(t, "p.cedar", noExampleAPI)).want(t, ExitOK)
	set := time.Now()
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := run.wait(t); code != ExitOK {
		t.Fatalf("run exited %d:\n%s", code, run.errOut)
	}
	got := strings.Join(strings.Fields(run.out.String()), " ")
	if !strings.HasSuffix(got, "one=ok two=refused") {
		t.Fatalf("agent: %s\nwant the second call refused\nstderr:\n%s", got, run.errOut)
	}
	t.Logf("policy in force at the running egress proxy within %s of being set (the agent's next connect)", time.Since(set).Round(time.Millisecond))
	mustContain(t, "run stderr", run.errOut.String(), "api.example.test:443 refused for lease", `policy rule \"no-example-api\" (git.example.test:`+w.gitPort+`/payments policy, version 1)`)
	_, nc := busClient(t, url)
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		evs, err := leasebus.ReadAudit(ctx, nc, "git.example.test:"+w.gitPort+"/payments", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Boundary == lease.BoundaryNet && ev.Type == lease.EventDenied && ev.Reason == "policy" && strings.Contains(ev.Message, `"no-example-api"`) {
				return nil
			}
		}
		return fmt.Errorf("no net refusal by the policy in the audit: %+v", evs)
	})
}

// The git fence judges every ref update as push and every touched path as
// write: a commit touching a protected path is refused naming the rule
// (in git push's own output), a push elsewhere lands.
func TestRunGitPushFollowsPolicy(t *testing.T) {
	isolate(t)
	url := startBus(t)
	w := newEgressWorld(t)
	fl(t, "--nats", url, "policy", "set", "--default", "-f", writeFile(t, "p.cedar", issuePolicy+`
@id("no-force-main") forbid (principal, action == Fenceline::Action::"push", resource is Fenceline::Ref)
when { resource.name == "refs/heads/main" && context.force };
`)).want(t, ExitOK)
	script := `set -e
blob=$(echo 'on: push' | git hash-object -w --stdin)
git update-index --add --cacheinfo 100644,$blob,.github/workflows/ci.yml
git -c user.name=agent -c user.email=agent@example.com commit -qm "workflow"
git push origin HEAD:refs/heads/wf 2>&1 | grep -m1 -o 'refused by policy rule "no-workflows" (default policy, version 1)' || echo wf=landed
git reset -q --soft HEAD~1 && git rm -q --cached .github/workflows/ci.yml
echo '// v2' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "billing"
git push -q origin HEAD:refs/heads/main && echo main=ok
git -c user.name=agent -c user.email=agent@example.com commit -q --amend -m "rewritten"
git push -f origin HEAD:refs/heads/main 2>&1 | grep -m1 -o 'refused by policy rule "no-force-main"' || echo force=landed`
	r := runFL(t, url, "--checkout", w.co, "--workspace", "exclusive", "--git-upstream", w.upstream, "--git-upstream-ca", w.ca.File,
		"--allow-force-push", "--egress-resolve", "git.example.test:"+w.gitPort+"="+w.gitAddr, "--", "bash", "-c", script).want(t, ExitOK)
	got := strings.Join(strings.Fields(r.stdout), " ")
	want := `refused by policy rule "no-workflows" (default policy, version 1) main=ok refused by policy rule "no-force-main"`
	if got != want {
		t.Fatalf("agent: %s\nwant   %s\nstderr:\n%s", got, want, r.stderr)
	}
	if m := w.upstreamMain(t); m != "billing" {
		t.Errorf("upstream main: %q, want the billing commit", m)
	}
	if out, err := gitRun(t, "", nil, "--git-dir", w.bare, "rev-parse", "--verify", "--quiet", "refs/heads/wf"); err == nil {
		t.Errorf("the workflow push landed: %s", out)
	}
}

// A policy change reaches a running sidecar without a restart: its egress
// proxy refuses, at the agent's next connect, a host the new version
// forbids, naming the rule. A shadow policy set before that refuses
// nothing and is audited as shadow-refused.
func TestSidecarFollowsPolicyChange(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	w := newEgressWorld(t)
	co := newCheckout(t, "")
	sc := startSidecar(t, busURL, "--repo", testRepo, "--scope", "in", "--state-dir", t.TempDir(),
		"--allow-host", "api.example.test", "--egress-resolve", "api.example.test:443="+w.api)
	fl(t, "--nats", busURL, "policy", "set", "--repo", testRepo, "--mode", "shadow", "-f", writeFile(t, "s.cedar", noExampleAPI)).want(t, ExitOK)
	goFile := filepath.Join(t.TempDir(), "go")
	script := `sleep 0.3
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/one && echo one=ok || echo one=failed
for i in $(seq 600); do [ -e ` + goFile + ` ] && break; sleep 0.05; done
curl -sS --max-time 10 --cacert ` + w.ca.File + ` https://api.example.test/two 2>/dev/null && echo two=reached || echo two=refused`
	r := startAgent(t, "--sidecar", sc.admin, "--checkout", co, "--allow-host", "api.example.test", "--", "bash", "-c", script)
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		if !strings.Contains(r.out.String(), "one=ok") {
			return fmt.Errorf("the agent has not reached the api yet:\n%s\n%s", r.out, r.errOut)
		}
		return nil
	})
	fl(t, "--nats", busURL, "policy", "set", "--repo", testRepo, "-f", writeFile(t, "p.cedar", noExampleAPI)).want(t, ExitOK)
	set := time.Now()
	if err := os.WriteFile(goFile, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("agent exited %d\n%s", code, r.errOut)
	}
	if got := strings.Join(strings.Fields(r.out.String()), " "); !strings.HasSuffix(got, "one=ok two=refused") {
		t.Fatalf("agent: %s\nwant the second call refused\nsidecar:\n%s", got, sc.errOut)
	}
	t.Logf("the running sidecar refused %s after the policy was set", time.Since(set).Round(time.Millisecond))
	_, nc := busClient(t, busURL)
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		evs, err := leasebus.ReadAudit(ctx, nc, testRepo, 0)
		if err != nil {
			return err
		}
		var shadow, denied int
		for _, ev := range evs {
			switch {
			case ev.Type == leasebus.EventShadowRefused && ev.Boundary == lease.BoundaryNet && strings.Contains(ev.Message, `"no-example-api"`):
				shadow++
			case ev.Type == lease.EventDenied && ev.Reason == "policy" && strings.Contains(ev.Message, `"no-example-api"`):
				denied++
			}
		}
		if shadow == 0 || denied == 0 {
			return fmt.Errorf("%d shadow-refused and %d policy refusals audited, want some of each", shadow, denied)
		}
		return nil
	})
}

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
