package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

// heldLease is a lease this process holds: acquired from flags, or attached
// to by id with its credential.
type heldLease struct {
	holder *leasebus.Holder // Attached: not taken here, so not released here
	cred   leasebus.Credential
}

// dialHolder connects to the bus for a long-lived holder: it reconnects
// forever, and the holder reports "unknown" meanwhile. With name set and
// no --creds or $FENCELINE_CREDS, on the default bus's machine, the holder
// gets an identity of its own, enrolled for it under name and removed when
// the session closes (see dialEphemeral); else it connects with the
// holder credentials credsFor chooses.
func (a *app) dialHolder(name string) (*session, error) {
	url, source := a.busURL()
	if name != "" {
		s, err := a.dialEphemeral(url, source, name)
		if s != nil || err != nil {
			return s, err
		}
	}
	nc, err := a.connect(leasebus.RoleHolder, url, source, holderConnOptions()...)
	if err != nil {
		return nil, err
	}
	c := leasebus.NewClient(nc)
	return &session{nc: nc, client: c, url: url}, nil
}

// enrolTimeout bounds waiting for the bus to admit a freshly enrolled
// identity (each node of a cluster reloads its own users).
const enrolTimeout = 5 * time.Second

// dialEphemeral connects as a holder identity of this session's own: a
// key pair made here, enrolled as name by the embedded bus with this
// machine's enroller credentials (which may do nothing else), and removed
// when the session closes. No holder shares its answers or its leases
// with another. It returns nil and no error when that is not how this
// command connects: --creds or $FENCELINE_CREDS given, no enroller
// credentials on this machine, or a bus that enrols nobody.
func (a *app) dialEphemeral(url, source, name string) (*session, error) {
	if p, _ := a.credsSetting(); p != "" {
		return nil, nil
	}
	bc, err := leasebus.ChooseCreds("", "", a.defaultCredsDir(), leasebus.RoleEnroller)
	if err != nil || bc.Path == "" {
		return nil, err
	}
	if !leasebus.ValidIdentityName("eph-" + name) { // an --attempt of odd characters
		name = "holder-" + lease.NewAttemptID()
	}
	enc, err := leasebus.Dial(url, source, bc, nats.Name("fenceline-enroll"))
	var refused *leasebus.CredsRefusedError
	if errors.As(err, &refused) {
		// A bus started before it had an enroller (restart it to give
		// each run its own identity).
		fmt.Fprintf(a.stderr, "fenceline: the bus at %s does not know this machine's enroller credentials (restart it: fenceline bus serve); connecting with the shared holder credentials\n", url)
		return nil, nil
	}
	if err != nil {
		return nil, a.dialError(err)
	}
	id, err := leasebus.EnrollEphemeral(enc, name)
	enc.Close()
	if errors.Is(err, leasebus.ErrNoEnrolment) {
		fmt.Fprintf(a.stderr, "fenceline: the bus at %s enrols no identities; connecting with this machine's shared holder credentials\n", url)
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("%w (the embedded bus enrols an identity for each run; is it this machine's? or pass --creds)", err)
	}
	opts := append(id.Options(), holderConnOptions()...)
	deadline := time.Now().Add(enrolTimeout)
	for {
		nc, err := leasebus.Dial(url, source, busCreds{Source: "an identity enrolled for this run", Role: leasebus.RoleHolder}, append([]nats.Option{nats.Name("fenceline-" + id.Name)}, opts...)...)
		var refused *leasebus.CredsRefusedError
		if errors.As(err, &refused) && time.Now().Before(deadline) {
			// A cluster node that has not reloaded its users yet.
			time.Sleep(100 * time.Millisecond)
			continue
		}
		if err != nil {
			return nil, a.dialError(err)
		}
		s := &session{nc: nc, client: leasebus.NewClient(nc), url: url}
		// Heard while it holds nothing (waiting for a lease, between
		// two): the bus collects an identity none hears from (a run
		// killed before it could leave).
		s.keeping = s.client.KeepIdentity()
		s.leave = func() {
			if err := id.Leave(nc); err != nil {
				fmt.Fprintf(a.stderr, "fenceline: warning: %v (remove it with: fenceline bus revoke-identity %s)\n", err, id.Name)
			}
		}
		return s, nil
	}
}

// holdLease acquires the lease the flags describe, or, with attachID,
// attaches to an existing lease using its credential (the credential file
// of this machine, or cred), and starts holding it.
func (a *app) holdLease(ctx context.Context, s *session, lf *leaseFlags, attachID string, cred leasebus.Credential) (*heldLease, error) {
	return a.holdWith(ctx, s, lf, attachID, cred, leasebus.HoldOptions{})
}

// holdWith is holdLease with the holder's options (a metrics hook).
func (a *app) holdWith(ctx context.Context, s *session, lf *leaseFlags, attachID string, cred leasebus.Credential, opts leasebus.HoldOptions) (*heldLease, error) {
	if attachID != "" {
		return a.attach(ctx, s, attachID, cred, opts)
	}
	req, err := lf.request()
	if err != nil {
		return nil, err
	}
	cred = leasebus.NewCredential()
	h, err := s.client.AcquireAndHold(ctx, req, cred, opts)
	if err != nil {
		var ce *lease.ConflictError
		if errors.As(err, &ce) {
			return nil, &conflictReport{ce: ce, claim: req.Scope, wait: time.Duration(req.Wait)}
		}
		return nil, fmt.Errorf("acquire %s in %s: %w", req.Scope, req.Repo, err)
	}
	return &heldLease{holder: h, cred: cred}, nil
}

// attach attaches to lease id with its credential (cred, else this
// machine's credential file for it) and holds it
// (leasebus.Client.AttachAndHold).
func (a *app) attach(ctx context.Context, s *session, id string, cred leasebus.Credential, opts leasebus.HoldOptions) (*heldLease, error) {
	if err := checkLeaseID(id); err != nil {
		return nil, err
	}
	if cred == "" {
		f, err := a.readCredFile(id)
		if err != nil {
			return nil, fmt.Errorf("attach to %s: %w (pass the owner's credential with --credential)", id, err)
		}
		cred = f.Credential
	}
	h, err := s.client.AttachAndHold(ctx, id, cred, opts)
	if err != nil {
		return nil, err
	}
	return &heldLease{holder: h, cred: cred}, nil
}

// finish ends holding (leasebus.Holder.Close): a lease acquired here is
// released, an attached one is only no longer renewed (its owner decides).
func (h *heldLease) finish(ctx context.Context) error {
	return h.holder.Close(ctx)
}
