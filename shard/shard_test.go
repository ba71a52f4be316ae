package shard

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func TestMain(m *testing.M) { testutil.Main(m) }

// newShard makes a repository of files files and creates shard-1 of it
// at its base for the attempt att; it returns the checkout, the base and
// the shard.
func newShard(t *testing.T, files int, att string) (co, base string, w *Worktree) {
	t.Helper()
	co = newRepo(t, files)
	base = mustGit(t, co, "rev-parse", "HEAD")
	w = &Worktree{Checkout: co, Dir: co + ".shards", ID: "shard-1", Path: co + ".shards/shard-1", Branch: "fenceline/shard-1"}
	if _, err := w.Create(context.Background(), base, att); err != nil {
		t.Fatal(err)
	}
	return co, base, w
}

// newRepo makes a checkout with a few files in one commit.
func newRepo(t testing.TB, files int) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "payments")
	for i := range files {
		p := filepath.Join(dir, fmt.Sprintf("d%03d", i/100), fmt.Sprintf("f%05d.txt", i))
		os.MkdirAll(filepath.Dir(p), 0o755)
		if err := os.WriteFile(p, []byte(fmt.Sprintf("file %d\n", i)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	os.WriteFile(filepath.Join(dir, ".gitignore"), []byte("*.o\n"), 0o644)
	mustGit(t, dir, "init", "-q", "-b", "main")
	mustGit(t, dir, "add", "-A")
	mustGit(t, dir, "commit", "-q", "-m", "seed")
	return dir
}

func mustGit(t testing.TB, dir string, args ...string) string {
	t.Helper()
	out, err := git(context.Background(), dir, nil, args...)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(out)
}

// The lease bus's implementations of what the store consumes.
var (
	_ Records       = (*leasebus.ShardRecords)(nil)
	_ lease.Auditor = (*leasebus.Auditor)(nil)
	_ lease.View    = (*leasebus.Client)(nil)
)

// openStore opens a store as an operator: it declares pools, and places
// and settles attempts as runners (holders) do.
func openStore(t testing.TB, b *bustest.Bus) *Store {
	t.Helper()
	nc := b.ConnectAs(t, leasebus.RoleOperator)
	audit, err := leasebus.NewAuditor(nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := Open(leasebus.NewShardRecords(nc), Config{Audit: audit, Admin: true})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// holderStore opens a store as the runner b.Acquire's leases belong to
// (b.Client's identity): its writes are bound to those leases.
func holderStore(t testing.TB, b *bustest.Bus) *Store {
	t.Helper()
	st, err := Open(leasebus.NewShardRecords(b.Client.Conn()), Config{Audit: b.Auditor})
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func declare(t testing.TB, st *Store, co string, size, sharers int) *Pool {
	t.Helper()
	p, err := st.Declare(context.Background(), Spec{Repo: co, Checkout: co, Size: size, MaxSharers: sharers}, nil)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestPoolDeclareResize: a pool is declared, grows, and shrinks only below
// shards no active lease occupies; no pool is ErrNoPool.
func TestPoolDeclareResize(t *testing.T) {
	t.Parallel()
	b := bustest.Start(t)
	st := openStore(t, b)
	ctx := context.Background()
	co := newRepo(t, 3)
	if _, err := st.Pool(ctx, co); !errors.Is(err, ErrNoPool) {
		t.Fatalf("Pool before any declare: %v, want ErrNoPool", err)
	}
	p := declare(t, st, co, 2, 3)
	if got := strings.Join(p.ShardIDs(), ","); got != "shard-1,shard-2" || p.Dir != co+".shards" || p.Shards[1].Branch != "fenceline/shard-2" || p.Shards[0].State != StateAbsent {
		t.Fatalf("declared %+v", p)
	}
	if _, err := st.Pool(ctx, co+"-other"); !errors.Is(err, ErrNoPool) {
		t.Fatalf("Pool of another repo: %v, want ErrNoPool", err)
	}
	p = declare(t, st, co, 4, 3)
	if len(p.Shards) != 4 || p.Size != 4 {
		t.Fatalf("grown: %+v", p)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "in"), WorkspaceID: "shard-3", TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	_, err := st.Declare(ctx, Spec{Repo: co, Checkout: co, Size: 2}, b.Client)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), l.Record.LeaseID) || !strings.Contains(err.Error(), "shard-3") {
		t.Fatalf("shrink below an occupied shard: %v, want ErrInUse naming %s in shard-3", err, l.Record.LeaseID)
	}
	if p, err = st.Declare(ctx, Spec{Repo: co, Checkout: co, Size: 3}, b.Client); err != nil || p.Size != 3 {
		t.Fatalf("shrink to keep shard-3: %+v, %v", p, err)
	}
	if err := (&Spec{Repo: co, Checkout: "rel", Size: 1}).Validate(); err == nil {
		t.Error("a relative checkout validated")
	}
	if err := (&Spec{Repo: co, Checkout: co, Size: 0}).Validate(); err == nil {
		t.Error("size 0 validated")
	}
}

// TestPoolCASNoLostUpdates: concurrent changes of one pool record each
// land once (compare-and-swap with retries).
func TestPoolCASNoLostUpdates(t *testing.T) {
	t.Parallel()
	b := bustest.Start(t)
	st := openStore(t, b)
	co := newRepo(t, 1)
	declare(t, st, co, 2, 0)
	const n = 20
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Go(func() {
			_, err := st.UpdatePool(context.Background(), co, false, func(p *Pool) error {
				p.MaxSharers++
				return nil
			})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	p, err := st.Pool(context.Background(), co)
	if err != nil || p.MaxSharers != n {
		t.Fatalf("after %d concurrent increments: %+v, %v", n, p, err)
	}
}

// TestCleanKeepsWork: cleaning returns a shard to base and keeps its
// branch's commits, a detached HEAD's and its uncommitted files as refs.
func TestCleanKeepsWork(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	co, base, w := newShard(t, 5, "att_a")
	if err := w.Ready(ctx, base); err != nil {
		t.Fatalf("fresh shard not ready: %v", err)
	}
	os.WriteFile(filepath.Join(w.Path, "d000", "f00000.txt"), []byte("changed\n"), 0o644)
	mustGit(t, w.Path, "commit", "-q", "-am", "work")
	work := mustGit(t, w.Path, "rev-parse", "HEAD")
	os.WriteFile(filepath.Join(w.Path, "untracked.txt"), []byte("new\n"), 0o644)
	os.WriteFile(filepath.Join(w.Path, "d000", "f00001.txt"), []byte("edited\n"), 0o644)
	os.WriteFile(filepath.Join(w.Path, "build.o"), []byte("ignored\n"), 0o644)
	if err := w.Ready(ctx, base); err == nil {
		t.Fatal("a shard with a new commit is ready")
	}
	kept, err := w.Clean(ctx, base, "att_a")
	if err != nil {
		t.Fatal(err)
	}
	if want := "refs/fenceline/attempts/att_a-worktree refs/fenceline/attempts/att_a"; strings.Join(kept, " ") != want {
		t.Fatalf("kept %v, want %s", kept, want)
	}
	if got := mustGit(t, co, "rev-parse", "refs/fenceline/attempts/att_a"); got != work {
		t.Errorf("kept commit %s, want %s", got, work)
	}
	if got := mustGit(t, co, "show", "refs/fenceline/attempts/att_a-worktree:untracked.txt"); got != "new" {
		t.Errorf("kept untracked file: %q", got)
	}
	if got := mustGit(t, co, "show", "refs/fenceline/attempts/att_a-worktree:d000/f00001.txt"); got != "edited" {
		t.Errorf("kept edit: %q", got)
	}
	if err := w.Ready(ctx, base); err != nil {
		t.Fatalf("cleaned shard not ready: %v", err)
	}
	for _, f := range []string{"untracked.txt", "build.o"} {
		if _, err := os.Stat(filepath.Join(w.Path, f)); err == nil {
			t.Errorf("%s survived the cleaning", f)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(w.Path, "d000", "f00000.txt")); string(b) != "file 0\n" {
		t.Errorf("f00000 = %q after cleaning", b)
	}
	// Nothing to keep: a second cleaning keeps nothing.
	if kept, err := w.Clean(ctx, base, "att_b"); err != nil || len(kept) != 0 {
		t.Fatalf("clean of a clean shard: kept %v, %v", kept, err)
	}
	// A detached HEAD with a commit is kept too.
	mustGit(t, w.Path, "checkout", "-q", "--detach")
	mustGit(t, w.Path, "commit", "-q", "--allow-empty", "-m", "detached")
	detached := mustGit(t, w.Path, "rev-parse", "HEAD")
	if kept, err := w.Clean(ctx, base, "att_c"); err != nil || len(kept) != 1 || kept[0] != "refs/fenceline/attempts/att_c-head" {
		t.Fatalf("clean of a detached HEAD: kept %v, %v", kept, err)
	}
	if got := mustGit(t, co, "rev-parse", "refs/fenceline/attempts/att_c-head"); got != detached {
		t.Errorf("kept detached %s, want %s", got, detached)
	}
	if got := mustGit(t, w.Path, "symbolic-ref", "HEAD"); got != "refs/heads/fenceline/shard-1" {
		t.Errorf("HEAD after cleaning: %s", got)
	}
}

// TestPlaceSharersCreateOnce: attempts placed on an absent shard at once
// create its worktree once (flock), each attempt is written running with
// its lease, and the shard is dirty; settling records the exit.
func TestPlaceSharersCreateOnce(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 50, 1, 0)
	ctx := context.Background()
	const n = 4
	var wg sync.WaitGroup
	places := make([]*Placement, n)
	errs := make([]error, n)
	for i := range n {
		l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, fmt.Sprintf("d%03d", i)), WorkspaceID: "shard-1", TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
		wg.Go(func() {
			places[i], errs[i] = st.Place(ctx, pool, *l.Record, ModeShared, Attempt{AttemptID: lease.NewAttemptID(), AgentID: fmt.Sprint("agent-", i), Command: []string{"true"}}, l)
		})
	}
	wg.Wait()
	created := 0
	for i, p := range places {
		if errs[i] != nil {
			t.Fatal(errs[i])
		}
		if p.Created {
			created++
		}
		if p.Attempt.Status != StatusRunning || len(p.Attempt.Leases) != 1 || p.Attempt.Shard != "shard-1" {
			t.Errorf("attempt %+v", p.Attempt)
		}
	}
	if created != 1 {
		t.Fatalf("%d placements created the worktree, want 1", created)
	}
	p, _ := st.Pool(ctx, co)
	if p.Shards[0].State != StateDirty {
		t.Errorf("shard with sharers is %s, want dirty", p.Shards[0].State)
	}
	if err := places[0].Settle(ctx, StatusFailed, 7); err != nil {
		t.Fatal(err)
	}
	a, err := st.Attempt(ctx, co, places[0].Attempt.AttemptID)
	if err != nil || a.Status != StatusFailed || a.ExitCode == nil || *a.ExitCode != 7 || a.SettledAt.IsZero() {
		t.Fatalf("settled attempt %+v, %v", a, err)
	}
	if atts, err := st.Attempts(ctx, co); err != nil || len(atts) != n {
		t.Fatalf("attempts: %d, %v", len(atts), err)
	}
}

// TestRecoverCrashedAttempt: a running attempt whose lease ended becomes
// unknown, its shard dirty, with an audit event; one whose lease is
// active is left alone; a runner's late settle still records its exit.
func TestRecoverCrashedAttempt(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 2, 0)
	ctx := context.Background()
	live := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	dead := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-2", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pl, err := st.Place(ctx, pool, *live.Record, ModeExclusive, Attempt{AttemptID: lease.NewAttemptID(), Command: []string{"live"}}, live)
	if err != nil {
		t.Fatal(err)
	}
	pd, err := st.Place(ctx, pool, *dead.Record, ModeExclusive, Attempt{AttemptID: lease.NewAttemptID(), AgentID: "crasher", Command: []string{"crash"}}, dead)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Operator.Revoke(ctx, dead.Record.LeaseID, "runner crashed"); err != nil {
		t.Fatal(err)
	}
	rec, err := st.Recover(ctx, co, b.Client, false)
	if err != nil {
		t.Fatal(err)
	}
	if len(rec) != 1 || rec[0].AttemptID != pd.Attempt.AttemptID || rec[0].Status != StatusUnknown {
		t.Fatalf("recovered %+v, want only %s, unknown", rec, pd.Attempt.AttemptID)
	}
	if a, _ := st.Attempt(ctx, co, pl.Attempt.AttemptID); a.Status != StatusRunning {
		t.Errorf("the live attempt is %s", a.Status)
	}
	p, _ := st.Pool(ctx, co)
	if sh := p.Shard("shard-2"); sh.State != StateDirty || len(sh.Running) != 0 {
		t.Errorf("shard-2 after recovery: %+v, want dirty with nothing running", sh)
	}
	if sh := p.Shard("shard-1"); len(sh.Running) != 1 || sh.Running[0] != pl.Attempt.AttemptID {
		t.Errorf("shard-1 after recovery: %+v, want the live attempt running", sh)
	}
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.Conn, co, 0)
		if err != nil {
			return err
		}
		for _, ev := range evs {
			if ev.Boundary == BoundaryShard && ev.Type == EventRecovered && ev.Owner.AttemptID == pd.Attempt.AttemptID && ev.LeaseID == dead.Record.LeaseID {
				return nil
			}
		}
		return errors.New("no recovered event")
	})
	if again, err := st.Recover(ctx, co, b.Client, false); err != nil || len(again) != 0 {
		t.Fatalf("second recovery: %v, %v", again, err)
	}
	// A runner that died after writing its attempt but before placing it:
	// only the full scan (shard list) sees it.
	orphan, err := st.Begin(ctx, Attempt{AttemptID: lease.NewAttemptID(), Repo: co, Leases: []string{dead.Record.LeaseID}, Command: []string{"orphan"}})
	if err != nil {
		t.Fatal(err)
	}
	if rec, err := st.Recover(ctx, co, b.Client, false); err != nil || len(rec) != 0 {
		t.Fatalf("index recovery found %v, %v; want nothing (not placed)", rec, err)
	}
	if rec, err := st.Recover(ctx, co, b.Client, true); err != nil || len(rec) != 1 || rec[0].AttemptID != orphan.AttemptID {
		t.Fatalf("full recovery: %v, %v; want %s", rec, err, orphan.AttemptID)
	}
	if err := pd.Settle(ctx, StatusSucceeded, 0); err != nil {
		t.Fatal(err)
	}
	if a, _ := st.Attempt(ctx, co, pd.Attempt.AttemptID); a.Status != StatusSucceeded || !strings.Contains(a.Note, "unknown") {
		t.Errorf("late settle: %+v", a)
	}
}

// TestExclusivePlacementCleans: an exclusive attempt on a dirty shard
// finds it cleaned (the leftovers kept), and CleanAfter returns it clean.
func TestExclusivePlacementCleans(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 10, 1, 0)
	ctx := context.Background()
	shared := b.Acquire(t, leasebus.AcquireRequest{Repo: co, Scope: bustest.Claim(t, "d000"), WorkspaceID: "shard-1", TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	ps, err := st.Place(ctx, pool, *shared.Record, ModeShared, Attempt{AttemptID: "att_shared1", Command: []string{"edit"}}, shared)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(ps.Worktree.Path, "d000", "new.txt"), []byte("agent work\n"), 0o644)
	ps.Settle(ctx, StatusSucceeded, 0)
	if err := shared.Close(ctx); err != nil {
		t.Fatal(err)
	}
	ex := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pe, err := st.Place(ctx, pool, *ex.Record, ModeExclusive, Attempt{AttemptID: "att_excl1", Command: []string{"build"}}, ex)
	if err != nil {
		t.Fatal(err)
	}
	if !pe.Cleaned || len(pe.Kept) != 1 || pe.Kept[0] != "refs/fenceline/attempts/att_shared1-worktree" {
		t.Fatalf("exclusive placement: cleaned %v, kept %v", pe.Cleaned, pe.Kept)
	}
	if _, err := os.Stat(filepath.Join(pe.Worktree.Path, "d000", "new.txt")); err == nil {
		t.Fatal("the exclusive attempt sees the shared attempt's file")
	}
	os.WriteFile(filepath.Join(pe.Worktree.Path, "junk"), nil, 0o644)
	pe.Settle(ctx, StatusSucceeded, 0)
	kept, err := pe.CleanAfter(ctx)
	if err != nil || len(kept) != 1 {
		t.Fatalf("clean after: %v, %v", kept, err)
	}
	p, _ := st.Pool(ctx, co)
	if sh := p.Shard("shard-1"); sh.State != StateClean || sh.CleanedAt.IsZero() {
		t.Fatalf("shard after the exclusive attempt: %+v", sh)
	}
	// Warm: the next exclusive placement neither creates nor cleans.
	if err := ex.Close(ctx); err != nil {
		t.Fatal(err)
	}
	ex2 := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pw, err := st.Place(ctx, pool, *ex2.Record, ModeExclusive, Attempt{AttemptID: "att_excl2", Command: []string{"build"}}, ex2)
	if err != nil || pw.Cleaned || pw.Created {
		t.Fatalf("warm placement: %+v, %v", pw, err)
	}
	testutil.CheckFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := leasebus.ReadAudit(ctx, b.Conn, co, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Boundary == BoundaryShard && ev.Type == EventCleaned && strings.Contains(ev.Message, "kept as refs/fenceline/attempts/") {
				n++
			}
		}
		if n < 2 {
			return fmt.Errorf("%d cleaned events keeping work, want 2", n)
		}
		return nil
	})
}

