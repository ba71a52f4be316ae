package cli

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// grantedBy waits until the audit of the bus at url has the grant of each
// lease and returns who each was granted to (the identity's name, or its
// public key when the bus gave it no name).
func grantedBy(t *testing.T, url string, leases ...string) map[string]string {
	t.Helper()
	by := map[string]string{}
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
		var evs []lease.AuditEvent
		if err := json.Unmarshal([]byte(r.stdout), &evs); err != nil {
			t.Fatal(err)
		}
		for _, ev := range evs {
			if ev.Type == lease.EventGrant {
				by[ev.LeaseID] = ev.RequestedBy
			}
		}
		for _, l := range leases {
			if by[l] == "" {
				return fmt.Errorf("no grant of %s in the audit yet", l)
			}
		}
		return nil
	})
	return by
}

// TestRunsHaveTheirOwnIdentities: on the embedded default bus, with no
// flag, each run connects with an identity of its own, enrolled for it
// (not the machine's shared holder.nk, as before, with which every run
// could hear every other's answers and act on its leases), and removed
// when it ends.
func TestRunsHaveTheirOwnIdentities(t *testing.T) {
	t.Parallel()
	isolate(t)
	url, _, _, _ := serveInProcess(t, "--listen", "127.0.0.1:0")
	co := newCheckout(t, "")
	r1 := runFL(t, url, "--checkout", co, "--scope", "in", "--", "true").want(t, ExitOK)
	r2 := runFL(t, url, "--checkout", co, "--scope", "in", "--", "true").want(t, ExitOK)
	l1, l2 := leaseOf(t, r1.stderr), leaseOf(t, r2.stderr)
	by := grantedBy(t, url, l1, l2)
	if by[l1] == by[l2] || by[l1] == string(leasebus.RoleHolder) || by[l2] == string(leasebus.RoleHolder) {
		t.Fatalf("the two runs were granted their leases as %q and %q: want two identities of their own", by[l1], by[l2])
	}
	// Each left when it ended.
	r := fl(t, "bus", "identities", "--json").want(t, ExitOK)
	var ids []leasebus.Identity
	if err := json.Unmarshal([]byte(r.stdout), &ids); err != nil || len(ids) != 0 {
		t.Fatalf("identities after the runs: %s %v, want none", r.stdout, err)
	}
}

// TestSidecarsHaveTheirOwnIdentities: two sidecars on the embedded default
// bus, with no flag, each hold their lease as an identity of its own,
// enrolled while they run and gone when they stop.
func TestSidecarsHaveTheirOwnIdentities(t *testing.T) {
	t.Parallel()
	isolate(t)
	url, _, _, _ := serveInProcess(t, "--listen", "127.0.0.1:0")
	gs, _ := seededGitServer(t)
	var scs []*aSidecar
	for _, p := range []string{"a", "b"} {
		scs = append(scs, startSidecar(t, url, "--repo", testRepo, "--scope", p, "--git-upstream", gs.URL+"/payments.git",
			"--admin", "127.0.0.1:0", "--state-dir", t.TempDir()))
	}
	ls := listJSON(t, url, "--repo", testRepo)
	if len(ls) != 2 {
		t.Fatalf("leases: %+v, want the two sidecars'", ls)
	}
	by := grantedBy(t, url, ls[0].LeaseID, ls[1].LeaseID)
	if by[ls[0].LeaseID] == by[ls[1].LeaseID] || by[ls[0].LeaseID] == string(leasebus.RoleHolder) {
		t.Fatalf("the two sidecars were granted their leases as %q and %q: want two identities of their own", by[ls[0].LeaseID], by[ls[1].LeaseID])
	}
	var ids []leasebus.Identity
	r := fl(t, "bus", "identities", "--json").want(t, ExitOK)
	if err := json.Unmarshal([]byte(r.stdout), &ids); err != nil || len(ids) != 2 || !ids[0].Ephemeral || !ids[1].Ephemeral {
		t.Fatalf("identities while the sidecars run: %s %v, want their two ephemeral ones", r.stdout, err)
	}
	for _, sc := range scs {
		sc.cancel()
		if code := sc.wait(t); code != ExitOK {
			t.Fatalf("sidecar exited %d\n%s", code, sc.errOut)
		}
	}
	r = fl(t, "bus", "identities", "--json").want(t, ExitOK)
	if err := json.Unmarshal([]byte(r.stdout), &ids); err != nil || len(ids) != 0 {
		t.Fatalf("identities after the sidecars stopped: %s %v, want none", r.stdout, err)
	}
}
