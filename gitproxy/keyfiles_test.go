package gitproxy

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
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

// TestSidecarKeyFile: the sidecars' copy lives in fenceline's state dir,
// one file per repository, the identity escaped into one path element.
func TestSidecarKeyFile(t *testing.T) {
	t.Parallel()
	state := t.TempDir()
	if got, want := SidecarKeyFile(state, testRepo), filepath.Join(state, "git-hook", "github.com%2Facme%2Fpayments.key"); got != want {
		t.Fatalf("SidecarKeyFile(state, %q) = %s, want %s", testRepo, got, want)
	}
	if SidecarKeyFile(state, "github.com/acme/infra") == SidecarKeyFile(state, testRepo) {
		t.Fatal("two repositories share a sidecar key file")
	}
}

// TestWriteSidecarKey: the copy is written 0600 in a 0700 directory,
// rewriting the same key only restores its mode, another key replaces it,
// and no temporary file is left behind.
func TestWriteSidecarKey(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "git-hook")
	file := filepath.Join(dir, "repo.key")
	key, err := GenerateHookKey()
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteSidecarKey(file, key); err != nil {
		t.Fatal(err)
	}
	testutil.WantPerm(t, file, 0o600)
	testutil.WantPerm(t, dir, 0o700)
	if got, err := ReadKeyFile(file); err != nil || !bytes.Equal(got, key) {
		t.Fatalf("read back %x (%v), wrote %x", got, err, key)
	}

	if err := os.Chmod(file, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := WriteSidecarKey(file, key); err != nil {
		t.Fatal(err)
	}
	testutil.WantPerm(t, file, 0o600)

	other, err := GenerateHookKey()
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteSidecarKey(file, other); err != nil {
		t.Fatal(err)
	}
	if got, err := ReadKeyFile(file); err != nil || !bytes.Equal(got, other) {
		t.Fatalf("after a new key: %x (%v), want %x", got, err, other)
	}
	testutil.WantPerm(t, file, 0o600)
	if _, err := os.Stat(file + ".tmp"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("temporary file left: %v", err)
	}
}

