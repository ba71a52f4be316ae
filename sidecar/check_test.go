package sidecar

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/gitproxy"
)

// TestCheckGitUpstream: what Start refuses of a git upstream, refused
// without a lease.
func TestCheckGitUpstream(t *testing.T) {
	for _, tc := range []struct {
		raw     string
		forward bool
		err     string
	}{
		{raw: "https://git.example.com/acme/payments.git"},
		{raw: "https://git.example.com", forward: true},
		{raw: "http://git.example.com/acme/payments.git"},
		{raw: "ftp://x", err: "http:// or https://"},
		{raw: "git.example.com/acme/payments.git", err: "http:// or https://"},
		{raw: "http://git.example.com/acme/payments.git", forward: true, err: "is for https remotes"},
	} {
		err := CheckGitUpstream(tc.raw, tc.forward)
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("CheckGitUpstream(%q, %v) = %v, want %q", tc.raw, tc.forward, err, tc.err)
		}
	}
}

// TestReadCAFile: a missing file, and one without a certificate, are
// errors; a CA certificate is a pool.
func TestReadCAFile(t *testing.T) {
	dir := t.TempDir()
	_, caFile, err := gitproxy.LoadOrCreateCA(filepath.Join(dir, "ca"))
	if err != nil {
		t.Fatal(err)
	}
	if pool, err := ReadCAFile(caFile); err != nil || pool == nil {
		t.Errorf("ReadCAFile of a CA certificate: %v", err)
	}
	if _, err := ReadCAFile(filepath.Join(dir, "missing.pem")); err == nil || !os.IsNotExist(err) {
		t.Errorf("ReadCAFile of a missing file: %v", err)
	}
	junk := filepath.Join(dir, "junk.pem")
	os.WriteFile(junk, []byte("not a certificate\n"), 0o644)
	if _, err := ReadCAFile(junk); err == nil || !strings.Contains(err.Error(), "no PEM certificate") {
		t.Errorf("ReadCAFile of a file without a certificate: %v", err)
	}
}

// TestAdminConfigValidateListen: the listen address's syntax, and a token
// off loopback, are checked before anything listens.
func TestAdminConfigValidateListen(t *testing.T) {
	const token = "0123456789abcdef0123"
	for _, tc := range []struct {
		cfg AdminConfig
		err string
	}{
		{cfg: AdminConfig{}},
		{cfg: AdminConfig{Listen: "127.0.0.1:0"}},
		{cfg: AdminConfig{Listen: "[::1]:9090"}},
		{cfg: AdminConfig{Listen: "localhost:9090"}},
		{cfg: AdminConfig{Listen: "0.0.0.0:9090", Token: token}},
		{cfg: AdminConfig{Listen: "9090"}, err: "want host:port"},
		{cfg: AdminConfig{Listen: "127.0.0.1:nope"}, err: "port"},
		{cfg: AdminConfig{Listen: "0.0.0.0:9090"}, err: "needs a bearer token"},
		{cfg: AdminConfig{Listen: ":9090"}, err: "needs a bearer token"},
		{cfg: AdminConfig{Listen: "10.1.2.3:9090"}, err: "needs a bearer token"},
	} {
		err := tc.cfg.Validate()
		if (tc.err == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.err)) {
			t.Errorf("Validate(%+v) = %v, want %q", tc.cfg, err, tc.err)
		}
	}
}
