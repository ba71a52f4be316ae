package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// runAsCLIEnv makes the test binary the fenceline command (as
// cmd/fenceline/main.go does), so a test can SIGKILL a real runner.
const runAsCLIEnv = "FENCELINE_TEST_RUN_AS_CLI"

// newCheckout makes a git checkout with in/seed, out/seed and a README in
// one commit, and origin as its origin remote ("" for none).
func newCheckout(t *testing.T, origin string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "checkout")
	for p, c := range map[string]string{"in/seed": "seed\n", "out/seed": "seed\n", "README.md": "payments\n"} {
		os.MkdirAll(filepath.Join(dir, filepath.Dir(p)), 0o755)
		if err := os.WriteFile(filepath.Join(dir, p), []byte(c), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mustGitRun(t, dir, nil, "init", "--quiet", "--initial-branch=main")
	mustGitRun(t, dir, nil, "add", "-A")
	mustGitRun(t, dir, nil, "commit", "--quiet", "-m", "seed")
	if origin != "" {
		mustGitRun(t, dir, nil, "remote", "add", "origin", origin)
	}
	return dir
}

// aRun is fenceline run going on in-process.
type aRun struct {
	cancel      context.CancelFunc
	done        chan int
	out, errOut *syncBuffer
}

// startRun starts "fenceline --nats url run ARGS" in-process.
func startRun(t *testing.T, url string, args ...string) *aRun {
	t.Helper()
	return startRunCmd(t, url, append([]string{"run"}, args...)...)
}

// wait returns the run's exit status.
func (r *aRun) wait(t *testing.T) int {
	t.Helper()
	select {
	case code := <-r.done:
		r.done <- code // for Cleanup
		return code
	case <-time.After(30 * time.Second):
		t.Fatalf("fenceline run did not end\nstdout:\n%s\nstderr:\n%s", r.out, r.errOut)
		return -1
	}
}

// exited fails the test if the run has ended.
func (r *aRun) running(t *testing.T) {
	t.Helper()
	select {
	case code := <-r.done:
		r.done <- code
		t.Fatalf("fenceline run exited %d early\nstdout:\n%s\nstderr:\n%s", code, r.out, r.errOut)
	default:
	}
}

// runFL runs fenceline run to its end.
func runFL(t *testing.T, url string, args ...string) result {
	t.Helper()
	r := startRun(t, url, args...)
	code := r.wait(t)
	return result{code: code, stdout: r.out.String(), stderr: r.errOut.String()}
}

var leaseIDRE = regexp.MustCompile(`lease (lease_[a-z0-9]+) (acquired|attached)`)

// leaseOf returns the id of the lease a run announced on stderr.
func leaseOf(t *testing.T, stderr string) string {
	t.Helper()
	m := leaseIDRE.FindStringSubmatch(stderr)
	if m == nil {
		t.Fatalf("no lease announced:\n%s", stderr)
	}
	return m[1]
}

// busClient is a lease client on the bus at url, as the lease service.
func busClient(t *testing.T, url string) (*leasebus.Client, *nats.Conn) {
	t.Helper()
	nc := bustest.Connect(t, url)
	return leasebus.NewClient(nc), nc
}

func exists(p string) error {
	_, err := os.Stat(p)
	return err
}

// TestRunExitStatus: the agent's exit status is run's, a signal death is
// 128+N, and the lease is taken before and released after.
func TestRunExitStatus(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	for _, tc := range []struct {
		script string
		want   int
	}{{"exit 0", 0}, {"exit 7", 7}, {"kill -TERM $$", 128 + 15}} {
		r := runFL(t, url, "--checkout", co, "--", "sh", "-c", tc.script)
		if r.code != tc.want {
			t.Errorf("%q: exit %d, want %d\n%s", tc.script, r.code, tc.want, r.stderr)
		}
		mustContain(t, "run stderr", r.stderr, "lease lease_", " acquired: repo "+co+", scope none, workspace checkout (exclusive), fence ", "file guard: ", "released (the agent exited")
		if strings.Contains(r.stderr, "fenceline: reported") {
			t.Errorf("%q: run printed its internal error:\n%s", tc.script, r.stderr)
		}
	}
	if ls := listJSON(t, url); len(ls) != 0 {
		t.Fatalf("active leases after the runs: %+v", ls)
	}
}

// TestRunWritesFollowTheLease: what the agent may write in its checkout
// follows the lease — its claim (created when missing), the git dir only
// in an exclusive workspace, the whole checkout without a claim — and the
// repo is the checkout's normalized origin.
func TestRunWritesFollowTheLease(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	probe := `for f in in/f out/f .git/probe new/deeper/f; do if (echo x > $f) 2>/dev/null; then echo "$f=ok"; else echo "$f=refused"; fi; done`
	for _, tc := range []struct {
		name  string
		flags []string
		want  string
	}{
		{"shared path lease", []string{"--scope", "in", "--scope", "new/deeper"}, "in/f=ok out/f=refused .git/probe=refused new/deeper/f=ok"},
		{"exclusive path lease", []string{"--scope", "in", "--workspace", "exclusive"}, "in/f=ok out/f=refused .git/probe=ok new/deeper/f=refused"},
		{"exclusive, no claim", nil, "in/f=ok out/f=ok .git/probe=ok new/deeper/f=refused"},
		{"whole repo", []string{"--whole-repo"}, "in/f=ok out/f=ok .git/probe=ok new/deeper/f=refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			co := newCheckout(t, "https://bot:s3cret@GitHub.com/acme/payments.git/")
			args := append([]string{"--checkout", co}, tc.flags...)
			r := runFL(t, url, append(args, "--", "sh", "-c", probe)...).want(t, ExitOK)
			if got := strings.Join(strings.Fields(r.stdout), " "); got != tc.want {
				t.Errorf("writes: %s\nwant    %s\nstderr:\n%s", got, tc.want, r.stderr)
			}
			mustContain(t, "run stderr", r.stderr, "repo github.com/acme/payments,")
			for _, f := range strings.Fields(tc.want) {
				path, verdict, _ := strings.Cut(f, "=")
				err := exists(filepath.Join(co, path))
				if (verdict == "ok") != (err == nil) {
					t.Errorf("%s: the agent's verdict is %s but stat says %v", path, verdict, err)
				}
			}
		})
	}
}

