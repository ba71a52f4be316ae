package cli

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/spf13/cobra"

	"github.com/fenceline/fenceline/egress"
	"github.com/fenceline/fenceline/internal/repoid"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/policy"
	"github.com/fenceline/fenceline/sidecar"
)

func (a *app) policyCommand() *cobra.Command {
	c := &cobra.Command{
		Use:   "policy",
		Short: "The security team's Cedar policy: schema, validate, test, set, get, history (docs/policy.md)",
		Args:  groupArgs,
		RunE:  showHelp,
	}
	c.AddCommand(a.policySchemaCommand(), a.policyValidateCommand(), a.policyTestCommand(),
		a.policySetCommand(), a.policyGetCommand(), a.policyHistoryCommand())
	return c
}

func (a *app) policySchemaCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "schema",
		Short: "Print the Cedar schema policies are validated against",
		Args:  exactArgs(0, ""),
		RunE: func(*cobra.Command, []string) error {
			_, err := fmt.Fprint(a.stdout, policy.SchemaText)
			return err
		},
	}
}

// readPolicyFile reads and validates a policy file (usage errors name
// every problem's line and column).
func readPolicyFile(file string) (string, *policy.Policy, error) {
	if file == "" {
		return "", nil, usagef("-f FILE is required: the Cedar policy")
	}
	data, err := os.ReadFile(file)
	if err != nil {
		return "", nil, fmt.Errorf("read policy: %w", err)
	}
	p, err := policy.Parse(file, string(data))
	return string(data), p, err
}

