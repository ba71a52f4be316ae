package pgproxy

import (
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/lease"
)

// DefaultSecretFile is where "fenceline pg install" keeps the
// fence-signing secret on this machine, and where the sidecars look for
// it: inside fenceline's state dir stateDir (the CLI passes the one it
// read from the environment), which the file guard hides from agents.
func DefaultSecretFile(stateDir string) string { return filepath.Join(stateDir, "pg-secret.key") }

// ReadSecretFile reads a secret file written by WriteSecretFile (hex, one
// line).
func ReadSecretFile(path string) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read postgres fence secret: %w", err)
	}
	key, err := hex.DecodeString(strings.TrimSpace(string(b)))
	if err != nil {
		return nil, fmt.Errorf("postgres fence secret %s: not hex: %w", path, err)
	}
	return key, nil
}

// WriteSecretFile writes secret to path (hex, mode 0600 when it makes the
// file), making its directory (mode 0700) when missing.
func WriteSecretFile(path string, secret []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return fmt.Errorf("secret file: %w", err)
	}
	if err := os.WriteFile(path, []byte(hex.EncodeToString(secret)+"\n"), 0o600); err != nil {
		return fmt.Errorf("write secret file %s: %w", path, err)
	}
	return nil
}

// LoadSecret reads the database's fence secret (what "fenceline pg
// install" wrote, for "fenceline bus fence-secret set --postgres") from
// file or, when file is "", from DefaultSecretFile(stateDir) when that exists, and
// checks its length. It returns the file it read, also with an error; with file "" and
// no default file it returns no secret, no file and no error.
func LoadSecret(stateDir, file string) (secret []byte, path string, err error) {
	path = file
	if path == "" {
		if _, err := os.Stat(DefaultSecretFile(stateDir)); err != nil {
			return nil, "", nil
		}
		path = DefaultSecretFile(stateDir)
	}
	if secret, err = ReadSecretFile(path); err != nil {
		return nil, path, err
	}
	if len(secret) < lease.MinStorageSecret {
		return nil, path, fmt.Errorf("postgres fence secret %s has %d bytes: want the key from \"fenceline pg install\" (32 bytes)", path, len(secret))
	}
	return secret, path, nil
}

// InstallDSN connects to the database dsn names (as its admin role), runs
// Install on tables with opts, and writes the secret it installed to
// secretFile (WriteSecretFile).
func InstallDSN(ctx context.Context, dsn string, tables []string, opts InstallOptions, secretFile string) (*Installed, error) {
	conn, err := pgx.Connect(ctx, dsn)
	if err != nil {
		return nil, fmt.Errorf("pg install: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	in, err := Install(ctx, conn, tables, opts)
	if err != nil {
		return nil, err
	}
	if err := WriteSecretFile(secretFile, in.Secret); err != nil {
		return nil, fmt.Errorf("pg install: %w", err)
	}
	return in, nil
}
