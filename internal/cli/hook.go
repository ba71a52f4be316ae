package cli

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/policy"
)

func (a *app) hookCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "hook",
		Short: "Hooks for git servers",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	cmd.AddCommand(a.hookPreReceiveCommand(), a.hookInstallCommand())
	return cmd
}

func (a *app) hookPreReceiveCommand() *cobra.Command {
	var (
		allowUnfenced bool
		repo, keyFile string
	)
	pre := &cobra.Command{
		Use:   "pre-receive [--repo R] [--secret-file FILE] [--allow-unfenced]",
		Short: "Refuse pushes whose fence is missing, forged or stale (the repository's pre-receive hook)",
		Long: `Run as a git server's pre-receive hook (fenceline hook install sets it up),
it reads the fence that the fenceline sidecar sends as push options and
accepts it only when the lease service granted it: its MAC (HMAC-SHA256
over the repo, lease, owner, fence, claim and this push's ref updates) must
verify under the fence's grant key, which the hook derives from this
repository's hook secret and which the lease service gave that lease's
acquirer alone. A push whose fenceline options are unsigned, forged (a fence,
lease, claim or owner the service did not grant), replayed from another
push, signed for another repository or malformed is refused, and nothing is
recorded. A signed fence is refused when a newer fence was already
accepted for a path the push claims or touches, and (with a bus) when the
bus says its lease has ended; otherwise it is recorded in
<git-dir>/fenceline/fences.json. Every refusal names the lease, owner,
fence and reason, goes to the pusher and is appended to
<git-dir>/fenceline/refusals.jsonl.

--allow-unfenced lets pushes that carry no fenceline options at all through
(people pushing directly); a push with any fenceline option is checked in
full either way.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			repo = repoid.Normalize(repo)
			bus, err := a.hookBus(cmd.Context(), repo)
			if err != nil {
				// A bus is named but its policy cannot be read: writes
				// fail closed.
				fmt.Fprintf(a.stderr, "fenceline: push refused: the policy in force cannot be read from the bus: %v\n", err)
				return &exitError{code: ExitConflict, err: errReported}
			}
			defer bus.close()
			err = gitproxy.PreReceive(cmd.Context(), gitproxy.HookConfig{Repo: repo, Options: a.cfg.PushOptions, KeyFile: keyFile, AllowUnfenced: allowUnfenced, Policy: bus.policy, Leases: bus.leases}, os.Stdin)
			var he *gitproxy.HookError
			if errors.As(err, &he) {
				// git shows the hook's output to the pusher as "remote: …".
				fmt.Fprintln(a.stderr, he.Msg)
				if aerr := a.auditHookRefusal(cmd.Context(), repo, he); aerr != nil {
					fmt.Fprintf(a.stderr, "fenceline: the refusal is in refusals.jsonl but not in the bus's audit stream: %v\n", aerr)
				}
				return &exitError{code: ExitConflict, err: errReported}
			}
			return err
		},
	}
	f := pre.Flags()
	f.BoolVar(&allowUnfenced, "allow-unfenced", false, "let pushes with no fenceline options at all through (people pushing directly)")
	f.StringVar(&repo, "repo", "", "the repository's identity as the leases name it; fences signed for another are refused")
	f.StringVar(&keyFile, "secret-file", "", "the hook secret (default <git-dir>/fenceline/hook.key)")
	return pre
}

func (a *app) hookInstallCommand() *cobra.Command {
	var (
		gitDir, repo, sidecarFile, exe string
		allowUnfenced, asJSON          bool
	)
	c := &cobra.Command{
		Use:   "install --git-dir DIR --repo R [--bus-secret-file FILE] [--allow-unfenced]",
		Short: "Install the fence's pre-receive hook and its secret in a repository on the git server",
		Long: `Install the storage-side git fence in the repository DIR (on the git
server, usually a bare repository):
  - a random hook secret in DIR/fenceline/hook.key (mode 0600, directory
    0700; an existing secret is kept, so running it again is safe),
  - DIR/hooks/pre-receive, running "fenceline hook pre-receive --repo R"
    (an existing pre-receive hook that is not fenceline's is left alone:
    install fails and says so),
  - receive.advertisePushOptions = true, so the fence can travel.

With --nats (and --creds: a holder's credentials suffice), the hook also
lands a push only while its lease is active with its fence (a push
delivered after its lease was revoked — a paused sidecar, a slow server —
is refused by the storage itself; no answer from the bus refuses), follows
the security team's policy, and writes each refusal to that bus's audit
stream (boundary git), as every other fence does; without, fences are
checked against each other only and refusals go only to
<git-dir>/fenceline/refusals.jsonl.

Run it as the user the git server runs hooks as: that user must own the
secret, and no agent's user may be able to read it (whoever reads it can
mint fences). R is the repository's identity exactly as the leases name it
(fenceline lease list shows it), e.g. github.com/acme/payments; a remote URL
is normalized to it.

The lease service holds the same secret and derives from it a grant key per
lease, which it gives the lease's acquirer alone; sidecars sign with that
and never hold the secret. A copy for the service is written to
--bus-secret-file (mode 0600; default $XDG_STATE_HOME/fenceline/git-hook/
<R, escaped>.key): register it where the lease service runs with
"fenceline bus fence-secret set --repo R --git FILE", then delete the copy.
Until it is registered, leases get no git grant key, and this hook refuses
their pushes saying the MAC is missing.`,
		Args: cobra.NoArgs,
		Example: `  sudo -u git fenceline hook install --git-dir /srv/git/payments.git --repo github.com/acme/payments \
    --bus-secret-file /srv/git/payments.bus.key
  fenceline bus fence-secret set --repo github.com/acme/payments --git /srv/git/payments.bus.key   # where the lease service runs`,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if gitDir == "" {
				return usagef("--git-dir is required: the repository on the git server, e.g. /srv/git/payments.git")
			}
			r, err := hookRepo(repo)
			if err != nil {
				return err
			}
			if exe == "" {
				if exe, err = os.Executable(); err != nil {
					return fmt.Errorf("hook install: find the fenceline binary for the hook: %w (pass --fenceline PATH)", err)
				}
			}
			if exe, err = filepath.Abs(exe); err != nil {
				return usagef("--fenceline %s: %v", exe, err)
			}
			var busArgs []string // the bus named here audits the hook's refusals too
			if u, source := a.busURL(); source != "" {
				busArgs = append(busArgs, "--nats", u)
			}
			if p, _ := a.credsSetting(); p != "" {
				if p, err = filepath.Abs(p); err != nil {
					return usagef("--creds %s: %v", p, err)
				}
				busArgs = append(busArgs, "--creds", p)
			}
			if sidecarFile == "" {
				sidecarFile = gitproxy.SidecarKeyFile(a.stateDir, r)
			}
			in, sidecarFile, err := gitproxy.InstallHookForSidecars(cmd.Context(),
				gitproxy.HookInstall{GitDir: gitDir, Repo: r, Fenceline: exe, AllowUnfenced: allowUnfenced, BusArgs: busArgs}, sidecarFile)
			if err != nil {
				return err
			}
			if asJSON {
				return writeJSON(a.stdout, struct {
					GitDir         string `json:"gitDir"`
					Repo           string `json:"repo"`
					Hook           string `json:"hook"`
					HookSecretFile string `json:"hookSecretFile"`
					NewSecret      bool   `json:"newSecret"`
					BusSecretFile  string `json:"busSecretFile"`
				}{in.GitDir, r, in.Hook, in.KeyFile, in.NewKey, sidecarFile})
			}
			kept := "new"
			if !in.NewKey {
				kept = "kept"
			}
			fmt.Fprintf(a.stdout, "hook installed: %s (repo %s)\n", in.Hook, r)
			fmt.Fprintf(a.stdout, "hook secret: %s (%s, mode 0600: keep it readable only by the git server's user)\n", in.KeyFile, kept)
			fmt.Fprintf(a.stdout, "bus secret: %s (register it with the lease service, then delete this copy: fenceline bus fence-secret set --repo %s --git %s; no sidecar may hold it)\n", sidecarFile, r, sidecarFile)
			return nil
		},
	}
	f := c.Flags()
	f.StringVar(&gitDir, "git-dir", "", "the repository on the git server (required)")
	f.StringVar(&repo, "repo", "", "the repository's identity as the leases name it, e.g. github.com/acme/payments (required)")
	f.StringVar(&sidecarFile, "bus-secret-file", "", "where to write the lease service's copy of the secret, for fenceline bus fence-secret set (default $XDG_STATE_HOME/fenceline/git-hook/<repo>.key)")
	f.StringVar(&sidecarFile, "sidecar-secret-file", "", "old name of --bus-secret-file")
	_ = f.MarkDeprecated("sidecar-secret-file", "sidecars no longer hold the hook secret; use --bus-secret-file and register it with fenceline bus fence-secret set")
	f.StringVar(&exe, "fenceline", "", "the fenceline binary the hook runs (default: this one)")
	f.BoolVar(&allowUnfenced, "allow-unfenced", false, "let pushes with no fenceline options at all through (people pushing directly)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return c
}

