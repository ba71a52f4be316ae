//go:build integration

package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// TestSidecarSignsForTheHook: a sidecar takes no hook secret (a usage
// error before any lease is taken: whoever holds it mints any fence). Its
// lease gets a git grant key only once the secret is registered with the
// lease service (bus fence-secret set): before, the hook refuses its
// pushes saying exactly what is missing; after, the same push lands and
// its fence is recorded.
func TestSidecarSignsForTheHook(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, bare := seededGitServer(t)
	secret := filepath.Join(t.TempDir(), "bus.key")
	installHookJSON(t, "--git-dir", bare, "--repo", testRepo, "--bus-secret-file", secret)

	r := fl(t, "--nats", url, "sidecar", "--repo", testRepo, "--scope", "services/billing", "--workspace", "exclusive",
		"--git-upstream", gs.URL+"/payments.git", "--git-hook-secret", secret).want(t, ExitUsage)
	mustContain(t, "stderr", r.stderr, "--git-hook-secret", "fence-secret set")
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 0 {
		t.Fatalf("a sidecar given --git-hook-secret took a lease: %+v", l)
	}

	push := func(registered bool) (string, error) {
		envFile := filepath.Join(t.TempDir(), "agent.env")
		sc := startSidecar(t, url, "--repo", testRepo, "--scope", "services/billing", "--workspace", "exclusive",
			"--git-upstream", gs.URL+"/payments.git", "--env-file", envFile, "--state-dir", t.TempDir())
		defer func() { sc.cancel(); sc.wait(t) }()
		env, err := readEnvFile(envFile)
		if err != nil {
			t.Fatal(err)
		}
		work := filepath.Join(t.TempDir(), "work")
		mustGitRun(t, "", env, "clone", "--quiet", gs.URL+"/payments.git", work)
		os.WriteFile(filepath.Join(work, "services/billing/invoice.go"), []byte("package billing // "+work+"\n"), 0o644)
		mustGitRun(t, work, env, "commit", "--quiet", "-am", "in scope")
		out, err := gitRun(t, work, env, "push", "origin", "main")
		if !registered {
			mustContain(t, "sidecar log", sc.errOut.String(), "no git grant key")
		}
		return out, err
	}
	out, err := push(false)
	if err == nil {
		t.Fatalf("the hook accepted a push from a lease without a grant key:\n%s", out)
	}
	mustContain(t, "push output", out, "not signed (no fenceline-mac option)", "fence-secret set", "[unsigned]", "of lease \"lease_")
	if _, err := os.Stat(filepath.Join(bare, "fenceline", "fences.json")); err == nil {
		t.Fatal("an unsigned push recorded a fence")
	}

	r = fl(t, "bus", "fence-secret", "set", "--repo", testRepo, "--git", secret).want(t, ExitOK)
	mustContain(t, "stdout", r.stdout, "git secret of "+testRepo+" registered")
	out, err = push(true)
	if err != nil {
		t.Fatalf("a push signed with the lease's grant key was refused: %v\n%s", err, out)
	}
	data, err := os.ReadFile(filepath.Join(bare, "fenceline", "fences.json"))
	if err != nil || !strings.Contains(string(data), `"services/billing"`) {
		t.Fatalf("the signed push's fence is not recorded (%v):\n%s", err, data)
	}
}

// TestRunSignsForTheHookAndHidesItsSecret: with the repository's hook
// secret registered with the lease service, run's git fence signs with the
// lease's grant key and the agent's push lands past the hook; the agent
// can read neither the state dir's copy of the secret nor the service's.
func TestRunSignsForTheHookAndHidesItsSecret(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	gs, bare := seededGitServer(t)
	co := filepath.Join(t.TempDir(), "payments")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", co)
	repo := repoid.FromRemote(gs.URL+"/payments.git", "")
	in := installHookJSON(t, "--git-dir", bare, "--repo", repo) // the service's copy in the state dir
	fl(t, "bus", "fence-secret", "set", "--repo", repo, "--git", in.BusSecretFile).want(t, ExitOK)
	key, err := os.ReadFile(in.BusSecretFile)
	if err != nil {
		t.Fatal(err)
	}
	registered := leasebus.FenceSecretFile(leasebus.FenceSecretDirIn(stateDir(t)), repo, "git")
	script := `cat ` + in.BusSecretFile + ` 2>/dev/null || echo copy=hidden
cat ` + registered + ` 2>/dev/null || echo registered=hidden
echo '// v2' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "signed push" && git push -q origin main && echo push=ok`
	r := runFL(t, busURL, "--checkout", co, "--git-upstream", gs.URL+"/payments.git", "--", "bash", "-c", script).want(t, ExitOK)
	if got, want := strings.Join(strings.Fields(r.stdout), " "), "copy=hidden registered=hidden push=ok"; got != want || strings.Contains(r.stdout, strings.TrimSpace(string(key))) {
		t.Errorf("run: agent: %s\nwant   %s\nstderr:\n%s", got, want, r.stderr)
	}
	data, err := os.ReadFile(filepath.Join(bare, "fenceline", "fences.json"))
	if err != nil || !strings.Contains(string(data), "services/billing/invoice.go") {
		t.Fatalf("the signed push's fence is not recorded (%v):\n%s", err, data)
	}
}

