//go:build integration

package pgproxy

import "testing"

// TestGateHolderCannotStallAnotherLease: a transaction left open after
// reading public.race's gate sequence (readable by every role: writers
// pass the gate by reading it) holds the gate, and lease A's first write,
// which raises the table's epoch, waited behind it for as long as it stayed
// open, every later writer of the table queued behind that. Here the
// reader is straight on Postgres (another tenant of the database, which no
// proxy stands before): A's raise is refused within its bound with a
// retryable 55P03 naming lease, fence and gate, and succeeds once the
// reader is gone.
func TestGateHolderCannotStallAnotherLease(t *testing.T) {
	forEachTrigger(t, testGateHolderCannotStall)
}
