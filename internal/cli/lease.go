package cli

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/url"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
)

func (a *app) leaseCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "lease",
		Short: "Acquire, renew, release, list, sweep, revoke and audit leases",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	c.AddCommand(a.acquireCommand(), a.renewCommand(), a.releaseCommand(), a.listCommand(),
		a.showCommand(), a.sweepCommand(), a.revokeCommand(), a.auditCommand())
	return c
}

func (a *app) acquireCommand() *cobra.Command {
	var (
		lf     leaseFlags
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "acquire --repo R (--scope PATH ... | --whole-repo | --workspace exclusive)",
		Short: "Acquire a lease on paths (or the whole repo) and tables of a repo",
		Long: `Acquire a lease and print it. The owner credential (a fresh secret; the bus
keeps only its hash) is stored in a file only you can read:
` + "$XDG_STATE_HOME/fenceline/leases/<leaseId>.json" + ` (mode 0600), which
"lease renew" and "lease release" read on this machine.

--scope alone leases paths in a shared workspace; --whole-repo claims every
path in an exclusive workspace; no claim at all is allowed only with
--workspace exclusive (an exclusive workspace claiming nothing repo-wide).

A refusal names each conflicting lease, its owner and when it expires
(exit 3). Invalid values (a --scope that is absolute or escapes the repo, a
bad --table, a --ttl out of range) are usage errors (exit 2).`,
		Args: cobra.NoArgs,
		Example: `  fenceline lease acquire --repo github.com/acme/payments --scope services/billing
  fenceline lease acquire --repo github.com/acme/payments --whole-repo --ttl 10m --json
  fenceline lease acquire --repo github.com/acme/payments --scope db --table public.users --wait 2m`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := lf.resolveRepo(cmd.Context()); err != nil {
				return err
			}
			req, err := lf.request()
			if err != nil {
				return err
			}
			s, err := a.dial(leasebus.RoleHolder)
			if err != nil {
				return err
			}
			defer s.Close()

			cred := leasebus.NewCredential()
			ctx := cmd.Context()
			l, err := s.client.Acquire(ctx, req, cred)
			if err != nil {
				var ce *lease.ConflictError
				if errors.As(err, &ce) {
					return &conflictReport{ce: ce, claim: req.Scope, wait: time.Duration(req.Wait)}
				}
				return fmt.Errorf("acquire %s in %s: %w", req.Scope, req.Repo, err)
			}
			path, err := a.writeCredFile(&credFile{LeaseID: l.LeaseID, Repo: l.Repo, Credential: cred, Version: l.Version, NATS: s.url})
			if err != nil {
				// Nobody could renew or release it: give it back now.
				rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
				_, rerr := s.client.Release(rctx, l.LeaseID, cred)
				cancel()
				if rerr != nil {
					return fmt.Errorf("%w (and releasing %s failed: %v; it expires in %s)", err, l.LeaseID, rerr, l.TTL)
				}
				return fmt.Errorf("%w (lease %s released again)", err, l.LeaseID)
			}
			if asJSON {
				return writeJSON(a.stdout, struct {
					*lease.Lease
					Credential     leasebus.Credential `json:"credential"`
					CredentialFile string              `json:"credentialFile"`
				}{l, cred, path})
			}
			w := a.stdout
			fmt.Fprintf(w, "lease acquired: %s\n", l.LeaseID)
			fmt.Fprintf(w, "repo: %s\n", l.Repo)
			fmt.Fprintf(w, "scope: %s\n", l.Scope)
			fmt.Fprintf(w, "workspace: %s (%s)\n", l.WorkspaceID, l.WorkspaceMode)
			fmt.Fprintf(w, "ttl: %s\n", l.TTL)
			fmt.Fprintf(w, "fence: %d\n", l.Fence)
			fmt.Fprintf(w, "expires: %s\n", l.ExpiresAt.UTC().Format(time.RFC3339))
			return nil
		},
	}
	f := c.Flags()
	lf.register(f, a.cfg.User)
	f.BoolVar(&asJSON, "json", false, "print the lease record with its credential as JSON")
	c.MarkFlagsMutuallyExclusive("scope", "whole-repo")
	return c
}

