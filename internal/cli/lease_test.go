package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestAcquireText(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	r := fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "services/billing").want(t, ExitOK)
	lines := strings.Split(strings.TrimSuffix(r.stdout, "\n"), "\n")
	want := []string{
		`^lease acquired: (lease_[0-9a-z]+)$`,
		`^repo: github\.com/acme/payments$`,
		`^scope: \[services/billing\]$`,
		`^workspace: checkout \(shared\)$`,
		`^ttl: 5m0s$`,
		`^fence: [1-9][0-9]*$`,
		`^expires: \d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$`,
	}
	if len(lines) != len(want) {
		t.Fatalf("got %d lines, want %d:\n%s", len(lines), len(want), r.stdout)
	}
	var id string
	for i, re := range want {
		m := regexp.MustCompile(re).FindStringSubmatch(lines[i])
		if m == nil {
			t.Errorf("line %d %q does not match %s", i+1, lines[i], re)
		} else if i == 0 {
			id = m[1]
		}
	}
	exp, err := time.Parse(time.RFC3339, strings.TrimPrefix(lines[6], "expires: "))
	if err != nil || exp.Before(time.Now().Add(4*time.Minute)) {
		t.Errorf("expires %q: want about 5m from now (%v)", lines[6], err)
	}

	// The credential file: 0600 in a 0700 dir, naming the lease and bus.
	path := filepath.Join(stateDir(t), "leases", id+".json")
	checkCredFile(t, path, id, url)
}

func checkCredFile(t *testing.T, path, id, url string) credFile {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatalf("credential file: %v", err)
	}
	if got := fi.Mode().Perm(); got != 0o600 {
		t.Errorf("credential file mode %o, want 600", got)
	}
	di, err := os.Stat(filepath.Dir(path))
	if err != nil {
		t.Fatal(err)
	}
	if got := di.Mode().Perm(); got != 0o700 {
		t.Errorf("credential dir mode %o, want 700", got)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var f credFile
	if err := json.Unmarshal(data, &f); err != nil {
		t.Fatalf("decode credential file: %v\n%s", err, data)
	}
	if f.LeaseID != id || f.Repo != testRepo || len(f.Credential) != 64 || f.Version == 0 || f.NATS != url {
		t.Errorf("credential file = %+v, want lease %s repo %s, a 64-char credential, a version and nats %s", f, id, testRepo, url)
	}
	return f
}

func TestAcquireJSON(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--scope", "services/billing", "--scope", "libs/tax", "--table", "public.users",
		"--ttl", "90s", "--task", "job_4821", "--agent", "codex-worker-4", "--workspace-id", "wt-billing-17")
	if a.Status != lease.StatusActive || a.Fence == 0 || a.Version != 1 {
		t.Errorf("lease = status %s fence %d version %d, want active, > 0, 1", a.Status, a.Fence, a.Version)
	}
	if got, want := a.Scope.String(), "[libs/tax services/billing] tables=[public.users]"; got != want {
		t.Errorf("scope %s, want %s", got, want)
	}
	if a.Owner.TaskID != "job_4821" || a.Owner.AgentID != "codex-worker-4" || !strings.HasPrefix(a.Owner.AttemptID, "att_") {
		t.Errorf("owner %+v", a.Owner)
	}
	if a.WorkspaceID != "wt-billing-17" || a.WorkspaceMode != lease.WorkspaceShared || time.Duration(a.TTL) != 90*time.Second {
		t.Errorf("workspace %s (%s), ttl %s", a.WorkspaceID, a.WorkspaceMode, a.TTL)
	}
	f := checkCredFile(t, a.CredentialFile, a.LeaseID, url)
	if string(f.Credential) != a.Credential {
		t.Errorf("credential file holds another credential than --json printed")
	}
	// Field names of the lease record (docs/design.md) are all present.
	var raw map[string]any
	r := fl(t, "--nats", url, "lease", "show", a.LeaseID, "--json").want(t, ExitOK)
	if err := json.Unmarshal([]byte(r.stdout), &raw); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"leaseId", "repo", "scope", "workspaceId", "workspaceMode", "owner", "status", "version", "fence", "acquiredAt", "renewedAt", "expiresAt"} {
		if _, ok := raw[k]; !ok {
			t.Errorf("lease show --json lacks %q: %s", k, r.stdout)
		}
	}
}