// TestRunHidesCredentials: the agent cannot read fenceline's state dir,
// where lease credentials live.
func TestRunHidesCredentials(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	a := acquireJSON(t, url, "--scope", "elsewhere") // writes a credential file
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", "cat "+a.CredentialFile+" || echo unreadable").want(t, ExitOK)
	if strings.Contains(r.stdout, a.Credential) || !strings.Contains(r.stdout, "unreadable") {
		t.Fatalf("the agent read a credential file:\n%s\n%s", r.stdout, r.stderr)
	}
}

// TestRunHidesBusCredentials: a guarded agent cannot read the bus
// credentials, neither the default bus's (in the state dir) nor the ones
// --creds or $FENCELINE_CREDS names elsewhere: with them it could revoke
// other agents' leases or forge change notices.
func TestRunHidesBusCredentials(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t) // $FENCELINE_CREDS: the test buses' credentials, outside the state dir
	co := newCheckout(t, "")
	elsewhere := filepath.Join(bustest.CredsDir(t), leasebus.CredsFile(leasebus.RoleOperator))
	// The default bus's credentials, as "bus serve" writes them.
	if _, err := leasebus.EnsureCreds(defaultCredsDir(t)); err != nil {
		t.Fatal(err)
	}
	inState := filepath.Join(defaultCredsDir(t), leasebus.CredsFile(leasebus.RoleService))
	for _, p := range []string{elsewhere, inState} {
		if data, err := os.ReadFile(p); err != nil || !strings.Contains(string(data), "NKEY SEED") {
			t.Fatalf("%s: %v", p, err) // readable outside the guard
		}
	}
	// (Names in a hidden directory stay listable, fsguard/doc.go; contents
	// do not.)
	script := fmt.Sprintf("cat %s || echo elsewhere-unreadable; cat %s || echo state-unreadable", elsewhere, inState)
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", script).want(t, ExitOK)
	if strings.Contains(r.stdout, "SEED") {
		t.Fatalf("the agent read bus credentials:\n%s", r.stdout)
	}
	mustContain(t, "agent stdout", r.stdout, "elsewhere-unreadable", "state-unreadable")
}

