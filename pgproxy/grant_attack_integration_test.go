//go:build integration

package pgproxy

import "testing"

// TestStolenGrantKeyMintsNoPostgresFence is issue 28 item 2 at Postgres:
// the trigger verified tokens under fenceline.secret, which every runner's
// Postgres fence held, so any runner minted any fence for any table. Now
// the database's secret is registered with the lease service, which gives
// each acquirer a grant key for its own lease, fence and tables; the
// runner holds only that. With everything a runner holds (its bus
// credentials and lease L's grant key) it signs tokens for another lease,
// a greater fence, a wider claim and another table, straight at Postgres
// on a session it bound itself: the real trigger refuses each as forged,
// naming lease and fence, and no epoch moves. L's own writes through its
// proxy, signed with the key the service gave it, land.
func TestStolenGrantKeyMintsNoPostgresFence(t *testing.T) {
	forEachTrigger(t, testStolenGrantKey)
}
