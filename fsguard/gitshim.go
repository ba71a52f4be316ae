//go:build linux && (amd64 || arm64)

package fsguard

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
)

// shimEnv carries the git shim's configuration into the attempt.
const shimEnv = "FENCELINE_GIT_SHIM"

// shimConfig is what the git shim knows: the real git, what it refuses,
// and how to explain a refusal.
type shimConfig struct {
	RealGit string   `json:"realGit"`
	Denied  []string `json:"denied"`
	Lease   string   `json:"lease"`
}

// installShim makes a directory with a git that is this binary, puts it
// first on PATH and returns the attempt's environment.
func (pr *Process) installShim(env []string) ([]string, error) {
	p := pr.policy
	real := p.RealGit
	if real == "" {
		var err error
		if real, err = exec.LookPath("git"); err != nil {
			return nil, fmt.Errorf("git shim: no real git on PATH (set Policy.RealGit): %w", err)
		}
	}
	if !filepath.IsAbs(real) {
		return nil, fmt.Errorf("git shim: real git %q must be an absolute path", real)
	}
	self, err := os.Executable()
	if err != nil {
		return nil, fmt.Errorf("git shim: find this binary: %w", err)
	}
	if pr.shimDir, err = os.MkdirTemp(p.TempRoot, "fenceline-shim-"); err != nil {
		return nil, fmt.Errorf("git shim dir: %w", err)
	}
	if err := os.Symlink(self, filepath.Join(pr.shimDir, "git")); err != nil {
		return nil, fmt.Errorf("git shim: %w", err)
	}
	denied := p.GitDenied
	if denied == nil {
		denied = DefaultRepoWideGit
	}
	cfg, err := json.Marshal(shimConfig{RealGit: real, Denied: denied, Lease: p.leaseDesc()})
	if err != nil {
		return nil, fmt.Errorf("git shim config: %w", err)
	}
	path := pr.shimDir
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok && v != "" {
			path += ":" + v
		}
	}
	env = setEnv(env, "PATH", path)
	return setEnv(env, shimEnv, string(cfg)), nil
}

// runShim is the git shim: it refuses a denied subcommand with a message
// naming the lease and runs the real git for everything else. It is a
// convenience for the agent; Landlock is what actually stops the write.
func runShim(rawCfg string, args []string, stderr io.Writer) int {
	var cfg shimConfig
	if err := json.Unmarshal([]byte(rawCfg), &cfg); err != nil || cfg.RealGit == "" {
		fmt.Fprintf(stderr, "fenceline git shim: bad %s: %v\n", shimEnv, err)
		return 128
	}
	if cmd := deniedGit(cfg.Denied, args); cmd != "" {
		fmt.Fprintf(stderr, "fenceline: refused `git %s`: it changes the whole repository (HEAD, index, refs or objects), "+
			"and this attempt runs under %s, a path lease in a shared workspace.\n"+
			"Only an attempt with an exclusive workspace (fenceline run --workspace exclusive) may run it; "+
			"the files of your claim are yours to edit, and read-only git (status, diff, log, show, blame, grep) works.\n",
			cmd, cfg.Lease)
		return 3
	}
	env := setEnv(os.Environ(), "GIT_OPTIONAL_LOCKS", "0")
	err := syscall.Exec(cfg.RealGit, append([]string{"git"}, args...), env)
	fmt.Fprintf(stderr, "fenceline git shim: exec %s: %v\n", cfg.RealGit, err)
	return 128
}

// gitGlobalWithValue are git's global options that take the next argument.
var gitGlobalWithValue = []string{"-C", "-c", "--git-dir", "--work-tree", "--namespace", "--super-prefix", "--config-env", "--list-cmds"}

// deniedGit returns the refused command ("stash", "branch -d") or "".
func deniedGit(denied, args []string) string {
	sub, rest := "", []string(nil)
	for i := 0; i < len(args); i++ {
		a := args[i]
		if slices.Contains(gitGlobalWithValue, a) {
			i++
			continue
		}
		if strings.HasPrefix(a, "-") {
			continue
		}
		sub, rest = a, args[i+1:]
		break
	}
	if sub == "" {
		return ""
	}
	for _, d := range denied {
		f := strings.Fields(d)
		if len(f) == 0 || f[0] != sub {
			continue
		}
		if len(f) == 1 {
			return sub
		}
		for _, flag := range f[1:] {
			for _, r := range rest {
				if r == flag || (flag == "-d" && (r == "-D" || r == "--delete" || (strings.HasPrefix(r, "-") && !strings.HasPrefix(r, "--") && strings.ContainsAny(r, "dD")))) {
					return sub + " " + flag
				}
			}
		}
	}
	return ""
}