// TestHookAuditsRefusals: a hook installed with a bus (--nats, --creds)
// writes each refusal to that bus's audit stream as well as to
// refusals.jsonl: a forged fence pushed straight to the git server is
// refused, and the audit names the lease, owner and fence the push claimed
// and the reason.
func TestHookAuditsRefusals(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, bare := seededGitServer(t)
	holder := bustest.CredsFile(t, leasebus.RoleHolder)
	in := installHookJSON(t, "--nats", url, "--creds", holder, "--git-dir", bare, "--repo", testRepo)
	script, err := os.ReadFile(in.Hook)
	if err != nil {
		t.Fatal(err)
	}
	mustContain(t, "hook script", string(script), "--nats", url, "--creds", holder)

	work := filepath.Join(t.TempDir(), "work")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", work)
	os.WriteFile(filepath.Join(work, "libs/tax/rates.go"), []byte("package tax // forged\n"), 0o644)
	mustGitRun(t, work, nil, "commit", "--quiet", "-am", "forged fence")
	out, err := gitRun(t, work, nil, "push", "-o", "fenceline-lease=lease_forged", "-o", "fenceline-fence=999999",
		"-o", "fenceline-owner=task=t agent=mallory attempt=a", "origin", "main")
	if err == nil {
		t.Fatalf("a forged fence landed:\n%s", out)
	}
	mustContain(t, "push output", out, "not signed")

	type event struct {
		Type, Boundary, Repo, LeaseID, Reason, Message string
		Fence                                          uint64
		Owner                                          lease.Owner
	}
	checkFor(t, 5*time.Second, 50*time.Millisecond, func() error {
		var evs []event
		r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
		if err := json.Unmarshal([]byte(r.stdout), &evs); err != nil {
			return fmt.Errorf("decode audit: %w\n%s", err, r.stdout)
		}
		for _, e := range evs {
			if e.Type == lease.EventDenied && e.Boundary == lease.BoundaryGit && e.LeaseID == "lease_forged" {
				if e.Repo != testRepo || e.Fence != 999999 || e.Reason != gitproxy.HookUnsigned || e.Owner.AgentID != "mallory" || !strings.Contains(e.Message, "pre-receive hook") {
					t.Fatalf("the hook's audit event is %+v", e)
				}
				return nil
			}
		}
		return fmt.Errorf("no audit event of the hook's refusal in %d events", len(evs))
	})
}

// TestHookRefusesAPushOfARevokedLease: a hook installed with a bus lands
// a push only while its lease is active with its fence. A push signed for
// a lease (as its sidecar signs, with the grant key the service gave) and
// delivered after an operator revoked that lease — a sidecar paused after
// its last check, a git server slow to take it — is refused by the
// storage itself and nothing is recorded; the same push under an active
// lease lands.
func TestHookRefusesAPushOfARevokedLease(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, bare := seededGitServer(t)
	holder := bustest.CredsFile(t, leasebus.RoleHolder)
	in := installHookJSON(t, "--nats", url, "--creds", holder, "--git-dir", bare, "--repo", testRepo)
	fl(t, "bus", "fence-secret", "set", "--repo", testRepo, "--git", in.BusSecretFile).want(t, ExitOK)
	nc := bustest.ConnectRole(t, url, leasebus.RoleHolder)
	c := leasebus.NewClient(nc)
	work := filepath.Join(t.TempDir(), "work")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", work)

	// push signs a commit's update of main for l, as the lease's sidecar
	// would, and pushes it straight to the server.
	push := func(l *lease.Lease, n int) (string, error) {
		t.Helper()
		os.WriteFile(filepath.Join(work, "libs/tax/rates.go"), []byte(fmt.Sprintf("package tax // %d\n", n)), 0o644)
		mustGitRun(t, work, nil, "commit", "--quiet", "-am", fmt.Sprintf("push %d", n))
		old := strings.TrimSpace(mustGitRun(t, work, nil, "rev-parse", "origin/main"))
		head := strings.TrimSpace(mustGitRun(t, work, nil, "rev-parse", "HEAD"))
		if l.Grants == nil || l.Grants.Git == nil {
			t.Fatalf("lease %s came with no git grant key", l.LeaseID)
		}
		opts, err := gitproxy.FenceOptions(l.Grants.Git, *l, l.Fence, []gitproxy.RefUpdate{{Old: old, New: head, Ref: "refs/heads/main"}})
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"push"}
		for _, o := range opts {
			args = append(args, "-o", o)
		}
		return gitRun(t, work, nil, append(args, "origin", "main")...)
	}
	acquire := func(agent string) *lease.Lease {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l, err := c.Acquire(ctx, leasebus.AcquireRequest{Repo: testRepo, Scope: bustest.Claim(t, "libs/tax"), WorkspaceMode: lease.WorkspaceExclusive,
			Owner: lease.Owner{TaskID: "t", AgentID: agent, AttemptID: "att_" + agent}, TTL: lease.Duration(time.Minute)}, leasebus.NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	revoked := acquire("paused")
	fl(t, "--nats", url, "lease", "revoke", revoked.LeaseID, "--reason", "the agent ran over its turn").want(t, ExitOK)
	out, err := push(revoked, 1)
	if err == nil {
		t.Fatalf("a push signed for a revoked lease landed:\n%s", out)
	}
	mustContain(t, "push output", out, revoked.LeaseID, "is revoked", "["+gitproxy.HookLeaseLost+"]")
	if data, err := os.ReadFile(filepath.Join(bare, "fenceline", "fences.json")); err == nil && strings.Contains(string(data), revoked.LeaseID) {
		t.Fatalf("the revoked lease's fence was recorded:\n%s", data)
	}
	mustGitRun(t, work, nil, "reset", "--quiet", "--hard", "origin/main")

	active := acquire("next")
	if out, err := push(active, 2); err != nil {
		t.Fatalf("a push signed for an active lease was refused: %v\n%s", err, out)
	}
}
