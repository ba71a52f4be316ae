package faults

import (
	"slices"
	"testing"
)

// TestTimelineMergesWarnings: the end of a failed cluster run's log lists
// every process's warnings and primary changes in time order, so a CI log
// that keeps only the tail still says who was primary when, and what
// failed where; a burst of one warning is one line with a count.
func TestTimelineMergesWarnings(t *testing.T) {
	n0 := `time=2026-12-04T23:26:50.249Z level=INFO msg="this lease service instance is the primary: it serves the lease requests" term=1
time=2026-12-04T23:26:51.000Z level=INFO msg="lease service loaded every repo's lease log"
lease service ready on nats://127.0.0.1:1 (replicas 3); stop with Ctrl-C
time=2026-12-04T23:27:17.734Z level=WARN msg="audit events not yet written; will retry"
time=2026-12-04T23:27:18.001Z level=WARN msg="reload lease log" repo=a err="503"
time=2026-12-04T23:27:18.002Z level=WARN msg="reload lease log" repo=a err="503"
time=2026-12-04T23:27:18.003Z level=WARN msg="reload lease log" repo=b err="503"
`
	svc := `time=2026-12-04T23:26:55.310Z level=ERROR msg="boom"
time=2026-12-04T23:26:40.000Z level=INFO msg="nothing to see"
`
	events := append(timeline("n0", 2, n0), timeline("svc", 1, svc)...)
	slices.Sort(events)
	want := []string{
		`2026-12-04T23:26:50.249Z n0/2 level=INFO msg="this lease service instance is the primary: it serves the lease requests" term=1`,
		`2026-12-04T23:26:55.310Z svc/1 level=ERROR msg="boom"`,
		`2026-12-04T23:27:17.734Z n0/2 level=WARN msg="audit events not yet written; will retry"`,
		`2026-12-04T23:27:18.001Z n0/2 level=WARN msg="reload lease log" repo=a err="503" (and 2 more like it)`,
	}
	if !slices.Equal(events, want) {
		t.Fatalf("timeline:\n%q\nwant\n%q", events, want)
	}
}
