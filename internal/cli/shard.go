package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/attempt"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/shard"
)

func (a *app) shardCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "shard",
		Short: "Declare and inspect a repo's pool of worktree shards; commit in a shard",
		Long: `A shard pool gives a repository N git worktrees ("shards") that agents'
attempts are placed in. With a pool declared, "fenceline run --checkout PATH"
works in a shard instead of the checkout: an exclusive attempt (no claim
flags) gets a whole empty shard, cleaned before and after it; path leases
(--scope) share a shard with disjoint claims, up to --max-sharers. Shards
are repositories of their own (the checkout's objects borrowed read-only
as alternates; their own refs, config and hooks), created by the first
attempt placed in them, on the branch fenceline/shard-N. An attempt's
git dir writes stay in its shard; cleaning keeps its work in the
checkout as refs/fenceline/attempts/<attemptId>.`,
		Args: groupArgs,
		RunE: showHelp,
	}
	c.AddCommand(a.shardPoolCommand(), a.shardListCommand(), a.shardCommitCommand())
	return c
}

func (a *app) shardPoolCommand() *cobra.Command {
	var (
		checkout, repo, dir string
		size, maxSharers    int
		replicas            int
	)
	c := &cobra.Command{
		Use:   "pool --checkout PATH --size N [--max-sharers K] [--dir DIR]",
		Short: "Declare a repo's shard pool, or resize it",
		Long: `Declare (or resize) the shard pool of the checkout at PATH, on the bus.
Shards live in DIR (default <checkout>.shards next to the checkout) and are
created lazily. A pool never shrinks below a shard an active lease occupies
(exit 3 naming who); a dropped shard's worktree stays on disk, and growing
again adopts it (dirty: cleaned before an exclusive attempt uses it).`,
		Example: `  fenceline shard pool --checkout . --size 4 --max-sharers 3`,
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			if strings.TrimSpace(checkout) == "" && strings.TrimSpace(repo) == "" {
				return usagef("--checkout is required: the local checkout, e.g. --checkout .")
			}
			if size < 1 {
				return usagef("--size %d: want at least 1 shard", size)
			}
			if maxSharers < 0 {
				return usagef("--max-sharers %d is negative (0: no bound)", maxSharers)
			}
			co, err := localCheckout(ctx, checkout, repo)
			if err != nil {
				return err
			}
			if len(co.GitDirs) == 0 {
				return usagef("%s is not a git checkout: shards are git worktrees", co.Root)
			}
			if dir != "" {
				if dir, err = filepath.Abs(dir); err != nil {
					return usagef("--dir: %v", err)
				}
			}
			s, err := a.dial(leasebus.RoleOperator)
			if err != nil {
				return err
			}
			defer s.Close()
			st, err := shard.Open(leasebus.NewShardRecords(s.nc), shard.Config{})
			if err != nil {
				return &usageError{err: err}
			}
			p, err := st.Declare(ctx, shard.Spec{Repo: co.Repo, Checkout: co.Root, Dir: dir, Size: size, MaxSharers: maxSharers}, s.client)
			if errors.Is(err, shard.ErrInUse) {
				return &exitError{code: ExitConflict, err: err}
			}
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "pool declared: %s\ncheckout: %s\nshards: %d in %s\nmax sharers: %s\n", p.Repo, p.Checkout, p.Size, p.Dir, sharersText(p.MaxSharers))
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&checkout, "checkout", "", "local checkout the pool is for (default --repo, when it is one)")
	f.StringVar(&repo, "repo", "", repoWithCheckoutUsage)
	f.IntVar(&size, "size", 0, "number of shards (required)")
	f.IntVar(&maxSharers, "max-sharers", 0, "most path leases sharing one shard (0: no bound)")
	f.StringVar(&dir, "dir", "", "where the shards live (default <checkout>.shards next to it)")
	f.IntVar(&replicas, "replicas", 1, "ignored: the bus's lease service makes the shard and attempt buckets, with its own --replicas")
	_ = f.MarkHidden("replicas") // kept so that scripts passing it still run
	return c
}

func sharersText(n int) string {
	if n == 0 {
		return "no bound"
	}
	return fmt.Sprint(n)
}

