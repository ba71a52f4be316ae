//go:build integration

package pgproxy

import "testing"

// TestEpochRaiseWaitsForOlderWriters: a newer lease's first write to a table
// waits until every open transaction that wrote it under an older fence has
// ended, then raises the epoch; from then on the older fence is refused,
// under every isolation level.
func TestEpochRaiseWaitsForOlderWriters(t *testing.T) { forEachTrigger(t, testEpochRaise) }
