package leasebus

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// Storage accepts only fences the lease service granted (lease/grant.go):
// the service holds each repository's storage secrets (the git hook's
// secret, the Postgres fence's fenceline.secret), derives a grant key per
// lease from them, and hands the keys to the acquirer alone, in the answer
// to its acquire or renewal (an attach renews). They are never in the
// lease log, a change notice, a get or list answer, or the audit.
//
// The secrets live in a directory only the service reads
// (ServiceConfig.FenceSecretDir; a Kubernetes Secret mounted in the
// service's pod), never in the bus's store: every role that may read
// JetStream, and every backup of its disks, would hold them.

// FenceSecretDirIn is where `bus serve` reads the storages' secrets and
// `bus fence-secret set` writes them by default, in fenceline's state
// directory stateDir: <stateDir>/fence-secrets.
func FenceSecretDirIn(stateDir string) string { return filepath.Join(stateDir, "fence-secrets") }

// GrantKeys are a lease's grant keys (lease.GrantKeys).
type GrantKeys = lease.GrantKeys

// FenceSecretFile is where dir keeps repo's storage secret of storage
// (lease.StorageGit or lease.StoragePostgres): <dir>/<RepoKey>.<storage>.key.
func FenceSecretFile(dir, repo, storage string) string {
	return filepath.Join(dir, RepoKey(repo)+"."+storage+".key")
}

// WriteFenceSecret stores repo's storage secret of storage in dir (hex,
// mode 0600; dir is made 0700), replacing any earlier one: from then on
// the service grants fences that the storage holding secret accepts.
func WriteFenceSecret(dir, repo, storage string, secret []byte) error {
	if storage != lease.StorageGit && storage != lease.StoragePostgres {
		return fmt.Errorf("fence secret: storage %q: want %s or %s", storage, lease.StorageGit, lease.StoragePostgres)
	}
	if len(secret) < lease.MinStorageSecret {
		return fmt.Errorf("fence secret of %s for %s: %d bytes, want at least %d", storage, repo, len(secret), lease.MinStorageSecret)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("fence secret: %w", err)
	}
	file := FenceSecretFile(dir, repo, storage)
	tmp, err := os.CreateTemp(dir, ".tmp-*")
	if err != nil {
		return fmt.Errorf("fence secret: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.WriteString(hex.EncodeToString(secret) + "\n"); err != nil {
		tmp.Close()
		return fmt.Errorf("fence secret %s: %w", file, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("fence secret %s: %w", file, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("fence secret %s: %w", file, err)
	}
	if err := os.Rename(tmp.Name(), file); err != nil {
		return fmt.Errorf("fence secret: %w", err)
	}
	return nil
}

// readFenceSecret reads repo's storage secret of storage from dir; nil
// when there is none.
func readFenceSecret(dir, repo, storage string) ([]byte, error) {
	data, err := os.ReadFile(FenceSecretFile(dir, repo, storage))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	secret, err := hex.DecodeString(strings.TrimSpace(string(data)))
	if err != nil || len(secret) < lease.MinStorageSecret {
		return nil, fmt.Errorf("fence secret %s is not a hex key of at least %d bytes (write it with fenceline bus fence-secret set)", FenceSecretFile(dir, repo, storage), lease.MinStorageSecret)
	}
	return secret, nil
}

// grantKeys are the grant keys of l for its acquirer: nil when the
// service keeps no fence secrets, the repository has none, or l is not
// active. A secret that cannot be read is logged, and the lease is
// answered without the key (its storage then refuses its writes, naming
// the missing signature).
func (s *Service) grantKeys(l *lease.Lease) *GrantKeys {
	dir := s.cfg.FenceSecretDir
	if dir == "" || !l.Active() {
		return nil
	}
	git, pg, err := s.secrets.get(dir, l.Repo)
	var keys *GrantKeys
	if err == nil {
		keys, err = lease.GrantKeysFor(l, git, pg)
	}
	if err != nil {
		s.log.Error("grant keys not made; the lease's storage will refuse its writes", "lease", l.LeaseID, "repo", l.Repo, "err", err)
	}
	return keys
}

// secretCache keeps what FenceSecretDir held when its modification time
// was last seen, so an acquire or renewal reads the directory's inode, not
// its files (WriteFenceSecret renames into it, which changes the time).
type secretCache struct {
	mu     sync.Mutex
	mod    time.Time            // the directory's, when read; guarded by mu
	byRepo map[string][2][]byte // repo -> git, postgres; guarded by mu
	errs   map[string]error     // repo -> why its secrets cannot be read; guarded by mu
}

func (c *secretCache) get(dir, repo string) (git, pg []byte, err error) {
	fi, err := os.Stat(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil, nil
	}
	if err != nil {
		return nil, nil, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if !fi.ModTime().Equal(c.mod) || c.byRepo == nil {
		c.mod, c.byRepo, c.errs = fi.ModTime(), map[string][2][]byte{}, map[string]error{}
	}
	if v, ok := c.byRepo[repo]; ok {
		return v[0], v[1], c.errs[repo]
	}
	git, gerr := readFenceSecret(dir, repo, lease.StorageGit)
	pg, perr := readFenceSecret(dir, repo, lease.StoragePostgres)
	err = errors.Join(gerr, perr)
	c.byRepo[repo], c.errs[repo] = [2][]byte{git, pg}, err
	return git, pg, err
}

// answersWithGrants reports whether an answer of op goes to the lease's
// acquirer alone, proven by its credential: acquire (its request carries
// the credential's hash) and renew (its proof).
func answersWithGrants(op string) bool { return op == "acquire" || op == "renew" }

// GrantKeys returns the lease's grant keys as the lease service gave them
// to its acquirer (nil: none). They stay the same for the lease's life:
// a grant's fence and claim never change.
func (h *Holder) GrantKeys() *GrantKeys { return h.grants }

// GrantKeys returns the keys the remembered record carries.
func (f Frozen) GrantKeys() *GrantKeys { return f.Record.Grants }

var (
	_ lease.Granter = (*Holder)(nil)
	_ lease.Granter = Frozen{}
)
