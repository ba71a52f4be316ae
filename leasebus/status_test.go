package leasebus

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"
)

// TestStatusSaysWhoServesAndWhy: every instance answers a status request
// (not one of a queue group), so a viewer learns which instance serves,
// and, once the primary's claim goes unrenewed, which instance wrote it
// and when a standby takes over — what `lease revoke` says when its
// answer is late.
func TestStatusSaysWhoServesAndWhy(t *testing.T) {
	t.Parallel()
	const term = 10 * time.Second // long: the window before a takeover is the test's, not the machine's
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{Primary: true, PrimaryTerm: term}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	other, err := StartService(ctxT(t), connect(t, b.srv.ClientURL()), ServiceConfig{Primary: true, PrimaryTerm: term})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(other.Stop)
	svcs := []*Service{b.svc, other}
	p := primaryOf(t, svcs, 30*time.Second)
	viewer := NewClient(connectAs(t, b.srv.ClientURL(), RoleViewer))
	ctx := ctxT(t)

	sts := statusOf(ctx, t, viewer, 2)
	serving := 0
	for _, st := range sts {
		if st.Serving {
			serving++
			if st.Instance != svcs[p].store.writer {
				t.Errorf("instance %s says it serves; the primary is %s", st.Instance, svcs[p].store.writer)
			}
		}
		if len(st.Streams) != len(statusStreams) || st.Streams[0].Name != LogStream || st.Streams[0].Err != "" {
			t.Errorf("instance %s reports the streams %+v: want %v, the log's read", st.Instance, st.Streams, statusStreams)
		}
	}
	if serving != 1 {
		t.Fatalf("%d instances say they serve, want 1: %+v", serving, sts)
	}
	if why := Explain(sts); !strings.Contains(why, "instance "+svcs[p].store.writer+" is the primary and serves") {
		t.Fatalf("Explain: %q", why)
	}

	// The claim written over in the name of an instance that is gone: the
	// primary learns it at its next renewal and stops serving; nobody
	// serves until the record has gone unrenewed for the term plus the
	// gap.
	takeClaimForAGoneInstance(t, b, svcs[p])
	checkFor(t, 30*time.Second, 20*time.Millisecond, func() error {
		for _, s := range svcs {
			if s.Primary() {
				return errors.New("instance " + s.store.writer + " still serves")
			}
		}
		return nil
	})
	sts = statusOf(ctx, t, viewer, 2)
	why := Explain(sts)
	for _, want := range []string{"no instance serves here: the primary an-instance-gone-since has not renewed its claim for ", "takes over once the claim is 11s old, in about ",
		"instance an-instance-gone-since did not answer from here", "the lease log (" + LogStream + ")"} {
		if !strings.Contains(why, want) {
			t.Errorf("Explain with the claim's writer gone: %q lacks %q", why, want)
		}
	}
	t.Logf("Explain: %s", why)
}

// statusOf asks for the status until n instances answer.
func statusOf(ctx context.Context, t *testing.T, c *Client, n int) []Status {
	t.Helper()
	var sts []Status
	checkFor(t, 30*time.Second, 0, func() error {
		var err error
		if sts, err = c.Status(ctx, 300*time.Millisecond); err != nil {
			return err
		}
		if len(sts) != n {
			return errors.New("answers from " + strings.Join(instances(sts), ", "))
		}
		return nil
	})
	return sts
}

func instances(sts []Status) []string {
	var out []string
	for _, st := range sts {
		out = append(out, st.Instance)
	}
	return out
}

// TestStatusNeedsAViewer: a holder (a runner) may not ask for the status;
// the bus refuses it and the client says which roles may.
func TestStatusNeedsAViewer(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	_, err := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder)).Status(ctxT(t), time.Second)
	if !errors.Is(err, ErrForbidden) || !strings.Contains(err.Error(), "viewer") {
		t.Fatalf("a holder's status request: %v, want forbidden naming the viewer role", err)
	}
	sts, err := NewClient(connectAs(t, b.srv.ClientURL(), RoleViewer)).Status(ctxT(t), 300*time.Millisecond)
	if err != nil || len(sts) != 1 || !sts[0].Serving || sts[0].Elected {
		t.Fatalf("a single instance's status: %+v, %v", sts, err)
	}
	if why := Explain(sts); !strings.Contains(why, "serves alone") {
		t.Errorf("Explain: %q", why)
	}
}
