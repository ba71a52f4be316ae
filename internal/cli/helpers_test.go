package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

const testRepo = "github.com/acme/payments"

// testConfigs holds each test's config: what Main would read from the
// environment, by test name. The commands a test runs (fl, run) take
// theirs from here, so tests with configs of their own run in parallel.
var testConfigs sync.Map // test name → config

// rootName is the name of t's top-level test.
func rootName(t testing.TB) string {
	name, _, _ := strings.Cut(t.Name(), "/")
	return name
}

// cfgOf is t's config: its own, else its nearest parent's, else the
// isolated default of its top-level test (isolate).
func cfgOf(t testing.TB) config {
	t.Helper()
	for name := t.Name(); ; {
		if c, ok := testConfigs.Load(name); ok {
			return c.(config)
		}
		i := strings.LastIndex(name, "/")
		if i < 0 {
			break
		}
		name = name[:i]
	}
	return isolatedConfig(t)
}

// setCfg changes t's config (a copy of cfgOf(t)) with f, until t ends.
func setCfg(t testing.TB, f func(*config)) {
	t.Helper()
	c := cfgOf(t)
	f(&c)
	name := t.Name()
	if _, had := testConfigs.Swap(name, c); !had {
		t.Cleanup(func() { testConfigs.Delete(name) })
	}
}

// isolatedConfig is the process's environment with a state dir of the
// top-level test's own and no bus or credentials chosen, so no test reads
// or writes the user's state or bus. It is made once per top-level test.
func isolatedConfig(t testing.TB) config {
	t.Helper()
	root := rootName(t)
	if c, ok := testConfigs.Load(root); ok {
		return c.(config)
	}
	dir, err := os.MkdirTemp("", "fenceline-cli-state-")
	if err != nil {
		t.Fatal(err)
	}
	testutil.AtExit(func() { os.RemoveAll(dir) })
	c := configFromEnv(os.Getenv)
	c.StateDir, c.NATS, c.Creds = filepath.Join(dir, "fenceline"), "", ""
	if actual, loaded := testConfigs.LoadOrStore(root, c); loaded {
		return actual.(config)
	}
	return c
}

// defaultCredsDir is where the embedded default bus of t's commands keeps
// its credentials.
func defaultCredsDir(t testing.TB) string {
	return leasebus.CredsDirOf(leasebus.StoreDirIn(stateDir(t)))
}

// stateDir is the state dir of t's commands.
func stateDir(t testing.TB) string { return cfgOf(t).StateDir }

// cfgEnv is t's config as the environment of a fenceline process (the
// test binary as the CLI): the process's own with the config's settings.
func cfgEnv(t testing.TB) []string {
	c := cfgOf(t)
	return append(os.Environ(),
		"XDG_STATE_HOME="+filepath.Dir(c.StateDir), EnvNATS+"="+c.NATS, EnvCreds+"="+c.Creds)
}

// startBus starts an in-process NATS server on a free 127.0.0.1 port with a
// t.TempDir() store and a lease service on it, points the config's
// credentials ($FENCELINE_CREDS) at its credentials, and returns its URL.
func startBus(t testing.TB) string {
	t.Helper()
	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	nc := bustest.Connect(t, srv.ClientURL())
	// The service reads the storages' secrets where "bus fence-secret set"
	// writes them by default (the test's state dir).
	svc, err := leasebus.StartService(context.Background(), nc, leasebus.ServiceConfig{Names: bustest.Names(t), FenceSecretDir: leasebus.FenceSecretDirIn(stateDir(t))})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	useTestCreds(t)
	return srv.ClientURL()
}

// useTestCreds points t's $FENCELINE_CREDS at the test buses' credentials
// directory: each command takes its role's file from it.
func useTestCreds(t testing.TB) {
	t.Helper()
	setCfg(t, func(c *config) { c.Creds = bustest.CredsDir(t) })
}

// isolate gives t a state dir of its own and no bus or credentials chosen
// (as if $XDG_STATE_HOME named a temp dir and $FENCELINE_NATS and
// $FENCELINE_CREDS were unset), so no test reads or writes the user's
// state or bus.
func isolate(t *testing.T) {
	t.Helper()
	dir := t.TempDir()
	setCfg(t, func(c *config) { c.StateDir, c.NATS, c.Creds = filepath.Join(dir, "fenceline"), "", "" })
}

// closedURL returns a nats:// URL on 127.0.0.1 where nothing listens.
func closedURL(t testing.TB) string {
	t.Helper()
	return "nats://" + testutil.FreeAddr(t)
}

type result struct {
	code           int
	stdout, stderr string
}

// fl runs the CLI in-process, with the real default bus URL.
func fl(t *testing.T, args ...string) result {
	t.Helper()
	return flDefault(t, leasebus.DefaultURL, args...)
}

// flDefault runs the CLI in-process with defaultURL as the default bus.
func flDefault(t *testing.T, defaultURL string, args ...string) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out, errOut bytes.Buffer
	code := run(ctx, args, &out, &errOut, defaultURL, cfgOf(t))
	return result{code: code, stdout: out.String(), stderr: errOut.String()}
}

// want fails the test unless r exited with code.
func (r result) want(t *testing.T, code int) result {
	t.Helper()
	if r.code != code {
		t.Fatalf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, code, r.stdout, r.stderr)
	}
	return r
}

// acquired is what "lease acquire --json" prints.
type acquired struct {
	lease.Lease
	Credential     string `json:"credential"`
	CredentialFile string `json:"credentialFile"`
}

func acquireJSON(t *testing.T, url string, args ...string) acquired {
	t.Helper()
	r := fl(t, append([]string{"--nats", url, "lease", "acquire", "--repo", testRepo, "--json"}, args...)...).want(t, ExitOK)
	var a acquired
	if err := json.Unmarshal([]byte(r.stdout), &a); err != nil {
		t.Fatalf("decode acquire --json: %v\n%s", err, r.stdout)
	}
	return a
}

func listJSON(t *testing.T, url string, args ...string) []lease.Lease {
	t.Helper()
	r := fl(t, append([]string{"--nats", url, "lease", "list", "--json"}, args...)...).want(t, ExitOK)
	var ls []lease.Lease
	if err := json.Unmarshal([]byte(r.stdout), &ls); err != nil {
		t.Fatalf("decode list --json: %v\n%s", err, r.stdout)
	}
	return ls
}

// checkFor polls f until it returns nil or timeout passes.
func checkFor(t *testing.T, timeout, interval time.Duration, f func() error) {
	t.Helper()
	testutil.CheckFor(t, timeout, interval, f)
}

func mustContain(t *testing.T, what, s string, subs ...string) {
	t.Helper()
	for _, sub := range subs {
		if !strings.Contains(s, sub) {
			t.Errorf("%s does not contain %q:\n%s", what, sub, s)
		}
	}
}

// syncBuffer is the shared buffer a command writes while a test reads.
type syncBuffer = testutil.SyncBuffer
