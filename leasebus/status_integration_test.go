//go:build integration

package leasebus

import (
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestClusterStatusThroughAPartition: the primary's node cut off from the
// other two. An operator on the majority side, whose lease requests wait
// for the takeover, hears from both instances there (not from the cut-off
// one) and learns who the primary was and that it is not heard, then,
// once a standby took over, who serves and who leads the lease log.
func TestClusterStatusThroughAPartition(t *testing.T) {
	t.Parallel()
	cl := startClusterOf(t, true)
	ctx := ctxFor(t, 3*time.Minute)
	svcs := make([]*Service, len(cl.srvs))
	for i := range svcs {
		svcs[i], _ = startClusterServiceWith(ctx, t, connect(t, cl.urls[i]), ServiceConfig{Primary: true})
	}
	p := primaryOf(t, svcs, 60*time.Second)
	gone := svcs[p].store.writer
	var majority []string
	for i, u := range cl.urls {
		if i != p {
			majority = append(majority, u)
		}
	}
	viewer := NewClient(connectAs(t, strings.Join(majority, ","), RoleViewer))
	statusOf(ctx, t, viewer, 3)

	cl.isolate(t, p, true)
	cut := time.Now()
	// Until a standby takes over (the term plus the gap after the last
	// renewal), the answers say the primary's claim is unrenewed; a
	// loaded machine may ask only after it did.
	sts := statusOf(ctx, t, viewer, 2)
	why := Explain(sts)
	t.Logf("%s after the cut: %s", time.Since(cut).Round(time.Millisecond), why)
	if !strings.Contains(why, "instance "+gone+" did not answer from here") &&
		!strings.Contains(why, "the primary "+gone+" has not renewed its claim for ") {
		t.Errorf("Explain after the primary's node was cut off names no silence of %s: %q", gone, why)
	}
	for _, st := range sts {
		if st.Instance == gone {
			t.Errorf("the cut-off instance %s answered from the majority's side", gone)
		}
	}
	checkFor(t, 60*time.Second, 100*time.Millisecond, func() error {
		sts = statusOf(ctx, t, viewer, 2)
		why = Explain(sts)
		if !strings.Contains(why, " is the primary and serves") || !strings.Contains(why, "the lease log ("+LogStream+") is led by ") {
			return fmt.Errorf("no takeover yet: %s", why)
		}
		return nil
	})
	t.Logf("%s after the cut: %s", time.Since(cut).Round(time.Millisecond), why)
	if strings.Contains(why, "instance "+gone+" is the primary") {
		t.Errorf("the cut-off instance serves, say the majority's instances: %s", why)
	}
	cl.isolate(t, p, false)
}
