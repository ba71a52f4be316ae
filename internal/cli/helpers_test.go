package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

const testRepo = "github.com/acme/payments"

// startBus starts an in-process NATS server on a free 127.0.0.1 port with a
// t.TempDir() store and a lease service on it, points $FENCELINE_CREDS at
// its credentials, and returns its URL.
func startBus(t testing.TB) string {
	t.Helper()
	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	nc := bustest.Connect(t, srv.ClientURL())
	// The service reads the storages' secrets where "bus fence-secret set"
	// writes them by default (the test's state dir, after isolate).
	svc, err := leasebus.StartService(context.Background(), nc, leasebus.ServiceConfig{Names: bustest.Names(t), FenceSecretDir: leasebus.DefaultFenceSecretDir()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(svc.Stop)
	useTestCreds(t)
	return srv.ClientURL()
}

// useTestCreds points $FENCELINE_CREDS at the test buses' credentials
// directory: each command takes its role's file from it.
func useTestCreds(t testing.TB) {
	t.Helper()
	t.Setenv(EnvCreds, bustest.CredsDir(t))
}

// isolate points the state dir at a temp dir and clears FENCELINE_NATS, so
// no test reads or writes the user's state or bus.
func isolate(t *testing.T) {
	t.Helper()
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	t.Setenv(EnvNATS, "")
	t.Setenv(EnvCreds, "")
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
	code := run(ctx, args, &out, &errOut, defaultURL)
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
