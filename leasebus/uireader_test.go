package leasebus

import (
	"encoding/json"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
)

// TestUIReaderFollowAudit: the run UI's reader, as a viewer, follows a
// repo's audit from a position: it hands on what the lease service wrote,
// skips a message it did not write, and reports one that does not decode
// as an error rather than dropping it silently.
func TestUIReaderFollowAudit(t *testing.T) {
	b := startBus(t)
	ctx := ctxT(t)
	const repo = "github.com/acme/followed"
	r := NewUIReader(connectAs(t, b.srv.ClientURL(), RoleViewer))
	from, err := r.AuditEnd(ctx)
	if err != nil {
		t.Fatal(err)
	}
	from++

	var mu sync.Mutex
	var got []lease.AuditEvent
	var errs []error
	stop, err := r.FollowAudit(ctx, repo, from, func(evs []lease.AuditEvent, err error) {
		mu.Lock()
		defer mu.Unlock()
		got = append(got, evs...)
		if err != nil {
			errs = append(errs, err)
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	// Stored on the events stream by someone with the rights to (the
	// service account's connection), but not as the service writes: no
	// writer header, then a writer header over bytes that do not decode.
	js, err := jetstream.New(b.nc)
	if err != nil {
		t.Fatal(err)
	}
	subj := eventsSubjectFor(repo, lease.BoundaryFile, serviceWriter)
	forged, err := json.Marshal(auditBatch{Events: []lease.AuditEvent{{Type: "forged", Boundary: lease.BoundaryFile, Repo: repo}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, subj, forged); err != nil {
		t.Fatal(err)
	}
	if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: subj, Header: nats.Header{writerHeader: []string{serviceWriter}}, Data: []byte("{not json")}); err != nil {
		t.Fatal(err)
	}
	aud, err := NewAuditor(connectAs(t, b.srv.ClientURL(), RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	if err := aud.Record(ctx, lease.AuditEvent{Time: time.Now().UTC(), Type: EventShadowRefused, Boundary: lease.BoundaryFile,
		Repo: repo, LeaseID: "lease_x", Message: "shadow policy: write x would be refused"}); err != nil {
		t.Fatal(err)
	}

	// The real event is stored after both others on the same stream: once
	// it is handed on, they have been delivered too.
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		mu.Lock()
		defer mu.Unlock()
		for _, ev := range got {
			if ev.Type == EventShadowRefused {
				return nil
			}
		}
		return errors.New("the recorded event has not been handed on")
	})
	mu.Lock()
	defer mu.Unlock()
	for _, ev := range got {
		if ev.Type == "forged" {
			t.Errorf("handed on an event the service did not write: %+v", ev)
		}
	}
	if len(errs) != 1 {
		t.Errorf("errors handed on: %v, want one for the undecodable message", errs)
	}
	if end, err := r.AuditEnd(ctx); err != nil || end < from+2 {
		t.Errorf("audit end after three messages from %d: %d, %v", from, end, err)
	}
}