// A runner that stalled until its lease was lost does not touch the shard:
// Place asks the lease under the shard's flock before creating or cleaning,
// and settles the attempt failed.
func TestPlaceRefusedWithoutLease(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 1, 0)
	ctx := context.Background()
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	if _, err := b.Operator.Revoke(ctx, l.Record.LeaseID, "the runner stalled"); err != nil {
		t.Fatal(err)
	}
	testutil.CheckFor(t, 5*time.Second, 5*time.Millisecond, func() error {
		if _, err := l.Fence(); err == nil {
			return errors.New("the holder has not seen the revoke yet")
		}
		return nil
	})
	att := Attempt{AttemptID: lease.NewAttemptID(), Command: []string{"stalled"}}
	if _, err := st.Place(ctx, pool, *l.Record, ModeExclusive, att, l); err == nil || !strings.Contains(err.Error(), "not prepared: the lease is not held") {
		t.Fatalf("Place with a lost lease: %v, want refused", err)
	}
	wt, err := pool.Worktree("shard-1")
	if err != nil {
		t.Fatal(err)
	}
	if wt.Exists() {
		t.Error("the worktree was created under a lost lease")
	}
	if a, err := st.Attempt(ctx, co, att.AttemptID); err != nil || a.Status != StatusFailed {
		t.Errorf("attempt after a refused placement: %+v, %v; want failed", a, err)
	}
}

