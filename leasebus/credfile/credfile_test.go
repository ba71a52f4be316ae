package credfile

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/leasebus"
)

// A credential file round-trips, is 0600 in a 0700 directory (a looser
// directory is tightened), is replaced whole on rewrite, and is gone after
// Remove, which is idempotent.
func TestStoreWriteReadRemove(t *testing.T) {
	s := Store{Dir: filepath.Join(t.TempDir(), "leases")}
	f := &File{LeaseID: "lease_abc123", Repo: "github.com/acme/billing", Credential: leasebus.NewCredential(), Version: 1, NATS: "nats://127.0.0.1:7422"}
	path, err := s.Write(f)
	if err != nil {
		t.Fatal(err)
	}
	if path != filepath.Join(s.Dir, "lease_abc123.json") || path != s.Path(f.LeaseID) {
		t.Errorf("written to %s", path)
	}
	if fi, err := os.Stat(path); err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("file %s: %v %v, want mode 0600", path, fi, err)
	}
	if fi, err := os.Stat(s.Dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("dir %s: %v %v, want mode 0700", s.Dir, fi, err)
	}
	got, err := s.Read(f.LeaseID)
	if err != nil || *got != *f {
		t.Fatalf("read %+v, %v; want %+v", got, err, f)
	}

	if err := os.Chmod(s.Dir, 0o755); err != nil {
		t.Fatal(err)
	}
	f.Version = 7
	if _, err := s.Write(f); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(s.Dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Errorf("dir after rewrite: %v %v, want mode 0700", fi, err)
	}
	if got, err := s.Read(f.LeaseID); err != nil || got.Version != 7 {
		t.Errorf("after rewrite: %+v, %v; want version 7", got, err)
	}
	entries, err := os.ReadDir(s.Dir)
	if err != nil || len(entries) != 1 {
		t.Errorf("store holds %v (%v), want the one file and no temp files", entries, err)
	}

	for range 2 {
		if err := s.Remove(f.LeaseID); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.Read(f.LeaseID); !errors.Is(err, ErrNoFile) {
		t.Fatalf("read after remove: %v, want ErrNoFile", err)
	}
}

// What is not a credential file of the lease is reported as such, not as a
// missing one; a name that is not a lease id never becomes a path.
func TestStoreRefuses(t *testing.T) {
	s := Store{Dir: t.TempDir()}
	_, err := s.Read("lease_none")
	if !errors.Is(err, ErrNoFile) || err.Error() != "no credential file for lease_none in "+s.Dir {
		t.Errorf("missing: %v", err)
	}
	for name, data := range map[string]string{
		"lease_damaged": "{not json",
		"lease_other":   `{"leaseId":"lease_else","credential":"c"}`,
		"lease_nocred":  `{"leaseId":"lease_nocred"}`,
	} {
		if err := os.WriteFile(s.Path(name), []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := s.Read(name)
		if err == nil || errors.Is(err, ErrNoFile) || !strings.Contains(err.Error(), s.Path(name)) {
			t.Errorf("%s: %v, want an error naming the file", name, err)
		}
	}
	for _, id := range []string{"../x", "lease_../../x", "", "lease_A"} {
		if _, err := s.Read(id); err == nil || errors.Is(err, ErrNoFile) {
			t.Errorf("Read(%q): %v", id, err)
		}
		if _, err := s.Write(&File{LeaseID: id, Credential: "c"}); err == nil {
			t.Errorf("Write(%q) succeeded", id)
		}
		if err := s.Remove(id); err == nil {
			t.Errorf("Remove(%q) succeeded", id)
		}
	}
}