// TestFindSidecarKey: no repo or no file is no key and no error; a file
// that is there is read; one that is not a key is an error naming it.
func TestFindSidecarKey(t *testing.T) {
	t.Parallel()
	state := t.TempDir()
	for _, repo := range []string{"", testRepo} {
		if key, file, err := FindSidecarKey(state, repo); key != nil || file != "" || err != nil {
			t.Fatalf("FindSidecarKey(state, %q) with no file = %x, %q, %v", repo, key, file, err)
		}
	}
	key, err := GenerateHookKey()
	if err != nil {
		t.Fatal(err)
	}
	if err := WriteSidecarKey(SidecarKeyFile(state, testRepo), key); err != nil {
		t.Fatal(err)
	}
	if got, file, err := FindSidecarKey(state, testRepo); !bytes.Equal(got, key) || file != SidecarKeyFile(state, testRepo) || err != nil {
		t.Fatalf("FindSidecarKey = %x, %q, %v; want %x from %s", got, file, err, key, SidecarKeyFile(state, testRepo))
	}
	if got, _, _ := FindSidecarKey(state, "github.com/acme/infra"); got != nil {
		t.Fatal("another repository found this one's key")
	}

	bad := SidecarKeyFile(state, "github.com/acme/bad")
	if err := os.WriteFile(bad, []byte("zz\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if got, file, err := FindSidecarKey(state, "github.com/acme/bad"); got != nil || file != bad || err == nil || !strings.Contains(err.Error(), "not hex") {
		t.Fatalf("a bad key file: %x, %q, %v", got, file, err)
	}
}

// TestInstallHookForSidecars: in a real bare repository, the hook and
// its secret are installed and the sidecars' copy written (to the state
// dir the CLI names, or where told), the same secret on a second install;
// someone else's hook is left alone and no copy is written; no file for
// the copy is an error before anything is installed.
func TestInstallHookForSidecars(t *testing.T) {
	t.Parallel()
	state := t.TempDir()
	ctx := ctxT(t)
	bare, err := gitserver.NewBare(filepath.Join(t.TempDir(), "payments.git"))
	if err != nil {
		t.Fatal(err)
	}
	hi := HookInstall{GitDir: bare, Repo: testRepo, Fenceline: "/usr/local/bin/fenceline"}
	if _, _, err := InstallHookForSidecars(ctx, hi, ""); err == nil || !strings.Contains(err.Error(), "no file for the sidecars' copy") {
		t.Fatalf("install with no sidecar file: %v, want an error naming it", err)
	}
	if _, err := os.Stat(HookKeyFile(bare)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("install with no sidecar file left a hook secret behind: %v", err)
	}
	in, file, err := InstallHookForSidecars(ctx, hi, SidecarKeyFile(state, testRepo))
	if err != nil {
		t.Fatal(err)
	}
	if file != SidecarKeyFile(state, testRepo) || !in.NewKey {
		t.Fatalf("installed %+v, sidecar copy %s", in, file)
	}
	testutil.WantPerm(t, in.KeyFile, 0o600)
	testutil.WantPerm(t, file, 0o600)
	if got, err := ReadKeyFile(file); err != nil || !bytes.Equal(got, in.Key) {
		t.Fatalf("sidecar copy %x (%v), hook secret %x", got, err, in.Key)
	}
	if got, err := ReadKeyFile(in.KeyFile); err != nil || !bytes.Equal(got, in.Key) {
		t.Fatalf("hook secret file %x (%v), installed %x", got, err, in.Key)
	}
	script, err := os.ReadFile(in.Hook)
	if err != nil || !strings.Contains(string(script), "hook pre-receive --repo '"+testRepo+"'") {
		t.Fatalf("hook script (%v):\n%s", err, script)
	}
	if out := mustGit(t, bare, "config", "receive.advertisePushOptions"); strings.TrimSpace(out) != "true" {
		t.Fatalf("receive.advertisePushOptions = %q", out)
	}

	elsewhere := filepath.Join(t.TempDir(), "sidecar.key")
	again, file2, err := InstallHookForSidecars(ctx, hi, elsewhere)
	if err != nil {
		t.Fatal(err)
	}
	if again.NewKey || file2 != elsewhere || !bytes.Equal(again.Key, in.Key) {
		t.Fatalf("again: %+v to %s, want the kept secret to %s", again, file2, elsewhere)
	}
	if got, err := ReadKeyFile(elsewhere); err != nil || !bytes.Equal(got, in.Key) {
		t.Fatalf("second copy %x (%v)", got, err)
	}

	foreign, err := gitserver.NewBare(filepath.Join(t.TempDir(), "foreign.git"))
	if err != nil {
		t.Fatal(err)
	}
	if err := gitserver.InstallHook(foreign, "pre-receive", "#!/bin/sh\nexit 0\n"); err != nil {
		t.Fatal(err)
	}
	notWritten := filepath.Join(t.TempDir(), "foreign.key")
	if _, _, err := InstallHookForSidecars(ctx, HookInstall{GitDir: foreign, Repo: testRepo, Fenceline: "/usr/local/bin/fenceline"}, notWritten); err == nil || !strings.Contains(err.Error(), "is not fenceline's") {
		t.Fatalf("over someone else's hook: %v", err)
	}
	if _, err := os.Stat(notWritten); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("a failed install wrote the sidecar copy: %v", err)
	}
}

// TestRecordRefusal: a refusal goes to the bus's audit stream as a
// denied git event with the lease, owner and fence the push claimed (a
// fence that is not a number is 0) and the hook's message.
func TestRecordRefusal(t *testing.T) {
	t.Parallel()
	bus := bustest.Start(t)
	he := &HookError{Msg: "fence refused: not signed", Reason: HookUnsigned, Lease: "lease_forged", Fence: "999999", Owner: "task=t agent=mallory attempt=a"}
	if err := RecordRefusal(ctxT(t), bus.Auditor, testRepo, he); err != nil {
		t.Fatal(err)
	}
	if ev := (&HookError{Fence: "many"}).AuditEvent(testRepo, time.Now()); ev.Fence != 0 {
		t.Fatalf("a fence that is no number audits as %d", ev.Fence)
	}
	evs, err := leasebus.ReadAudit(ctxT(t), bus.Conn, testRepo, 0)
	if err != nil {
		t.Fatal(err)
	}
	var got []lease.AuditEvent
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryGit {
			got = append(got, ev)
		}
	}
	if len(got) != 1 {
		t.Fatalf("git audit events %+v, want the one refusal", got)
	}
	ev := got[0]
	if ev.Type != lease.EventDenied || ev.Repo != testRepo || ev.LeaseID != "lease_forged" || ev.Fence != 999999 ||
		ev.Owner.AgentID != "mallory" || ev.Reason != HookUnsigned || ev.Message != "pre-receive hook: "+he.Msg || ev.Time.IsZero() {
		t.Fatalf("audit event %+v", ev)
	}
	// The repo is the audit's key: a refusal without one is not recorded.
	if err := RecordRefusal(ctxT(t), bus.Auditor, "", he); !errors.Is(err, lease.ErrInvalid) {
		t.Fatalf("a refusal without a repo: %v", err)
	}
}
