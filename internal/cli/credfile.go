package cli

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/fenceline/fenceline/leasebus"
)

// credFile is what the acquiring machine keeps of a lease so that only its
// user can renew or release it: the secret credential (the bus stores only
// its hash), the version the last renewal saw, and the bus it lives on.
type credFile struct {
	LeaseID    string              `json:"leaseId"`
	Repo       string              `json:"repo"`
	Credential leasebus.Credential `json:"credential"`
	Version    uint64              `json:"version"`
	NATS       string              `json:"nats"`
}

// credDir is <state dir>/leases.
func credDir() string { return filepath.Join(leasebus.StateDir(), "leases") }

// credPath is where the credential of lease id lives. id must have been
// checked with checkLeaseID: it becomes part of a file name.
func credPath(id string) string { return filepath.Join(credDir(), id+".json") }

// checkLeaseID rejects anything that is not a lease id before it is used as
// a file name or sent to the bus.
func checkLeaseID(id string) error {
	if !leasebus.ValidLeaseID(id) {
		return usagef("%q is not a lease id (want lease_ followed by lower-case letters and digits, as printed by \"fenceline lease acquire\" or \"fenceline lease list\")", id)
	}
	return nil
}

// writeCredFile stores f atomically (temp file + rename) with mode 0600 in
// a 0700 directory.
func writeCredFile(f *credFile) (string, error) {
	dir := credDir()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("create credential dir: %w", err)
	}
	if fi, err := os.Stat(dir); err == nil && fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(dir, 0o700); err != nil {
			return "", fmt.Errorf("restrict credential dir %s to its owner: %w", dir, err)
		}
	}
	data, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return "", fmt.Errorf("encode credential file: %w", err)
	}
	data = append(data, '\n')
	path := credPath(f.LeaseID)
	tmp, err := os.CreateTemp(dir, "."+f.LeaseID+".*.tmp") // mode 0600
	if err != nil {
		return "", fmt.Errorf("write credential file: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after the rename
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return "", fmt.Errorf("write credential file %s: %w", tmp.Name(), err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return "", fmt.Errorf("write credential file %s: %w", tmp.Name(), err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return "", fmt.Errorf("write credential file %s: %w", tmp.Name(), err)
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("write credential file %s: %w", tmp.Name(), err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return "", fmt.Errorf("write credential file %s: %w", path, err)
	}
	return path, nil
}

// errNoCredFile means this machine keeps no credential for the lease.
var errNoCredFile = errors.New("no credential file")

// readCredFile reads the credential of lease id, or errNoCredFile.
func readCredFile(id string) (*credFile, error) {
	path := credPath(id)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w for %s in %s", errNoCredFile, id, credDir())
	}
	if err != nil {
		return nil, fmt.Errorf("read credential file: %w", err)
	}
	var f credFile
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("credential file %s is damaged: %w", path, err)
	}
	if f.LeaseID != id || f.Credential == "" {
		return nil, fmt.Errorf("credential file %s does not hold a credential for %s", path, id)
	}
	return &f, nil
}

func removeCredFile(id string) error {
	err := os.Remove(credPath(id))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove credential file: %w", err)
	}
	return nil
}