// An agent that deletes its shard's .git (or points it at the checkout's)
// does not get its files deleted by the next cleaning: the directory is
// moved aside and named as kept.
func TestCleanMovesAsideAWorktreeWithoutGit(t *testing.T) {
	t.Parallel()
	b, st, co, pool := poolFixture(t, 3, 1, 0)
	ctx := context.Background()
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co, WorkspaceID: "shard-1", WorkspaceMode: lease.WorkspaceExclusive, TTL: lease.Duration(time.Minute)}, leasebus.HoldOptions{})
	pl, err := st.Place(ctx, pool, *l.Record, ModeExclusive, Attempt{AttemptID: "att_nogit", Command: []string{"rm .git"}}, l)
	if err != nil {
		t.Fatal(err)
	}
	// The .git goes, and in its place a .git file pointing at the
	// checkout's git dir: cleaning must not take it for the shard's.
	if err := os.RemoveAll(filepath.Join(pl.Worktree.Path, ".git")); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pl.Worktree.Path, ".git"), []byte("gitdir: "+filepath.Join(co, ".git")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(pl.Worktree.Path, "work.txt"), []byte("precious\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := pl.Settle(ctx, StatusSucceeded, 0); err != nil {
		t.Fatal(err)
	}
	kept, err := pl.CleanAfter(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var aside string
	for _, k := range kept {
		if strings.Contains(k, ".orphan-") {
			aside = k
		}
	}
	if got, err := os.ReadFile(filepath.Join(aside, "work.txt")); aside == "" || err != nil || string(got) != "precious\n" {
		t.Fatalf("kept %v: the agent's file is not in a moved-aside directory (%v)", kept, err)
	}
	if !pl.Worktree.Exists() {
		t.Error("the shard has no worktree after cleaning")
	}
}

// poolFixture starts a bus and a store, and declares a pool of size shards
// over a new repository of files files.
func poolFixture(t *testing.T, files, size, maxSharers int) (*bustest.Bus, *Store, string, *Pool) {
	t.Helper()
	b := bustest.Start(t)
	co := newRepo(t, files)
	pool := declare(t, openStore(t, b), co, size, maxSharers)
	return b, holderStore(t, b), co, pool
}

// The bus's permission table names this package's buckets: a renamed
// bucket would lock runners out of reading it, or the service out of
// writing it; and no role but the service writes it.
func TestBucketsInThePermissionTable(t *testing.T) {
	for _, role := range []leasebus.Role{leasebus.RoleHolder, leasebus.RoleOperator, leasebus.RoleViewer, leasebus.RoleService} {
		g, err := leasebus.GrantOf(role, leasebus.IdentityToken)
		if err != nil {
			t.Fatal(err)
		}
		for _, b := range []string{PoolBucket, AttemptBucket} {
			if role != leasebus.RoleService && !slices.Contains(g.Publish, leasebus.FleetJSAPI+".STREAM.INFO.KV_"+b) {
				t.Errorf("%s may not read %s", role, b)
			}
			if w := slices.Contains(g.Publish, "$KV."+b+".>"); w != (role == leasebus.RoleService) {
				t.Errorf("%s may write %s: %v, want %v", role, b, w, role == leasebus.RoleService)
			}
		}
	}
}

// TestCleanKeepsARacyEdit: an edit of the same size made in the same tick
// as the index was written ("racily clean" to git) is kept too. The clock
// is set, not waited for: the file and the index get the mtime the index
// entry recorded, as when the agent edits right after committing.
func TestCleanKeepsARacyEdit(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	co, base, w := newShard(t, 3, "att_r")
	f := filepath.Join(w.Path, "d000", "f00001.txt")
	fi, err := os.Stat(f)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(f, []byte("edited\n"), 0o644); err != nil { // "file 1\n": the same size
		t.Fatal(err)
	}
	index := filepath.Join(mustGit(t, w.Path, "rev-parse", "--absolute-git-dir"), "index")
	for _, p := range []string{f, index} {
		if err := os.Chtimes(p, fi.ModTime(), fi.ModTime()); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Clean(ctx, base, "att_r"); err != nil {
		t.Fatal(err)
	}
	if got := mustGit(t, co, "show", "refs/fenceline/attempts/att_r-worktree:d000/f00001.txt"); got != "edited" {
		t.Errorf("kept edit: %q, want \"edited\"", got)
	}
}
