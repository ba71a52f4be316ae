package gitproxy

import (
	"crypto/rand"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func mustPush(t *testing.T, dir string, args ...string) string {
	t.Helper()
	out, ok := pushOut(t, dir, args...)
	if !ok {
		t.Fatalf("git push %s refused:\n%s", strings.Join(args, " "), out)
	}
	return out
}

func mustRefuse(t *testing.T, dir, want string, args ...string) string {
	t.Helper()
	out, ok := pushOut(t, dir, args...)
	if ok {
		t.Fatalf("git push %s accepted, want refused:\n%s", strings.Join(args, " "), out)
	}
	if !strings.Contains(out, want) {
		t.Fatalf("git push %s output lacks %q:\n%s", strings.Join(args, " "), want, out)
	}
	return out
}

func TestAtomicAndMultiRefPushGoAsAWhole(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := e.clone(e.proxy(l).URL)
	good := e.commit(dir, "good", "services/billing/a.go", "a\n")
	mustGit(t, dir, "branch", "good")
	e.commit(dir, "bad", "libs/tax/rates.go", "x\n")
	mustGit(t, dir, "branch", "bad")
	for _, atomic := range []bool{true, false} {
		args := []string{"origin", "good", "bad"}
		if atomic {
			args = append([]string{"--atomic"}, args...)
		}
		out := mustRefuse(t, dir, "libs/tax/rates.go is outside lease", args...)
		if !strings.Contains(out, "refs/heads/bad in the same push was refused") && !strings.Contains(out, "atomic") {
			t.Fatalf("good ref's refusal does not say why:\n%s", out)
		}
		if e.upstreamRef("refs/heads/good") != "" {
			t.Fatalf("atomic=%v: good ref landed although the push was refused", atomic)
		}
	}
	mustPush(t, dir, "--atomic", "origin", "good")
	if e.upstreamRef("refs/heads/good") != good {
		t.Fatal("good ref did not land")
	}
}

func writeHook(t *testing.T, bare, name, script string) {
	t.Helper()
	p := filepath.Join(bare, "hooks", name)
	if err := os.WriteFile(p, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
}

func testThinAndLarge(t *testing.T, local bool) {
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir := filepath.Join(t.TempDir(), "work")
	srv := e.proxy(l, func(c *Config) {
		if local {
			c.ObjectDirs = []string{filepath.Join(dir, ".git")}
			c.MirrorDir = ""
		}
	})
	mustGit(t, "", "clone", "--quiet", srv.URL+"/payments.git", dir)
	// 3 MiB of incompressible data: the request body is over 1 MiB, so git
	// sends it chunked.
	big := make([]byte, 3<<20)
	rand.Read(big)
	e.commit(dir, "big", "services/billing/blob.bin", string(big))
	tr, err := gitCmd(t, dir, []string{"GIT_TRACE_CURL=1", "GIT_TRACE_CURL_NO_DATA=1"}, "push", "origin", "main")
	if err != nil {
		t.Fatalf("large push refused: %v\n%s", err, tr)
	}
	if !strings.Contains(tr, "Transfer-Encoding: chunked") {
		t.Fatalf("large push was not sent chunked:\n%s", tr)
	}
	// A small change to the big file: git sends a thin pack whose delta
	// base is the blob the upstream already has.
	copy(big[100:], "changed")
	head := e.commit(dir, "delta", "services/billing/blob.bin", string(big))
	tr, err = gitCmd(t, dir, []string{"GIT_TRACE=1"}, "push", "origin", "main")
	if err != nil {
		t.Fatalf("thin push refused: %v\n%s", err, tr)
	}
	if !strings.Contains(tr, "pack-objects") || !strings.Contains(tr, "--thin") {
		t.Fatalf("git did not send a thin pack:\n%s", tr)
	}
	if e.upstreamRef("refs/heads/main") != head {
		t.Fatal("thin push did not land")
	}
	mustGit(t, e.bare, "fsck", "--no-progress")
}

func TestPushAfterReleaseRevokeAndWithoutLease(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	srv := e.proxy(l)
	dir := e.clone(srv.URL)
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	if err := l.Close(ctxT(t)); err != nil {
		t.Fatal(err)
	}
	mustRefuse(t, dir, "is not held", "origin", "main")

	l2 := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	dir2 := e.clone(e.proxy(l2).URL)
	e.commit(dir2, "x", "services/billing/x.go", "x\n")
	if _, err := e.bus.Operator.Revoke(ctxT(t), l2.Record.LeaseID, "operator says stop"); err != nil {
		t.Fatal(err)
	}
	// The holder learns of the revoke by watch; the proxy also asks the bus.
	mustRefuse(t, dir2, "fenceline: lease "+l2.Record.LeaseID, "origin", "main")

	// No lease at all: clone and fetch still work, pushes do not.
	none := e.proxy(nil)
	dir3 := e.clone(none.URL)
	mustGit(t, dir3, "fetch", "--quiet", "origin")
	e.commit(dir3, "x", "services/billing/x.go", "x\n")
	mustRefuse(t, dir3, "holds no lease", "origin", "main")
	for _, ev := range e.audit() {
		if ev.Repo != testRepo || ev.Reason == "" || ev.Message == "" {
			t.Fatalf("incomplete audit event %+v", ev)
		}
	}
}

// TestZombiePush: a sidecar whose lease expired and was regranted to
// another owner, who pushed, must not land its push — at the proxy, and,
// should a zombie get past its own checks, at the server's hook.
func TestZombiePush(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	e.installHook(false)

	claim := bustest.Claim(t, "services/billing")
	cred := leasebus.NewCredential()
	zombie, err := e.bus.Client.Acquire(ctxT(t), leasebus.AcquireRequest{
		Repo: testRepo, Scope: claim, WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Second),
		Owner: lease.Owner{TaskID: "t", AgentID: "zombie", AttemptID: lease.NewAttemptID()},
	}, cred)
	if err != nil {
		t.Fatal(err)
	}
	// A frozen holder: it believes the lease is still held.
	frozen := leasebus.Frozen{Record: *zombie}
	zdir := e.clone(e.proxy(frozen).URL)
	e.commit(zdir, "zombie", "services/billing/invoice.go", "zombie\n")

	// The lease expires; another agent takes the same claim and pushes.
	var next *lease.Lease
	testutil.CheckFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		next, err = e.bus.Client.Acquire(ctxT(t), leasebus.AcquireRequest{
			Repo: testRepo, Scope: claim, WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(30 * time.Second),
			Owner: lease.Owner{TaskID: "t", AgentID: "successor", AttemptID: lease.NewAttemptID()},
		}, leasebus.NewCredential())
		return err
	})
	if next.Fence <= zombie.Fence {
		t.Fatalf("regrant fence %d not above %d", next.Fence, zombie.Fence)
	}
	ndir := e.clone(e.proxy(leasebus.Frozen{Record: *next}).URL)
	e.commit(ndir, "successor", "services/billing/other.go", "successor\n")
	mustPush(t, ndir, "origin", "main")

	// At the proxy: the bus says the zombie's lease is not active.
	mustGit(t, zdir, "pull", "--quiet", "--rebase", "origin", "main")
	mustRefuse(t, zdir, "fenceline: lease "+zombie.LeaseID, "origin", "main")

	// At the server: a zombie sidecar that got past its own checks and
	// signed its stale fence before it paused delivers the push late; the
	// hook refuses it.
	late := signed(t, e.hookKey, testRepo, zombie, e.updateOf(zdir))
	out := mustRefuse(t, zdir, "is stale", append(pushOpts(late), e.gs.url("payments.git"), "HEAD:main")...)
	if !strings.Contains(out, fmt.Sprintf("was pushed under fence %d", next.Fence)) {
		t.Fatalf("hook refusal does not name the newer fence:\n%s", out)
	}
	if !strings.Contains(out, "agent=zombie") || !strings.Contains(out, "agent=successor") {
		t.Fatalf("hook refusal does not name both owners:\n%s", out)
	}
	// And a push with no fence at all is refused by the hook.
	mustRefuse(t, zdir, "carries no fence", e.gs.url("payments.git"), "HEAD:main")
	// The successor keeps pushing.
	e.commit(ndir, "again", "services/billing/other.go", "again\n")
	mustPush(t, ndir, "origin", "main")
}

// buildFenceline returns the fenceline binary (testutil.FencelineBinary:
// built once per run), for the git server's hook.
func buildFenceline(t *testing.T) string {
	t.Helper()
	return testutil.FencelineBinary(t)
}

func TestPushOnlyToTheLeasedRepository(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	other := e.gs.newRepo(t, "infra.git")
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	srv := e.proxy(l)
	dir := e.clone(srv.URL)
	e.commit(dir, "x", "services/billing/x.go", "x\n")
	mustRefuse(t, dir, "the git fence serves only git's smart-HTTP endpoints of /payments.git", srv.URL+"/infra.git", "main")
	if out, err := gitCmd(t, other, nil, "rev-parse", "--verify", "--quiet", "refs/heads/main"); err == nil {
		t.Fatalf("push to another repository landed: %s", out)
	}
	mustPush(t, dir, "origin", "main")
}