// leaseFlags are the flags that describe a lease to acquire, shared by
// lease acquire, sidecar and run.
type leaseFlags struct {
	repo, workspaceID, workspace string
	task, agent, attempt         string
	paths, tables                []string
	wholeRepo                    bool
	ttl, wait                    time.Duration
	user                         string // $USER, for the default --agent
}

// register adds the lease flags to f; user ($USER) names the default
// --agent.
func (lf *leaseFlags) register(f *pflag.FlagSet, user string) {
	lf.user = user
	f.StringVar(&lf.repo, "repo", "", "repository: its identity (github.com/acme/payments), a remote URL (https://…, git@host:org/repo, ssh://…) or a local checkout, all named by its normalized identity (required)")
	f.StringArrayVar(&lf.paths, "scope", nil, "repo-relative path to claim (repeatable)")
	f.BoolVar(&lf.wholeRepo, "whole-repo", false, "claim every path of the repo (exclusive workspace)")
	f.StringArrayVar(&lf.tables, "table", nil, "Postgres table to claim, schema.table or schema.* (repeatable)")
	f.StringVar(&lf.workspaceID, "workspace-id", "", "workspace (shard) the lease works in (default \""+lease.DefaultWorkspace+"\")")
	f.StringVar(&lf.workspace, "workspace", "", "workspace mode: shared or exclusive (default shared with --scope, else exclusive)")
	f.DurationVar(&lf.ttl, "ttl", leasebus.DefaultTTL, "how long the lease lives without a renewal")
	f.StringVar(&lf.task, "task", "", "owner task id (default \"cli\")")
	f.StringVar(&lf.agent, "agent", "", "owner agent id (default $USER@hostname)")
	f.StringVar(&lf.attempt, "attempt", "", "owner attempt id (default a fresh att_… id)")
	f.DurationVar(&lf.wait, "wait", 0, "queue behind conflicting leases up to this long (0: fail at once)")
}

// resolveRepo turns --repo into the repository's one identity (package
// repoid): a local checkout stands for its origin, every spelling of a
// remote for host/org/repo.
func (lf *leaseFlags) resolveRepo(ctx context.Context) error {
	r, err := resolveRepoFlag(ctx, lf.repo)
	if err != nil {
		return err
	}
	lf.repo = r
	return nil
}

// resolveRepoFlag is the identity of a repository named by a --repo flag
// ("" stays "").
func resolveRepoFlag(ctx context.Context, repo string) (string, error) {
	r, err := repoid.Resolve(ctx, repo)
	if err != nil {
		return "", usagef("--repo %s: %v", shownRepo(repo), err)
	}
	return r, nil
}

// shownRepo is a --repo value as a message may show it: a remote URL
// without its user and password (a token often rides there).
func shownRepo(repo string) string {
	if u, err := url.Parse(repo); err == nil && u.User != nil && u.Host != "" {
		u.User = nil
		return u.String()
	}
	return repo
}

// request checks the flags and builds the acquire request; bad values are
// usage errors naming the flag. The repo is normalized (without looking
// at the disk: resolveRepo does that first where a checkout may be named).
func (lf *leaseFlags) request() (leasebus.AcquireRequest, error) {
	var req leasebus.AcquireRequest
	if strings.TrimSpace(lf.repo) == "" {
		return req, usagef("--repo is required: name the repository, e.g. --repo github.com/acme/payments")
	}
	mode := lease.WorkspaceMode(lf.workspace)
	switch mode {
	case "", lease.WorkspaceShared, lease.WorkspaceExclusive:
	default:
		return req, usagef("--workspace %q: want shared or exclusive", lf.workspace)
	}
	if len(lf.paths) == 0 && !lf.wholeRepo && mode != lease.WorkspaceExclusive {
		return req, usagef("nothing claimed: give --scope PATH (repeatable) or --whole-repo, or --workspace exclusive to lease an exclusive workspace that claims no paths")
	}
	claim, err := scope.New(lf.paths, lf.wholeRepo, lf.tables)
	if err != nil {
		return req, &usageError{err: err}
	}
	if lf.ttl < leasebus.MinTTL || lf.ttl > leasebus.MaxTTL {
		return req, usagef("--ttl %s out of range: want %s to %s", lf.ttl, leasebus.MinTTL, leasebus.MaxTTL)
	}
	if lf.wait < 0 {
		return req, usagef("--wait %s is negative", lf.wait)
	}
	task, agent, attempt := lf.task, lf.agent, lf.attempt
	if task == "" {
		task = "cli"
	}
	if agent == "" {
		agent = leasebus.DefaultAgentID(lf.user)
	}
	if attempt == "" {
		attempt = lease.NewAttemptID()
	}
	return leasebus.AcquireRequest{
		Repo:          repoid.Normalize(lf.repo),
		Scope:         claim,
		WorkspaceID:   lf.workspaceID,
		WorkspaceMode: mode,
		Owner:         lease.Owner{TaskID: task, AgentID: agent, AttemptID: attempt},
		TTL:           lease.Duration(lf.ttl),
		Wait:          lease.Duration(lf.wait),
	}, nil
}

