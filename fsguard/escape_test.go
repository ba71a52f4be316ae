//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// TestStaticBinaryConfined: a CGO_ENABLED=0 Go binary makes its system
// calls directly, so nothing in user space can intercept them; the kernel
// guard still confines it.
func TestStaticBinaryConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	p := w.policy()
	in := runGuarded(t, p, &testGate{}, w.root, helper, "write", filepath.Join(w.leased, "static.txt"))
	if in.code != 0 || in.out != "ok" {
		t.Fatalf("in-scope write by the static binary: exit %d %q, want ok", in.code, in.out)
	}
	for _, target := range []string{filepath.Join(w.other, "static.txt"), filepath.Join(w.outside, "static.txt"), filepath.Join(w.root, "static.txt")} {
		r := runGuarded(t, p, &testGate{}, w.root, helper, "write", target)
		if r.code == 0 || r.out != "EACCES" {
			t.Errorf("static binary writing %s: exit %d %q, want EACCES", target, r.code, r.out)
		}
		if _, err := os.Stat(target); err == nil {
			t.Errorf("%s exists after a denied write", target)
		}
	}
}

// TestEscapeTricks tries the usual ways around a path check.
func TestEscapeTricks(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	p := w.policy()
	secret := filepath.Join(w.outside, "secret.txt")
	theirs := filepath.Join(w.other, "theirs.txt")
	if err := os.Symlink(w.outside, filepath.Join(w.leased, "link-out")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(theirs, filepath.Join(w.leased, "link-theirs")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, script string }{
		{"symlink in scope to a dir outside", "echo x > leased/link-out/secret.txt"},
		{"symlink in scope to another claim's file", "echo x > leased/link-theirs"},
		{"new file through symlink to outside", "echo x > leased/link-out/new.txt"},
		{"dot-dot out of the lease", "echo x > leased/../other/theirs.txt"},
		{"dot-dot far out", "echo x > leased/../../outside/secret.txt"},
		{"rename from lease to outside", "mv -T leased/mine.txt " + filepath.Join(w.outside, "stolen.txt") + " && test ! -e leased/mine.txt"},
		{"rename another claim's file into the lease", "mv -T other/theirs.txt leased/theirs.txt"},
		{"hard link of an outside file into the lease, then write", "ln " + secret + " leased/hard && echo x >> leased/hard"},
		{"hard link of a leased file to outside", "ln leased/mine.txt " + filepath.Join(w.outside, "hard")},
		{"/proc/self/fd of a read-only fd", "exec 3<" + secret + "; echo x >> /proc/self/fd/3"},
		{"/proc/self/fd of the cwd", "cd " + w.outside + " && exec 3<. && echo x > /proc/self/fd/3/new.txt"},
		{"truncate outside", "truncate -s 0 " + secret},
		{"symlink created outside", "ln -s /etc/passwd " + filepath.Join(w.outside, "sym")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := sh(t, p, w.root, tc.script)
			if r.code == 0 {
				t.Fatalf("%q succeeded (%s), want it refused", tc.script, r.out)
			}
		})
	}
	if b, _ := os.ReadFile(secret); string(b) != "data" {
		t.Errorf("outside file = %q, want it untouched", b)
	}
	if b, _ := os.ReadFile(theirs); string(b) != "data" {
		t.Errorf("another claim's file = %q, want it untouched", b)
	}
	ents, _ := os.ReadDir(w.outside)
	if len(ents) != 1 {
		t.Errorf("outside dir has %d entries, want only secret.txt", len(ents))
	}
	if _, err := os.Stat(filepath.Join(w.leased, "mine.txt")); err != nil {
		t.Errorf("leased file moved away: %v", err)
	}
}

