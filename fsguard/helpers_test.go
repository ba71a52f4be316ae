package fsguard

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// testGate is a gate the test flips; the kernel guard under it is real.
type testGate struct{ lost atomic.Bool }

func (g *testGate) Fence() (uint64, error) {
	if g.lost.Load() {
		return 0, lease.ErrLeaseLost
	}
	return 7, nil
}

// memAuditor keeps the events a Process records.
type memAuditor struct {
	mu     sync.Mutex
	events []lease.AuditEvent
}

func (a *memAuditor) Record(_ context.Context, ev lease.AuditEvent) error {
	a.mu.Lock()
	a.events = append(a.events, ev)
	a.mu.Unlock()
	return nil
}

func (a *memAuditor) all() []lease.AuditEvent {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([]lease.AuditEvent(nil), a.events...)
}

// worktree is a directory with a leased part, an unleased part and a file
// outside both.
type worktree struct {
	root, leased, other, outside string
}

func newWorktree(t testing.TB) worktree {
	t.Helper()
	dir := t.TempDir()
	if base := os.Getenv("FSGUARD_BENCH_DIR"); base != "" {
		// Benchmarks may run on another file system (tmpfs isolates the
		// guard's cost from disk noise).
		var err error
		if dir, err = os.MkdirTemp(base, "fsguard-bench-"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(dir) })
	}
	w := worktree{root: filepath.Join(dir, "wt"), outside: filepath.Join(dir, "outside")}
	w.leased = filepath.Join(w.root, "leased")
	w.other = filepath.Join(w.root, "other")
	for _, d := range []string{w.leased, w.other, w.outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, f := range []string{filepath.Join(w.leased, "mine.txt"), filepath.Join(w.other, "theirs.txt"), filepath.Join(w.outside, "secret.txt")} {
		if err := os.WriteFile(f, []byte("data"), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return w
}

func (w worktree) policy() Policy {
	return Policy{Root: w.root, Writable: []string{w.leased}, KillGrace: 2 * time.Second,
		Lease: lease.Lease{LeaseID: "lease_test1", Repo: "github.com/acme/payments", Fence: 7,
			Owner: lease.Owner{TaskID: "task-1", AgentID: "agent-1", AttemptID: "att-1"}, WorkspaceMode: lease.WorkspaceShared, WorkspaceID: "checkout"}}
}

type result struct {
	out  string
	code int
}

// runGuarded runs name args under the guard and returns its combined
// output and exit code once the whole tree is gone.
func runGuarded(t testing.TB, p Policy, gate Gate, dir string, name string, args ...string) result {
	t.Helper()
	return runAudited(t, p, gate, nil, dir, name, args...)
}

func sh(t testing.TB, p Policy, dir, script string) result {
	t.Helper()
	return runGuarded(t, p, &testGate{}, dir, "/bin/sh", "-c", script)
}

var (
	helperOnce sync.Once
	helperPath string
	helperErr  error
	helperDir  string
)

// guardHelper builds testdata/guardhelper with CGO_ENABLED=0: a static
// binary that makes its system calls itself (no libc to interpose on).
func guardHelper(t testing.TB) string {
	t.Helper()
	helperOnce.Do(func() {
		helperDir, helperErr = os.MkdirTemp("", "fsguard-helper-")
		if helperErr != nil {
			return
		}
		helperPath = filepath.Join(helperDir, "guardhelper")
		cmd := exec.Command("go", "build", "-o", helperPath, "./testdata/guardhelper")
		cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
		if out, err := cmd.CombinedOutput(); err != nil {
			helperErr = err
			helperPath = string(out)
		}
	})
	if helperErr != nil {
		t.Fatalf("build guardhelper: %v\n%s", helperErr, helperPath)
	}
	return helperPath
}

// runAudited runs name args in dir under the guard, records the attempt's
// denials in audit (nil: none) and returns its combined output and exit
// code once the whole tree is gone.
func runAudited(t testing.TB, p Policy, gate Gate, audit Auditor, dir, name string, args ...string) result {
	t.Helper()
	cmd := exec.Command(name, args...)
	cmd.Dir = dir
	return runGuardedAudit(t, p, gate, audit, cmd)
}

// runGuardedAudit runs cmd under the guard with audit and returns its
// output (stdout and stderr, unless cmd has its own) and exit code.
func runGuardedAudit(t testing.TB, p Policy, gate Gate, audit Auditor, cmd *exec.Cmd) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	var out bytes.Buffer
	if cmd.Stdout == nil {
		cmd.Stdout = &out
	}
	if cmd.Stderr == nil {
		cmd.Stderr = &out
	}
	pr, err := Start(ctx, p, gate, audit, cmd)
	if err != nil {
		t.Fatalf("start %s: %v", cmd.Path, err)
	}
	st, err := pr.Wait()
	if err != nil {
		t.Fatalf("wait %s: %v", cmd.Path, err)
	}
	return result{out: strings.TrimSpace(out.String()), code: st.ExitCode()}
}