func (a *app) policyValidateCommand() *cobra.Command {
	var file string
	c := &cobra.Command{
		Use:   "validate -f FILE",
		Short: "Parse a policy and validate it against the schema; every problem with its line and column",
		Args:  exactArgs(0, ""),
		RunE: func(*cobra.Command, []string) error {
			_, p, err := readPolicyFile(file)
			if err != nil {
				return err
			}
			fmt.Fprintf(a.stdout, "%s: valid, %d rules, %s\n", file, len(p.Rules), p.Digest)
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "the Cedar policy file")
	return c
}

func (a *app) policyTestCommand() *cobra.Command {
	var file, cases string
	c := &cobra.Command{
		Use:   "test -f POLICY --cases FILE",
		Short: "Decide each case of FILE (JSON) with the policy; exit 1 on any case that does not get its expected decision",
		Args:  exactArgs(0, ""),
		RunE: func(*cobra.Command, []string) error {
			text, _, err := readPolicyFile(file)
			if err != nil {
				return err
			}
			if cases == "" {
				return usagef("--cases FILE is required: a JSON array of {name, request, expect: allow|deny, rule}")
			}
			data, err := os.ReadFile(cases)
			if err != nil {
				return fmt.Errorf("read cases: %w", err)
			}
			cs, err := policy.ParseCases(data)
			if err != nil {
				return usagef("%v", err)
			}
			var st policy.Store
			if err := st.Put(policy.Document{Mode: policy.ModeEnforce, Version: 1, Text: text}); err != nil {
				return err
			}
			failed := 0
			for _, r := range policy.RunCases(&st, cs) {
				if r.Passed {
					fmt.Fprintf(a.stdout, "ok    %s\n", r.Case.Name)
					continue
				}
				failed++
				fmt.Fprintf(a.stdout, "FAIL  %s: %s\n", r.Case.Name, r.Why)
			}
			fmt.Fprintf(a.stdout, "%d cases, %d failed\n", len(cs), failed)
			if failed > 0 {
				return &exitError{code: ExitError, err: fmt.Errorf("%d of %d policy test cases failed", failed, len(cs))}
			}
			return nil
		},
	}
	c.Flags().StringVarP(&file, "file", "f", "", "the Cedar policy file")
	c.Flags().StringVar(&cases, "cases", "", "the cases: a JSON array of {name, request: {agent, task, repo, action, resource: {kind, name, port}, context}, expect, rule}")
	return c
}

// policyScope are the flags that say whose policy: --repo R or --default,
// and --mode.
type policyScope struct {
	repo   string
	def    bool
	mode   string
	asJSON bool
}

func (f *policyScope) add(c *cobra.Command) {
	c.Flags().StringVar(&f.repo, "repo", "", "the repository (host/org/repo, or any URL of it)")
	c.Flags().BoolVar(&f.def, "default", false, "the default policy, which every repository follows besides its own")
	c.Flags().StringVar(&f.mode, "mode", string(policy.ModeEnforce), "enforce, or shadow: evaluated beside the enforced policy, its refusals only audited (shadow-refused)")
	c.Flags().BoolVar(&f.asJSON, "json", false, "print JSON")
}

func (f *policyScope) resolve() (repo string, mode policy.Mode, err error) {
	switch {
	case f.def && f.repo != "":
		return "", "", usagef("--repo and --default: a policy is one or the other")
	case !f.def && f.repo == "":
		return "", "", usagef("say whose policy: --repo R or --default")
	}
	mode = policy.Mode(f.mode)
	if mode != policy.ModeEnforce && mode != policy.ModeShadow {
		return "", "", usagef("--mode %q: want enforce or shadow", f.mode)
	}
	if f.repo != "" {
		repo = repoid.Normalize(f.repo)
	}
	return repo, mode, nil
}

func (a *app) policySetCommand() *cobra.Command {
	var (
		f       policyScope
		file    string
		version int64
	)
	c := &cobra.Command{
		Use:   "set -f FILE (--repo R | --default) [--mode shadow] [--version N]",
		Short: "Set a policy as an operator: a new version, audited (an empty file removes it)",
		Args:  exactArgs(0, ""),
		RunE: func(cmd *cobra.Command, _ []string) error {
			repo, mode, err := f.resolve()
			if err != nil {
				return err
			}
			text, _, err := readPolicyFile(file)
			if err != nil {
				return err
			}
			s, err := a.dial(leasebus.RoleOperator)
			if err != nil {
				return err
			}
			defer s.Close()
			w := leasebus.PolicyWrite{Repo: repo, Default: f.def, Mode: mode, Text: text}
			if version >= 0 {
				w.Version = uint64(version)
			} else {
				js, err := leasebus.JetStream(cmd.Context(), s.nc)
				if err != nil {
					return err
				}
				cur, _, err := leasebus.GetPolicy(cmd.Context(), js, repo, mode)
				if err != nil {
					return err
				}
				w.Version = cur.Version
			}
			d, err := s.client.SetPolicy(cmd.Context(), w)
			if err != nil {
				return err
			}
			if f.asJSON {
				return writeJSON(a.stdout, d)
			}
			fmt.Fprintf(a.stdout, "policy set: %s (%s)\nversion: %d\ndigest: %s\nset by: %s\n", d.Scope(), d.Mode, d.Version, d.Digest, d.SetBy)
			return nil
		},
	}
	f.add(c)
	c.Flags().StringVarP(&file, "file", "f", "", "the Cedar policy file (an empty file removes the policy)")
	c.Flags().Int64Var(&version, "version", -1, "the version this replaces (compare-and-swap; default: the version in force now)")
	return c
}

// readPolicies resolves f and connects as a viewer to read policies; done
// closes the connection.
func (a *app) readPolicies(ctx context.Context, f policyScope) (repo string, mode policy.Mode, js jetstream.JetStream, done func(), err error) {
	if repo, mode, err = f.resolve(); err != nil {
		return "", "", nil, nil, err
	}
	s, err := a.dial(leasebus.RoleViewer)
	if err != nil {
		return "", "", nil, nil, err
	}
	if js, err = leasebus.JetStream(ctx, s.nc); err != nil {
		s.Close()
		return "", "", nil, nil, err
	}
	return repo, mode, js, s.Close, nil
}

func (a *app) policyGetCommand() *cobra.Command {
	var f policyScope
	c := &cobra.Command{
		Use:   "get (--repo R | --default) [--mode shadow]",
		Short: "Print the policy in force",
		Args:  exactArgs(0, ""),
		RunE: func(cmd *cobra.Command, _ []string) error {
			repo, mode, js, done, err := a.readPolicies(cmd.Context(), f)
			if err != nil {
				return err
			}
			defer done()
			d, ok, err := leasebus.GetPolicy(cmd.Context(), js, repo, mode)
			if err != nil {
				return err
			}
			if f.asJSON {
				return writeJSON(a.stdout, d)
			}
			if !ok || d.Text == "" {
				fmt.Fprintf(a.stdout, "no %s policy (%s) in force\n", d.Scope(), mode)
				return nil
			}
			fmt.Fprintf(a.stdout, "# %s policy (%s), version %d, %s, set by %s at %s\n%s", d.Scope(), d.Mode, d.Version, d.Digest, d.SetBy, d.SetAt.Format("2006-01-02T15:04:05Z"), d.Text)
			return nil
		},
	}
	f.add(c)
	return c
}

func (a *app) policyHistoryCommand() *cobra.Command {
	var f policyScope
	c := &cobra.Command{
		Use:   "history (--repo R | --default) [--mode shadow]",
		Short: "List every version of a policy: who set it, when, its digest",
		Args:  exactArgs(0, ""),
		RunE: func(cmd *cobra.Command, _ []string) error {
			repo, mode, js, done, err := a.readPolicies(cmd.Context(), f)
			if err != nil {
				return err
			}
			defer done()
			h, err := leasebus.PolicyHistory(cmd.Context(), js, repo, mode)
			if err != nil {
				return err
			}
			if f.asJSON {
				return writeJSON(a.stdout, h)
			}
			if len(h) == 0 {
				fmt.Fprintf(a.stdout, "no versions\n")
			}
			for _, d := range h {
				what := ""
				if d.Text == "" {
					what = " (removed)"
				}
				fmt.Fprintf(a.stdout, "version %d  %s  %s  %s%s\n", d.Version, d.SetAt.Format("2006-01-02T15:04:05Z"), d.SetBy, d.Digest, what)
			}
			return nil
		},
	}
	f.add(c)
	return c
}

// followPolicy reads the policies of repo from the bus into a store the
// fences ask, kept in step until stop, and refuses (exit 2, naming the
// rule) flags that would allow what the policy forbids: before any lease
// is taken.
func (a *app) followPolicy(ctx context.Context, s *session, repo string, f policy.Flags) (st *policy.Store, stop func(), err error) {
	st, w, err := leasebus.FollowPolicy(ctx, s.nc, repo)
	if err != nil {
		return nil, nil, err
	}
	f.Repo = repo
	if err := st.CheckFlags(f); err != nil {
		w.Stop()
		return nil, nil, err
	}
	policy.Prefault() // the fences decide for the whole run
	return st, w.Stop, nil
}

// policyFlags are what the claim and fence flags would allow, for
// policy.Store.CheckFlags. allowWrite are real absolute paths; those in
// root are asked about as repo-relative paths.
func policyFlags(req leasebus.AcquireRequest, ff *fenceFlags, root string, allowWrite []string) policy.Flags {
	f := policy.Flags{Agent: req.Owner.AgentID, Task: req.Owner.TaskID,
		Paths: req.Scope.Paths, Tables: req.Scope.Tables, WholeRepo: req.Scope.Kind == scope.KindWholeRepo,
		TTLSeconds: int64(time.Duration(req.TTL) / time.Second), WorkspaceMode: string(req.WorkspaceMode),
		AllowForcePush: ff.allowForcePush, AllowRefDelete: ff.allowDelete, PGAllowOpaque: ff.pgAllowOpaque}
	for _, p := range allowWrite {
		if rel, err := filepath.Rel(root, p); err == nil && root != "" && rel != ".." && !strings.HasPrefix(rel, "../") {
			f.AllowWrite = append(f.AllowWrite, filepath.ToSlash(rel))
		}
	}
	if rules, err := egress.ParseRules(ff.allowHosts); err == nil {
		for _, r := range rules {
			f.AllowHosts = append(f.AllowHosts, policy.Resource{Kind: policy.KindHost, Name: r.Host, Port: r.Port})
		}
	}
	for _, s := range ff.injectFiles {
		if spec, err := sidecar.ParseInjectSpec(s); err == nil {
			host, port, _ := net.SplitHostPort(spec.HostPort)
			n, _ := strconv.Atoi(port)
			f.InjectHosts = append(f.InjectHosts, policy.Resource{Kind: policy.KindHost, Name: host, Port: n})
		}
	}
	return f
}
