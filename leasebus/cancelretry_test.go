package leasebus

import (
	"errors"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
)

// TestCancelInARetriedBatchAnswersOnce: a cancel answered the acquire it
// withdrew at once, before its batch was written. When the append lost
// its compare-and-swap and the batch ran again, an acquire queued in the
// same batch was queued anew and withdrawn anew, and its asker answered
// twice; a batch that failed had answered "cancelled" for a withdrawal
// it never made. The withdrawn acquire is now answered once the batch is
// committed, and an attempt abandoned puts its withdrawals back.
func TestCancelInARetriedBatchAnswersOnce(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const retried = "github.com/acme/cancel-retried"
	key := RepoKey(retried)
	acquireVia(t, ctx, b.svc, retried, claim(t, "held"), owner(1))

	req := func(path string, wait time.Duration) *AcquireRequest {
		r := &AcquireRequest{Repo: retried, Scope: claim(t, path), Owner: owner(2), TTL: lease.Duration(time.Minute),
			Wait: lease.Duration(wait), RequestID: NewRequestID(), CredentialHash: NewCredential().hash()}
		if err := r.normalize(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	cred := NewCredential()
	waiting := req("held", time.Minute)
	waiting.CredentialHash = cred.hash()
	withdrawn := &call{op: "acquire", req: waiting, reply: make(chan reply, 4), at: time.Now()}
	cancelled := &call{op: "cancel", req: &cancelRequest{Repo: retried, RequestID: waiting.RequestID, Credential: cred}, reply: make(chan reply, 4), at: time.Now()}
	writes := &call{op: "acquire", req: req("elsewhere", 0), reply: make(chan reply, 4), at: time.Now()}

	a := b.svc.actor(key, retried)
	// One batch: the acquire queues, the cancel withdraws it, the other
	// acquire makes the batch a write; a record stored behind the actor's
	// back (anyone's message on the log subject, as the reply trick can
	// have the server store) makes its first append lose.
	a.busy.Lock()
	js, err := jetstream.New(b.nc)
	if err != nil {
		a.busy.Unlock()
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, logSubjectFor(key), []byte(`{}`)); err != nil {
		a.busy.Unlock()
		t.Fatal(err)
	}
	for _, c := range []*call{withdrawn, cancelled, writes} {
		a.enqueue(c)
	}
	a.busy.Unlock()

	for _, c := range []*call{cancelled, writes} {
		select {
		case r := <-c.reply:
			if r.Error != nil {
				t.Fatalf("%s: %v", c.op, r.Error.err())
			}
		case <-ctx.Done():
			t.Fatalf("%s: no answer", c.op)
		}
	}
	r := <-withdrawn.reply
	if !errors.Is(r.Error.err(), lease.ErrInvalid) {
		t.Fatalf("the withdrawn acquire answered %+v, want cancelled", r)
	}
	// Anything else for it would have been sent with the batch's answers.
	if a.ask(ctx, &call{op: "sync", req: &syncRequest{}}).Error != nil {
		t.Fatal("sync")
	}
	if n := len(withdrawn.reply); n != 0 {
		t.Fatalf("the withdrawn acquire was answered %d more times", n)
	}
}
