package leasebus

import (
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
)

// TestCancelInARetriedBatchAnswersOnce: a cancel answered the acquire it
// withdrew at once, before its batch was written. When the append lost
// its compare-and-swap and the batch ran again, an acquire queued in the
// same batch was queued anew and withdrawn anew, and its asker answered
// twice. Each withdrawn acquire is now answered once, when its batch
// ends.
func TestCancelInARetriedBatchAnswersOnce(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const retried = "github.com/acme/cancel-retried"
	key := RepoKey(retried)
	acquireVia(t, ctx, b.svc, retried, claim(t, "held"), owner(1))

	cred := NewCredential()
	withdrawn := acquireCall(t, retried, "held", time.Minute, cred)
	cancelled := cancelCall(retried, withdrawn, cred)
	writes := acquireCall(t, retried, "elsewhere", 0, NewCredential())

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
		if r := answerOf(t, c); r.Error != nil {
			t.Fatalf("%s: %v", c.op, r.Error.err())
		}
	}
	r := answerOf(t, withdrawn)
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

// TestCancelInAFailedBatchStands: a withdrawal writes nothing, so it
// stands when its batch's record cannot be written: the client cancels
// once, and an acquire it gave up on must not stay queued, to be granted
// to nobody once the conflict clears.
func TestCancelInAFailedBatchStands(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	const failing = "github.com/acme/cancel-failing"
	key := RepoKey(failing)
	held := acquireVia(t, ctx, b.svc, failing, claim(t, "held"), owner(1))

	cred := NewCredential()
	withdrawn := acquireCall(t, failing, "held", time.Minute, cred)
	a := b.svc.actor(key, failing)
	a.enqueue(withdrawn)
	checkFor(t, 10*time.Second, 5*time.Millisecond, func() error {
		a.busy.Lock()
		defer a.busy.Unlock()
		if len(a.waiters) != 1 {
			return fmt.Errorf("%d waiting", len(a.waiters))
		}
		return nil
	})

	// The store refuses every write (as a full one would) while the
	// cancel's batch runs; a write beside the cancel makes it append.
	fault := fmt.Errorf("%w: store full (test)", lease.ErrUnavailable)
	b.svc.storeErr.Store(&fault)
	cancelled := cancelCall(failing, withdrawn, cred)
	writes := acquireCall(t, failing, "elsewhere", 0, NewCredential())
	a.busy.Lock()
	a.enqueue(cancelled)
	a.enqueue(writes)
	a.busy.Unlock()
	if r := answerOf(t, writes); !errors.Is(r.Error.err(), lease.ErrUnavailable) {
		t.Fatalf("a write while the store refuses writes: %+v, want unavailable", r)
	}
	answerOf(t, cancelled) // unavailable with its batch: the client does not ask again
	r := answerOf(t, withdrawn)
	if !errors.Is(r.Error.err(), lease.ErrInvalid) {
		t.Fatalf("the withdrawn acquire answered %+v, want cancelled", r)
	}

	// The store takes writes again and the conflict clears: nothing that
	// was withdrawn is granted.
	b.svc.storeErr.Store(nil)
	if rep := a.ask(ctx, &call{op: "revoke", req: &RevokeRequest{LeaseID: held.LeaseID, Reason: "the test clears the conflict"}}); rep.Error != nil {
		t.Fatal(rep.Error.err())
	}
	a.busy.Lock()
	n := len(a.waiters)
	a.busy.Unlock()
	if n != 0 || len(withdrawn.reply) != 0 {
		t.Fatalf("after the release: %d waiting, %d more answers to the withdrawn acquire", n, len(withdrawn.reply))
	}
	settled(t, b.svc, 0)
}

// answerOf is c's answer, within 10 s.
func answerOf(t *testing.T, c *call) reply {
	t.Helper()
	select {
	case r := <-c.reply:
		return r
	case <-time.After(10 * time.Second):
		t.Fatalf("%s: no answer within 10s", c.op)
		return reply{}
	}
}

// acquireCall is an in-process call acquiring path in repo with cred,
// waiting up to wait, whose answers (up to 4) stay in its reply channel.
func acquireCall(t *testing.T, repo, path string, wait time.Duration, cred Credential) *call {
	t.Helper()
	r := &AcquireRequest{Repo: repo, Scope: claim(t, path), Owner: owner(2), TTL: lease.Duration(time.Minute),
		Wait: lease.Duration(wait), RequestID: NewRequestID(), CredentialHash: cred.hash()}
	if err := r.normalize(); err != nil {
		t.Fatal(err)
	}
	return &call{op: "acquire", req: r, reply: make(chan reply, 4), at: time.Now()}
}

// cancelCall is an in-process call cancelling the acquire of c.
func cancelCall(repo string, c *call, cred Credential) *call {
	r := c.req.(*AcquireRequest)
	return &call{op: "cancel", req: &cancelRequest{Repo: repo, RequestID: r.RequestID, Credential: cred}, reply: make(chan reply, 4), at: time.Now()}
}
