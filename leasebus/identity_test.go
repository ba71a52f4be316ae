package leasebus

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
)

// identityBus is a bus with a credentials directory of its own, in which
// each of names is an enrolled holder identity (bus enroll NAME).
type identityBus struct {
	url, dir string
	svc      *nats.Conn // the lease service's connection
	service  *Service
	holders  map[string]*nats.Conn
	cfg      ServiceConfig // the service's, less Names
}

// restartService stops the lease service and starts another instance on a
// connection of its own: it knows the leases from the log alone.
func (b *identityBus) restartService(t *testing.T) {
	t.Helper()
	b.service.Stop()
	b.svc = connectFile(t, b.url, filepath.Join(b.dir, CredsFile(RoleService)))
	cfg := b.cfg
	cfg.Names = NamesIn(b.dir)
	svc, err := StartService(context.Background(), b.svc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	b.service = svc // stopped by startIdentityBus's cleanup
}

func startIdentityBus(t *testing.T, names ...string) *identityBus {
	t.Helper()
	return startIdentityBusWith(t, ServiceConfig{}, names...)
}

// startIdentityBusWith is startIdentityBus whose service runs with cfg
// (its Names are the directory's).
func startIdentityBusWith(t *testing.T, cfg ServiceConfig, names ...string) *identityBus {
	t.Helper()
	dir := enrolledCreds(t, names...)
	srv, err := EmbeddedStartServer(ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), CredsDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	})
	return serveIdentityBus(t, srv.ClientURL(), dir, cfg, names...)
}

// enrolledCreds is a new credentials directory in which each of names is
// an enrolled holder identity.
func enrolledCreds(t *testing.T, names ...string) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "creds")
	if _, err := EnsureCreds(dir); err != nil {
		t.Fatal(err)
	}
	for _, n := range names {
		if _, _, err := EnrollIdentity(dir, n, RoleHolder, ""); err != nil {
			t.Fatal(err)
		}
	}
	return dir
}

// serveIdentityBus starts a lease service with cfg on the server at url,
// whose users are those of the credentials directory dir, and connects
// each of names (enrolled there).
func serveIdentityBus(t *testing.T, url, dir string, cfg ServiceConfig, names ...string) *identityBus {
	t.Helper()
	b := &identityBus{url: url, dir: dir, holders: map[string]*nats.Conn{}, cfg: cfg}
	b.svc = connectFile(t, b.url, filepath.Join(dir, CredsFile(RoleService)))
	cfg.Names = NamesIn(dir)
	svc, err := StartService(context.Background(), b.svc, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.service.Stop() })
	b.service = svc
	for _, n := range names {
		b.holders[n] = connectFile(t, b.url, filepath.Join(HoldersDir(dir), n+".nk"))
	}
	return b
}

// connectHolder makes another connection of holder identity name.
func (b *identityBus) connectHolder(t *testing.T, name string) *nats.Conn {
	t.Helper()
	return connectFile(t, b.url, filepath.Join(HoldersDir(b.dir), name+".nk"))
}