// lostProbe writes into its claim and reads a file every round and says
// how each went, until a file named stop appears in the checkout.
const lostProbe = `n=0
while [ ! -e stop ]; do
  n=$((n+1))
  if err=$( (echo $n > in/probe) 2>&1 ); then w=ok; else w="refused($err)"; fi
  if [ "$(cat in/seed)" = seed ]; then r=ok; else r=refused; fi
  echo "round $n write=$w read=$r"
  sleep 0.02
done`

// TestRunLostLeaseStopsWrites: an operator revokes the lease mid-run; the
// agent's next write-open fails with EACCES within a second while reads go
// on, the agent keeps running (--on-lost keep), run says so on stderr and
// the denials are audited.
func TestRunLostLeaseStopsWrites(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	_, nc := busClient(t, url)
	co := newCheckout(t, "")
	r := startRun(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", lostProbe)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.out.String(), "write=ok read=ok") {
			return errors.New("the agent has not written yet")
		}
		return nil
	})
	id := leaseOf(t, r.errOut.String())
	// The operator's command, as a person would type it.
	mark := revokeAndSeeRefused(t, url, id, r.out, filepath.Join(co, "in", "probe"))
	// Later rounds stay refused, and reads keep working.
	checkFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		after := r.out.String()[mark:]
		first := strings.Index(after, "write=refused")
		if n := strings.Count(after[first:], "\n"); n < 3 {
			return fmt.Errorf("%d rounds since the first refusal", n)
		}
		return nil
	})
	after := r.out.String()[mark:]
	rest := after[strings.Index(after, "write=refused"):]
	if strings.Contains(rest, "write=ok") || strings.Contains(rest, "read=refused") || !strings.Contains(rest, "Permission denied") {
		t.Errorf("after the revoke, want every write refused with EACCES and every read ok:\n%s", rest)
	}
	r.running(t) // --on-lost keep
	mustContain(t, "run stderr", r.errOut.String(), "LEASE LOST: ", id, "revoked", "runaway agent", "the agent keeps running, as asked")

	if err := os.WriteFile(filepath.Join(co, "stop"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != 0 {
		t.Fatalf("run exited %d, want the agent's 0\n%s", code, r.errOut)
	}
	mustContain(t, "run stderr", r.errOut.String(), "writes of the agent were refused after the lease was lost", "ended before the agent did")
	evs, err := leasebus.ReadAudit(context.Background(), nc, co, 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryFile && ev.Type == lease.EventDenied && ev.LeaseID == id && strings.Contains(ev.Message, filepath.Join(co, "in", "probe")) {
			return
		}
	}
	t.Fatalf("no audited file denial for %s among %d events", id, len(evs))
}

// TestRunOnLostSignal: with --on-lost signal a lost lease also stops the
// agent, and run exits 4.
func TestRunOnLostSignal(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newCheckout(t, "")
	r := startRun(t, url, "--checkout", co, "--scope", "in", "--on-lost", "signal", "--", "sh", "-c", lostProbe)
	checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
		r.running(t)
		if !strings.Contains(r.out.String(), "write=ok") {
			return errors.New("the agent has not written yet")
		}
		return nil
	})
	if _, err := client.Revoke(context.Background(), leaseOf(t, r.errOut.String()), "runaway agent"); err != nil {
		t.Fatal(err)
	}
	if code := r.wait(t); code != ExitLost {
		t.Fatalf("run exited %d, want %d\n%s", code, ExitLost, r.errOut)
	}
	mustContain(t, "run stderr", r.errOut.String(), "LEASE LOST: ", "stopping the agent as asked: SIGTERM now", "the agent was stopped (--on-lost signal) and exited 143")
}

// startRunnerProcess runs "fenceline ARGS" as a real child process (this
// test binary, dispatched to the CLI), its output to a log file, so a test
// can SIGKILL the runner.
func startRunnerProcess(t *testing.T, args ...string) (cmd *exec.Cmd, logPath string) {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	logPath = filepath.Join(t.TempDir(), "run.log")
	logf, err := os.Create(logPath)
	if err != nil {
		t.Fatal(err)
	}
	defer logf.Close() // the child has its own copy
	cmd = exec.Command(self, args...)
	cmd.Env = append(cfgEnv(t), runAsCLIEnv+"=1")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return cmd, logPath
}

