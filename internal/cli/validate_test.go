package cli

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/attempt"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// TestFenceFlagsCheckedBeforeTheLease: a bad fence flag or file is a usage
// error (exit 2) naming the flag, found before the lease is asked for: the
// repo's audit stream holds no grant (issue 20).
func TestFenceFlagsCheckedBeforeTheLease(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	_, nc := busClient(t, url)
	missingCA := filepath.Join(t.TempDir(), "no-such-ca.pem")
	cases := []struct {
		name string
		env  string // FENCELINE_GIT_UPSTREAM_HEADER
		args []string
		want []string
	}{
		{name: "git-upstream-scheme", args: []string{"--git-upstream", "ftp://x"},
			want: []string{"--git-upstream", "ftp://x", "http:// or https://"}},
		{name: "git-upstream-header", args: []string{"--git-upstream", "http://git.example.test/payments.git", "--git-upstream-header", "NoColon"},
			want: []string{"--git-upstream-header", "Name: value"}},
		{name: "git-upstream-header-env", env: "Bad Name: x", args: []string{"--git-upstream", "http://git.example.test/payments.git"},
			want: []string{"FENCELINE_GIT_UPSTREAM_HEADER", "Name: value"}},
		{name: "git-upstream-ca", args: []string{"--git-upstream", "https://git.example.test/payments.git", "--git-upstream-ca", missingCA},
			want: []string{"--git-upstream-ca", missingCA}},
		{name: "pg-upstream", args: []string{"--pg-upstream", "db.example.test"},
			want: []string{"--pg-upstream", "db.example.test", "host:port"}},
	}
	for _, command := range []string{"sidecar", "run"} {
		for _, tc := range cases {
			t.Run(command+"/"+tc.name, func(t *testing.T) {
				setCfg(t, func(c *config) { c.GitUpstreamHeader = tc.env })
				var repo string
				var args []string
				if command == "sidecar" {
					repo = "github.com/acme/" + tc.name
					args = append([]string{"--nats", url, "sidecar", "--repo", repo, "--scope", "src", "--state-dir", t.TempDir()}, tc.args...)
				} else {
					repo = newCheckout(t, "")
					args = append(append([]string{"--nats", url, "run", "--checkout", repo, "--scope", "in"}, tc.args...), "--", "true")
				}
				r := flDefault(t, url, args...)
				if r.code != ExitUsage {
					t.Errorf("exit %d, want %d\nstdout:\n%s\nstderr:\n%s", r.code, ExitUsage, r.stdout, r.stderr)
				}
				mustContain(t, "stderr", r.stderr, tc.want...)
				noGrantBefore(t, url, nc, repo)
			})
		}
	}
}

// noGrantBefore fails the test if repo's audit stream holds a grant. It
// acquires a lease on repo and waits for that grant to be audited first:
// the service audits a repo's events in order, so a grant made before it
// would be there too.
func noGrantBefore(t *testing.T, url string, nc *nats.Conn, repo string) {
	t.Helper()
	r := fl(t, "--nats", url, "lease", "acquire", "--repo", repo, "--scope", "barrier", "--json").want(t, ExitOK)
	var mark acquired
	if err := json.Unmarshal([]byte(r.stdout), &mark); err != nil {
		t.Fatalf("decode acquire --json: %v\n%s", err, r.stdout)
	}
	var evs []lease.AuditEvent
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		var err error
		if evs, err = leasebus.ReadAudit(context.Background(), nc, repo, 0); err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Type == lease.EventGrant && ev.LeaseID == mark.LeaseID {
				return nil
			}
		}
		return errors.New("the marker lease's grant is not audited yet")
	})
	for _, ev := range evs {
		if ev.Type == lease.EventGrant && ev.LeaseID != mark.LeaseID {
			t.Errorf("repo %s: a lease was granted before the command failed: %s", repo, ev.Message)
		}
	}
}

