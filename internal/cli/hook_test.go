package cli

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/leasebus"
)

// hookInstalled is what "hook install --json" prints.
type hookInstalled struct {
	GitDir            string `json:"gitDir"`
	Repo              string `json:"repo"`
	Hook              string `json:"hook"`
	HookSecretFile    string `json:"hookSecretFile"`
	NewSecret         bool   `json:"newSecret"`
	SidecarSecretFile string `json:"sidecarSecretFile"`
}

func installHookJSON(t *testing.T, args ...string) hookInstalled {
	t.Helper()
	r := fl(t, append([]string{"hook", "install", "--json"}, args...)...).want(t, ExitOK)
	var in hookInstalled
	if err := json.Unmarshal([]byte(r.stdout), &in); err != nil {
		t.Fatalf("decode hook install --json: %v\n%s", err, r.stdout)
	}
	return in
}

// TestHookInstall: hook install makes a random per-repository secret
// (mode 0600, its directory 0700) for the hook and a copy for the
// sidecars, installs the hook and lets push options through; again, it
// keeps the secret; it leaves someone else's hook alone.
func TestHookInstall(t *testing.T) {
	isolate(t)
	bare, err := gitserver.NewBare(filepath.Join(t.TempDir(), "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	fl(t, "hook", "install", "--repo", testRepo).want(t, ExitUsage)
	fl(t, "hook", "install", "--git-dir", bare).want(t, ExitUsage)
	r := fl(t, "hook", "install", "--git-dir", t.TempDir(), "--repo", testRepo).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "is not a git repository")

	in := installHookJSON(t, "--git-dir", bare, "--repo", "https://GitHub.com/acme/payments.git")
	if in.Repo != testRepo || !in.NewSecret {
		t.Fatalf("install = %+v, want repo %s and a new secret", in, testRepo)
	}
	if in.HookSecretFile != filepath.Join(in.GitDir, "fenceline", "hook.key") || in.SidecarSecretFile != gitproxy.SidecarKeyFile(testRepo) {
		t.Fatalf("secret files %s, %s", in.HookSecretFile, in.SidecarSecretFile)
	}
	testutil.WantPerm(t, in.HookSecretFile, 0o600)
	testutil.WantPerm(t, filepath.Dir(in.HookSecretFile), 0o700)
	testutil.WantPerm(t, in.SidecarSecretFile, 0o600)
	key, err := gitproxy.ReadKeyFile(in.HookSecretFile)
	if err != nil {
		t.Fatal(err)
	}
	if sk, err := gitproxy.ReadKeyFile(in.SidecarSecretFile); err != nil || !bytes.Equal(sk, key) || len(key) != gitproxy.HookKeySize {
		t.Fatalf("sidecar secret %x (%v), hook secret %x", sk, err, key)
	}
	script, err := os.ReadFile(in.Hook)
	if err != nil {
		t.Fatal(err)
	}
	mustContain(t, "hook script", string(script), "hook pre-receive --repo '"+testRepo+"'")
	if out := mustGitRun(t, bare, nil, "config", "receive.advertisePushOptions"); strings.TrimSpace(out) != "true" {
		t.Fatalf("receive.advertisePushOptions = %q", out)
	}

	// Again: the secret is kept (sidecars holding it keep working).
	again := installHookJSON(t, "--git-dir", bare, "--repo", testRepo)
	if again.NewSecret {
		t.Fatal("install again made a new secret")
	}
	if k2, _ := gitproxy.ReadKeyFile(in.HookSecretFile); !bytes.Equal(k2, key) {
		t.Fatal("install again changed the secret")
	}
	// Another repository gets another secret.
	other, _ := gitserver.NewBare(filepath.Join(t.TempDir(), "infra.git"))
	oi := installHookJSON(t, "--git-dir", other, "--repo", "github.com/acme/infra")
	if ok, _ := gitproxy.ReadKeyFile(oi.HookSecretFile); bytes.Equal(ok, key) || oi.SidecarSecretFile == in.SidecarSecretFile {
		t.Fatal("two repositories share a secret")
	}

	// Someone else's pre-receive hook is left alone.
	foreign, _ := gitserver.NewBare(filepath.Join(t.TempDir(), "foreign.git"))
	if err := gitserver.InstallHook(foreign, "pre-receive", "#!/bin/sh\nexit 0\n"); err != nil {
		t.Fatal(err)
	}
	r = fl(t, "hook", "install", "--git-dir", foreign, "--repo", testRepo).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "exists and is not fenceline's")
}