func TestAcquireWholeRepoAndExclusiveNone(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--workspace", "exclusive", "--workspace-id", "wt-1")
	if a.Scope.Kind != "none" || a.WorkspaceMode != lease.WorkspaceExclusive {
		t.Errorf("claim-nothing lease: scope %s, mode %s", a.Scope, a.WorkspaceMode)
	}
	w := acquireJSON(t, url, "--whole-repo", "--workspace-id", "wt-2")
	if w.Scope.Kind != "whole-repo" || w.WorkspaceMode != lease.WorkspaceExclusive {
		t.Errorf("whole-repo lease: scope %s, mode %s", w.Scope, w.WorkspaceMode)
	}
	// Any path now conflicts with the whole-repo lease.
	r := fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "x").want(t, ExitConflict)
	mustContain(t, "stderr", r.stderr, w.LeaseID)
}

func TestAcquireConflict(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	first := acquireJSON(t, url, "--scope", "services/billing", "--agent", "agent-a")
	start := time.Now()
	r := fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "services/billing/api", "--agent", "agent-b").want(t, ExitConflict)
	if !strings.HasPrefix(r.stderr, "fenceline: ") {
		t.Errorf("stderr should start with \"fenceline: \": %s", r.stderr)
	}
	mustContain(t, "stderr", r.stderr, first.LeaseID, "agent=agent-a", "expires "+first.ExpiresAt.UTC().Format(time.RFC3339), "services/billing/api", "--wait")
	if r.stdout != "" {
		t.Errorf("stdout should be empty on conflict: %s", r.stdout)
	}

	// With --wait, the refusal comes at the end of the wait and says so.
	r = fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "services", "--wait", "300ms").want(t, ExitConflict)
	mustContain(t, "stderr", r.stderr, first.LeaseID, "still held after --wait 300ms")
	if time.Since(start) < 300*time.Millisecond {
		t.Errorf("--wait 300ms returned before the wait")
	}
	// A queued acquire is granted once the holder releases.
	done := make(chan result, 1)
	go func() {
		done <- fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "services/billing", "--wait", "20s", "--json")
	}()
	fl(t, "--nats", url, "lease", "release", first.LeaseID).want(t, ExitOK)
	select {
	case r := <-done:
		r.want(t, ExitOK)
		var a acquired
		if err := json.Unmarshal([]byte(r.stdout), &a); err != nil || a.Fence <= first.Fence {
			t.Errorf("queued acquire: fence %d (%v), want > %d", a.Fence, err, first.Fence)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("queued acquire not granted after the release")
	}
}

func TestRenewReleaseLifecycle(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--scope", "services/billing")

	// Renew with no flags: the credential file supplies credential, version
	// and bus (no --nats needed), and is updated.
	r := fl(t, "lease", "renew", a.LeaseID).want(t, ExitOK)
	mustContain(t, "renew", r.stdout, "lease renewed: "+a.LeaseID, "version: 2")
	if f := checkCredFile(t, a.CredentialFile, a.LeaseID, url); f.Version != 2 {
		t.Errorf("credential file version %d after renew, want 2", f.Version)
	}
	r = fl(t, "lease", "renew", a.LeaseID, "--json").want(t, ExitOK)
	var l lease.Lease
	if err := json.Unmarshal([]byte(r.stdout), &l); err != nil || l.Version != 3 || !l.ExpiresAt.After(a.ExpiresAt) {
		t.Errorf("renew --json: version %d expires %s (%v), want 3 and later than %s", l.Version, l.ExpiresAt, err, a.ExpiresAt)
	}

	// A wrong credential is refused as not the owner.
	r = fl(t, "--nats", url, "lease", "renew", a.LeaseID, "--credential", string(leasebus.NewCredential())).want(t, ExitConflict)
	mustContain(t, "stderr", r.stderr, "not the lease owner")
	// The right one works from anywhere (no version check).
	fl(t, "--nats", url, "lease", "renew", a.LeaseID, "--credential", a.Credential).want(t, ExitOK)

	// Release, twice: both succeed; the credential file is gone.
	r = fl(t, "lease", "release", a.LeaseID).want(t, ExitOK)
	mustContain(t, "release", r.stdout, "lease released: "+a.LeaseID)
	if _, err := os.Stat(a.CredentialFile); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("credential file still there after release: %v", err)
	}
	r = fl(t, "--nats", url, "lease", "release", a.LeaseID).want(t, ExitOK)
	mustContain(t, "second release", r.stdout, "already ended: released")
	fl(t, "--nats", url, "lease", "release", a.LeaseID, "--credential", a.Credential).want(t, ExitOK)

	// Renewing a released lease: lost.
	r = fl(t, "--nats", url, "lease", "renew", a.LeaseID).want(t, ExitLost)
	mustContain(t, "stderr", r.stderr, "lease lost", "released")
	r = fl(t, "--nats", url, "lease", "renew", a.LeaseID, "--credential", a.Credential).want(t, ExitLost)
	mustContain(t, "stderr", r.stderr, "lease lost")
}

