package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/fenceline/fenceline/leasebus"
)

// heldLease is a lease this process holds: acquired from flags, or attached
// to by id with its credential.
type heldLease struct {
	holder   *leasebus.Holder
	cred     leasebus.Credential
	acquired bool // taken here (so released here), not attached
}

// dialHolder connects to the bus for a long-lived holder: it reconnects
// forever, and the holder reports "unknown" meanwhile.
func (a *app) dialHolder() (*session, error) {
	url, source := a.busURL()
	nc, err := a.connect(leasebus.RoleHolder, url, source, holderConnOptions()...)
	if err != nil {
		return nil, err
	}
	c := leasebus.NewClient(nc)
	return &session{nc: nc, client: c, url: url}, nil
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
		var ce *leasebus.ConflictError
		if errors.As(err, &ce) {
			return nil, &conflictReport{ce: ce, claim: req.Scope, wait: time.Duration(req.Wait)}
		}
		return nil, fmt.Errorf("acquire %s in %s: %w", req.Scope, req.Repo, err)
	}
	return &heldLease{holder: h, cred: cred, acquired: true}, nil
}

// attach attaches to lease id with its credential (cred, else this
// machine's credential file for it) and holds it
// (leasebus.Client.AttachAndHold).
func (a *app) attach(ctx context.Context, s *session, id string, cred leasebus.Credential, opts leasebus.HoldOptions) (*heldLease, error) {
	if err := checkLeaseID(id); err != nil {
		return nil, err
	}
	if cred == "" {
		f, err := readCredFile(id)
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

// finish ends holding: a lease acquired here is released, an attached one
// is only no longer renewed (its owner decides).
func (h *heldLease) finish(ctx context.Context) error {
	return h.holder.End(ctx, h.acquired)
}
