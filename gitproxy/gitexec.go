package gitproxy

import (
	"bytes"
	"context"
	"fmt"
	"strings"

	"github.com/fenceline/fenceline/internal/gitsafe"
)

// gitRunner runs the real git (to keep a mirror of the upstream's objects,
// and in the pre-receive hook) through gitsafe: no hook, and no program
// the repository's configuration names, ever runs.
type gitRunner struct {
	path string // the git binary
}

// run runs git on gitDir, with an environment free of the caller's GIT_*
// variables (a sidecar started from a hook must not act on the hook's
// repository), and returns its stdout; a failure carries git's stderr.
func (g gitRunner) run(ctx context.Context, gitDir string, args ...string) ([]byte, error) {
	gs := gitsafe.Git{Bin: g.path, Env: []string{"GIT_DIR=" + gitDir, "GIT_CONFIG_NOSYSTEM=1"}}
	return output(ctx, gs, args)
}

// runHere runs git in the current repository and environment: the
// hook's, where GIT_DIR and the push's quarantine are set.
func (g gitRunner) runHere(ctx context.Context, args ...string) ([]byte, error) {
	return output(ctx, gitsafe.Git{Bin: g.path, KeepEnv: true}, args)
}

func output(ctx context.Context, gs gitsafe.Git, args []string) ([]byte, error) {
	cmd, err := gs.Command(ctx, args...)
	if err != nil {
		return nil, err
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("git %s: %w: %s", args[0], err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}
