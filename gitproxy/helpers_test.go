package gitproxy

import (
	"bytes"
	"context"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestMain(m *testing.M) { testutil.Main(m) }

const testRepo = "github.com/acme/payments"

// gitEnv is the environment every git the tests run gets: no user or
// system config, a fixed identity.
func gitEnv(home string) []string { return gitserver.ClientEnv(home, "agent") }

// gitCmd runs git in dir and returns combined output and error.
func gitCmd(t testing.TB, dir string, env []string, args ...string) (string, error) {
	t.Helper()
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = append(gitEnv(t.TempDir()), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

// mustGit runs git and fails the test on error.
func mustGit(t testing.TB, dir string, args ...string) string {
	t.Helper()
	out, err := gitCmd(t, dir, nil, args...)
	if err != nil {
		t.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return out
}

// gitServer is a real git http-backend serving bare repositories.
type gitServer struct {
	root string
	srv  *gitserver.Server
}

func startGitServer(t testing.TB) *gitServer {
	t.Helper()
	root := t.TempDir()
	srv, err := gitserver.Start(root, gitEnv(t.TempDir())...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return &gitServer{root: root, srv: srv}
}

// newRepo creates a bare repository that accepts pushes and push options.
func (gs *gitServer) newRepo(t testing.TB, name string) string {
	t.Helper()
	dir, err := gs.srv.NewRepo(name)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

func (gs *gitServer) url(name string) string { return gs.srv.URL + "/" + name }

// env is one test's world: a bus, a git server with one repository seeded
// with a few paths, and helpers to run a proxy and agents.
type env struct {
	t    *testing.T
	bus  *bustest.Bus
	gs   *gitServer
	bare string // upstream bare repository
	// hookKey, once installHook ran, is the repository's hook secret (the
	// storage secret: the hook's and the lease service's, no runner's).
	hookKey []byte
}

func newEnv(t *testing.T) *env {
	t.Helper()
	e := &env{t: t, bus: bustest.Start(t), gs: startGitServer(t)}
	e.bare = e.gs.newRepo(t, "payments.git")
	seed := t.TempDir()
	mustGit(t, seed, "init", "--quiet", "--initial-branch=main")
	e.write(seed, "services/billing/invoice.go", "package billing\n")
	e.write(seed, "libs/tax/rates.go", "package tax\n")
	e.write(seed, "README.md", "payments\n")
	mustGit(t, seed, "add", "-A")
	mustGit(t, seed, "commit", "--quiet", "-m", "seed")
	mustGit(t, seed, "push", "--quiet", e.bare, "main")
	return e
}

func (e *env) write(dir, path, content string) { writeFile(e.t, dir, path, content) }

// writeFile writes content to the repo-relative path under dir.
func writeFile(t testing.TB, dir, path, content string) {
	t.Helper()
	p := filepath.Join(dir, filepath.FromSlash(path))
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

// serve serves h on a loopback port for the test's duration.
func serve(t testing.TB, h http.Handler) string {
	t.Helper()
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// lease acquires and holds a lease on the test repository.
func (e *env) lease(claim []string, mode lease.WorkspaceMode) *bustest.Lease {
	e.t.Helper()
	c := bustest.Claim(e.t, claim...)
	return e.bus.Acquire(e.t, leasebus.AcquireRequest{
		Repo: testRepo, Scope: c, WorkspaceMode: mode, WorkspaceID: "ws-" + leasebus.NewRequestID(),
		TTL: lease.Duration(30e9),
	}, leasebus.HoldOptions{})
}

// proxy starts a gitproxy in front of the git server's payments.git for
// src (nil: no lease).
func (e *env) proxy(src lease.Source, mutate ...func(*Config)) *httptest.Server {
	e.t.Helper()
	cfg := Config{
		Upstream:  e.gs.url("payments.git"),
		Lease:     src,
		Repo:      testRepo,
		Bus:       e.bus.Client,
		Audit:     e.bus.Auditor,
		MirrorDir: e.t.TempDir(),
		TempDir:   e.t.TempDir(),
	}
	for _, m := range mutate {
		m(&cfg)
	}
	p, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	srv := httptest.NewServer(p)
	e.t.Cleanup(srv.Close)
	return srv
}

// clone makes an agent's working copy of the repository through url.
func (e *env) clone(url string) string {
	e.t.Helper()
	dir := filepath.Join(e.t.TempDir(), "work")
	mustGit(e.t, "", "clone", "--quiet", url+"/payments.git", dir)
	return dir
}

// commit writes files (path, content pairs) and commits them.
func (e *env) commit(dir, msg string, files ...string) string {
	e.t.Helper()
	for i := 0; i+1 < len(files); i += 2 {
		e.write(dir, files[i], files[i+1])
	}
	mustGit(e.t, dir, "add", "-A")
	mustGit(e.t, dir, "commit", "--quiet", "-m", msg)
	return strings.TrimSpace(mustGit(e.t, dir, "rev-parse", "HEAD"))
}

// upstreamRef returns the upstream's value of ref ("" if absent).
func (e *env) upstreamRef(ref string) string {
	e.t.Helper()
	out, err := gitCmd(e.t, e.bare, nil, "rev-parse", "--verify", "--quiet", ref)
	if err != nil {
		return ""
	}
	return strings.TrimSpace(out)
}

// audit returns the git-boundary audit events recorded for the test repo.
func (e *env) audit() []lease.AuditEvent {
	e.t.Helper()
	evs, err := leasebus.ReadAudit(ctxT(e.t), e.bus.Conn, testRepo, 0)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []lease.AuditEvent
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryGit {
			out = append(out, ev)
		}
	}
	return out
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// execGit is a git command in dir with the tests' environment.
func execGit(dir string, args ...string) *exec.Cmd {
	cmd := exec.Command("git", args...)
	cmd.Dir = dir
	cmd.Env = gitEnv(os.TempDir())
	return cmd
}