// revokeAndSeeRefused revokes lease id as an operator would and waits for
// the agent's output (out) to report a refused write after it, within a
// second; it returns where out stood at the revoke.
func revokeAndSeeRefused(t *testing.T, url, id string, out *syncBuffer, probe string) (mark int) {
	t.Helper()
	mark = len(out.String())
	fl(t, "--nats", url, "lease", "revoke", id, "--reason", "runaway agent").want(t, ExitOK)
	revoked := time.Now()
	var refusedAfter time.Duration
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		if strings.Contains(out.String()[mark:], "write=refused") {
			refusedAfter = time.Since(revoked)
			return nil
		}
		return errors.New("no refused write yet")
	})
	// The bound is on what landed: the agent's last write to probe (each
	// round writes it) is at most a second after the revoke returned. How
	// soon the agent reports a refusal also counts its own rounds, slow on
	// a busy machine.
	fi, err := os.Stat(probe)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("the agent saw its writes refused %v after the revoke; its last write landed %v after it", refusedAfter, fi.ModTime().Sub(revoked))
	if late := fi.ModTime().Sub(revoked); late > time.Second {
		t.Errorf("a write landed %v after the revoke, want within a second", late)
	}
	return mark
}

// releasedAfterChild fails t unless lease id was released, and only after
// the agent's background child wrote co/in/child-done (invariant 6).
func releasedAfterChild(t *testing.T, client *leasebus.Client, id, co string) {
	t.Helper()
	fi, err := os.Stat(filepath.Join(co, "in", "child-done"))
	if err != nil {
		t.Fatalf("the background child did not finish: %v", err)
	}
	l, err := client.Get(context.Background(), id)
	if err != nil {
		t.Fatal(err)
	}
	if l.Status != lease.StatusReleased || l.EndedAt.Before(fi.ModTime()) {
		t.Fatalf("lease %s %s at %s, want released after the background child finished at %s", id, l.Status, l.EndedAt, fi.ModTime())
	}
}

// openPty opens a pseudo-terminal pair.
func openPty(t *testing.T) (master, slave *os.File) {
	t.Helper()
	master, err := os.OpenFile("/dev/ptmx", os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		t.Fatal(err)
	}
	var n uint32
	rc, err := master.SyscallConn()
	if err == nil {
		cerr := rc.Control(func(fd uintptr) {
			if err = unix.IoctlSetPointerInt(int(fd), unix.TIOCSPTLCK, 0); err == nil {
				n, err = unix.IoctlGetUint32(int(fd), unix.TIOCGPTN)
			}
		})
		err = errors.Join(err, cerr)
	}
	if err != nil {
		master.Close()
		t.Fatalf("set up a pty: %v", err)
	}
	slave, err = os.OpenFile(fmt.Sprintf("/dev/pts/%d", n), os.O_RDWR|syscall.O_NOCTTY, 0)
	if err != nil {
		master.Close()
		t.Fatal(err)
	}
	return master, slave
}

// TestRunGitShimRefusesRepoWideGit: in a path lease (shared workspace)
// git stash and git commit are refused with the shim's message naming the
// lease, and still fail when the real git is called by its absolute path;
// read-only git works.
func TestRunGitShimRefusesRepoWideGit(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "")
	realGit, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	realGit, _ = filepath.EvalSymlinks(realGit)
	id := "-c user.name=agent -c user.email=agent@example.com"
	script := `echo edit >> in/seed
git stash; echo "stash=$?"
git ` + id + ` commit -qam x; echo "commit=$?"
` + realGit + ` stash; echo "abs-stash=$?"
` + realGit + ` ` + id + ` commit -qam x; echo "abs-commit=$?"
git status --short >/dev/null; echo "status=$?"`
	r := runFL(t, url, "--checkout", co, "--scope", "in", "--", "sh", "-c", script).want(t, ExitOK)
	lease := leaseOf(t, r.stderr)
	got := map[string]string{}
	for _, l := range strings.Fields(r.stdout) {
		k, v, _ := strings.Cut(l, "=")
		got[k] = v
	}
	if got["stash"] != "3" || got["commit"] != "3" || got["status"] != "0" ||
		got["abs-stash"] == "0" || got["abs-stash"] == "" || got["abs-commit"] == "0" || got["abs-commit"] == "" {
		t.Errorf("exit codes %v: want stash and commit refused by the shim (3), by absolute path refused too, status 0\n%s", got, r.stderr)
	}
	mustContain(t, "agent stderr", r.stderr, "refused `git stash`", "refused `git commit`", "lease "+lease)
	if out := mustGitRun(t, co, nil, "stash", "list"); out != "" {
		t.Errorf("git stash list = %q, want none", out)
	}
	if out := strings.TrimSpace(mustGitRun(t, co, nil, "rev-list", "--count", "HEAD")); out != "1" {
		t.Errorf("%s commits, want the seed alone", out)
	}
	if b, _ := os.ReadFile(filepath.Join(co, "in", "seed")); string(b) != "seed\nedit\n" {
		t.Errorf("in/seed = %q, want the agent's edit kept", b)
	}
}

