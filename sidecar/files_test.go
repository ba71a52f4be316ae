package sidecar

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestDefaultStateDir: a lease's files go under fenceline's state dir.
func TestDefaultStateDir(t *testing.T) {
	state := t.TempDir()
	if got, want := DefaultStateDir(state, "lease_1"), filepath.Join(state, "sidecar", "lease_1"); got != want {
		t.Fatalf("DefaultStateDir = %s, want %s", got, want)
	}
}

// TestReadAdminToken: space is trimmed, an empty file is
// ErrEmptyAdminToken and a missing one the read error.
func TestReadAdminToken(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "token")
	if err := os.WriteFile(file, []byte("\n from-file \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if tok, err := ReadAdminToken(file); tok != "from-file" || err != nil {
		t.Fatalf("from the file: %q, %v", tok, err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, []byte(" \n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if tok, err := ReadAdminToken(empty); tok != "" || !errors.Is(err, ErrEmptyAdminToken) {
		t.Fatalf("an empty file: %q, %v", tok, err)
	}
	missing := filepath.Join(dir, "missing")
	if _, err := ReadAdminToken(missing); !errors.Is(err, fs.ErrNotExist) || !strings.Contains(err.Error(), missing) {
		t.Fatalf("a missing file: %v", err)
	}
}

// TestWriteEnvFile: KEY=VALUE lines, replacing the file whole, with no
// temporary file left; a directory that does not exist is an error.
func TestWriteEnvFile(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.env")
	if err := os.WriteFile(file, []byte("OLD=1\nSTALE=2\nLONGER=3\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	env := []string{"PGHOST=127.0.0.1", "PGPORT=5433", "GIT_CONFIG_COUNT=0"}
	if err := WriteEnvFile(file, env); err != nil {
		t.Fatal(err)
	}
	data, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	if want := "PGHOST=127.0.0.1\nPGPORT=5433\nGIT_CONFIG_COUNT=0\n"; string(data) != want {
		t.Fatalf("env file:\n%s\nwant:\n%s", data, want)
	}
	if _, err := os.Stat(file + ".tmp"); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("temporary file left: %v", err)
	}
	if err := WriteEnvFile(filepath.Join(t.TempDir(), "missing", "agent.env"), env); err == nil || !strings.HasPrefix(err.Error(), "write env file: ") {
		t.Fatalf("into a missing directory: %v", err)
	}
}