// conflictReport explains a refused acquire: each conflicting lease, its
// owner, its fence and when it expires, and what to do.
type conflictReport struct {
	ce    *lease.ConflictError
	claim scope.Claim
	wait  time.Duration
}

func (r *conflictReport) Unwrap() error { return r.ce }

func (r *conflictReport) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "cannot lease %s in %s: it conflicts with %d active lease(s)", r.claim, r.ce.Repo, len(r.ce.Conflicts)+r.ce.More)
	if r.ce.Waited {
		fmt.Fprintf(&b, ", still held after --wait %s", r.wait)
	}
	b.WriteString(":")
	for _, c := range r.ce.Conflicts {
		b.WriteString("\n  " + heldText(c.LeaseID, c))
		if c.Why != "" {
			fmt.Fprintf(&b, "\n    %s", c.Why)
		}
	}
	if r.ce.More > 0 {
		fmt.Fprintf(&b, "\n  and %d more", r.ce.More)
	}
	b.WriteString("\nretry once it ends, queue for it with --wait DUR, or have an operator end it with \"fenceline lease revoke LEASE_ID --reason TEXT\"")
	return b.String()
}

// heldText says who holds conflict c, named id, and until when: "ID held
// by OWNER[, fence N][, expires T (in Ns)]".
func heldText(id string, c lease.Conflict) string {
	s := fmt.Sprintf("%s held by %s", id, c.Owner)
	if c.Fence > 0 {
		s += fmt.Sprintf(", fence %d", c.Fence)
	}
	if !c.ExpiresAt.IsZero() {
		s += fmt.Sprintf(", expires %s (in %s)", c.ExpiresAt.UTC().Format(time.RFC3339), untilSeconds(c.ExpiresAt))
	}
	return s
}

func untilSeconds(t time.Time) string {
	return fmt.Sprintf("%ds", int(time.Until(t).Round(time.Second).Seconds()))
}

func (a *app) renewCommand() *cobra.Command {
	var (
		credential string
		asJSON     bool
	)
	c := &cobra.Command{
		Use:   "renew LEASE_ID",
		Short: "Extend a lease by its TTL",
		Long: `Renew a lease. On the machine that acquired it, the credential file supplies
the credential and the version last seen: the renewal is a compare-and-swap
on it, and the file is updated. From elsewhere pass --credential: the
renewal then compares against the version it reads first. A refused renewal means stop writing: exit 4 when the lease is lost,
3 when the credential is not the owner's.`,
		Args: exactArgs(1, "LEASE_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, id := cmd.Context(), args[0]
			return a.asOwner(ctx, "renew", id, leasebus.Credential(credential), asJSON, func(s *session, f *credFile, cred leasebus.Credential) error {
				req := leasebus.RenewRequest{LeaseID: id, Credential: cred}
				if f != nil {
					req.Version = f.Version
				}
				if req.Version == 0 {
					cur, err := s.client.Get(ctx, id)
					if err != nil {
						return err
					}
					req.Version = cur.Version
				}
				l, err := s.client.Renew(ctx, req)
				if err != nil {
					if errors.Is(err, lease.ErrLeaseLost) {
						return fmt.Errorf("%w\n%s", err, stopWriting(id))
					}
					return err
				}
				if f != nil {
					f.Version = l.Version
					if _, err := a.writeCredFile(f); err != nil {
						return fmt.Errorf("lease %s renewed to version %d, but: %w", id, l.Version, err)
					}
				}
				if asJSON {
					return writeJSON(a.stdout, l)
				}
				fmt.Fprintf(a.stdout, "lease renewed: %s\nversion: %d\nfence: %d\nexpires: %s\n",
					l.LeaseID, l.Version, l.Fence, l.ExpiresAt.UTC().Format(time.RFC3339))
				return nil
			})
		},
	}
	c.Flags().StringVar(&credential, "credential", "", "owner credential, when renewing from a machine without the credential file")
	c.Flags().BoolVar(&asJSON, "json", false, "print the renewed lease record as JSON")
	return c
}

