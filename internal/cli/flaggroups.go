package cli

import (
	"fmt"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
)

// flagGroup is one section of a command's help: a title and its flags, in
// the order they are listed.
type flagGroup struct {
	title string
	flags []string
}

// runFlagGroups sections run's help: what it leases, where the agent
// works, the fences it is routed through, the guard around it, and the
// policy a security team sets.
var runFlagGroups = []flagGroup{
	{"Lease", []string{"repo", "scope", "whole-repo", "table", "ttl", "wait", "task", "agent", "attempt", "lease", "credential"}},
	{"Workspace", []string{"checkout", "workspace", "workspace-id"}},
	{"Fences", []string{"git-upstream", "git-listen", "git-forward", "git-objects", "git-upstream-header", "git-upstream-ca",
		"pg-upstream", "pg-listen", "pg-tls-cert", "pg-tls-key", "egress-resolve", "inject-header-file", "egress-ca", "state-dir"}},
	{"Guard", []string{"allow-write", "private-state", "allow-connect", "allow-bind", "on-lost", "kill-grace", "allow-unguarded"}},
	{"Policy", []string{"allow-host", "allow-force-push", "allow-ref-delete", "pg-allow-opaque"}},
}

// groupFlags makes c's usage list its local flags in groups (a flag in
// none goes under "Other flags"), then the global ones.
func groupFlags(c *cobra.Command, groups []flagGroup) {
	c.SetUsageFunc(func(cmd *cobra.Command) error {
		w := cmd.OutOrStderr()
		fmt.Fprintf(w, "Usage:\n  %s\n", cmd.UseLine())
		if cmd.HasExample() {
			fmt.Fprintf(w, "\nExamples:\n%s\n", cmd.Example)
		}
		local := cmd.LocalFlags()
		listed := map[string]bool{}
		section := func(title string, fs *pflag.FlagSet) {
			if fs.HasAvailableFlags() {
				fmt.Fprintf(w, "\n%s:\n%s", title, fs.FlagUsagesWrapped(0))
			}
		}
		for _, g := range groups {
			fs := pflag.NewFlagSet(g.title, pflag.ContinueOnError)
			fs.SortFlags = false // the group's own order
			for _, name := range g.flags {
				if f := local.Lookup(name); f != nil {
					fs.AddFlag(f)
					listed[name] = true
				}
			}
			section(g.title, fs)
		}
		rest := pflag.NewFlagSet("other", pflag.ContinueOnError)
		local.VisitAll(func(f *pflag.Flag) {
			if !listed[f.Name] {
				rest.AddFlag(f)
			}
		})
		section("Other flags", rest)
		section("Global flags", cmd.InheritedFlags())
		return nil
	})
}