// TestRunGitFenceAndConnects: the agent's unmodified git pushes through
// the git fence and it reaches its Postgres fence, while direct TCP
// connects to the bus, the git server and the Postgres server are refused.
func TestRunGitFenceAndConnects(t *testing.T) {
	t.Parallel()
	isolate(t)
	busURL := startBus(t)
	gs, bare := seededGitServer(t)
	co := filepath.Join(t.TempDir(), "payments")
	mustGitRun(t, "", nil, "clone", "--quiet", gs.URL+"/payments.git", co)
	port := func(raw string) string {
		u, err := url.Parse(raw)
		if err != nil {
			t.Fatal(err)
		}
		return u.Port()
	}
	// The Postgres server's port: a listener that would accept anyone; the
	// agent must reach it only through its Postgres fence ($PGHOST:$PGPORT).
	pgUp, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pgUp.Close()
	pgPort := strconv.Itoa(pgUp.Addr().(*net.TCPAddr).Port)
	script := `exec 3<>/dev/tcp/127.0.0.1/` + port(busURL) + ` && echo bus=connected || echo bus=refused
exec 4<>/dev/tcp/127.0.0.1/` + port(gs.URL) + ` && echo git-server=connected || echo git-server=refused
exec 5<>/dev/tcp/127.0.0.1/` + pgPort + ` && echo postgres=connected || echo postgres=refused
exec 6<>/dev/tcp/$PGHOST/$PGPORT && echo pg-fence=connected || echo pg-fence=refused
echo '// v2' >> services/billing/invoice.go
git -c user.name=agent -c user.email=agent@example.com commit -qam "through the fence" && git push -q origin main && echo push=ok`
	r := runFL(t, busURL, "--checkout", co, "--git-upstream", gs.URL+"/payments.git", "--pg-upstream", "127.0.0.1:"+pgPort,
		"--", "bash", "-c", script).want(t, ExitOK)
	const want = "bus=refused git-server=refused postgres=refused pg-fence=connected push=ok"
	if got := strings.Join(strings.Fields(r.stdout), " "); got != want {
		t.Errorf("agent: %s\nwant   %s\nstderr:\n%s", got, want, r.stderr)
	}
	mustContain(t, "run stderr", r.stderr, "repo 127.0.0.1:"+port(gs.URL)+"/payments,", "git fence http://127.0.0.1:", "Permission denied")
	out, err := gitRun(t, "", nil, "--git-dir", bare, "log", "-1", "--format=%s", "main")
	if err != nil || strings.TrimSpace(out) != "through the fence" {
		t.Errorf("upstream main: %q, %v; want the agent's commit", out, err)
	}
}

// TestRunConflict: a claim that overlaps an active lease is refused with
// exit 3 naming that lease, and the command never runs.
func TestRunConflict(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "git@github.com:acme/payments.git")
	held := fl(t, "--nats", url, "lease", "acquire", "--repo", "github.com/acme/payments", "--scope", "in", "--agent", "other-agent", "--json").want(t, ExitOK)
	var a acquired
	if err := json.Unmarshal([]byte(held.stdout), &a); err != nil {
		t.Fatal(err)
	}
	r := runFL(t, url, "--checkout", co, "--scope", "in/sub", "--", "sh", "-c", "touch ran").want(t, ExitConflict)
	mustContain(t, "run stderr", r.stderr, a.LeaseID, "other-agent", "conflicts with 1 active lease")
	if exists(filepath.Join(co, "ran")) == nil {
		t.Error("the command ran despite the conflict")
	}
}

