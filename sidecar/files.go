package sidecar

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

// DefaultStateDir is where a sidecar keeps its files (Config.StateDir)
// for the lease leaseID when not told: <fenceline's state dir>/sidecar/<lease>.
func DefaultStateDir(fencelineStateDir, leaseID string) string {
	return filepath.Join(fencelineStateDir, "sidecar", leaseID)
}

// ErrEmptyAdminToken is ReadAdminToken's error for a token file that
// holds no token.
var ErrEmptyAdminToken = errors.New("the admin token file is empty")

// ReadAdminToken reads the admin API's bearer token (AdminConfig.Token)
// from file, trimmed of surrounding space. A file that cannot be read is
// os.ReadFile's error (it names the file); one that holds no token is
// ErrEmptyAdminToken. (The token may also come from the environment,
// $EnvAdminToken: the caller reads it.)
func ReadAdminToken(file string) (string, error) {
	data, err := os.ReadFile(file)
	if err != nil {
		return "", err
	}
	tok := strings.TrimSpace(string(data))
	if tok == "" {
		return "", ErrEmptyAdminToken
	}
	return tok, nil
}

// WriteEnvFile writes the agent's environment (AgentEnv) to path as
// KEY=VALUE lines, atomically: a reader sees the old file or the whole
// new one.
func WriteEnvFile(path string, env []string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(strings.Join(env, "\n")+"\n"), 0o644); err != nil {
		return fmt.Errorf("write env file: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write env file: %w", err)
	}
	return nil
}
