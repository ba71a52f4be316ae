package demo

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"time"

	"github.com/fenceline/fenceline/fsguard"
	"github.com/fenceline/fenceline/internal/gitsafe"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

var demoAcquiredRE = regexp.MustCompile(`lease (lease_[a-z0-9]+) acquired`)

// zombieStory is the file boundary's zombie: an agent, a real child
// process under the file-write guard, keeps running after its lease was
// revoked; its next write is refused by the kernel and audited, its reads
// go on.
func (d *demo) zombieStory(ctx context.Context, dir, url string) (err error) {
	d.section("10. A zombie at the file guard")
	if _, gerr := fsguard.Available(); gerr != nil {
		fmt.Fprintf(d.out, "(skipped: no Landlock on this kernel: %v)\n", gerr)
		return nil
	}
	s := &demoShards{demo: d, url: url, dir: filepath.Join(dir, "zombie"), ctl: filepath.Join(dir, "zombie", "ctl")}
	if err := os.MkdirAll(s.ctl, 0o755); err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer func() {
		s.stop("agent-zombie")
		if err != nil {
			cancel()
		}
		s.wg.Wait()
		cancel()
	}()
	s.co = filepath.Join(s.dir, "payments")
	if err := os.MkdirAll(filepath.Join(s.co, "notes"), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(s.co, "notes", "todo.md"), []byte("# todo\n"), 0o644); err != nil {
		return err
	}
	for _, args := range [][]string{{"init", "-q", "-b", "main"}, {"add", "-A"}, {"-c", "user.name=demo", "-c", "user.email=demo@localhost", "commit", "-q", "-m", "seed"}} {
		if _, err := (gitsafe.Git{Dir: s.co}).Output(ctx, args...); err != nil {
			return err
		}
	}
	script := fmt.Sprintf(`echo "draft" >> notes/todo.md
touch %[1]s/ready-agent-zombie
while [ ! -e %[1]s/stop-agent-zombie ]; do sleep 0.02; done
if echo "late" >> notes/todo.md 2>/dev/null; then echo "write=wrote"; else echo "write=refused"; fi
echo "read=$(grep -c . notes/todo.md)"`, s.ctl) // after the loss it reports on stdout: the control dir is not writable either
	fmt.Fprintf(d.out, "fenceline run --checkout %s --scope notes -- sh -c '...'   (agent-zombie writes notes/todo.md)\n", s.co)
	z := s.start(runCtx, "agent-zombie", "run", "--checkout", s.co, "--scope", "notes", "--", "sh", "-c", script)
	if err := s.awaitFile(ctx, z, "ready-agent-zombie"); err != nil {
		return err
	}
	m := demoAcquiredRE.FindStringSubmatch(z.errOut.String())
	if m == nil {
		return fail("agent-zombie's run should name its lease:\n%s", z.errOut.String())
	}
	id := m[1]
	fmt.Fprintf(d.out, "  agent-zombie holds %s and has written its draft; then it stalls (a paused VM, a long GC) ...\n", id)
	if _, err := d.op.Revoke(ctx, id, "demo: the agent stopped answering"); err != nil {
		return fail("revoke %s: %v", id, err)
	}
	if err := s.awaitText(ctx, z, "LEASE LOST"); err != nil {
		return err
	}
	fmt.Fprintf(d.out, "  the operator revokes %s; fenceline run sees it at once: every file write of the agent is refused from now on\n", id)
	s.stop("agent-zombie") // the zombie wakes up and writes
	if code, err := z.wait(ctx); err != nil || code != 0 {
		return fail("agent-zombie should exit 0 (it keeps running; --on-lost keep): exit %d, %v\n%s", code, err, z.errOut.String())
	}
	if got := strings.Fields(z.out.String()); strings.Join(got, " ") != "write=refused read=2" {
		return fail("agent-zombie's late write should be refused and its read of notes/todo.md (2 lines) go on; it said %q", got)
	}
	fmt.Fprintln(d.out, `  it wakes up: echo "late" >> notes/todo.md -> Permission denied (refused at the system call); reading the file still works`)
	deadline := time.Now().Add(5 * time.Second)
	for {
		evs, err := leasebus.ReadAudit(ctx, d.nc, "", 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Boundary == lease.BoundaryFile && ev.LeaseID == id && ev.Type == lease.EventDenied {
				fmt.Fprintf(d.out, "  audit: %s %s %s fence=%d: %s\n", ev.Type, ev.Boundary, ev.LeaseID, ev.Fence, ev.Message)
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fail("no audit event for agent-zombie's refused write")
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}