func (a *app) releaseCommand() *cobra.Command {
	var (
		credential string
		asJSON     bool
	)
	c := &cobra.Command{
		Use:   "release LEASE_ID",
		Short: "End a lease (idempotent) and forget its credential",
		Long: `Release a lease with its credential (from the credential file on the
machine that acquired it, or --credential). Releasing a lease that already
ended is not an error. The credential file is removed afterwards.`,
		Args: exactArgs(1, "LEASE_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx, id := cmd.Context(), args[0]
			return a.asOwner(ctx, "release", id, leasebus.Credential(credential), asJSON, func(s *session, f *credFile, cred leasebus.Credential) error {
				l, err := s.client.Release(ctx, id, cred)
				if err != nil {
					return err
				}
				if f != nil {
					if err := a.removeCredFile(id); err != nil {
						return fmt.Errorf("lease %s released, but: %w", id, err)
					}
				}
				if asJSON {
					return writeJSON(a.stdout, l)
				}
				if l.Status == lease.StatusReleased {
					fmt.Fprintf(a.stdout, "lease released: %s\n", l.LeaseID)
				} else {
					fmt.Fprintln(a.stdout, alreadyEnded(l))
				}
				return nil
			})
		},
	}
	c.Flags().StringVar(&credential, "credential", "", "owner credential, when releasing from a machine without the credential file")
	c.Flags().BoolVar(&asJSON, "json", false, "print the final lease record as JSON")
	return c
}

// asOwner runs op (renew or release) on lease id as its owner: act gets
// a holder's session on the bus and the credential. That is the
// credential file's when this machine has one for id and cred is empty or
// the same secret (f is the file, and its bus is dialed unless --nats or
// the environment names one), else cred (f nil: someone else's
// credential leaves the file alone). Without either, withoutCredential
// answers.
func (a *app) asOwner(ctx context.Context, op, id string, cred leasebus.Credential, asJSON bool, act func(s *session, f *credFile, cred leasebus.Credential) error) error {
	if err := checkLeaseID(id); err != nil {
		return err
	}
	url, source := a.busURL()
	f, ferr := a.readCredFile(id)
	switch {
	case ferr == nil && (cred == "" || cred == f.Credential):
		cred = f.Credential
		if source == "" && f.NATS != "" {
			url, source = f.NATS, "the credential file"
		}
	case cred != "":
		f = nil // someone else's credential: leave the file alone
	case errors.Is(ferr, errNoCredFile):
		return a.withoutCredential(ctx, op, id, ferr, asJSON)
	default:
		return ferr
	}
	s, err := a.dialURL(leasebus.RoleHolder, url, source)
	if err != nil {
		return err
	}
	defer s.Close()
	return act(s, f, cred)
}

