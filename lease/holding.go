package lease

import "time"

// HolderState is what a holder knows of its lease.
type HolderState string

const (
	// Held: the last renewal succeeded and the holder's margin has not run out.
	Held HolderState = "held"
	// Unknown: the holder cannot vouch for the lease now — the bus did not
	// answer the last renewal, the connection dropped (and the lease is not
	// re-checked since), or a change notice said the lease ended and the
	// service has not confirmed it yet. The lease may still be valid, but
	// writes stop until the service answers a renewal sent after the doubt.
	Unknown HolderState = "unknown"
	// Lost: the service said the lease ended (released, revoked, expired,
	// renewal refused) or the holder's own margin ran out. Terminal.
	Lost HolderState = "lost"
)

// Holding is a lease this process holds and keeps alive, as whoever acts
// under it sees it: a Source (the fence for each write, the record) that
// also says how sure it is of the lease and when it lost it.
// *leasebus.Holder is one; how it ends (Close, Orphan) is its owner's,
// not the fences'.
type Holding interface {
	Source
	// State is the holder's state and, unless Held, why.
	State() (HolderState, error)
	// Remaining is how much longer the holder considers the lease valid
	// without another renewal (0 unless held).
	Remaining() time.Duration
	// Lost is closed once the lease is lost.
	Lost() <-chan struct{}
}