func (a *app) shardListCommand() *cobra.Command {
	var (
		repo   string
		asJSON bool
		recent int
	)
	c := &cobra.Command{
		Use:   "list [--repo R] [--json]",
		Short: "Show pools: shards with their state and occupants, and attempts",
		Long: `Show each pool (or the pool of --repo): its shards with state (absent,
clean, dirty) and occupants (the active leases of that shard, from the
bus), and its attempts. Attempts still "running" whose leases ended (their
runner crashed) are marked unknown and their shards dirty first, with an
audit event.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			var repoID string
			if repo != "" {
				id, err := resolveRepoFlag(ctx, repo)
				if err != nil {
					return err
				}
				repoID = id
			}
			s, err := a.dial(leasebus.RoleHolder)
			if err != nil {
				return err
			}
			defer s.Close()
			audit, err := leasebus.NewAuditor(s.nc)
			if err != nil {
				return err
			}
			st, err := shard.Open(leasebus.NewShardRecords(s.nc), shard.Config{Audit: audit})
			if err != nil {
				return err
			}
			var pools []*shard.Pool
			if repoID != "" {
				p, err := st.Pool(ctx, repoID)
				if errors.Is(err, shard.ErrNoPool) {
					return fmt.Errorf("no shard pool is declared for %s: declare one with \"fenceline shard pool --checkout PATH --size N\"", repoID)
				}
				if err != nil {
					return err
				}
				pools = []*shard.Pool{p}
			} else if pools, err = st.Pools(ctx); err != nil {
				return err
			}
			var views []*shard.View
			for _, p := range pools {
				v, err := st.View(ctx, p, s.client, recent)
				if err != nil {
					return err
				}
				views = append(views, v)
			}
			return writeList(a.stdout, views, asJSON, "no shard pools declared", printPools)
		},
	}
	c.Flags().StringVar(&repo, "repo", "", "only the pool of this repository: its identity, a remote URL or a local checkout")
	c.Flags().BoolVar(&asJSON, "json", false, "print the pools as JSON")
	c.Flags().IntVar(&recent, "attempts", 20, "show this many most recent attempts besides the running ones (0: all)")
	return c
}

// printPools prints pools as shard list shows them, a blank line apart.
func printPools(w io.Writer, vs []*shard.View) {
	for i, v := range vs {
		if i > 0 {
			fmt.Fprintln(w)
		}
		printPool(w, v)
	}
}

// printPool prints one pool as shard list shows it.
func printPool(w io.Writer, v *shard.View) {
	fmt.Fprintf(w, "pool %s: %d shards in %s (checkout %s, max sharers %s)\n", v.Repo, v.Size, v.Dir, v.Checkout, sharersText(v.MaxSharers))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  SHARD\tSTATE\tBRANCH\tLAST ATTEMPT\tOCCUPANTS")
	for _, sh := range v.Shards {
		var occ []string
		for _, l := range sh.Occupants {
			occ = append(occ, occupantText(l))
		}
		if len(occ) == 0 {
			occ = []string{"-"}
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\n", sh.ID, sh.State, sh.Branch, orDash(sh.LastAttempt), strings.Join(occ, "; "))
	}
	tw.Flush()
	for _, l := range v.Other {
		fmt.Fprintf(w, "  outside the shards: %s\n", occupantText(l))
	}
	if len(v.Attempts) == 0 {
		fmt.Fprintln(w, "attempts: none")
		return
	}
	fmt.Fprintln(w, "attempts:")
	tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  ATTEMPT\tSTATUS\tSHARD\tMODE\tAGENT\tSTARTED\tEXIT\tCOMMAND")
	for _, at := range v.Attempts {
		exit := "-"
		if at.ExitCode != nil {
			exit = fmt.Sprint(*at.ExitCode)
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", at.AttemptID, at.Status, at.Shard, at.Mode, at.AgentID,
			at.StartedAt.UTC().Format(time.RFC3339), exit, commandText(at.Command))
	}
	tw.Flush()
}

// commandText is a command line cut to fit a table row.
func commandText(argv []string) string {
	s := strings.Join(strings.Fields(strings.Join(argv, " ")), " ")
	if r := []rune(s); len(r) > 48 {
		return string(r[:47]) + "…"
	}
	return s
}

func occupantText(l *lease.Lease) string {
	return fmt.Sprintf("%s %s %s by %s, fence %d, expires %s", l.LeaseID, l.WorkspaceMode, l.Scope, l.Owner.AgentID, l.Fence, l.ExpiresAt.UTC().Format(time.RFC3339))
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func (a *app) shardCommitCommand() *cobra.Command {
	var (
		rf                    runFlags
		serialized, exclusive bool
	)
	c := &cobra.Command{
		Use:   "commit --checkout PATH --shard ID (--serialized | --exclusive) -- CMD [ARGS...]",
		Short: "Run a coordinator's git command with a shard's commit capacity",
		Long: `Run CMD in a shard with the right to change the repository as a whole
(commit, stash, reset, ...), under the file-write guard like "fenceline run".

  --serialized  an exclusive lease claiming nothing on the workspace
                <shard>/commit: one commit at a time per shard, while the
                shard's path-leased attempts keep working. CMD may write the
                git dirs; the worktree's files are read-only to it.
  --exclusive   an exclusive lease on the shard itself: it waits (--wait)
                until the shard is empty; CMD writes everything.

The shard is not cleaned afterwards: what CMD commits stays on the shard's
branch (an exclusive attempt that later cleans the shard keeps it as
refs/fenceline/attempts/<attemptId>).`,
		Example: `  fenceline shard commit --checkout . --shard shard-1 --serialized -- git commit -am "agents' work"`,
		Args: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				return fmt.Errorf("%s needs the command to run after --, e.g. -- git commit -am msg", cmd.CommandPath())
			}
			return nil
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			switch {
			case serialized == exclusive:
				return usagef("give exactly one of --serialized (commit beside path leases) or --exclusive (the whole shard)")
			case rf.commitShard == "":
				return usagef("--shard is required: the shard to commit in, e.g. --shard shard-1 (see fenceline shard list)")
			case serialized:
				rf.commit = "serialized"
			default:
				rf.commit = "exclusive"
			}
			rf.lf.workspace = string(lease.WorkspaceExclusive)
			return a.runAgent(cmd.Context(), &rf, args)
		},
	}
	f := c.Flags()
	f.StringVar(&rf.checkout, "checkout", "", "local checkout whose pool holds the shard (default --repo, when it is one)")
	f.StringVar(&rf.lf.repo, "repo", "", repoWithCheckoutUsage)
	f.StringVar(&rf.commitShard, "shard", "", "shard to commit in, e.g. shard-1 (required)")
	f.BoolVar(&serialized, "serialized", false, "serialized commit capacity: git dirs writable, files read-only, beside path leases")
	f.BoolVar(&exclusive, "exclusive", false, "the whole shard: wait until it is empty, everything writable")
	f.DurationVar(&rf.lf.ttl, "ttl", leasebus.DefaultTTL, "how long the lease lives without a renewal")
	f.DurationVar(&rf.lf.wait, "wait", 0, "queue for the capacity up to this long (0: fail at once)")
	f.StringVar(&rf.lf.task, "task", "", "owner task id (default \"cli\")")
	f.StringVar(&rf.lf.agent, "agent", "", "owner agent id (default $USER@hostname)")
	f.BoolVar(&rf.allowUnguarded, "allow-unguarded", false, "run even when the kernel cannot confine file writes (no Landlock)")
	f.StringArrayVar(&rf.allowConnect, "allow-connect", nil, "TCP port CMD may connect to besides the sidecar's (repeatable)")
	f.StringArrayVar(&rf.allowWrite, "allow-write", nil, "existing path CMD may write besides what the capacity allows (repeatable)")
	registerPrivateState(f, &rf.privateState)
	f.StringVar(&rf.onLost, "on-lost", onLostKeep, "when the lease is lost: keep or signal")
	f.DurationVar(&rf.killGrace, "kill-grace", 10*time.Second, "how long CMD's processes have between SIGTERM and SIGKILL")
	rf.ff.register(c)
	f.SetInterspersed(false)
	return c
}

// findPool returns the pool a run works in: its repo's, unless it attaches
// to a lease or names a workspace outside the pool; nil without a pool.
// It first recovers the pool's crashed attempts.
func (a *app) findPool(ctx context.Context, s *session, rf *runFlags, co *attempt.Checkout) (*attempt.Pool, error) {
	if rf.attachID != "" {
		return nil, nil
	}
	audit, err := leasebus.NewAuditor(s.nc)
	if err != nil {
		return nil, err
	}
	st, err := shard.Open(leasebus.NewShardRecords(s.nc), shard.Config{Audit: audit})
	if err != nil {
		return nil, err
	}
	p, err := attempt.OpenPool(ctx, st, s.client, co.Repo, attempt.PoolUse{Commit: rf.commit, Shard: rf.commitShard, WorkspaceID: rf.lf.workspaceID, Checkout: co.Root})
	if errors.Is(err, shard.ErrNoPool) {
		return nil, usagef("no shard pool is declared for %s: declare one with \"fenceline shard pool --checkout %s --size N\"", co.Repo, co.Root)
	}
	return p, err
}

// holdPoolLease acquires the run's lease in one of the pool's shards (the
// lease service picks the first that fits), or the commit capacity of one.
func (a *app) holdPoolLease(ctx context.Context, s *session, rf *runFlags, pool *attempt.Pool) (*heldLease, error) {
	req, err := rf.lf.request()
	if err != nil {
		return nil, err
	}
	w := pool.Request(attempt.Workspace{ID: req.WorkspaceID, Candidates: req.Workspaces, MaxSharers: req.MaxSharers})
	req.WorkspaceID, req.Workspaces, req.MaxSharers = w.ID, w.Candidates, w.MaxSharers
	if req.Wait > 0 {
		what := fmt.Sprintf("a shard of the pool of %s (%d shards)", req.Repo, pool.Pool.Size)
		if req.WorkspaceID != "" {
			what = "workspace " + req.WorkspaceID
		}
		fmt.Fprintf(a.stderr, "fenceline: waiting up to %s for %s\n", time.Duration(req.Wait), what)
	}
	cred := leasebus.NewCredential()
	h, err := s.client.AcquireAndHold(ctx, req, cred, leasebus.HoldOptions{})
	if err != nil {
		var ce *lease.ConflictError
		if !errors.As(err, &ce) {
			return nil, fmt.Errorf("acquire %s in a shard of %s: %w", req.Scope, req.Repo, err)
		}
		if pool.Commits() {
			return nil, &conflictReport{ce: ce, claim: req.Scope, wait: time.Duration(req.Wait)}
		}
		active, _ := s.client.List(context.WithoutCancel(ctx), req.Repo, false)
		return nil, &poolConflict{ce: ce, pool: pool.Pool, req: req, active: active}
	}
	return &heldLease{holder: h, cred: cred}, nil
}

// poolConflict explains an attempt no shard could take: the pool's size
// and who holds each shard.
type poolConflict struct {
	ce     *lease.ConflictError
	pool   *shard.Pool
	req    leasebus.AcquireRequest
	active []*lease.Lease
}

func (e *poolConflict) Unwrap() error { return e.ce }

func (e *poolConflict) Error() string {
	var b strings.Builder
	mode := e.req.WorkspaceMode
	if mode == "" {
		mode = lease.WorkspaceShared
		if len(e.req.Scope.Paths) == 0 {
			mode = lease.WorkspaceExclusive
		}
	}
	fmt.Fprintf(&b, "no shard of the pool of %s can take this attempt (%s, %s workspace): pool size %d, max sharers %s",
		e.pool.Repo, e.req.Scope, mode, e.pool.Size, sharersText(e.pool.MaxSharers))
	if e.ce.Waited {
		fmt.Fprintf(&b, "; still so after --wait %s", time.Duration(e.req.Wait))
	}
	b.WriteString(":")
	named := map[string]bool{}
	for _, sh := range e.pool.Shards {
		fmt.Fprintf(&b, "\n  %s:", sh.ID)
		n := 0
		for _, c := range e.ce.Conflicts {
			if shard.WorkspaceShard(c.WorkspaceID) == sh.ID && c.LeaseID != "" {
				b.WriteString("\n    " + conflictText(c))
				named[c.LeaseID] = true
				n++
			}
		}
		for _, l := range e.active {
			if shard.WorkspaceShard(l.WorkspaceID) == sh.ID && !named[l.LeaseID] {
				b.WriteString("\n    " + occupantText(l))
				named[l.LeaseID] = true
				n++
			}
		}
		if n == 0 {
			b.WriteString(" empty")
		}
	}
	for _, c := range e.ce.Conflicts {
		if c.LeaseID == "" || !named[c.LeaseID] {
			b.WriteString("\n  also: " + conflictText(c))
		}
	}
	fmt.Fprintf(&b, "\nretry once one ends, queue with --wait DUR, or grow the pool with \"fenceline shard pool --checkout %s --size %d\"", e.pool.Checkout, e.pool.Size+1)
	return b.String()
}

// conflictText is one conflict on a line: who holds it until when, and
// why it conflicts.
func conflictText(c lease.Conflict) string {
	id := c.LeaseID
	if id == "" {
		id = "queued request " + c.RequestID
	}
	s := heldText(id, c)
	if c.Why != "" {
		s += ": " + c.Why
	}
	return s
}