// withoutCredential answers renew or release of a lease this machine keeps
// no credential for: an ended lease is lost (renew, exit 4) or already
// released (release, exit 0); an active one needs --credential.
func (a *app) withoutCredential(ctx context.Context, op, id string, ferr error, asJSON bool) error {
	s, err := a.dial(leasebus.RoleViewer)
	if err != nil {
		return err
	}
	defer s.Close()
	l, err := s.client.Get(ctx, id)
	if err != nil {
		if errors.Is(err, lease.ErrNotFound) {
			return fmt.Errorf("%s %s: the bus at %s does not know this lease, and there is %w", op, id, s.url, ferr)
		}
		return fmt.Errorf("%s %s: %w", op, id, err)
	}
	if l.Active() {
		return fmt.Errorf("%s %s: %w; renew or release it where it was acquired, or pass --credential SECRET", op, id, ferr)
	}
	if op == "renew" {
		return fmt.Errorf("renew %s: %w: it is %s (%s)\n%s", id, lease.ErrLeaseLost, l.Status, l.Reason, stopWriting(id))
	}
	if asJSON {
		return writeJSON(a.stdout, l)
	}
	fmt.Fprintln(a.stdout, alreadyEnded(l))
	return nil
}

// alreadyEnded says that l ended before the command came: "lease ID
// already ended: STATUS (REASON)".
func alreadyEnded(l *lease.Lease) string {
	return fmt.Sprintf("lease %s already ended: %s (%s)", l.LeaseID, l.Status, l.Reason)
}

// stopWriting is the advice after a renewal found the lease lost.
func stopWriting(id string) string {
	return fmt.Sprintf("(stop writing under %s; acquire a new lease)", id)
}

func (a *app) listCommand() *cobra.Command {
	var (
		repo        string
		all, asJSON bool
	)
	c := &cobra.Command{
		Use:   "list",
		Short: "List active leases (with --all, recently ended ones too)",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			r, err := resolveRepoFlag(cmd.Context(), repo)
			if err != nil {
				return err
			}
			repo = r
			s, err := a.dial(leasebus.RoleViewer)
			if err != nil {
				return err
			}
			defer s.Close()
			ls, err := s.client.List(cmd.Context(), repo, all)
			if err != nil {
				return fmt.Errorf("list leases: %w", err)
			}
			none := "no active leases"
			if all {
				none = "no leases"
			}
			return writeList(a.stdout, ls, asJSON, none, func(w io.Writer, ls []*lease.Lease) { printLeaseTable(w, ls, time.Now()) })
		},
	}
	c.Flags().StringVar(&repo, "repo", "", "only this repository")
	c.Flags().BoolVar(&all, "all", false, fmt.Sprintf("include leases ended within the last %s, at most %d a repo (the audit keeps every end: fenceline lease audit)", leasebus.EndedKept, leasebus.MaxEndedKept))
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of lease records")
	return c
}

// printLeaseTable prints leases as a table; EXPIRES IN is display only
// (the record's expiresAt against this machine's clock).
func printLeaseTable(out io.Writer, ls []*lease.Lease, now time.Time) {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "LEASE\tREPO\tSCOPE\tWORKSPACE\tOWNER\tFENCE\tSTATUS\tEXPIRES IN")
	for _, l := range ls {
		expires := "-"
		if l.Active() {
			expires = fmt.Sprintf("%ds", int(l.ExpiresAt.Sub(now).Round(time.Second).Seconds()))
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s (%s)\t%s/%s\t%d\t%s\t%s\n", l.LeaseID, l.Repo, l.Scope,
			l.WorkspaceID, l.WorkspaceMode, l.Owner.AgentID, l.Owner.TaskID, l.Fence, l.Status, expires)
	}
	w.Flush()
}

func (a *app) showCommand() *cobra.Command {
	var asJSON bool
	c := &cobra.Command{
		Use:   "show LEASE_ID",
		Short: "Show one lease record, active or recently ended",
		Args:  exactArgs(1, "LEASE_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := args[0]
			if err := checkLeaseID(id); err != nil {
				return err
			}
			s, err := a.dial(leasebus.RoleViewer)
			if err != nil {
				return err
			}
			defer s.Close()
			l, err := s.client.Get(cmd.Context(), id)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(a.stdout, l)
			}
			w := a.stdout
			fmt.Fprintf(w, "lease: %s\nrepo: %s\nscope: %s\nworkspace: %s (%s)\nowner: %s\nstatus: %s\nversion: %d\nfence: %d\nttl: %s\n",
				l.LeaseID, l.Repo, l.Scope, l.WorkspaceID, l.WorkspaceMode, l.Owner, l.Status, l.Version, l.Fence, l.TTL)
			fmt.Fprintf(w, "acquired: %s\nrenewed: %s\nexpires: %s\n", rfc3339(l.AcquiredAt), rfc3339(l.RenewedAt), rfc3339(l.ExpiresAt))
			if !l.Active() {
				fmt.Fprintf(w, "ended: %s\nreason: %s\n", rfc3339(l.EndedAt), l.Reason)
			}
			return nil
		},
	}
	c.Flags().BoolVar(&asJSON, "json", false, "print the lease record as JSON")
	return c
}

