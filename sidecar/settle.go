package sidecar

import "time"

// Settlement is how WaitSettled ended.
type Settlement int

const (
	// SettleReported: the agent wrapper reported its attempt settled.
	SettleReported Settlement = iota
	// SettleNoAgent: no agent wrapper ever connected, so nothing but the
	// (drained) fences wrote under the lease.
	SettleNoAgent
	// SettleTimedOut: an agent wrapper connected, but reported nothing in
	// time; processes may still write under the lease.
	SettleTimedOut
)

// Settled reports whether the lease may be released: the attempt settled,
// or no agent wrapper ever connected.
func (s Settlement) Settled() bool { return s != SettleTimedOut }

// WaitSettled waits for the agent wrapper's settle report (POST
// PathSettled): at most timeout when a wrapper is connected or ever was,
// not at all when none ever was.
func (a *Admin) WaitSettled(timeout time.Duration) Settlement {
	select {
	case <-a.Settled():
		return SettleReported
	default:
	}
	if ever, _ := a.AgentConnected(); !ever {
		return SettleNoAgent
	}
	t := time.NewTimer(timeout)
	defer t.Stop()
	select {
	case <-a.Settled():
		return SettleReported
	case <-t.C:
		return SettleTimedOut
	}
}