// TestHiddenPathUnreadable: the sidecar's credentials stay unreadable while
// their neighbours and the rest of the system are readable.
func TestHiddenPathUnreadable(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	creds := filepath.Join(w.outside, "creds")
	if err := os.MkdirAll(creds, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(creds, "token"), []byte("s3cret"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(creds, filepath.Join(w.outside, "creds-link")); err != nil {
		t.Fatal(err)
	}
	p := w.policy()
	// The second hidden path does not exist yet, nor do its parents (a
	// state dir that was never created): the guard must still start.
	p.Hidden = []string{creds, filepath.Join(w.outside, "never", "made", "state")}
	for _, tc := range []struct {
		script string
		wantOK bool
	}{
		{"cat " + filepath.Join(creds, "token"), false},
		{"cat " + filepath.Join(w.outside, "creds-link", "token"), false},
		{"cat " + filepath.Join(w.outside, "secret.txt"), true},
		{"cat /etc/hostname leased/mine.txt", true},
		{"ls " + w.outside, true},
		{"echo x > leased/ok.txt", true},
	} {
		r := sh(t, p, w.root, tc.script)
		if (r.code == 0) != tc.wantOK || strings.Contains(r.out, "s3cret") {
			t.Errorf("%q: exit %d %q, want success=%v and no secret", tc.script, r.code, r.out, tc.wantOK)
		}
	}
}

// TestTCPConnectLimited: the agent reaches the allowed port (the
// sidecar's) but not another service on the same host.
func TestTCPConnectLimited(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	allowed := listen(t)
	denied := listen(t)
	w := newWorktree(t)
	p := w.policy()
	p.ConnectPorts = []uint16{port(allowed)}
	if r := runGuarded(t, p, &testGate{}, w.root, helper, "connect", allowed.Addr().String()); r.out != "ok" {
		t.Errorf("connect to the allowed port %s: %q, want ok", allowed.Addr(), r.out)
	}
	if r := runGuarded(t, p, &testGate{}, w.root, helper, "connect", denied.Addr().String()); r.out != "EACCES" {
		t.Errorf("connect to the other port %s: %q, want EACCES", denied.Addr(), r.out)
	}
	p.AllowAnyConnect = true
	if r := runGuarded(t, p, &testGate{}, w.root, helper, "connect", denied.Addr().String()); r.out != "ok" {
		t.Errorf("connect with AllowAnyConnect: %q, want ok", r.out)
	}
}

func listen(t *testing.T) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	t.Cleanup(func() { l.Close(); <-done })
	return l
}

func port(l net.Listener) uint16 {
	var p uint16
	fmt.Sscan(l.Addr().String()[strings.LastIndexByte(l.Addr().String(), ':')+1:], &p)
	return p
}

// TestCannotSignalSupervisor: Landlock's signal scope keeps the agent from
// killing the sidecar that guards it (same user, so kill(2) would allow it).
func TestCannotSignalSupervisor(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	r := sh(t, w.policy(), w.root, fmt.Sprintf("kill -0 %d", os.Getpid()))
	if r.code == 0 {
		t.Fatalf("the guarded agent could signal its supervisor (%s)", r.out)
	}
	if r := sh(t, w.policy(), w.root, "sleep 10 & kill $!"); r.code != 0 {
		t.Errorf("the agent could not signal its own child: exit %d %s", r.code, r.out)
	}
}

// TestCallsOnOtherProcessesConfined: calls that act on a process by pid
// without a ptrace check (prlimit64, setpriority, sched_setaffinity) are
// the agent's on its own processes and refused on any other of its uid —
// here the supervisor, whose limits and priority the agent could
// otherwise lower (RLIMIT_NOFILE to nothing) — and so is setpriority on a
// process group (or user-wide); reading another process's limits stays allowed. Each
// refusal is audited.
func TestCallsOnOtherProcessesConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	audit := &memAuditor{}
	const own = "prlimit-read=ok prlimit=ok setpriority=ok affinity=ok setpriority-pgrp=EPERM"
	for _, tc := range []struct{ target, want string }{
		{"self", own},
		{"child", own},
		{strconv.Itoa(os.Getpid()), "prlimit-read=ok prlimit=EPERM setpriority=EPERM affinity=EPERM setpriority-pgrp=EPERM"},
	} {
		if r := runAudited(t, w.policy(), &testGate{}, audit, w.root, helper, "proc", tc.target); r.out != tc.want {
			t.Errorf("calls on %s: %q, want %q", tc.target, r.out, tc.want)
		}
	}
	wantDenial(t, audit, lease.BoundaryFile, lease.ReasonNotAllowed, fmt.Sprintf("prlimit64 on process %d: not a process of the attempt", os.Getpid()))
	wantDenial(t, audit, lease.BoundaryFile, lease.ReasonNotAllowed, "setpriority on a process group or every process of the user")
}
