package attempt

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/fenceline/fenceline/internal/gitsafe"
	"github.com/fenceline/fenceline/internal/repoid"
)

// Checkout is the local repository an attempt works in.
type Checkout struct {
	Root    string   // real absolute path of its top directory
	Repo    string   // bus identity: normalized origin URL, else Root
	Origin  string   // remote.origin.url as configured, "" without one
	GitDirs []string // real git dirs: the worktree's, then the common one
}

// FindCheckout resolves path, which names the top directory of a git
// checkout or a plain directory, to the checkout an attempt works in. Its
// Repo is the origin's identity (package repoid), else its real path. Git
// runs through gitsafe: no hook and no program the repository's
// configuration names runs, since an earlier attempt may have planted
// them.
func FindCheckout(ctx context.Context, path string) (*Checkout, error) {
	abs, err := filepath.Abs(path)
	if err == nil {
		abs, err = filepath.EvalSymlinks(abs)
	}
	if err != nil {
		return nil, invalidf("%s: %v (want the local checkout the agent works in)", path, err)
	}
	if fi, err := os.Stat(abs); err != nil || !fi.IsDir() {
		return nil, invalidf("%s is not a directory (want the local checkout the agent works in)", path)
	}
	co := &Checkout{Root: abs, Repo: abs}
	top, err := gitOutput(ctx, abs, "rev-parse", "--show-toplevel", "--absolute-git-dir", "--git-common-dir")
	if err != nil {
		if _, serr := os.Lstat(filepath.Join(abs, ".git")); serr == nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		return co, nil // a plain directory: its path is the repo
	}
	lines := strings.Split(strings.TrimSpace(top), "\n")
	if len(lines) != 3 {
		return nil, fmt.Errorf("%s: unexpected git rev-parse output %q", path, top)
	}
	if t, err := filepath.EvalSymlinks(lines[0]); err != nil || t != abs {
		return nil, invalidf("%s is inside the checkout %s: pass its top directory", path, lines[0])
	}
	for _, d := range lines[1:] {
		if !filepath.IsAbs(d) {
			d = filepath.Join(abs, d)
		}
		if real, err := filepath.EvalSymlinks(d); err == nil && !slices.Contains(co.GitDirs, real) {
			co.GitDirs = append(co.GitDirs, real)
		}
	}
	if origin, err := gitOutput(ctx, abs, "config", "--get", "remote.origin.url"); err == nil && strings.TrimSpace(origin) != "" {
		co.Origin = strings.TrimSpace(origin)
		co.Repo = repoid.FromRemote(co.Origin, abs)
	}
	return co, nil
}

func gitOutput(ctx context.Context, dir string, args ...string) (string, error) {
	return gitsafe.Git{Dir: dir}.Output(ctx, args...)
}

// Within reports whether p is dir or lies beneath it (both absolute).
func Within(p, dir string) bool {
	p, dir = filepath.Clean(p), filepath.Clean(dir)
	return p == dir || dir == "/" || strings.HasPrefix(p, dir+"/")
}
