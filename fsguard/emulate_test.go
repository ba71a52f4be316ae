//go:build linux && (amd64 || arm64)

package fsguard

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// markerGate holds until marker exists: a guarded script loses its lease
// at a point of its own choosing by creating the marker.
type markerGate struct{ marker string }

func (g markerGate) Fence() (uint64, error) {
	if _, err := os.Lstat(g.marker); err == nil {
		return 0, lease.ErrLeaseLost
	}
	return 7, nil
}

type metaState struct {
	mode       os.FileMode
	uid, gid   uint32
	mtime      int64
	xattrNames []string
}

func metaOf(t *testing.T, path string) metaState {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(path, buf)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range strings.Split(string(buf[:n]), "\x00") {
		if strings.HasPrefix(s, "user.") {
			names = append(names, s)
		}
	}
	slices.Sort(names)
	return metaState{mode: os.FileMode(st.Mode & 0o7777), uid: st.Uid, gid: st.Gid, mtime: st.Mtim.Sec, xattrNames: names}
}

func presetXattrs(t *testing.T, path string) {
	t.Helper()
	for _, n := range []string{"user.pre1", "user.pre2", "user.pre3", "user.pre4"} {
		if err := unix.Setxattr(path, n, []byte("x"), 0); err != nil {
			t.Fatalf("setxattr %s %s: %v (the test needs user xattrs)", path, n, err)
		}
	}
}

// metaResults parses "call=RESULT ..." of the helper's meta mode.
func metaResults(t *testing.T, out string) map[string]string {
	t.Helper()
	m := map[string]string{}
	for _, f := range strings.Fields(out) {
		k, v, ok := strings.Cut(f, "=")
		if !ok {
			t.Fatalf("meta output %q", out)
		}
		m[k] = v
	}
	if len(m) < 18 {
		t.Fatalf("meta output %q: too few calls", out)
	}
	return m
}

// TestMetadataConfined: chmod, chown, utimes and xattr writes reach only
// files of the lease while it holds (Landlock does not govern metadata: the
// supervisor performs them on a descriptor it judged), and none after the
// loss. Every refusal is audited and leaves the file as it was.
func TestMetadataConfined(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	secret, mine := filepath.Join(w.outside, "secret.txt"), filepath.Join(w.leased, "mine.txt")
	link := filepath.Join(w.leased, "link-secret")
	if err := os.Symlink(secret, link); err != nil {
		t.Fatal(err)
	}
	presetXattrs(t, secret)
	presetXattrs(t, mine)
	before := metaOf(t, secret)
	audit := &memAuditor{}
	gate := &testGate{}

	// Through the symlink in the lease, the nofollow variants act on the
	// symlink itself, which is in the lease (user xattrs on a symlink are
	// refused by the kernel: EPERM); every other call reaches the outside
	// file and is refused.
	onLink := map[string]string{"fchownat-nofollow": "ok", "lchown": "ok", "lsetxattr": "EPERM", "lremovexattr": "EPERM"}
	for _, target := range []string{secret, link} {
		r := runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "meta", target))
		for call, res := range metaResults(t, r.out) {
			want := "EACCES"
			if w, ok := onLink[call]; ok && target == link {
				want = w
			}
			if res != want {
				t.Errorf("%s on %s: %s, want %s", call, target, res, want)
			}
		}
	}
	if got := metaOf(t, secret); !equalMeta(got, before) {
		t.Errorf("outside file changed: %+v, was %+v", got, before)
	}
	if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
		return ev.Boundary == lease.BoundaryFile && ev.Reason == lease.ReasonOutsideLease &&
			strings.Contains(ev.Message, "setxattr") && strings.Contains(ev.Message, secret) && ev.LeaseID == "lease_test1"
	}); !ok {
		t.Errorf("no outside-lease audit event for setxattr on %s among %d events", secret, len(audit.all()))
	}

	r := runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "meta", mine))
	for call, res := range metaResults(t, r.out) {
		if res != "ok" {
			t.Errorf("%s on the leased %s: %s, want ok", call, mine, res)
		}
	}
	want := metaState{mode: 0o600, uid: 4242, gid: 4242, mtime: 1000, xattrNames: []string{"user.a", "user.b", "user.c", "user.d"}}
	if got := metaOf(t, mine); !equalMeta(got, want) {
		t.Errorf("leased file after meta: %+v, want %+v", got, want)
	}

	mine2 := filepath.Join(w.leased, "mine2.txt")
	if err := os.WriteFile(mine2, []byte("data"), 0o644); err != nil {
		t.Fatal(err)
	}
	presetXattrs(t, mine2)
	before2 := metaOf(t, mine2)
	gate.lost.Store(true)
	r = runGuardedAudit(t, w.policy(), gate, audit, exec.Command(helper, "meta", mine2))
	for call, res := range metaResults(t, r.out) {
		if res != "EACCES" {
			t.Errorf("%s on the leased %s after the loss: %s, want EACCES", call, mine2, res)
		}
	}
	if got := metaOf(t, mine2); !equalMeta(got, before2) {
		t.Errorf("leased file changed after the loss: %+v, was %+v", got, before2)
	}
}

func equalMeta(a, b metaState) bool {
	return a.mode == b.mode && a.uid == b.uid && a.gid == b.gid && a.mtime == b.mtime && slices.Equal(a.xattrNames, b.xattrNames)
}