// TestRunAttach: run --lease works under a lease acquired elsewhere (its
// claim decides the writes), keeps it renewed, and leaves it to its owner;
// a lease of another repo is refused.
func TestRunAttach(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newCheckout(t, "git@github.com:acme/payments.git")
	a := acquireJSON(t, url, "--scope", "in") // testRepo is github.com/acme/payments
	probe := `for f in in/f out/f; do if (echo x > $f) 2>/dev/null; then echo "$f=ok"; else echo "$f=refused"; fi; done`
	r := runFL(t, url, "--checkout", co, "--lease", a.LeaseID, "--", "sh", "-c", probe).want(t, ExitOK)
	if got := strings.Join(strings.Fields(r.stdout), " "); got != "in/f=ok out/f=refused" {
		t.Errorf("writes under the attached lease: %s, want in/f=ok out/f=refused\n%s", got, r.stderr)
	}
	mustContain(t, "run stderr", r.stderr, "lease "+a.LeaseID+" attached", "its owner releases it")
	if l, err := client.Get(context.Background(), a.LeaseID); err != nil || !l.Active() {
		t.Fatalf("attached lease after the run: %+v, %v; want it still active", l, err)
	}

	other := acquireJSON(t, url, "--scope", "x")
	co2 := newCheckout(t, "https://github.com/acme/ledger.git")
	r = runFL(t, url, "--checkout", co2, "--lease", other.LeaseID, "--", "true").want(t, ExitError)
	mustContain(t, "run stderr", r.stderr, "is for repo github.com/acme/payments", "github.com/acme/ledger")
}

// TestRunRepoOrCheckout: run works in --checkout; --repo alone names the
// checkout too (the CLI contract's "run --repo PATH"); with both, --repo
// is the repository the checkout must be of, in any of its spellings.
func TestRunRepoOrCheckout(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	co := newCheckout(t, "git@github.com:acme/payments.git")
	for _, args := range [][]string{
		{"--repo", co},
		{"--checkout", co},
		{"--checkout", co, "--repo", "https://github.com/acme/payments.git"},
	} {
		r := runFL(t, url, append(args, "--scope", "in", "--", "sh", "-c", "pwd")...).want(t, ExitOK)
		mustContain(t, strings.Join(args, " "), r.stderr, "repo github.com/acme/payments, scope [in]")
		mustContain(t, strings.Join(args, " "), r.stdout, co)
	}
}

// TestRunRepoCredentialNotShown: a --repo URL with a token in it is
// refused without the token in the message (stderr lands in CI logs).
func TestRunRepoCredentialNotShown(t *testing.T) {
	t.Parallel()
	isolate(t)
	co := newCheckout(t, "")
	const secretRepo = "https://bot:s3cret@github.com/acme/other.git"
	for _, args := range [][]string{
		{"--checkout", co, "--repo", secretRepo},
		{"--repo", secretRepo},
		{"--checkout", co, "--repo", "https://s3cret@github.com/acme/other.git"},
	} {
		r := flDefault(t, closedURL(t), append(append([]string{"run"}, args...), "--", "true")...)
		if r.code != ExitUsage || strings.Contains(r.stderr, "s3cret") || !strings.Contains(r.stderr, "github.com/acme/other") {
			t.Errorf("run %s: exit %d %q, want %d naming the repo without its credential", strings.Join(args, " "), r.code, r.stderr, ExitUsage)
		}
	}
}

// TestRunUsage: a wrong command line is exit 2, before any bus is dialed.
func TestRunUsage(t *testing.T) {
	t.Parallel()
	isolate(t)
	co := newCheckout(t, "")
	sub := filepath.Join(co, "in")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--checkout", co}, "needs the command to run"},
		{[]string{"--", "true"}, "--checkout is required"},
		{[]string{"--repo", "github.com/acme/payments", "--", "true"}, "is no local checkout, and this command works in one: pass it with --checkout PATH"},
		{[]string{"--repo", "github.com/acme/other", "--checkout", co, "--", "true"}, "is a checkout of " + co},
		{[]string{"--checkout", filepath.Join(co, "nope"), "--", "true"}, "no such file"},
		{[]string{"--checkout", sub, "--", "true"}, "pass its top directory"},
		{[]string{"--checkout", co, "--on-lost", "pray", "--", "true"}, "--on-lost"},
		{[]string{"--checkout", co, "--allow-connect", "http", "--", "true"}, "--allow-connect"},
		{[]string{"--checkout", co, "--allow-bind", "0", "--", "true"}, "--allow-bind"},
		{[]string{"--checkout", co, "--lease", "lease_abc", "--scope", "in", "--", "true"}, "drop --scope"},
		{[]string{"--checkout", co, "--scope", "../x", "--", "true"}, "../x"},
		{[]string{"--checkout", co, "--workspace", "shared", "--", "true"}, "nothing claimed"},
		{[]string{"--checkout", co, "--private-state", "/etc", "--", "true"}, "--private-state /etc: not beneath HOME"},
		{[]string{"--checkout", co, "--private-state", filepath.Join(cfgOf(t).Home, ".claude"), "--allow-write", cfgOf(t).Home, "--", "true"}, "drop the --allow-write"},
	} {
		r := flDefault(t, closedURL(t), append([]string{"run"}, tc.args...)...)
		if r.code != ExitUsage || !strings.Contains(r.stderr, tc.want) {
			t.Errorf("run %s: exit %d %q, want %d mentioning %q", strings.Join(tc.args, " "), r.code, r.stderr, ExitUsage, tc.want)
		}
	}
}

