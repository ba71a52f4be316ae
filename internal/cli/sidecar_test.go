package cli

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/gitserver"
)

// gitRun runs git in dir with a clean identity and extra env.
func gitRun(t *testing.T, dir string, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(gitserver.ClientEnv(t.TempDir(), "agent"), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func mustGitRun(t *testing.T, dir string, env []string, args ...string) string {
	t.Helper()
	out, err := gitRun(t, dir, env, args...)
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// seededGitServer serves payments.git with services/billing, libs/tax and
// a README on main.
func seededGitServer(t *testing.T) (*gitserver.Server, string) {
	t.Helper()
	srv, err := gitserver.Start(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	bare, err := srv.NewRepo("payments.git")
	if err != nil {
		t.Fatal(err)
	}
	seed := t.TempDir()
	mustGitRun(t, seed, nil, "init", "--quiet", "--initial-branch=main")
	for p, c := range map[string]string{"services/billing/invoice.go": "package billing\n", "libs/tax/rates.go": "package tax\n", "README.md": "payments\n"} {
		os.MkdirAll(filepath.Join(seed, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(seed, p), []byte(c), 0o644)
	}
	mustGitRun(t, seed, nil, "add", "-A")
	mustGitRun(t, seed, nil, "commit", "--quiet", "-m", "seed")
	mustGitRun(t, seed, nil, "push", "--quiet", bare, "main")
	return srv, bare
}

func readEnvFile(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	return strings.Split(strings.TrimSpace(string(data)), "\n"), nil
}

// TestSidecarFencesAnUnmodifiedGit: the agent's git, given only the
// sidecar's environment, pushes through the git fence to its usual remote.
func TestSidecarFencesAnUnmodifiedGit(t *testing.T) {
	isolate(t)
	url := startBus(t)
	gs, _ := seededGitServer(t)
	envFile := filepath.Join(t.TempDir(), "agent.env")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	go func() {
		done <- run(ctx, []string{"--nats", url, "sidecar", "--repo", testRepo, "--scope", "services/billing",
			"--workspace", "exclusive", "--agent", "agent-7", "--git-upstream", gs.URL + "/payments.git",
			"--env-file", envFile, "--state-dir", t.TempDir()}, &out, &errOut, url)
	}()
	var env []string
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		var err error
		env, err = readEnvFile(envFile)
		select {
		case code := <-done:
			t.Fatalf("sidecar exited %d:\n%s\n%s", code, out.String(), errOut.String())
		default:
		}
		return err
	})
	mustContain(t, "sidecar output", out.String(), "sidecar: lease lease_", "git fence: http://127.0.0.1:", "GIT_CONFIG_COUNT=2")

	// The agent clones and pushes its usual remote URL.
	work := filepath.Join(t.TempDir(), "work")
	mustGitRun(t, "", env, "clone", "--quiet", gs.URL+"/payments.git", work)
	os.WriteFile(filepath.Join(work, "services/billing/invoice.go"), []byte("package billing // v2\n"), 0o644)
	mustGitRun(t, work, env, "commit", "--quiet", "-am", "in scope")
	mustGitRun(t, work, env, "push", "--quiet", "origin", "main")
	os.WriteFile(filepath.Join(work, "libs/tax/rates.go"), []byte("package tax // mine now\n"), 0o644)
	mustGitRun(t, work, env, "commit", "--quiet", "-am", "out of scope")
	got, err := gitRun(t, work, env, "push", "origin", "main")
	if err == nil || !strings.Contains(got, "libs/tax/rates.go is outside lease lease_") {
		t.Fatalf("out-of-scope push through the sidecar: err=%v\n%s", err, got)
	}
	// Without the sidecar's env the same git would reach the server
	// directly: the env is the whole integration.
	if joined := strings.Join(env, "\n"); !strings.Contains(joined, ".insteadOf\n") || !strings.Contains(joined, "GIT_CONFIG_VALUE_0="+gs.URL+"/\n") {
		t.Fatalf("agent env does not route the remote: %v", env)
	}

	l := listJSON(t, url, "--repo", testRepo)
	if len(l) != 1 || l[0].Owner.AgentID != "agent-7" {
		t.Fatalf("active leases = %+v, want the sidecar's", l)
	}
	cancel()
	select {
	case code := <-done:
		if code != 0 {
			t.Fatalf("sidecar exited %d:\n%s", code, errOut.String())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("sidecar did not stop on cancel")
	}
	mustContain(t, "sidecar output", out.String(), "released")
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 0 {
		t.Fatalf("lease not released on shutdown: %+v", l)
	}
}
