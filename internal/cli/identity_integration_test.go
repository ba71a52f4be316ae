//go:build integration

package cli

import (
	"path/filepath"
	"testing"
)

// TestBusEnrollAndRevokeIdentity: what a platform team runs. `bus enroll`
// gives one runner an identity and a credentials file, which the running
// embedded bus admits at once; the lease it acquires is its own (the
// machine's shared holder identity cannot renew it, even with the lease's
// credential file); `bus revoke-identity` makes the bus refuse it, and
// nobody else is touched.
func TestBusEnrollAndRevokeIdentity(t *testing.T) {
	isolate(t)
	url, _, _, _ := serveInProcess(t, "--listen", "127.0.0.1:0")
	out := filepath.Join(t.TempDir(), "runner-ci-4.nk")
	r := fl(t, "--nats", url, "bus", "enroll", "runner-ci-4", "--out", out).want(t, ExitOK)
	mustContain(t, "enroll stdout", r.stdout, "identity enrolled: runner-ci-4", "role: holder", "credentials: "+out)
	mustContain(t, "enroll stderr", r.stderr, "reloaded its identities")
	fl(t, "--nats", url, "bus", "enroll", "runner-ci-4", "--out", filepath.Join(t.TempDir(), "again.nk")).want(t, ExitError)
	fl(t, "bus", "enroll", "eph-mine").want(t, ExitUsage)

	a := acquireJSON(t, url, "--creds", out, "--scope", "services/billing")
	fl(t, "--nats", url, "--creds", out, "lease", "renew", a.LeaseID).want(t, ExitOK)
	// The machine's shared holder key, with the lease's own credential
	// file: another identity.
	r = fl(t, "--nats", url, "lease", "renew", a.LeaseID).want(t, ExitConflict)
	mustContain(t, "renew by another identity", r.stderr, "another")
	other := acquireJSON(t, url, "--scope", "libs")

	r = fl(t, "--nats", url, "bus", "revoke-identity", "runner-ci-4").want(t, ExitOK)
	mustContain(t, "revoke-identity stdout", r.stdout, "identity revoked: runner-ci-4")
	r = fl(t, "--nats", url, "--creds", out, "lease", "list").want(t, ExitError)
	mustContain(t, "revoked identity", r.stderr, "refused the credentials", out)
	fl(t, "--nats", url, "lease", "renew", other.LeaseID).want(t, ExitOK)
	fl(t, "--nats", url, "bus", "revoke-identity", "runner-ci-4").want(t, ExitError)
}