// TestRunClaimThroughSymlink is finding 3 of issue 17: agent A (claim in)
// makes in/evil -> ../out while agent B holds out. A run claiming in/evil
// compares as in/evil on the bus (no conflict with out) but would make out
// writable. Claims are judged by what they resolve to: run refuses it
// before asking for a lease, and an attached lease with such a claim never
// gets a guard granting the target.
func TestRunClaimThroughSymlink(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	client, _ := busClient(t, url)
	co := newCheckout(t, "git@github.com:acme/payments.git")
	acquireJSON(t, url, "--scope", "out", "--agent", "agent-b")
	if err := os.Symlink("../out", filepath.Join(co, "in", "evil")); err != nil {
		t.Fatal(err)
	}
	target := filepath.Join(co, "out", "seed")
	for _, claim := range []string{"in/evil", "in/evil/sub"} {
		r := runFL(t, url, "--checkout", co, "--scope", claim, "--", "sh", "-c", "echo pwned > "+claim+"/seed; echo pwned > in/evil/new").want(t, ExitUsage)
		mustContain(t, "run stderr", r.stderr, "claim "+claim+" goes through a symlink", "in/evil resolves to out", "claim out instead")
	}
	if b, _ := os.ReadFile(target); string(b) != "seed\n" {
		t.Fatalf("%s = %q after the refused runs; want it untouched", target, b)
	}
	if exists(filepath.Join(co, "out", "new")) == nil {
		t.Fatal("a file was created through the symlinked claim")
	}
	ls, err := client.List(context.Background(), "", true)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range ls {
		if l.Active() && strings.Contains(l.Scope.String(), "evil") {
			t.Fatalf("a lease on the symlinked claim was granted: %s %s", l.LeaseID, l.Scope)
		}
	}

	// A lease acquired elsewhere on the link (the bus cannot see the disk)
	// is attached to, but its guard is never built on the link's target.
	a := acquireJSON(t, url, "--scope", "in/evil")
	r := runFL(t, url, "--checkout", co, "--lease", a.LeaseID, "--", "sh", "-c", "echo pwned > in/evil/seed").want(t, ExitError)
	mustContain(t, "run stderr", r.stderr, "claim in/evil goes through a symlink")
	if b, _ := os.ReadFile(target); string(b) != "seed\n" {
		t.Fatalf("%s = %q after the attached run; want it untouched", target, b)
	}
}

// readsProbe is lostProbe with the reads an agent makes every minute:
// output thrown away through /dev/null, git status, a query through the
// Postgres fence, a scratch file in its private temp dir.
const readsProbe = `n=0
while [ ! -e stop ]; do
  n=$((n+1))
  if err=$( (echo $n > in/probe) 2>&1 ); then w=ok; else w="refused($err)"; fi
  if cat in/seed >/dev/null; then c=ok; else c=failed; fi
  if git status --porcelain >/dev/null; then g=ok; else g=failed; fi
  if psql -X -q -c 'select 1' >/dev/null; then p=ok; else p=failed; fi
  if echo $n > "$TMPDIR/scratch" && mv "$TMPDIR/scratch" "$TMPDIR/kept" && rm "$TMPDIR/kept"; then s=ok; else s=failed; fi
  echo "round $n write=$w cat=$c git=$g psql=$p tmp=$s"
done`
