package gitproxy

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
)

// gitRunner runs the real git: to keep a mirror of the upstream's objects
// (fetch), and in the pre-receive hook.
type gitRunner struct {
	path string // the git binary
}

// command returns a git command on gitDir with an environment free of the
// caller's GIT_* variables (a sidecar started from a hook must not act on
// the hook's repository).
func (g gitRunner) command(ctx context.Context, gitDir string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, g.path, append([]string{"--git-dir=" + gitDir}, args...)...)
	env := make([]string, 0, 8)
	for _, kv := range os.Environ() {
		if strings.HasPrefix(kv, "GIT_") {
			continue
		}
		env = append(env, kv)
	}
	cmd.Env = append(env, "GIT_TERMINAL_PROMPT=0", "GIT_CONFIG_NOSYSTEM=1")
	return cmd
}

// run runs git and returns its stdout; a failure carries git's stderr.
func (g gitRunner) run(ctx context.Context, gitDir string, args ...string) ([]byte, error) {
	cmd := g.command(ctx, gitDir, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("git %s: %w: %s", args[0], err, strings.TrimSpace(stderr.String()))
	}
	return stdout.Bytes(), nil
}

// runHere runs git in the current repository and environment unchanged:
// the hook's, where GIT_DIR and the push's quarantine are set.
func (g gitRunner) runHere(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, g.path, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("git %s: %w: %s", args[0], err, strings.TrimSpace(stderr.String()))
	}
	return out, nil
}
