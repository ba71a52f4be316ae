package shardbench

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
)

var files = flag.Int("files", 10000, "files in the benchmark repository (at least 10,000 for the published numbers)")

func TestMain(m *testing.M) { testutil.Main(m) }

// repo makes a checkout of n files (100 per directory) in one commit.
func repo(b *testing.B, n int) string {
	b.Helper()
	dir := filepath.Join(b.TempDir(), "big")
	for i := range n {
		p := filepath.Join(dir, fmt.Sprintf("pkg%03d", i/100), fmt.Sprintf("file%05d.go", i))
		if i%100 == 0 {
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				b.Fatal(err)
			}
		}
		if err := os.WriteFile(p, fmt.Appendf(nil, "package pkg\n\n// file %d\nvar V%d = %d\n", i, i, i), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	git(b, dir, "init", "-q", "-b", "main")
	git(b, dir, "add", "-A")
	git(b, dir, "-c", "user.name=bench", "-c", "user.email=bench@localhost", "commit", "-q", "-m", "seed")
	return dir
}

func git(b *testing.B, dir string, args ...string) string {
	b.Helper()
	out, err := exec.Command("git", append([]string{"-C", dir}, args...)...).CombinedOutput()
	if err != nil {
		b.Fatalf("git %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return strings.TrimSpace(string(out))
}

// BenchmarkShardHandOut hands out a shard of a 10,000-file repository:
// warm (an existing, clean shard: the path every exclusive attempt takes
// after the first) and fresh (git worktree add of a new worktree). The
// cleaning after each warm attempt and the removal after each fresh one
// are not timed.
func BenchmarkShardHandOut(b *testing.B) {
	co := repo(b, *files)
	base := git(b, co, "rev-parse", "HEAD")
	ctx := context.Background()

	b.Run("warm", func(b *testing.B) {
		bus := bustest.Start(b)
		op, err := shard.Open(leasebus.NewShardRecords(bus.ConnectAs(b, leasebus.RoleOperator)), shard.Config{}) // declares the pool
		if err != nil {
			b.Fatal(err)
		}
		if _, err := op.Declare(ctx, shard.Spec{Repo: co, Checkout: co, Size: 1}, nil); err != nil {
			b.Fatal(err)
		}
		// The runner: its records' writes are bound to the leases it holds.
		st, err := shard.Open(leasebus.NewShardRecords(bus.Client.Conn()), shard.Config{Audit: bus.Auditor})
		if err != nil {
			b.Fatal(err)
		}
		handOut := func() (*shard.Placement, *leasebus.Holder) {
			cred := leasebus.NewCredential()
			p, err := st.Pool(ctx, co) // the runner's record read
			if err != nil {
				b.Fatal(err)
			}
			h, err := bus.Client.AcquireAndHold(ctx, leasebus.AcquireRequest{
				Repo: co, Workspaces: p.ShardIDs(), WorkspaceMode: lease.WorkspaceExclusive,
				Owner: lease.Owner{TaskID: "bench", AgentID: "bench", AttemptID: lease.NewAttemptID()},
				TTL:   lease.Duration(time.Minute),
			}, cred, leasebus.HoldOptions{})
			if err != nil {
				b.Fatal(err)
			}
			l := h.Lease()
			pl, err := st.Place(ctx, p, l, shard.ModeExclusive, shard.Attempt{AttemptID: l.Owner.AttemptID, AgentID: "bench", Command: []string{"bench"}}, h)
			if err != nil {
				b.Fatal(err)
			}
			return pl, h
		}
		giveBack := func(pl *shard.Placement, h *leasebus.Holder) {
			if err := pl.Settle(ctx, shard.StatusSucceeded, 0); err != nil {
				b.Fatal(err)
			}
			if _, err := pl.CleanAfter(ctx); err != nil {
				b.Fatal(err)
			}
			if err := h.Close(ctx); err != nil {
				b.Fatal(err)
			}
		}
		giveBack(handOut()) // the first attempt creates the shard
		b.ResetTimer()
		for range b.N {
			pl, h := handOut()
			b.StopTimer()
			if pl.Created || pl.Cleaned {
				b.Fatalf("a warm hand-out created %v or cleaned %v the shard", pl.Created, pl.Cleaned)
			}
			giveBack(pl, h)
			b.StartTimer()
		}
	})

	b.Run("fresh", func(b *testing.B) {
		dir := b.TempDir()
		b.ResetTimer()
		for i := range b.N {
			path := filepath.Join(dir, fmt.Sprint("wt-", i))
			git(b, co, "worktree", "add", "-q", "-f", "-B", fmt.Sprint("bench/wt-", i), path, base)
			b.StopTimer()
			git(b, co, "worktree", "remove", "--force", path)
			git(b, co, "branch", "-q", "-D", fmt.Sprint("bench/wt-", i))
			b.StartTimer()
		}
	})
}