// connectFile connects with the credentials file path.
func connectFile(t *testing.T, url, path string, opts ...nats.Option) *nats.Conn {
	t.Helper()
	c, err := LoadCreds(path)
	if err != nil {
		t.Fatal(err)
	}
	copts, err := c.Options()
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(url, append(copts, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	return nc
}

// TestLeaseBoundToItsIdentity: a lease belongs to the bus identity that
// acquired it. Another runner's identity that stole the credential (from
// a credential file, a log, an agent) renews, releases, cancels and
// attaches to nothing, and each refusal is audited with the lease, its
// owner, its fence and reason other-identity; the owner's identity goes
// on renewing and an operator still revokes.
func TestLeaseBoundToItsIdentity(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "runner-a", "runner-b")
	ctx := ctxT(t)
	a, thief := NewClient(b.holders["runner-a"]), NewClient(b.holders["runner-b"])
	cred := NewCredential()
	l, err := a.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "services/billing"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}

	// A renewal proves the credential over (lease, version, renewal id):
	// the thief makes a perfectly valid proof with the stolen credential.
	if _, err := thief.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Repo: repo, Credential: cred, Version: l.Version}); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("renew by another identity with the stolen credential: %v, want %v", err, lease.ErrNotOwner)
	}
	if _, err := thief.Release(ctx, l.LeaseID, cred); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("release by another identity with the stolen credential: %v, want %v", err, lease.ErrNotOwner)
	}
	if h, err := thief.AttachAndHold(ctx, l.LeaseID, cred, HoldOptions{}); !errors.Is(err, lease.ErrNotOwner) {
		if h != nil {
			h.Orphan()
		}
		t.Fatalf("attach by another identity with the stolen credential: %v, want %v", err, lease.ErrNotOwner)
	}
	if got, err := a.Get(ctx, l.LeaseID); err != nil || !got.Active() || got.Version != l.Version {
		t.Fatalf("the refused requests changed the lease: %+v %v", got, err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.svc, repo, 0)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == "other-identity" && ev.LeaseID == l.LeaseID && ev.Owner == owner(1) && ev.Fence == l.Fence {
				n++
				if !strings.Contains(ev.Message, b.holders["runner-b"].Opts.Nkey) {
					return fmt.Errorf("the refusal does not name the asking identity: %q", ev.Message)
				}
			}
		}
		if n != 3 { // renew, release, attach's proving renewal
			return fmt.Errorf("%d other-identity refusals audited, want 3", n)
		}
		return nil
	})

	// The binding is in the lease log: a service that loads the lease
	// afresh refuses the other identity too.
	b.restartService(t)
	if _, err := thief.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Repo: repo, Credential: cred, Version: l.Version}); !errors.Is(err, lease.ErrNotOwner) {
		t.Fatalf("renew by another identity after a service restart: %v, want %v", err, lease.ErrNotOwner)
	}

	// The acquiring identity goes on as before.
	r, err := a.Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Repo: repo, Credential: cred, Version: l.Version})
	if err != nil || r.Version != l.Version+1 {
		t.Fatalf("owner's renew: %+v %v", r, err)
	}
	// An operator revokes whatever identity holds it.
	op := NewClient(connectFile(t, b.url, filepath.Join(b.dir, CredsFile(RoleOperator))))
	if rv, err := op.Revoke(ctx, l.LeaseID, "identity test"); err != nil || rv.Status != lease.StatusRevoked {
		t.Fatalf("operator revoke: %+v %v", rv, err)
	}
}

// TestCancelBoundToItsIdentity: withdrawing a queued acquire (or releasing
// what it was granted) is the asking identity's alone too. Request ids are
// each identity's own (TestRequestIDsAreEachIdentitysOwn): another's
// cancel names a request of its own that it never made, and withdraws
// nothing; a release of the lease by its id is refused by name
// (TestLeaseBoundToItsIdentity).
func TestCancelBoundToItsIdentity(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "runner-a", "runner-b")
	ctx := ctxT(t)
	a, thief := NewClient(b.holders["runner-a"]), NewClient(b.holders["runner-b"])
	cred := NewCredential()
	req := AcquireRequest{Repo: repo, Scope: claim(t, "libs"), Owner: owner(1), TTL: lease.Duration(time.Minute), RequestID: NewRequestID()}
	l, err := a.Acquire(ctx, req, cred)
	if err != nil {
		t.Fatal(err)
	}
	// The thief names the request id and the stolen credential.
	rep, err := thief.request(ctx, "cancel", cancelRequest{Repo: repo, RequestID: req.RequestID, Credential: cred}, 0)
	if err == nil && rep.Error != nil {
		err = rep.Error.err()
	}
	if err != nil {
		t.Fatalf("cancel by another identity of a request id it never sent: %v, want nothing to withdraw", err)
	}
	if got, err := a.Get(ctx, l.LeaseID); err != nil || !got.Active() {
		t.Fatalf("another identity's cancel ended the lease: %+v %v", got, err)
	}
}
