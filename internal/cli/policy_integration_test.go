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
			if ev.Boundary == leasebus.BoundaryNet && ev.Type == leasebus.EventDenied && ev.Reason == "policy" && strings.Contains(ev.Message, `"no-example-api"`) {
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
			case ev.Type == leasebus.EventShadowRefused && ev.Boundary == leasebus.BoundaryNet && strings.Contains(ev.Message, `"no-example-api"`):
				shadow++
			case ev.Type == leasebus.EventDenied && ev.Reason == "policy" && strings.Contains(ev.Message, `"no-example-api"`):
				denied++
			}
		}
		if shadow == 0 || denied == 0 {
			return fmt.Errorf("%d shadow-refused and %d policy refusals audited, want some of each", shadow, denied)
		}
		return nil
	})
}