// hookRepo checks --repo of hook install and pre-receive; every spelling
// of a remote is turned into the identity the leases use (host/org/repo).
func hookRepo(repo string) (string, error) {
	r := strings.TrimSpace(repo)
	if r == "" {
		return "", usagef("--repo is required: the repository's identity as the leases name it, e.g. --repo github.com/acme/payments")
	}
	r = repoid.Normalize(r)
	if strings.ContainsAny(r, "\n\x00") {
		return "", usagef("--repo %q contains a newline or NUL", repo)
	}
	return r, nil
}

// hookPolicy reads the policy in force for repo (the default's and its
// own) from the bus named by --nats or FENCELINE_NATS, once; with no bus
// named there is none (a git server need not reach one).
// hookBus is what the pre-receive hook reads from the bus named by --nats
// or FENCELINE_NATS: the policy in force and the leases (the zero value,
// with no bus named: a git server need not reach one).
type hookBusView struct {
	policy *policy.Store
	leases gitproxy.LeaseGetter
	close  func()
}

func (a *app) hookBus(ctx context.Context, repo string) (hookBusView, error) {
	none := hookBusView{close: func() {}}
	u, source := a.busURL()
	if source == "" {
		return none, nil
	}
	nc, err := a.connect(leasebus.RoleHolder, u, source)
	if err != nil {
		return none, err
	}
	st, w, err := leasebus.FollowPolicy(ctx, nc, repo)
	if err != nil {
		nc.Close()
		return none, err
	}
	w.Stop() // one push, one reading
	return hookBusView{policy: st, leases: leasebus.NewClient(nc), close: nc.Close}, nil
}

// auditHookRefusal writes a refusal of the pre-receive hook to the audit
// stream of the bus named by --nats or FENCELINE_NATS (hook install puts
// them in the hook when it was given them); with no bus named it does
// nothing: a git server need not reach one. gitproxy.RecordRefusal words
// the event and bounds the wait.
func (a *app) auditHookRefusal(ctx context.Context, repo string, he *gitproxy.HookError) error {
	u, source := a.busURL()
	if source == "" {
		return nil
	}
	nc, err := a.connect(leasebus.RoleHolder, u, source)
	if err != nil {
		return err
	}
	defer nc.Close()
	aud, err := leasebus.NewAuditor(nc)
	if err != nil {
		return err
	}
	return gitproxy.RecordRefusal(ctx, aud, repo, he)
}