// TestLostLeaseHarmlessWritesGoOn: after the loss, reads that redirect to
// /dev/null, the private temp dir, /dev/stdout on a pipe and the terminal
// keep working, while writes to the leased dir, also through a symlink or
// a hard link (made while the lease held) in the temp dir, stay refused and
// audited.
func TestLostLeaseHarmlessWritesGoOn(t *testing.T) {
	t.Parallel()
	w := newWorktree(t)
	mine := filepath.Join(w.leased, "mine.txt")
	marker := filepath.Join(w.leased, "LOSE")
	master, slave := openPty(t)
	script := `set -u
ln -s "$LEASED/mine.txt" "$TMPDIR/l" || exit 10
ln "$LEASED/mine.txt" "$TMPDIR/h" || exit 8
: > "$MARKER" || exit 9
cat "$LEASED/mine.txt" >/dev/null || exit 11
echo x > "$TMPDIR/a" && mv "$TMPDIR/a" "$TMPDIR/b" && rm "$TMPDIR/b" || exit 12
mkdir "$TMPDIR/d" && echo y > "$TMPDIR/d/f" && cat "$TMPDIR/d/f" >/dev/null && rm -r "$TMPDIR/d" || exit 13
echo piped > /dev/stdout || exit 14
echo to-the-terminal > "$PTY" || exit 15
if echo x > "$LEASED/new.txt"; then exit 16; fi
if echo x >> "$LEASED/mine.txt"; then exit 17; fi
if echo x > "$TMPDIR/l"; then exit 18; fi
if mkdir "$LEASED/dir"; then exit 19; fi
if echo x > "$TMPDIR/h"; then exit 20; fi
if echo x >> "$TMPDIR/h"; then exit 21; fi
git status >/dev/null || exit 22
echo done`
	for _, args := range [][]string{{"init", "-q"}, {"add", "-A"}, {"-c", "user.name=t", "-c", "user.email=t@example.com", "commit", "-qm", "one"}} {
		git := exec.Command("git", args...)
		git.Dir = w.root
		if out, err := git.CombinedOutput(); err != nil {
			t.Fatalf("git %v: %v\n%s", args, err, out)
		}
	}
	audit := &memAuditor{}
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Env = append(os.Environ(), "LEASED="+w.leased, "MARKER="+marker, "PTY="+slave.Name())
	cmd.Dir = w.root
	var stderr strings.Builder
	cmd.Stderr = &stderr
	r := runGuardedAudit(t, w.policy(), markerGate{marker}, audit, cmd)
	if r.code != 0 || r.out != "piped\ndone" {
		t.Fatalf("after the loss: exit %d, stdout %q, stderr %q; want exit 0 and piped, done", r.code, r.out, stderr.String())
	}
	if b, _ := os.ReadFile(mine); string(b) != "data" {
		t.Errorf("leased file = %q after the loss, want it untouched", b)
	}
	for _, p := range []string{filepath.Join(w.leased, "new.txt"), filepath.Join(w.leased, "dir")} {
		if _, err := os.Lstat(p); err == nil {
			t.Errorf("%s exists after a write refused after the loss", p)
		}
	}
	mfd := int(master.Fd()) // Fd makes the file blocking: call it once
	unix.SetNonblock(mfd, true)
	var seen []byte
	testutil.CheckFor(t, 5*time.Second, 10*time.Millisecond, func() error {
		buf := make([]byte, 4096)
		if n, _ := unix.Read(mfd, buf); n > 0 {
			seen = append(seen, buf[:n]...)
		}
		if !strings.Contains(string(seen), "to-the-terminal") {
			return fmt.Errorf("the terminal shows %q, want the write made after the loss", seen)
		}
		return nil
	})
	for _, p := range []string{filepath.Join(w.leased, "new.txt"), mine} {
		if _, ok := findEvent(audit.all(), func(ev lease.AuditEvent) bool {
			return ev.Reason == lease.ReasonLeaseLost && strings.Contains(ev.Message, p)
		}); !ok {
			t.Errorf("no lease-lost audit event naming %s among %+v", p, audit.all())
		}
	}
}

// TestLostLeaseOpenat2: after the loss a read-only openat2 answers ENOSYS
// (callers fall back to openat, which reads without a round trip); a
// write-open with openat2 works in the temp dir and on /dev/null and is
// refused in the lease.
func TestLostLeaseOpenat2(t *testing.T) {
	t.Parallel()
	helper := guardHelper(t)
	w := newWorktree(t)
	gate := &testGate{}
	gate.lost.Store(true)
	audit := &memAuditor{}
	script := helper + ` openat2 "$TMPDIR/new" /dev/null "$LEASED/mine.txt"`
	cmd := exec.Command("/bin/sh", "-c", script)
	cmd.Env = append(os.Environ(), "LEASED="+w.leased)
	r := runGuardedAudit(t, w.policy(), gate, audit, cmd)
	if want := "ro=function not implemented rw=ok ro=function not implemented rw=ok ro=function not implemented rw=EACCES"; r.out != want {
		t.Errorf("openat2 after the loss: %q, want %q", r.out, want)
	}
	if b, _ := os.ReadFile(filepath.Join(w.leased, "mine.txt")); string(b) != "data" {
		t.Errorf("leased file = %q, want it untouched", b)
	}
}
