package cli

import (
	"fmt"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/pgproxy"
)

func (a *app) fenceSecretCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fence-secret",
		Short: "Register a storage's secret with the lease service, so that the storage accepts only fences the service granted",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	cmd.AddCommand(a.fenceSecretSetCommand())
	return cmd
}

func (a *app) fenceSecretSetCommand() *cobra.Command {
	var repo, gitFile, pgFile, dir string
	c := &cobra.Command{
		Use:   "set --repo R [--git FILE] [--postgres FILE] [--dir DIR]",
		Short: "Register repository R's git hook secret and/or Postgres fence secret with the lease service",
		Long: `Copy a storage's secret into the lease service's fence-secret directory
(bus serve --fence-secrets; default ` + leasebus.FenceSecretDirIn(a.stateDir) + `),
mode 0600. From then on, each lease of R granted (or renewed) gets grant keys
derived from it, handed to the lease's acquirer alone: its sidecar signs with
them, and the storage, which holds the same secret, derives and verifies.

--git is the hook secret "fenceline hook install" wrote (its --bus-secret-file
copy, or <git-dir>/fenceline/hook.key); --postgres is the secret "fenceline pg
install" wrote. Run this where the lease service runs, as its user: only the
service and the storage may hold these secrets (whoever holds one can mint
any fence); no runner, sidecar or agent needs them.`,
		Example: `  fenceline bus fence-secret set --repo github.com/acme/payments --git /srv/git/payments.bus.key
  fenceline bus fence-secret set --repo github.com/acme/payments --postgres pg-secret.key --dir /var/lib/fenceline/fence-secrets`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			r, err := hookRepo(repo)
			if err != nil {
				return err
			}
			if gitFile == "" && pgFile == "" {
				return usagef("name a secret to register: --git FILE (from fenceline hook install) and/or --postgres FILE (from fenceline pg install)")
			}
			if gitFile != "" {
				key, err := gitproxy.ReadKeyFile(gitFile)
				if err != nil {
					return usagef("--git %s: %v", gitFile, err)
				}
				if err := leasebus.WriteFenceSecret(dir, r, lease.StorageGit, key); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "git secret of %s registered: %s\n", r, leasebus.FenceSecretFile(dir, r, lease.StorageGit))
			}
			if pgFile != "" {
				key, err := pgproxy.ReadSecretFile(pgFile)
				if err != nil {
					return usagef("--postgres %s: %v", pgFile, err)
				}
				if err := leasebus.WriteFenceSecret(dir, r, lease.StoragePostgres, key); err != nil {
					return err
				}
				fmt.Fprintf(a.stdout, "postgres secret of %s registered: %s\n", r, leasebus.FenceSecretFile(dir, r, lease.StoragePostgres))
			}
			fmt.Fprintln(a.stdout, "leases granted from now on get grant keys; leases already held get them at their next renewal")
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&repo, "repo", "", "the repository's identity as the leases name it (required)")
	f.StringVar(&gitFile, "git", "", "the repository's git hook secret file (from fenceline hook install)")
	f.StringVar(&pgFile, "postgres", "", "the Postgres fence secret file (from fenceline pg install)")
	f.StringVar(&dir, "dir", leasebus.FenceSecretDirIn(a.stateDir), "the lease service's fence-secret directory (bus serve --fence-secrets)")
	return c
}