// TestSidecarSignsForTheHook: a sidecar without the repository's hook
// secret still fences pushes, and the server's hook refuses them saying
// exactly what is missing; with --git-hook-secret the same push lands and
// its fence is recorded. A bad --git-hook-secret is a usage error before
// any lease is taken.
func TestSidecarSignsForTheHook(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, bare := seededGitServer(t)
	secret := filepath.Join(t.TempDir(), "sidecar.key")
	installHookJSON(t, "--git-dir", bare, "--repo", testRepo, "--sidecar-secret-file", secret)

	r := fl(t, "--nats", url, "sidecar", "--repo", testRepo, "--scope", "services/billing", "--workspace", "exclusive",
		"--git-upstream", gs.URL+"/payments.git", "--git-hook-secret", filepath.Join(t.TempDir(), "missing.key")).want(t, ExitUsage)
	mustContain(t, "stderr", r.stderr, "--git-hook-secret", "missing.key")
	fl(t, "--nats", url, "sidecar", "--repo", testRepo, "--scope", "services/billing", "--workspace", "exclusive",
		"--pg-upstream", "127.0.0.1:1", "--git-hook-secret", secret).want(t, ExitUsage)
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 0 {
		t.Fatalf("a sidecar with a bad --git-hook-secret took a lease: %+v", l)
	}

	push := func(sidecarArgs ...string) (string, error) {
		envFile := filepath.Join(t.TempDir(), "agent.env")
		sc := startSidecar(t, url, append([]string{"--repo", testRepo, "--scope", "services/billing", "--workspace", "exclusive",
			"--git-upstream", gs.URL + "/payments.git", "--env-file", envFile, "--state-dir", t.TempDir()}, sidecarArgs...)...)
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
		if len(sidecarArgs) == 0 {
			mustContain(t, "sidecar log", sc.errOut.String(), "no git hook secret")
		}
		return out, err
	}
	out, err := push()
	if err == nil {
		t.Fatalf("the hook accepted a push from a sidecar without its secret:\n%s", out)
	}
	mustContain(t, "push output", out, "not signed (no fenceline-mac option)", "--git-hook-secret", "[unsigned]", "of lease \"lease_")
	if _, err := os.Stat(filepath.Join(bare, "fenceline", "fences.json")); err == nil {
		t.Fatal("an unsigned push recorded a fence")
	}

	out, err = push("--git-hook-secret", secret)
	if err != nil {
		t.Fatalf("a signed push was refused: %v\n%s", err, out)
	}
	data, err := os.ReadFile(filepath.Join(bare, "fenceline", "fences.json"))
	if err != nil || !strings.Contains(string(data), `"services/billing"`) {
		t.Fatalf("the signed push's fence is not recorded (%v):\n%s", err, data)
	}
}

// TestRunSignsForTheHookAndHidesItsSecret: run finds the repository's hook
// secret where hook install left it (or takes --git-hook-secret), the
// agent's push through the git fence lands past the hook, and the guarded
// agent can read neither copy of the secret.
func TestRunSignsForTheHookAndHidesItsSecret(t *testing.T) {
	isolate(t)
	busURL := startBus(t)
	gs, bare := seededGitServer(t)
	co := filepath.Join(t.TempDir(), "payments")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", co)
	repo := repoid.FromRemote(gs.URL+"/payments.git", "")
	in := installHookJSON(t, "--git-dir", bare, "--repo", repo) // the sidecars' copy in the state dir
	elsewhere := filepath.Join(t.TempDir(), "git-hook.key")
	installHookJSON(t, "--git-dir", bare, "--repo", repo, "--sidecar-secret-file", elsewhere)
	key, err := os.ReadFile(in.SidecarSecretFile)
	if err != nil {
		t.Fatal(err)
	}
	// The first run knows only the default copy; the second hides the one
	// it was given too. (A copy a run is not told of is as readable as any
	// other file: keep it in the state dir, or under another user.)
	for i, flags := range [][]string{nil, {"--git-hook-secret", elsewhere}} {
		script := `cat ` + in.SidecarSecretFile + ` 2>/dev/null || echo default=hidden
test $# = 0 || cat ` + elsewhere + ` 2>/dev/null || echo flag=hidden
echo '// v` + string(rune('2'+i)) + `' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "signed push" && git push -q origin main && echo push=ok`
		args := append([]string{"--checkout", co, "--git-upstream", gs.URL + "/payments.git"}, flags...)
		want, argv := "default=hidden push=ok", []string{"--", "bash", "-c", script, "agent"}
		if flags != nil {
			want, argv = "default=hidden flag=hidden push=ok", append(argv, "check-flag")
		}
		r := runFL(t, busURL, append(args, argv...)...).want(t, ExitOK)
		if got := strings.Join(strings.Fields(r.stdout), " "); got != want || strings.Contains(r.stdout, strings.TrimSpace(string(key))) {
			t.Errorf("run %v: agent: %s\nwant   %s\nstderr:\n%s", flags, got, want, r.stderr)
		}
	}
	data, err := os.ReadFile(filepath.Join(bare, "fenceline", "fences.json"))
	if err != nil || !strings.Contains(string(data), "services/billing/invoice.go") {
		t.Fatalf("the signed pushes' fences are not recorded (%v):\n%s", err, data)
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
		Owner                                          leasebus.Owner
	}
	checkFor(t, 5*time.Second, 50*time.Millisecond, func() error {
		var evs []event
		r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
		if err := json.Unmarshal([]byte(r.stdout), &evs); err != nil {
			return fmt.Errorf("decode audit: %w\n%s", err, r.stdout)
		}
		for _, e := range evs {
			if e.Type == leasebus.EventDenied && e.Boundary == leasebus.BoundaryGit && e.LeaseID == "lease_forged" {
				if e.Repo != testRepo || e.Fence != 999999 || e.Reason != gitproxy.HookUnsigned || e.Owner.AgentID != "mallory" || !strings.Contains(e.Message, "pre-receive hook") {
					t.Fatalf("the hook's audit event is %+v", e)
				}
				return nil
			}
		}
		return fmt.Errorf("no audit event of the hook's refusal in %d events", len(evs))
	})
}
