// Package credfile keeps what the acquiring machine knows of its leases,
// one file per lease, so that only its user can renew or release them:
// the secret credential (the bus stores only its hash), the version the
// last renewal saw, and the bus the lease lives on.
package credfile

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// File is one lease's credential file.
type File struct {
	LeaseID    string              `json:"leaseId"`
	Repo       string              `json:"repo"`
	Credential leasebus.Credential `json:"credential"`
	Version    uint64              `json:"version"`
	NATS       string              `json:"nats"`
}

// ErrNoFile means the store keeps no credential for the lease.
var ErrNoFile = errors.New("no credential file")

// Store is a directory of credential files, <lease id>.json, each of mode
// 0600 in the 0700 directory.
type Store struct {
	Dir string
}

// In is the store in fenceline's state directory stateDir:
// <stateDir>/leases.
func In(stateDir string) Store { return Store{Dir: filepath.Join(stateDir, "leases")} }

// Path is where the credential of lease id lives. id becomes part of a
// file name: only a valid lease id (leasebus.ValidLeaseID) is read,
// written or removed.
func (s Store) Path(id string) string { return filepath.Join(s.Dir, id+".json") }

func checkID(id string) error {
	if !lease.ValidLeaseID(id) {
		return fmt.Errorf("%q is not a lease id: no credential file is named after it", id)
	}
	return nil
}

// Write stores f atomically (temp file, fsync, rename) with mode 0600 in a
// 0700 directory (made, or restricted, if need be), and returns its path.
func (s Store) Write(f *File) (string, error) {
	if err := checkID(f.LeaseID); err != nil {
		return "", err
	}
	if err := os.MkdirAll(s.Dir, 0o700); err != nil {
		return "", fmt.Errorf("create credential dir: %w", err)
	}
	if fi, err := os.Stat(s.Dir); err == nil && fi.Mode().Perm() != 0o700 {
		if err := os.Chmod(s.Dir, 0o700); err != nil {
			return "", fmt.Errorf("restrict credential dir %s to its owner: %w", s.Dir, err)
		}
	}
	data, err := json.MarshalIndent(f, "", "  ")
	if err != nil {
		return "", fmt.Errorf("encode credential file: %w", err)
	}
	data = append(data, '\n')
	path := s.Path(f.LeaseID)
	tmp, err := os.CreateTemp(s.Dir, "."+f.LeaseID+".*.tmp") // mode 0600
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

// Read reads the credential of lease id; ErrNoFile (wrapped) when the
// store has none.
func (s Store) Read(id string) (*File, error) {
	if err := checkID(id); err != nil {
		return nil, err
	}
	path := s.Path(id)
	data, err := os.ReadFile(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%w for %s in %s", ErrNoFile, id, s.Dir)
	}
	if err != nil {
		return nil, fmt.Errorf("read credential file: %w", err)
	}
	var f File
	if err := json.Unmarshal(data, &f); err != nil {
		return nil, fmt.Errorf("credential file %s is damaged: %w", path, err)
	}
	if f.LeaseID != id || f.Credential == "" {
		return nil, fmt.Errorf("credential file %s does not hold a credential for %s", path, id)
	}
	return &f, nil
}

// Remove forgets the credential of lease id; one that is not there is no
// error.
func (s Store) Remove(id string) error {
	if err := checkID(id); err != nil {
		return err
	}
	err := os.Remove(s.Path(id))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove credential file: %w", err)
	}
	return nil
}
