package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testutil"
)

// hookInstalled is what "hook install --json" prints.
type hookInstalled struct {
	GitDir         string `json:"gitDir"`
	Repo           string `json:"repo"`
	Hook           string `json:"hook"`
	HookSecretFile string `json:"hookSecretFile"`
	NewSecret      bool   `json:"newSecret"`
	BusSecretFile  string `json:"busSecretFile"`
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
	t.Parallel()
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
	if in.HookSecretFile != filepath.Join(in.GitDir, "fenceline", "hook.key") || in.BusSecretFile != gitproxy.SidecarKeyFile(stateDir(t), testRepo) {
		t.Fatalf("secret files %s, %s", in.HookSecretFile, in.BusSecretFile)
	}
	testutil.WantPerm(t, in.HookSecretFile, 0o600)
	testutil.WantPerm(t, filepath.Dir(in.HookSecretFile), 0o700)
	testutil.WantPerm(t, in.BusSecretFile, 0o600)
	key, err := gitproxy.ReadKeyFile(in.HookSecretFile)
	if err != nil {
		t.Fatal(err)
	}
	if sk, err := gitproxy.ReadKeyFile(in.BusSecretFile); err != nil || !bytes.Equal(sk, key) || len(key) != gitproxy.HookKeySize {
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
	if ok, _ := gitproxy.ReadKeyFile(oi.HookSecretFile); bytes.Equal(ok, key) || oi.BusSecretFile == in.BusSecretFile {
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
