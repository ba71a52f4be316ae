//go:build integration

package agents

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http/httptest"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"text/template"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/internal/pgtest"
	"github.com/fenceline/fenceline/internal/testca"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// forbidden is the host the script's curl tries: not on the allowlist.
const forbidden = "forbidden.example.test"

var (
	buildOnce sync.Once
	flBin     string
	buildErr  error

	npmOnce sync.Once
	npmBins map[string]string
	npmErr  error
)

// wrapperBin is a copy of this test binary nobody can run (the guard-off
// run's wrapper, see execWithoutLandlock).
func wrapperBin(t *testing.T) string {
	t.Helper()
	dir := filepath.Dir(fenceline(t))
	dst := filepath.Join(dir, "no-landlock")
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// fenceline returns the fenceline command (testutil.FencelineBinary),
// copied once per test binary into a directory of its own.
func fenceline(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "agents-e2e-bin-")
		if err != nil {
			buildErr = err
			return
		}
		os.Chmod(dir, 0o755)
		flBin = filepath.Join(dir, "fenceline")
		// A copy in a directory of its own: the wrapper and the copied
		// CLIs go beside it, never beside a binary the run shares.
		b, err := os.ReadFile(testutil.FencelineBinary(t))
		if err == nil {
			err = os.WriteFile(flBin, b, 0o755)
		}
		if err != nil {
			buildErr = fmt.Errorf("copy the fenceline binary: %w", err)
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return flBin
}

// agentBin returns the path of the pinned CLI (codex or claude) in
// node_modules, running "npm ci" first when it is missing. When the
// packages cannot be installed the test is skipped, loudly.
func agentBin(t *testing.T, name string) string {
	t.Helper()
	npmOnce.Do(func() {
		bins := map[string]string{}
		for _, n := range []string{"codex", "claude"} {
			p, _ := filepath.Abs(filepath.Join("node_modules", ".bin", n))
			bins[n] = p
		}
		if _, err := os.Stat(bins["codex"]); err != nil {
			cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
			if out, err := cmd.CombinedOutput(); err != nil {
				npmErr = fmt.Errorf("npm ci in test/agents: %w\n%s", err, out)
				return
			}
		}
		for _, p := range bins {
			if out, err := exec.Command(p, "--version").CombinedOutput(); err != nil {
				npmErr = fmt.Errorf("%s --version: %w\n%s", p, err, out)
				return
			}
		}
		// The agents run as nobody: a checkout nobody cannot traverse
		// (a CI clone under /root) gets its CLIs copied where it can.
		if os.Getuid() == 0 && !othersReach(bins["codex"]) {
			dst := filepath.Join(filepath.Dir(fenceline(t)), "node_modules")
			if out, err := exec.Command("cp", "-a", "node_modules", dst).CombinedOutput(); err != nil {
				npmErr = fmt.Errorf("copy the agent CLIs where nobody can run them: %w\n%s", err, out)
				return
			}
			for n := range bins {
				bins[n] = filepath.Join(dst, ".bin", n)
			}
		}
		npmBins = bins
	})
	if npmErr != nil {
		msg := fmt.Sprintf("SKIPPING REAL-AGENT TEST: the pinned agent CLIs (test/agents/package.json) cannot be installed: %v", npmErr)
		fmt.Fprintln(os.Stderr, "\n*** "+msg+" ***")
		t.Skip(msg)
	}
	return npmBins[name]
}

// othersReach reports whether every directory above p lets others
// through.
func othersReach(p string) bool {
	for d := filepath.Dir(p); ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return false
		}
		if d == "/" {
			return true
		}
	}
}

// nobody is the unprivileged user the agents run as (Claude Code refuses
// to skip its permission checks as root).
type nobody struct {
	uid, gid int
	cred     *syscall.Credential
}

func lookupNobody(t *testing.T) nobody {
	t.Helper()
	u, err := user.Lookup("nobody")
	if err != nil {
		t.Fatalf("the agents run as the user nobody: %v", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	n := nobody{uid: uid, gid: gid}
	if os.Getuid() == 0 {
		n.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), Groups: []uint32{}}
	}
	return n
}

// world is everything one agent run needs: a bus, a git upstream and the
// agent's clone of it, a Postgres with a claimed and an unclaimed table,
// the scripted model, and a private HOME, all reachable by nobody.
type world struct {
	t        *testing.T
	fl       string
	busURL   string
	creds    string // nobody's copy of the bus credentials
	rootCred string // the test's own (operator) credentials
	user     nobody
	base     string // nobody-owned root of the run's files
	home     string
	state    string
	co       string // the agent's checkout
	bare     string // the upstream repository
	gitPort  string
	upstream string
	pg       *pgtest.Server
	pgSecret string
	// fenceSecrets is the lease service's fence-secret directory: the
	// database's secret is registered there, never given to a runner.
	fenceSecrets string
	model        *Model
	modelSrv     *httptest.Server
	modelPt      string
	caFile       string // the CA the model's certificate chains to
}

