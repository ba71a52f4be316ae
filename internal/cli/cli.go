// Package cli is the fenceline command tree: it parses the command line
// with cobra, talks to the lease bus (package leasebus) and maps every
// outcome to the exit statuses of the CLI contract in docs/design.md.
//
// Main is the whole program; cmd/fenceline only wires it to the process
// (arguments, standard streams, signals, os.Exit), so tests drive the real
// command tree in-process.
package cli

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/attempt"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/policy"
)

// Exit statuses (CLI contract).
const (
	ExitOK       = 0 // done
	ExitError    = 1 // something failed: no bus, I/O, an unexpected answer
	ExitUsage    = 2 // the command line is wrong: unknown flag or command, missing or invalid value
	ExitConflict = 3 // refused: the claim overlaps an active lease, or the credential is not the owner's
	ExitLost     = 4 // the lease is lost: released, revoked, expired or reclaimed
)

const exitHelp = `Exit status:
  0  ok
  1  error (no bus, I/O, unexpected answer)
  2  usage: unknown command or flag, missing argument, or an invalid value
     (a --scope that escapes the repo or is absolute, a bad --table, a --ttl
     that is not a duration or out of range, an unknown --workspace mode,
     an invalid policy, or a flag that would allow what the policy forbids)
  3  conflict or denied: the claim overlaps an active lease, the credential
     does not own the lease, or the policy refuses it
  4  lease lost: it was released, revoked, expired or reclaimed`

// EnvNATS names the environment variable that selects the bus, like --nats.
const EnvNATS = "FENCELINE_NATS"

// Main runs fenceline with args (without the program name) and returns the
// process exit status. It prints results to stdout and errors to stderr as
// "fenceline: <message>". Cancelling ctx interrupts the running command
// (bus serve stops cleanly).
func Main(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return run(ctx, args, stdout, stderr, leasebus.DefaultURL, configFromEnv(os.Getenv))
}

// run is Main with the default bus URL and the environment's settings as
// parameters, so tests can exercise the "no bus at the default address"
// path without touching the real one, and run side by side, each with a
// state dir of its own.
func run(ctx context.Context, args []string, stdout, stderr io.Writer, defaultURL string, cfg config) int {
	a := &app{stdout: stdout, stderr: stderr, defaultURL: defaultURL, cfg: cfg, stateDir: cfg.StateDir}
	root := a.rootCommand()
	if args == nil {
		args = []string{} // nil makes cobra read os.Args
	}
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	cmd, err := root.ExecuteContextC(ctx)
	if err == nil {
		return ExitOK
	}
	code := exitCode(err)
	if errors.Is(err, errReported) {
		return code // the command already said why
	}
	var re *runError
	if errors.As(err, &re) {
		err = re.err
	}
	msg := err.Error() + settingHint(err)
	if code == ExitUsage && cmd != nil {
		msg += fmt.Sprintf("\n(run %q for usage)", cmd.CommandPath()+" --help")
	}
	fmt.Fprintf(stderr, "fenceline: %s\n", msg)
	return code
}

// app holds what every command shares: the streams and the global flags.
type app struct {
	stdout, stderr io.Writer
	defaultURL     string
	natsFlag       string // --nats
	credsFlag      string // --creds
	// cfg is what Main read from the environment, once.
	cfg config
	// stateDir is fenceline's state dir (cfg.StateDir), handed to the
	// packages through their config structs.
	stateDir string
}

