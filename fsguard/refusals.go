package fsguard

import "github.com/fenceline/fenceline/lease"

// Refusals counts the calls the supervisor refused during an attempt, by
// cause; each is also an audit event. Landlock's own refusals while the
// lease holds (a plain write outside the claim) are the kernel's and are
// not counted here.
type Refusals struct {
	// Confined are calls refused for what they are, whatever the state
	// of the lease: a write outside the claim that the supervisor judges
	// (metadata, inode ioctls), a connect or socket not allowed, a call
	// never allowed (keyrings, TIOCSTI, another process's IPC objects).
	Confined uint64
	// AfterLoss are write-class calls refused because the lease was lost
	// or its state unknown (the holder could not reach the bus).
	AfterLoss uint64
}

// Total is every refused call.
func (r Refusals) Total() uint64 { return r.Confined + r.AfterLoss }

// afterLoss reports whether an audit reason is the lease's state.
func afterLoss(reason string) bool {
	return reason == lease.ReasonLeaseLost || reason == lease.ReasonLeaseUnknown
}
