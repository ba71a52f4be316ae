package cli

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testutil"
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
	t.Parallel()
	isolate(t)
	url := startBus(t)
	gs, _ := seededGitServer(t)
	envFile := filepath.Join(t.TempDir(), "agent.env")

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	done := make(chan int, 1)
	cfg, dir := cfgOf(t), t.TempDir()
	go func() {
		done <- run(ctx, []string{"--nats", url, "sidecar", "--repo", testRepo, "--scope", "services/billing",
			"--workspace", "exclusive", "--agent", "agent-7", "--git-upstream", gs.URL + "/payments.git",
			"--env-file", envFile, "--state-dir", dir}, &out, &errOut, url, cfg)
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
		if err != nil {
			return err
		}
		// The env file may be written a moment before the lines are printed.
		for _, want := range []string{"sidecar: lease lease_", "git fence: http://127.0.0.1:", "GIT_CONFIG_COUNT=2", "admin: http://127.0.0.1:"} {
			if !strings.Contains(out.String(), want) {
				return fmt.Errorf("sidecar output does not contain %q yet:\n%s", want, out.String())
			}
		}
		return nil
	})
	admin := adminURL(t, out.String())
	if code, body := testutil.HTTPGet(t, admin+"/readyz", ""); code != 200 || !strings.Contains(body, "ready: lease lease_") {
		t.Fatalf("readyz of a sidecar holding its lease: %d %q", code, body)
	}
	// The run UI is on the admin port too, showing the bus's leases.
	if code, body := testutil.HTTPGet(t, admin+"/ui/", ""); code != 200 || !strings.Contains(body, "fenceline") {
		t.Fatalf("run UI page on the admin port: %d %.200q", code, body)
	}
	if code, body := testutil.HTTPGet(t, admin+"/ui/api/v1/leases", ""); code != 200 || !strings.Contains(body, `"agentId":"agent-7"`) {
		t.Fatalf("run UI API on the admin port: %d %.300q", code, body)
	}

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

	// The refused push is counted by reason, the requests and bytes of
	// both pushes by direction.
	_, metrics := testutil.HTTPGet(t, admin+"/metrics", "")
	for series, min := range map[string]float64{
		`fenceline_refusals_total{boundary="git",reason="outside-lease"}`:     1,
		`fenceline_proxy_requests_total{boundary="git"}`:                      4,
		`fenceline_proxy_bytes_total{boundary="git",direction="to_upstream"}`: 100,
		`fenceline_proxy_bytes_total{boundary="git",direction="to_agent"}`:    100,
		`fenceline_leases_held`: 1,
	} {
		if got := sample(metrics, series); got < min {
			t.Errorf("%s = %v, want >= %v", series, got, min)
		}
	}
	if got := sample(metrics, `fenceline_refusals_total{boundary="git",reason="outside-lease"}`); got != 1 {
		t.Errorf("refused pushes counted: %v, want 1", got)
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
	mustContain(t, "sidecar output", out.String(), "released (no agent wrapper ever connected; the fences are drained)")
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 0 {
		t.Fatalf("lease not released on shutdown: %+v", l)
	}
}

var adminRE = regexp.MustCompile(`admin: (http://\S+)`)

// adminURL is the admin server a sidecar printed.
func adminURL(t *testing.T, stdout string) string {
	t.Helper()
	m := adminRE.FindStringSubmatch(stdout)
	if m == nil {
		t.Fatalf("no admin URL printed:\n%s", stdout)
	}
	return m[1]
}

// sample is the value of one series in a Prometheus exposition (-1 when
// absent).
func sample(body, series string) float64 {
	for line := range strings.Lines(body) {
		if rest, ok := strings.CutPrefix(line, series+" "); ok {
			if v, err := strconv.ParseFloat(strings.TrimSpace(rest), 64); err == nil {
				return v
			}
		}
	}
	return -1
}

// aSidecar is fenceline sidecar going on in-process.
type aSidecar struct {
	cancel      context.CancelFunc
	done        chan int
	out, errOut *syncBuffer
	admin       string
}

// startSidecar starts "fenceline --nats url sidecar ARGS" in-process and
// waits for its admin server and lease.
func startSidecar(t *testing.T, url string, args ...string) *aSidecar {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	s := &aSidecar{cancel: cancel, done: make(chan int, 1), out: &syncBuffer{}, errOut: &syncBuffer{}}
	cfg := cfgOf(t)
	go func() {
		s.done <- run(ctx, append([]string{"--nats", url, "sidecar"}, args...), s.out, s.errOut, url, cfg)
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
		case <-time.After(30 * time.Second):
			t.Error("fenceline sidecar did not stop")
		}
	})
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		s.running(t)
		if !strings.Contains(s.out.String(), "agent environment:") {
			return errors.New("the sidecar has no lease yet")
		}
		return nil
	})
	s.admin = adminURL(t, s.out.String())
	return s
}

func (s *aSidecar) running(t *testing.T) {
	t.Helper()
	select {
	case code := <-s.done:
		s.done <- code
		t.Fatalf("fenceline sidecar exited %d early\nstdout:\n%s\nstderr:\n%s", code, s.out, s.errOut)
	default:
	}
}

func (s *aSidecar) wait(t *testing.T) int {
	t.Helper()
	select {
	case code := <-s.done:
		s.done <- code
		return code
	case <-time.After(30 * time.Second):
		t.Fatalf("fenceline sidecar did not end\nstdout:\n%s\nstderr:\n%s", s.out, s.errOut)
		return -1
	}
}

// TestSidecarAdminToken: bound off loopback the sidecar wants a token and
// says how to give one; with --admin-token-file the API wants it, the
// probes do not.
func TestSidecarAdminToken(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	gs, _ := seededGitServer(t)
	r := flDefault(t, url, "--nats", url, "sidecar", "--repo", testRepo, "--scope", "a", "--git-upstream", gs.URL+"/payments.git",
		"--admin", "0.0.0.0:0", "--state-dir", t.TempDir()).want(t, ExitUsage)
	mustContain(t, "stderr", r.stderr, "needs a bearer token", "--admin-token-file")
	if l := listJSON(t, url, "--repo", testRepo); len(l) != 0 {
		t.Fatalf("a sidecar that could not start its admin server holds %+v", l)
	}

	tokenFile := filepath.Join(t.TempDir(), "token")
	const token = "s3cret-admin-token-0123456789"
	os.WriteFile(tokenFile, []byte(token+"\n"), 0o600)
	sc := startSidecar(t, url, "--repo", testRepo, "--scope", "a", "--git-upstream", gs.URL+"/payments.git",
		"--admin", "0.0.0.0:0", "--admin-token-file", tokenFile, "--state-dir", t.TempDir())
	admin := strings.Replace(sc.admin, "0.0.0.0", "127.0.0.1", 1)
	admin = strings.Replace(admin, "[::]", "127.0.0.1", 1)
	if code, _ := testutil.HTTPGet(t, admin+"/api/v1/lease", ""); code != http.StatusUnauthorized {
		t.Errorf("lease API without the token: %d", code)
	}
	if code, body := testutil.HTTPGet(t, admin+"/api/v1/lease", token); code != 200 || !strings.Contains(body, `"state":"held"`) {
		t.Errorf("lease API with the token: %d %s", code, body)
	}
	if code, _ := testutil.HTTPGet(t, admin+"/readyz", ""); code != 200 {
		t.Errorf("readyz without a token: %d", code)
	}
}
