package cli

import (
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus/credfile"
)

// credFile is what the acquiring machine keeps of a lease (see package
// credfile).
type credFile = credfile.File

// errNoCredFile means this machine keeps no credential for the lease.
var errNoCredFile = credfile.ErrNoFile

// checkLeaseID rejects anything that is not a lease id before it is used as
// a file name or sent to the bus.
func checkLeaseID(id string) error {
	if !lease.ValidLeaseID(id) {
		return usagef("%q is not a lease id (want lease_ followed by lower-case letters and digits, as printed by \"fenceline lease acquire\" or \"fenceline lease list\")", id)
	}
	return nil
}

// credFiles is this user's credential store, in the state dir.
func (a *app) credFiles() credfile.Store { return credfile.In(a.stateDir) }

// writeCredFile stores f in this user's credential store.
func (a *app) writeCredFile(f *credFile) (string, error) { return a.credFiles().Write(f) }

// readCredFile reads the credential of lease id, or errNoCredFile.
func (a *app) readCredFile(id string) (*credFile, error) { return a.credFiles().Read(id) }

func (a *app) removeCredFile(id string) error { return a.credFiles().Remove(id) }
