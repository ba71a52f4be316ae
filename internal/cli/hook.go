package cli

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/gitproxy"
)

func (a *app) hookCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hook",
		Short: "Hooks for git servers",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	var allowUnfenced bool
	pre := &cobra.Command{
		Use:   "pre-receive",
		Short: "Refuse pushes whose fence is stale (install as the repository's pre-receive hook)",
		Long: `Run as a git server's pre-receive hook, it reads the fence that the fenceline
sidecar sends as push options (the upstream must advertise them:
git config receive.advertisePushOptions true) and refuses the push when a newer
fence was already accepted for a path the push claims or touches. The accepted
fences live in <git-dir>/fenceline/fences.json.

Install, in the bare repository:
  printf '#!/bin/sh\nexec fenceline hook pre-receive\n' > hooks/pre-receive
  chmod +x hooks/pre-receive
  git config receive.advertisePushOptions true`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			err := gitproxy.PreReceive(cmd.Context(), gitproxy.HookConfig{AllowUnfenced: allowUnfenced}, os.Stdin)
			var he *gitproxy.HookError
			if errors.As(err, &he) {
				// git shows the hook's output to the pusher as "remote: …".
				fmt.Fprintln(a.stderr, he.Msg)
				return &exitError{code: ExitConflict, err: errReported}
			}
			return err
		},
	}
	pre.Flags().BoolVar(&allowUnfenced, "allow-unfenced", false, "let pushes without a fence through (people pushing directly)")
	cmd.AddCommand(pre)
	return cmd
}