func TestRenewStaleVersionIsLost(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--scope", "x")
	// Someone on another machine renews with the credential: the file's
	// version is stale, and a compare-and-swap on it must fail (stop writing).
	here, elsewhere := stateDir(t), t.TempDir()
	setCfg(t, func(c *config) { c.StateDir = elsewhere })
	fl(t, "--nats", url, "lease", "renew", a.LeaseID, "--credential", a.Credential).want(t, ExitOK)
	setCfg(t, func(c *config) { c.StateDir = here })
	r := fl(t, "--nats", url, "lease", "renew", a.LeaseID).want(t, ExitLost)
	mustContain(t, "stderr", r.stderr, "version", "stop writing")
}

func TestReleaseWithoutCredentialFile(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--scope", "x")
	elsewhere := t.TempDir()
	setCfg(t, func(c *config) { c.StateDir = elsewhere }) // another machine
	r := fl(t, "--nats", url, "lease", "release", a.LeaseID).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "no credential file", "--credential")
	r = fl(t, "--nats", url, "lease", "renew", a.LeaseID).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "--credential")
	fl(t, "--nats", url, "lease", "release", a.LeaseID, "--credential", a.Credential).want(t, ExitOK)
	// Unknown lease: an error naming it.
	r = fl(t, "--nats", url, "lease", "release", "lease_zzzzzzzzzzzzzzzz").want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "lease_zzzzzzzzzzzzzzzz", "does not know")
}

func TestRevoke(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	a := acquireJSON(t, url, "--scope", "services/billing")
	r := fl(t, "--nats", url, "lease", "revoke", a.LeaseID).want(t, ExitUsage)
	mustContain(t, "stderr", r.stderr, "--reason is required")
	fl(t, "--nats", url, "lease", "revoke", a.LeaseID, "--reason", "  ").want(t, ExitUsage)

	r = fl(t, "--nats", url, "lease", "revoke", a.LeaseID, "--reason", "runaway agent").want(t, ExitOK)
	mustContain(t, "revoke", r.stdout, "lease revoked: "+a.LeaseID, "runaway agent")
	ls := listJSON(t, url, "--all")
	if len(ls) != 1 || ls[0].LeaseID != a.LeaseID || ls[0].Status != lease.StatusRevoked {
		t.Errorf("list --all after revoke = %+v, want %s revoked", ls, a.LeaseID)
	}
	r = fl(t, "--nats", url, "lease", "list", "--all").want(t, ExitOK)
	mustContain(t, "list --all", r.stdout, a.LeaseID, "revoked")
	if ls := listJSON(t, url); len(ls) != 0 {
		t.Errorf("list of active leases after revoke = %+v, want none", ls)
	}
	// The holder's renewal is refused: lost.
	r = fl(t, "lease", "renew", a.LeaseID).want(t, ExitLost)
	mustContain(t, "stderr", r.stderr, "revoked")
	// Revoking again is harmless.
	r = fl(t, "--nats", url, "lease", "revoke", a.LeaseID, "--reason", "again").want(t, ExitOK)
	mustContain(t, "revoke again", r.stdout, "already ended")
}

