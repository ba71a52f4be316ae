package leasebus

import "github.com/fenceline/fenceline/lease"

// The lease domain lives in package lease, free of NATS, so that a fence
// can name a lease without linking the bus; the bus's client side is what
// a fence asks through lease.Source and lease.Auditor.
var (
	_ lease.Source  = (*Holder)(nil)
	_ lease.Source  = Frozen{}
	_ lease.Auditor = (*Auditor)(nil)
)