func (a *app) sweepCommand() *cobra.Command {
	var (
		repo   string
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "sweep-stale",
		Short: "Reclaim leases whose TTL lapsed without renewal, now",
		Long: `Ask the lease service to reclaim every lease whose TTL lapsed without a
renewal (the service also does this on its own at each deadline). Each
reclaim is audited.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			r, err := resolveRepoFlag(cmd.Context(), repo)
			if err != nil {
				return err
			}
			repo = r
			s, err := a.dial(leasebus.RoleOperator)
			if err != nil {
				return err
			}
			defer s.Close()
			ls, err := s.client.Sweep(cmd.Context(), repo)
			if err != nil {
				return fmt.Errorf("sweep stale leases: %w", err)
			}
			return writeList(a.stdout, ls, asJSON, "nothing to reclaim", func(w io.Writer, ls []*lease.Lease) {
				for _, l := range ls {
					fmt.Fprintf(w, "reclaimed: %s owner=%s/%s repo=%s scope=%s fence=%d\n",
						l.LeaseID, l.Owner.AgentID, l.Owner.TaskID, l.Repo, l.Scope, l.Fence)
				}
			})
		},
	}
	c.Flags().StringVar(&repo, "repo", "", "only this repository")
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of the reclaimed lease records")
	return c
}

func (a *app) revokeCommand() *cobra.Command {
	var (
		reason string
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "revoke LEASE_ID --reason TEXT",
		Short: "End a lease now as an operator (audited; its holder's fences close)",
		Args:  exactArgs(1, "LEASE_ID"),
		RunE: func(cmd *cobra.Command, args []string) error {
			id := args[0]
			if err := checkLeaseID(id); err != nil {
				return err
			}
			if strings.TrimSpace(reason) == "" {
				return usagef("--reason is required: say why the lease is revoked, e.g. --reason \"runaway agent\" (it goes into the audit trail)")
			}
			s, err := a.dial(leasebus.RoleOperator)
			if err != nil {
				return err
			}
			defer s.Close()
			l, err := a.revokeSaying(cmd.Context(), s, id, reason)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(a.stdout, l)
			}
			// The service answers an ended lease with its record as is.
			if l.Status == lease.StatusRevoked && strings.HasSuffix(l.Reason, reason) {
				fmt.Fprintf(a.stdout, "lease revoked: %s\nowner: %s\n%s\n", l.LeaseID, l.Owner, l.Reason)
			} else {
				fmt.Fprintf(a.stdout, "%s; nothing to revoke\n", alreadyEnded(l))
			}
			return nil
		},
	}
	c.Flags().StringVar(&reason, "reason", "", "why the lease is revoked (required; audited)")
	c.Flags().BoolVar(&asJSON, "json", false, "print the final lease record as JSON")
	return c
}

// revokePatience is how long `lease revoke` waits for the service's answer
// before it says what it is waiting for (a cluster fault can hold a
// revoke for seconds).
const revokePatience = 2 * time.Second

// revokeSaying revokes lease id; when the answer takes longer than
// revokePatience it says why on stderr — the service's view of the lease,
// asked separately — and keeps waiting.
func (a *app) revokeSaying(ctx context.Context, s *session, id, reason string) (*lease.Lease, error) {
	type answer struct {
		l   *lease.Lease
		err error
	}
	done := make(chan answer, 1)
	go func() {
		l, err := s.client.Revoke(ctx, id, reason)
		done <- answer{l, err}
	}()
	select {
	case r := <-done:
		return r.l, r.err
	case <-time.After(revokePatience):
	}
	fmt.Fprintf(a.stderr, "fenceline: no answer to the revoke of %s after %s: %s; still trying (revoking again is safe)\n", id, revokePatience, revokeDelay(ctx, s, id))
	r := <-done
	return r.l, r.err
}

// revokeDelay says why a revoke may be slow: what the lease service
// instances this server reaches say of the election and the lease log
// (leasebus.Explain), and whether the lease is still active.
func revokeDelay(ctx context.Context, s *session, id string) string {
	c := leasebus.NewClient(s.nc)
	c.Timeout, c.Tries = time.Second, 1
	var (
		l   *lease.Lease
		err error
	)
	got := make(chan struct{})
	go func() {
		defer close(got)
		l, err = c.Get(ctx, id)
	}()
	sts, serr := c.Status(ctx, time.Second)
	why := leasebus.Explain(sts)
	if serr != nil && !leasebus.NoService(serr) {
		why = fmt.Sprintf("the lease service's status is unknown (%v)", serr)
	}
	<-got
	switch {
	case err != nil:
		return why
	case l.Active():
		return why + "; the lease is still active"
	}
	return fmt.Sprintf("the lease has meanwhile ended (%s): its answer is on its way", l.Status)
}

func (a *app) auditCommand() *cobra.Command {
	var (
		repo   string
		asJSON bool
	)
	c := &cobra.Command{
		Use:   "audit",
		Short: "Print the audit trail: grants, releases, expiries, reclaims, revokes, refusals",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			r, err := resolveRepoFlag(cmd.Context(), repo)
			if err != nil {
				return err
			}
			repo = r
			s, err := a.dial(leasebus.RoleViewer)
			if err != nil {
				return err
			}
			defer s.Close()
			evs, err := leasebus.ReadAudit(cmd.Context(), s.nc, repo, 0)
			if err != nil {
				return fmt.Errorf("read audit trail: %w", err)
			}
			return writeList(a.stdout, evs, asJSON, "no audit events", printAudit)
		},
	}
	c.Flags().StringVar(&repo, "repo", "", "only this repository")
	c.Flags().BoolVar(&asJSON, "json", false, "print a JSON array of audit events")
	return c
}

// printAudit prints one line per event: time type lease owner fence message.
func printAudit(out io.Writer, evs []lease.AuditEvent) {
	w := tabwriter.NewWriter(out, 0, 4, 1, ' ', 0)
	for _, ev := range evs {
		lease, owner, fence := ev.LeaseID, "-", "-"
		if lease == "" {
			lease = "-"
		}
		if ev.Owner.AgentID != "" || ev.Owner.TaskID != "" {
			owner = ev.Owner.AgentID + "/" + ev.Owner.TaskID
		}
		if ev.Fence > 0 {
			fence = fmt.Sprintf("fence=%d", ev.Fence)
		}
		fmt.Fprintf(w, "%s\t%s\t%s\t%s\t%s\t%s\n", ev.Time.UTC().Format("2006-01-02T15:04:05.000Z"), ev.Type, lease, owner, fence, ev.Message)
	}
	w.Flush()
}

func rfc3339(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// exactArgs is cobra.ExactArgs with a message naming the argument.
func exactArgs(n int, name string) cobra.PositionalArgs {
	return func(cmd *cobra.Command, args []string) error {
		if len(args) != n {
			return fmt.Errorf("%s takes exactly %d argument (%s), got %d", cmd.CommandPath(), n, name, len(args))
		}
		return nil
	}
}

// writeList prints what a listing command found: with asJSON a JSON array
// ([] for nothing), else the line none for nothing, else text.
func writeList[T any](w io.Writer, items []T, asJSON bool, none string, text func(io.Writer, []T)) error {
	if asJSON {
		if items == nil {
			items = []T{}
		}
		return writeJSON(w, items)
	}
	if len(items) == 0 {
		fmt.Fprintln(w, none)
		return nil
	}
	text(w, items)
	return nil
}

// writeJSON writes v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	if err := enc.Encode(v); err != nil {
		return fmt.Errorf("write JSON: %w", err)
	}
	return nil
}