func TestList(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	r := fl(t, "--nats", url, "lease", "list", "--json").want(t, ExitOK)
	if r.stdout != "[]\n" {
		t.Errorf("list --json with no leases = %q, want []", r.stdout)
	}
	r = fl(t, "--nats", url, "lease", "list").want(t, ExitOK)
	mustContain(t, "list", r.stdout, "no active leases")

	a := acquireJSON(t, url, "--scope", "services/billing", "--agent", "agent-a", "--task", "task-1")
	b := acquireJSON(t, url, "--scope", "libs/tax", "--agent", "agent-b", "--task", "task-2")
	other := fl(t, "--nats", url, "lease", "acquire", "--repo", "github.com/acme/other", "--scope", "x").want(t, ExitOK)
	r = fl(t, "--nats", url, "lease", "list", "--repo", testRepo).want(t, ExitOK)
	lines := strings.Split(strings.TrimSpace(r.stdout), "\n")
	if len(lines) != 3 {
		t.Fatalf("list --repo: want a header and 2 rows:\n%s", r.stdout)
	}
	if f := strings.Fields(lines[0]); strings.Join(f, " ") != "LEASE REPO SCOPE WORKSPACE OWNER FENCE STATUS EXPIRES IN" {
		t.Errorf("header %q", lines[0])
	}
	row := regexp.MustCompile(`^(lease_\w+)\s+github\.com/acme/payments\s+\[(\S+)\]\s+checkout \(shared\)\s+(agent-\w)/(task-\d)\s+(\d+)\s+active\s+(\d+)s$`)
	for i, l := range []acquired{a, b} {
		m := row.FindStringSubmatch(lines[1+i])
		if m == nil {
			t.Errorf("row %q does not match %s", lines[1+i], row)
			continue
		}
		if m[1] != l.LeaseID || m[5] != fmt.Sprint(l.Fence) {
			t.Errorf("row %q: want %s fence %d", lines[1+i], l.LeaseID, l.Fence)
		}
		if m[6] < "290" || len(m[6]) != 3 {
			t.Errorf("row %q: EXPIRES IN should be about 300s", lines[1+i])
		}
	}
	if ls := listJSON(t, url); len(ls) != 3 {
		t.Errorf("list of every repo has %d leases, want 3 (%s)", len(ls), other.stdout)
	}
}

func TestAudit(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
	if r.stdout != "[]\n" {
		t.Errorf("audit --json on a fresh bus = %q, want []", r.stdout)
	}
	a := acquireJSON(t, url, "--scope", "x", "--agent", "agent-z")
	fl(t, "lease", "release", a.LeaseID).want(t, ExitOK)
	checkFor(t, 5*time.Second, 50*time.Millisecond, func() error {
		r := fl(t, "--nats", url, "lease", "audit", "--repo", testRepo).want(t, ExitOK)
		for _, typ := range []string{"grant", "release"} {
			re := regexp.MustCompile(`(?m)^\S+Z\s+` + typ + `\s+` + a.LeaseID + `\s+agent-z/cli\s+fence=` + fmt.Sprint(a.Fence) + `\s+\S`)
			if !re.MatchString(r.stdout) {
				return fmt.Errorf("no %s line for %s in:\n%s", typ, a.LeaseID, r.stdout)
			}
		}
		return nil
	})
}

func TestNoBus(t *testing.T) {
	t.Parallel()
	isolate(t)
	closed := closedURL(t)
	for _, tc := range []struct {
		name    string
		args    []string
		env     string
		deflt   string
		wantMsg string
	}{
		{"flag", []string{"--nats", closed}, "", leasebus.DefaultURL, "fenceline: no bus at " + closed + " (from --nats): "},
		{"env", nil, closed, leasebus.DefaultURL, "fenceline: no bus at " + closed + " (from FENCELINE_NATS): "},
		{"default", nil, "", closed, "fenceline: no bus at " + closed + ": start one with \"fenceline bus serve\" (or set --nats/FENCELINE_NATS)\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			setCfg(t, func(c *config) { c.NATS = tc.env })
			for _, cmd := range [][]string{
				{"lease", "list"},
				{"lease", "acquire", "--repo", testRepo, "--scope", "x"},
				{"lease", "renew", "lease_0123456789abcdef"},
				{"lease", "audit"},
			} {
				start := time.Now()
				r := flDefault(t, tc.deflt, append(append([]string{}, tc.args...), cmd...)...).want(t, ExitError)
				if took := time.Since(start); took > 3*time.Second {
					t.Errorf("%v took %s, want under 3s", cmd, took)
				}
				if !strings.HasPrefix(r.stderr, tc.wantMsg) {
					t.Errorf("%v: stderr %q, want it to start with %q", cmd, r.stderr, tc.wantMsg)
				}
			}
		})
	}
}

