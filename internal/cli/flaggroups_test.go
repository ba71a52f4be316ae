package cli

import (
	"slices"
	"strings"
	"testing"

	"github.com/spf13/pflag"
)

// TestRunHelpGroups: run's help lists every flag once, under its group, in
// the groups' order; a group names only flags run has.
func TestRunHelpGroups(t *testing.T) {
	t.Parallel()
	isolate(t)
	out := fl(t, "run", "--help").want(t, ExitOK).stdout
	want := []string{"Usage", "Examples", "Lease", "Workspace", "Fences", "Guard", "Policy", "Other flags", "Global flags"}
	var titles []string
	count := map[string]int{}
	section := ""
	for _, line := range strings.Split(out, "\n") {
		if slices.Contains(want, strings.TrimSuffix(line, ":")) {
			section = strings.TrimSuffix(line, ":")
			titles = append(titles, section)
			continue
		}
		f := strings.Fields(line)
		if len(f) == 0 || !strings.HasPrefix(line, "  ") || section == "" || section == "Usage" || section == "Examples" {
			continue // the description and usage name flags too
		}
		name := f[0]
		if strings.HasPrefix(name, "-") && !strings.HasPrefix(name, "--") && len(f) > 1 {
			name = f[1] // "-h, --help"
		}
		if strings.HasPrefix(name, "--") {
			count[strings.TrimSuffix(name, ",")]++
			if section == "Workspace" && name == "--checkout" || section == "Guard" && name == "--on-lost" {
				count["placed "+name]++
			}
			if section == "Other flags" && name != "--help" {
				t.Errorf("%s is in no group of run's help (add it to runFlagGroups)", name)
			}
		}
	}
	if strings.Join(titles, "|") != strings.Join(want, "|") {
		t.Errorf("sections %q, want %q\n%s", titles, want, out)
	}
	c := (&app{}).runCommand()
	for _, g := range runFlagGroups {
		for _, name := range g.flags {
			if c.Flags().Lookup(name) == nil {
				t.Errorf("group %s names --%s, which run does not have", g.title, name)
			}
		}
	}
	c.LocalFlags().VisitAll(func(f *pflag.Flag) {
		if f.Hidden {
			return // refused with a usage error that says what replaced it
		}
		if count["--"+f.Name] != 1 {
			t.Errorf("--%s listed %d times in run's help", f.Name, count["--"+f.Name])
		}
	})
	if count["placed --checkout"] != 1 || count["placed --on-lost"] != 1 {
		t.Errorf("--checkout under Workspace and --on-lost under Guard: %v\n%s", count, out)
	}
}