// TestSidecarUsageBeforeTheBus: flags the sidecar used to check only once
// connected (or once its admin server listened) are usage errors before
// the bus is dialed: the bus here is a closed port.
func TestSidecarUsageBeforeTheBus(t *testing.T) {
	t.Parallel()
	isolate(t)
	tokenFile := filepath.Join(t.TempDir(), "token")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--scope", "a", "--workspace", "weird"}, "--workspace"},
		{[]string{"--lease", "nope"}, "is not a lease id"},
		{[]string{"--scope", "a", "--admin", "9090"}, "--admin 9090"},
		{[]string{"--scope", "a", "--admin", "0.0.0.0:0"}, "--admin-token-file"},
		{[]string{"--scope", "a", "--admin-token-file", tokenFile}, "--admin-token-file"},
		{[]string{"--scope", "a", "--env-file", filepath.Join(t.TempDir(), "nodir", "agent.env")}, "--env-file"},
		{[]string{"--scope", "a", "--git-upstream", "http://git.example.test/p.git", "--git-forward"}, "--git-forward"},
		{[]string{"--scope", "a", "--git-upstream", "http://git.example.test/p.git", "--git-listen", "nope"}, "--git-listen"},
		{[]string{"--scope", "a", "--pg-upstream", "db.example.test:5432", "--pg-secret-file", filepath.Join(t.TempDir(), "nope.key")}, "--pg-secret-file"},
		{[]string{"--scope", "a", "--pg-upstream", "db.example.test:5432", "--pg-tls-cert", tokenFile}, "--pg-tls-key"},
		{[]string{"--scope", "a", "--log-format", "xml"}, "--log-format"},
	} {
		args := append([]string{"sidecar", "--repo", testRepo, "--allow-host", "api.example.test"}, tc.args...)
		r := flDefault(t, closedURL(t), args...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.want) || strings.Contains(r.stderr, "no bus") {
			t.Errorf("%s: exit %d %q, want %d mentioning %q, before dialing the bus", strings.Join(args, " "), r.code, r.stderr, ExitUsage, tc.want)
		}
	}
}

// TestRunMissingCommandBeforeTheBus: a command that cannot be found is
// reported before the bus is dialed and a lease taken for it.
func TestRunMissingCommandBeforeTheBus(t *testing.T) {
	t.Parallel()
	isolate(t)
	co := newCheckout(t, "")
	r := flDefault(t, closedURL(t), "run", "--checkout", co, "--scope", "in", "--", "no-such-agent-command")
	if r.code != ExitError || !strings.Contains(r.stderr, "no-such-agent-command") || strings.Contains(r.stderr, "no bus") {
		t.Errorf("exit %d %q, want %d naming the command, before dialing the bus", r.code, r.stderr, ExitError)
	}
}

// TestFenceFlagNamesFields: every sidecar.FenceOptions field an
// OptionError may name maps to a flag that fenceline sidecar and
// fenceline run both have.
func TestFenceFlagNamesFields(t *testing.T) {
	t.Parallel()
	root := (&app{stdout: io.Discard, stderr: io.Discard, defaultURL: "nats://127.0.0.1:1"}).rootCommand()
	opts := reflect.TypeOf(sidecar.FenceOptions{})
	for field, flag := range fenceFlag {
		if _, ok := opts.FieldByName(field); !ok {
			t.Errorf("fenceFlag names %s, which sidecar.FenceOptions has not", field)
		}
		for _, cmd := range []string{"sidecar", "run"} {
			c, _, err := root.Find([]string{cmd})
			if err != nil {
				t.Fatal(err)
			}
			if c.Flags().Lookup(flag) == nil {
				t.Errorf("fenceFlag maps %s to --%s, which fenceline %s has not", field, flag, cmd)
			}
		}
	}
}

// TestAttemptErrorNamesTheFlag: an attempt's FieldError is reported under
// the flag that filled its field, and stays a usage error; every field
// mapped has its flag on fenceline agent or fenceline run.
func TestAttemptErrorNamesTheFlag(t *testing.T) {
	t.Parallel()
	claim, err := scope.New([]string{"services"}, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	l := lease.Lease{LeaseID: "lease_s", Scope: claim, WorkspaceMode: lease.WorkspaceShared}
	_, err = attempt.Narrow(l, true, []string{"libs"}, "")
	got := attemptError(err)
	if want := "--scope libs: is outside lease lease_s's claim"; !strings.HasPrefix(got.Error(), want) || !errors.Is(got, attempt.ErrInvalid) {
		t.Errorf("attemptError(%v) = %v, want a usage error starting %q", err, got, want)
	}
	_, err = attempt.Narrow(l, true, nil, lease.WorkspaceExclusive)
	if got := attemptError(err); !strings.HasPrefix(got.Error(), "--workspace exclusive: lease lease_s has a shared workspace") {
		t.Errorf("attemptError(%v) = %v, want it to name --workspace exclusive", err, got)
	}

	root := (&app{stdout: io.Discard, stderr: io.Discard, defaultURL: "nats://127.0.0.1:1"}).rootCommand()
	for field, flag := range attemptFlag {
		found := false
		for _, cmd := range []string{"agent", "run"} {
			c, _, err := root.Find([]string{cmd})
			if err != nil {
				t.Fatal(err)
			}
			found = found || c.Flags().Lookup(flag) != nil
		}
		if !found {
			t.Errorf("attemptFlag maps %s to --%s, which neither fenceline agent nor fenceline run has", field, flag)
		}
	}
}