func TestBadInput(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := closedURL(t) // none of these may get as far as the bus
	acq := []string{"--nats", url, "lease", "acquire", "--repo", testRepo}
	for _, tc := range []struct {
		args []string
		want []string
	}{
		{append(acq, "--scope", "../x"), []string{`"../x"`, "escapes the repository root"}},
		{append(acq, "--scope", "/abs"), []string{`"/abs"`, "absolute"}},
		{append(acq, "--scope", ".git/config"), []string{`".git/config"`}},
		{append(acq, "--scope", "x", "--ttl", "banana"), []string{`"banana"`, "--ttl"}},
		{append(acq, "--scope", "x", "--ttl", "0s"), []string{"--ttl 0s out of range"}},
		{append(acq, "--scope", "x", "--table", "users"), []string{`"users"`}},
		{append(acq, "--scope", "x", "--workspace", "roomy"), []string{`"roomy"`, "shared or exclusive"}},
		{append(acq, "--scope", "x", "--whole-repo"), []string{"scope", "whole-repo"}},
		{append(acq, "--scope", "x", "--wait", "-1s"), []string{"--wait -1s"}},
		{acq, []string{"nothing claimed", "--workspace exclusive"}},
		{[]string{"--nats", url, "lease", "acquire", "--scope", "x"}, []string{"repo"}},
		{[]string{"--nats", url, "lease", "acquire", "--repo", " ", "--scope", "x"}, []string{"--repo is required"}},
		{[]string{"--nats", url, "lease", "renew"}, []string{"LEASE_ID"}},
		{[]string{"--nats", url, "lease", "renew", "../../etc/passwd"}, []string{`"../../etc/passwd" is not a lease id`}},
		{[]string{"--nats", url, "lease", "release", "a", "b"}, []string{"exactly 1 argument"}},
		{[]string{"--nats", url, "lease", "revoke", "lease_x"}, []string{"reason"}},
		{[]string{"--nats", url, "lease", "frobnicate"}, []string{`unknown command "frobnicate"`}},
		{[]string{"frobnicate"}, []string{`unknown command "frobnicate"`}},
		{[]string{"lease", "list", "--bogus"}, []string{"--bogus"}},
		{[]string{"bus", "serve", "--log-format", "xml"}, []string{`"xml"`}},
		{[]string{"--nats", url, "bus", "serve", "--listen", "127.0.0.1:0"}, []string{"--listen", "embedded"}},
	} {
		r := fl(t, tc.args...)
		if r.code != ExitUsage {
			t.Errorf("%v: exit %d, want %d (usage)\nstderr: %s", tc.args, r.code, ExitUsage, r.stderr)
			continue
		}
		if !strings.HasPrefix(r.stderr, "fenceline: ") {
			t.Errorf("%v: stderr %q should start with \"fenceline: \"", tc.args, r.stderr)
		}
		mustContain(t, fmt.Sprint(tc.args), r.stderr, append(tc.want, "--help")...)
	}
}

func TestHelp(t *testing.T) {
	t.Parallel()
	isolate(t)
	r := fl(t, "--help").want(t, ExitOK)
	mustContain(t, "help", r.stdout, "Exit status", "bus", "lease", "demo", "--nats", "FENCELINE_NATS")
	r = fl(t, "lease", "acquire", "--help").want(t, ExitOK)
	mustContain(t, "acquire help", r.stdout, "--scope", "--whole-repo", "--table", "--workspace-id", "--workspace", "--ttl", "--task", "--agent", "--attempt", "--wait", "--json", "exit 2")
	r = fl(t, "lease").want(t, ExitOK)
	for _, sub := range []string{"acquire", "renew", "release", "list", "sweep-stale", "revoke", "audit"} {
		mustContain(t, "lease help", r.stdout, sub)
	}
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		want int
	}{
		{errors.New("cobra: unknown flag"), ExitUsage},
		{&runError{errors.New("boom")}, ExitError},
		{&runError{usagef("bad")}, ExitUsage},
		{&runError{fmt.Errorf("x: %w", lease.ErrInvalid)}, ExitUsage},
		{&runError{&lease.ConflictError{Repo: "r"}}, ExitConflict},
		{&runError{fmt.Errorf("x: %w", lease.ErrNotOwner)}, ExitConflict},
		{&runError{fmt.Errorf("x: %w", lease.ErrLeaseLost)}, ExitLost},
		{&runError{fmt.Errorf("x: %w", lease.ErrNotFound)}, ExitError},
		{&runError{fmt.Errorf("x: %w", lease.ErrUnavailable)}, ExitError},
	} {
		if got := exitCode(tc.err); got != tc.want {
			t.Errorf("exitCode(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}