func (a *app) rootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:   "fenceline",
		Short: "Keep parallel coding agents from corrupting each other's work",
		Long: `fenceline grants leases on parts of a repository (paths, Postgres tables,
workspaces) from a lease bus on NATS JetStream, with fence tokens that rise
for every overlapping grant.

The bus: --nats URL, else $` + EnvNATS + `, else the embedded default at
` + a.defaultURL + ` (start it with "fenceline bus serve").

Bus credentials: --creds PATH, else $` + EnvCreds + `, else the embedded
default bus's own (written to ` + a.defaultCredsDir() + ` on its first
start). PATH is a credentials directory (each command takes the file of the
least role it needs: viewer.nk, holder.nk, operator.nk, service.nk) or one
.nk file used for every command. See docs/trust.md.

` + exitHelp,
		SilenceErrors: true,
		SilenceUsage:  true,
		Args:          groupArgs,
		RunE:          showHelp,
	}
	root.CompletionOptions.HiddenDefaultCmd = true
	root.PersistentFlags().StringVar(&a.natsFlag, "nats", "", "NATS URL of the lease bus (env "+EnvNATS+"; default the embedded bus at "+a.defaultURL+")")
	root.PersistentFlags().StringVar(&a.credsFlag, "creds", "", "bus credentials: a credentials directory (one <role>.nk per role) or one .nk file (env "+EnvCreds+"; default the embedded bus's, in "+a.defaultCredsDir()+")")
	root.AddCommand(a.busCommand(), a.leaseCommand(), a.sidecarCommand(), a.runCommand(), a.pgCommand(), a.hookCommand(), a.demoCommand())
	root.AddCommand(a.shardCommand())
	root.AddCommand(a.agentCommand())
	root.AddCommand(a.policyCommand())
	markRunErrors(root)
	return root
}

// groupArgs rejects an unknown subcommand of a command group.
func groupArgs(cmd *cobra.Command, args []string) error {
	if len(args) > 0 {
		return fmt.Errorf("unknown command %q for %q", args[0], cmd.CommandPath())
	}
	return nil
}

func showHelp(cmd *cobra.Command, _ []string) error { return cmd.Help() }

// runError marks an error returned by a command's own RunE. Anything else
// Execute returns comes from cobra itself (flags, arguments, unknown
// commands) and is a usage error.
type runError struct{ err error }

func (e *runError) Error() string { return e.err.Error() }
func (e *runError) Unwrap() error { return e.err }

func markRunErrors(c *cobra.Command) {
	if f := c.RunE; f != nil {
		c.RunE = func(cmd *cobra.Command, args []string) error {
			if err := f(cmd, args); err != nil {
				return &runError{err: err}
			}
			return nil
		}
	}
	for _, sub := range c.Commands() {
		markRunErrors(sub)
	}
}

// usageError is a wrong command line found by a command itself.
type usageError struct{ err error }

func (e *usageError) Error() string { return e.err.Error() }
func (e *usageError) Unwrap() error { return e.err }

func usagef(format string, args ...any) error {
	return &usageError{err: fmt.Errorf(format, args...)}
}

// errReported marks a failure the command has already explained on
// stderr in its own words (a git hook's refusal, say).
var errReported = errors.New("reported")

// exitError carries an explicit exit status.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// exitCode maps an error from Execute to the exit status of the contract.
func exitCode(err error) int {
	var re *runError
	if !errors.As(err, &re) {
		return ExitUsage
	}
	var ee *exitError
	var ue *usageError
	switch {
	case errors.As(err, &ee):
		return ee.code
	case errors.As(err, &ue), errors.Is(err, lease.ErrInvalid), errors.Is(err, attempt.ErrInvalid),
		errors.Is(err, policy.ErrInvalid), errors.Is(err, policy.ErrFlagForbidden):
		return ExitUsage
	case errors.Is(err, lease.ErrConflict), errors.Is(err, lease.ErrNotOwner), errors.Is(err, leasebus.ErrForbidden), errors.Is(err, policy.ErrRefused):
		return ExitConflict
	case errors.Is(err, lease.ErrLeaseLost):
		return ExitLost
	default:
		return ExitError
	}
}

// busURL returns the bus URL to use and where it came from.
func (a *app) busURL() (url, source string) {
	if a.natsFlag != "" {
		return a.natsFlag, "--nats"
	}
	if a.cfg.NATS != "" {
		return a.cfg.NATS, EnvNATS
	}
	return a.defaultURL, ""
}