// repoKey is the lease's repo: the checkout's origin, normalized.
func (w *world) repoKey() string { return "127.0.0.1:" + w.gitPort + "/payments" }

// modelKey is the scripted model's API key in the story runs: only in the
// header file fenceline's egress proxy reads (keyFile).
const modelKey = "sk-fenceline-e2e-real-key-5150"

// keyFile writes the header file of --inject-header-file for the model:
// both CLIs' spellings of the key, readable by the user fenceline runs as.
func (w *world) keyFile(t *testing.T) string {
	t.Helper()
	f := filepath.Join(w.base, "model.headers")
	if err := os.WriteFile(f, []byte("Authorization: Bearer "+modelKey+"\nx-api-key: "+modelKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if w.user.cred != nil {
		if err := os.Chown(f, w.user.uid, w.user.gid); err != nil {
			t.Fatal(err)
		}
	}
	return f
}

// modelHost is the model's name and port as the agents address it.
func (w *world) modelHost() string { return "model.example.test:" + w.modelPt }

func newWorld(t *testing.T) *world {
	t.Helper()
	w := &world{t: t, fl: fenceline(t), user: lookupNobody(t)}

	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	nc := bustest.Connect(t, srv.ClientURL())
	w.fenceSecrets = t.TempDir()
	svc, err := leasebus.StartService(context.Background(), nc, leasebus.ServiceConfig{Names: bustest.Names(t), FenceSecretDir: w.fenceSecrets})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	w.busURL = srv.ClientURL()
	w.rootCred = bustest.CredsDir(t)

	base, err := os.MkdirTemp("", "agents-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	w.base = base
	w.home = filepath.Join(base, "home")
	w.state = filepath.Join(base, "state")
	w.creds = filepath.Join(base, "creds")
	for _, d := range []string{w.home, w.state, w.creds} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	ents, err := os.ReadDir(w.rootCred)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range ents {
		b, err := os.ReadFile(filepath.Join(w.rootCred, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(w.creds, e.Name()), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}

	// The git upstream (plain http, served by this test) and its clone.
	gitRoot := t.TempDir()
	w.bare, err = gitserver.NewBare(filepath.Join(gitRoot, "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	backend, err := gitserver.Handler(gitRoot, gitserver.ClientEnv(t.TempDir(), "server")...)
	if err != nil {
		t.Fatal(err)
	}
	gs := httptest.NewServer(backend)
	t.Cleanup(gs.Close)
	_, w.gitPort, _ = net.SplitHostPort(gs.Listener.Addr().String())
	w.upstream = gs.URL + "/payments.git"
	seed := t.TempDir()
	git(t, seed, "init", "--quiet", "--initial-branch=main")
	for p, c := range map[string]string{"services/billing/invoice.go": "package billing\n", "libs/tax/rates.go": "package tax\n"} {
		os.MkdirAll(filepath.Join(seed, filepath.Dir(p)), 0o755)
		os.WriteFile(filepath.Join(seed, p), []byte(c), 0o644)
	}
	git(t, seed, "add", "-A")
	git(t, seed, "commit", "--quiet", "-m", "seed")
	git(t, seed, "push", "--quiet", w.bare, "main")
	w.co = filepath.Join(base, "payments")
	git(t, "", "clone", "--quiet", w.upstream, w.co)

	// Postgres: billing.invoices is claimed, ledger.entries is not.
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	w.pg, err = pgtest.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { w.pg.Stop() })
	admin, err := pgx.Connect(ctx, w.pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer admin.Close(context.Background())
	if _, err := admin.Exec(ctx, `CREATE SCHEMA billing; CREATE SCHEMA ledger;
		CREATE TABLE billing.invoices (id int PRIMARY KEY, note text);
		CREATE TABLE ledger.entries (id int PRIMARY KEY, note text)`); err != nil {
		t.Fatal(err)
	}
	w.pgSecret = filepath.Join(base, "pg.key")
	w.flRoot("pg", "install", "--dsn", w.pg.AdminDSN(""), "--table", "billing.invoices", "--table", "ledger.entries",
		"--secret-file", w.pgSecret)
	w.flRoot("bus", "fence-secret", "set", "--repo", w.repoKey(), "--postgres", w.pgSecret, "--dir", w.fenceSecrets)

	// The scripted model, on loopback, over TLS with a test CA's
	// certificate for its made-up name: the agents reach it by that name
	// through the egress proxy only, a tunnel with TLS end to end, as
	// they would their vendor's API.
	w.model = &Model{Steps: loadStory(t), Log: slog.New(slog.NewTextHandler(testWriter{t}, nil))}
	ca := testca.New(t)
	w.modelSrv = httptest.NewUnstartedServer(w.model.Handler())
	w.modelSrv.TLS = ca.ServerTLS(t, "model.example.test", "127.0.0.1") // by IP: a plain run outside fenceline
	w.modelSrv.StartTLS()
	t.Cleanup(w.modelSrv.Close)
	pem, err := os.ReadFile(ca.File)
	if err != nil {
		t.Fatal(err)
	}
	w.caFile = filepath.Join(base, "model-ca.pem")
	if err := os.WriteFile(w.caFile, pem, 0o644); err != nil {
		t.Fatal(err)
	}
	_, w.modelPt, _ = net.SplitHostPort(w.modelSrv.Listener.Addr().String())

	if w.user.cred != nil {
		if err := chownR(base, w.user.uid, w.user.gid); err != nil {
			t.Fatal(err)
		}
		os.Chmod(base, 0o755)
	}
	return w
}

type testWriter struct{ t *testing.T }

func (tw testWriter) Write(p []byte) (int, error) {
	tw.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func chownR(root string, uid, gid int) error {
	return filepath.Walk(root, func(p string, _ os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		return os.Lchown(p, uid, gid)
	})
}

func loadStory(t *testing.T) []Step {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "story.json"))
	if err != nil {
		t.Fatal(err)
	}
	var steps []Step
	if err := json.Unmarshal(b, &steps); err != nil {
		t.Fatalf("testdata/story.json: %v", err)
	}
	for i, st := range steps {
		var out bytes.Buffer
		if err := template.Must(template.New(st.Name).Parse(st.Cmd)).Execute(&out, map[string]string{"Forbidden": forbidden}); err != nil {
			t.Fatal(err)
		}
		steps[i].Cmd = out.String()
	}
	return steps
}

func git(t *testing.T, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command("git", append([]string{"-c", "safe.directory=*"}, args...)...)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GIT_AUTHOR_NAME=seed", "GIT_AUTHOR_EMAIL=seed@example.com",
		"GIT_COMMITTER_NAME=seed", "GIT_COMMITTER_EMAIL=seed@example.com", "GIT_CONFIG_NOSYSTEM=1")
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("git %v: %v\n%s", args, err, out)
	}
	return strings.TrimSpace(string(out))
}

// flRoot runs fenceline as the test (an operator) and fails on error.
func (w *world) flRoot(args ...string) string {
	w.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, w.fl, append([]string{"--nats", w.busURL}, args...)...)
	cmd.Env = append(os.Environ(), "FENCELINE_CREDS="+w.rootCred, "XDG_STATE_HOME="+w.t.TempDir())
	out, err := cmd.CombinedOutput()
	if err != nil {
		w.t.Fatalf("fenceline %v: %v\n%s", args, err, out)
	}
	return string(out)
}

// agentEnv is the environment of fenceline and the agent it runs: a
// private HOME, the bus credentials, Postgres's user, and each CLI's
// settings for the scripted model (by name, through the proxy).
func (w *world) agentEnv(extra ...string) []string {
	env := []string{
		"PATH=/usr/local/bin:/usr/bin:/bin",
		"HOME=" + w.home,
		"USER=nobody",
		"LANG=C.UTF-8",
		"TERM=dumb",
		"XDG_STATE_HOME=" + w.state,
		"FENCELINE_CREDS=" + w.creds,
		"PGUSER=" + w.pg.Admin,
		"PGDATABASE=postgres",
		// Codex
		"CODEX_HOME=" + filepath.Join(w.home, ".codex"),
		"OPENAI_API_KEY=test-key",
		"CODEX_CA_CERTIFICATE=" + w.caFile,
		// Claude Code
		"ANTHROPIC_BASE_URL=https://" + w.modelHost(),
		"NODE_EXTRA_CA_CERTS=" + w.caFile,
		"ANTHROPIC_API_KEY=test-key",
		"CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1",
		"CLAUDE_CODE_MAX_RETRIES=0",
		"DISABLE_AUTOUPDATER=1",
	}
	return append(env, extra...)
}

// codexConfig writes Codex's config.toml: the scripted model as a custom
// Responses API provider, no retries, no plugins, analytics or telemetry.
func (w *world) codexConfig() {
	w.t.Helper()
	dir := filepath.Join(w.home, ".codex")
	cfg := `model = "scripted"
model_provider = "scripted"

[model_providers.scripted]
name = "scripted"
base_url = "https://` + w.modelHost() + `/v1"
wire_api = "responses"
env_key = "OPENAI_API_KEY"
request_max_retries = 0
stream_max_retries = 0

[analytics]
enabled = false

[otel]
metrics_exporter = "none"

[features]
plugins = false
unbounded_connection_retries = false
`
	if err := os.MkdirAll(dir, 0o700); err != nil {
		w.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.toml"), []byte(cfg), 0o600); err != nil {
		w.t.Fatal(err)
	}
	if w.user.cred != nil {
		chownR(dir, w.user.uid, w.user.gid)
	}
}

const prompt = "Work through the task the tools give you."

// agentArgv is each CLI's command line: unmodified, its own sandbox and
// approvals off, bounded.
func (w *world) agentArgv(t *testing.T, agent string) []string {
	bin := agentBin(t, agent)
	switch agent {
	case "codex":
		w.codexConfig()
		return []string{bin, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", "--ephemeral", "--json", prompt}
	case "claude":
		return []string{bin, "-p", prompt, "--output-format", "json", "--max-turns", "30", "--dangerously-skip-permissions"}
	}
	t.Fatalf("unknown agent %q", agent)
	return nil
}

// proc is a fenceline process the test started as nobody.
type proc struct {
	cmd         *exec.Cmd
	out, errOut *testutil.SyncBuffer
	done        chan struct{}
	code        int
}

// start runs argv as nobody in dir with env; it is killed if the test
// ends first.
func (w *world) start(dir string, env []string, tee io.Writer, argv ...string) *proc {
	w.t.Helper()
	p := &proc{out: &testutil.SyncBuffer{}, errOut: &testutil.SyncBuffer{}, done: make(chan struct{})}
	p.cmd = exec.Command(argv[0], argv[1:]...)
	p.cmd.Dir = dir
	p.cmd.Env = env
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.errOut
	if tee != nil {
		p.cmd.Stdout, p.cmd.Stderr = io.MultiWriter(p.out, tee), io.MultiWriter(p.errOut, tee)
	}
	p.cmd.SysProcAttr = &syscall.SysProcAttr{Credential: w.user.cred, Setpgid: true}
	if err := p.cmd.Start(); err != nil {
		w.t.Fatal(err)
	}
	go func() {
		err := p.cmd.Wait()
		p.code = p.cmd.ProcessState.ExitCode()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			p.code = -1
		}
		close(p.done)
	}()
	w.t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
	})
	return p
}

// wait waits up to d for the process to exit and returns its status.
func (p *proc) wait(t *testing.T, d time.Duration) int {
	t.Helper()
	select {
	case <-p.done:
		return p.code
	case <-time.After(d):
		syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		select {
		case <-p.done:
		case <-time.After(30 * time.Second):
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.done
		}
		t.Fatalf("%s did not finish within %s\nstdout:\n%s\nstderr:\n%s", p.cmd.Args[0], d, p.out, p.errOut)
		return -1
	}
}

var leaseIDRE = regexp.MustCompile(`(lease_[a-z0-9]+)`)

// waitFor polls f every 20ms until it returns nil or d passes (then it
// returns f's last error, with why the wait ended).
func waitFor(ctx context.Context, d time.Duration, f func() error) error {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	return testutil.Retry(ctx, 20*time.Millisecond, f)
}

// revokeHook is the script's "revoke" hook: the lease named on logs is
// revoked as an operator would, and the hook returns once lost (a line
// of the guard's side reporting the loss) appears there.
func (w *world) revokeHook(logs *testutil.SyncBuffer, lost string) func(context.Context) error {
	return func(ctx context.Context) error {
		m := leaseIDRE.FindStringSubmatch(logs.String())
		if m == nil {
			return fmt.Errorf("no lease id in the logs:\n%s", logs)
		}
		cmd := exec.CommandContext(ctx, w.fl, "--nats", w.busURL, "lease", "revoke", m[1], "--reason", "the test revokes it mid-run")
		cmd.Env = append(os.Environ(), "FENCELINE_CREDS="+w.rootCred, "XDG_STATE_HOME="+w.t.TempDir())
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("lease revoke: %w\n%s", err, out)
		}
		return waitFor(ctx, 20*time.Second, func() error {
			if !strings.Contains(logs.String(), lost) {
				return fmt.Errorf("%q not in the logs yet", lost)
			}
			return nil
		})
	}
}

// upstreamSubject is the subject of the upstream's main.
func (w *world) upstreamSubject(t *testing.T) string {
	return git(t, "", "--git-dir", w.bare, "log", "-1", "--format=%s", "main")
}

// pgCount counts the rows of table.
func (w *world) pgCount(t *testing.T, table string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, w.pg.AdminDSN(""))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// netRefusals are the audit's egress refusals of lease id naming host.
func (w *world) netRefusals(t *testing.T, id, host string) int {
	t.Helper()
	nc := bustest.Connect(t, w.busURL)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	evs, err := leasebus.ReadAudit(ctx, nc, w.repoKey(), 0)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryNet && ev.LeaseID == id && ev.Reason == lease.ReasonNotAllowed && strings.Contains(ev.Message, host) {
			n++
		}
	}
	return n
}
