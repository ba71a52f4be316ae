package leasebus

import (
	"context"
	"encoding/json"
	"fmt"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/policy"
)

// UIReader is what the run UI reads of the bus (runui.Source): the
// leases, through the lease service (Client.List, Client.Watch); the
// audit, from its streams (AuditSources), counting only what the lease
// service wrote; and the policies' history. It never writes. Safe for
// concurrent use.
type UIReader struct {
	nc *nats.Conn
	c  *Client
	js lazyJetStream
}

// NewUIReader returns the run UI's reader of nc's bus. It reaches nothing
// yet: the first read of a stream learns where JetStream is (JetStream).
func NewUIReader(nc *nats.Conn) *UIReader {
	return &UIReader{nc: nc, c: NewClient(nc), js: lazyJetStream{nc: nc, what: "run UI"}}
}

// List lists the leases of repo (every repo when empty); all: recently
// ended ones too (Client.List).
func (u *UIReader) List(ctx context.Context, repo string, all bool) ([]*lease.Lease, error) {
	return u.c.List(ctx, repo, all)
}

// Watch calls fn with every lease record of repo (every repo when empty)
// the service commits, until stop (Client.Watch).
func (u *UIReader) Watch(repo string, fn func(*lease.Lease)) (stop func() error, err error) {
	return u.c.Watch(repo, fn)
}

// AuditEnd is the sequence of the last message of the longest of the
// audit's streams (0: none): positions of ReadAudit and FollowAudit count
// back from it.
func (u *UIReader) AuditEnd(ctx context.Context) (uint64, error) {
	js, err := u.js.get(ctx)
	if err != nil {
		return 0, err
	}
	var last uint64
	for _, src := range AuditSources("") {
		stream, err := js.Stream(ctx, src.Stream)
		if err != nil {
			return 0, fmt.Errorf("open stream %s: %w", src.Stream, err)
		}
		last = max(last, stream.CachedInfo().State.LastSeq)
	}
	return last, nil
}

// ReadAudit returns the audit events of repo (every repo when empty) from
// sequence from of each of the audit's streams (ReadAudit).
func (u *UIReader) ReadAudit(ctx context.Context, repo string, from uint64) ([]lease.AuditEvent, error) {
	return ReadAudit(ctx, u.nc, repo, from)
}

// FollowAudit calls fn with the events of each audit message of repo
// (every repo when empty) from sequence from of each of the audit's
// streams, in stream order, then with every new one, until stop: one
// ordered consumer per stream. A message the lease service did not write
// is skipped; one that does not decode is handed to fn as an error.
func (u *UIReader) FollowAudit(ctx context.Context, repo string, from uint64, fn func(evs []lease.AuditEvent, err error)) (stop func(), err error) {
	js, err := u.js.get(ctx)
	if err != nil {
		return nil, err
	}
	var all consumeAll
	for _, src := range AuditSources(repo) {
		cons, err := js.OrderedConsumer(ctx, src.Stream, jetstream.OrderedConsumerConfig{
			FilterSubjects: []string{src.Filter},
			DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:    from,
		})
		if err == nil {
			var cc jetstream.ConsumeContext
			if cc, err = cons.Consume(func(m jetstream.Msg) { followedAudit(m, fn) }); err == nil {
				all = append(all, cc)
			}
		}
		if err != nil {
			all.stop()
			return nil, fmt.Errorf("audit consumer of %s: %w", src.Stream, err)
		}
	}
	return all.stop, nil
}

// followedAudit hands the events of one audit message to fn.
func followedAudit(m jetstream.Msg, fn func([]lease.AuditEvent, error)) {
	if !ServiceWrote(m.Headers()) {
		return // only the lease service writes events (see Auditor)
	}
	var b auditBatch
	if err := json.Unmarshal(m.Data(), &b); err != nil {
		fn(nil, fmt.Errorf("undecodable audit message on %s: %w", m.Subject(), err))
		return
	}
	fn(b.Events, nil)
}

// consumeAll are the consumers of the audit's streams.
type consumeAll []jetstream.ConsumeContext

func (c consumeAll) stop() {
	for _, cc := range c {
		cc.Stop()
	}
}

// PolicyHistory returns every version of repo's policy in mode ("": the
// default), oldest first (PolicyHistory).
func (u *UIReader) PolicyHistory(ctx context.Context, repo string, mode policy.Mode) ([]policy.Document, error) {
	js, err := u.js.get(ctx)
	if err != nil {
		return nil, err
	}
	return PolicyHistory(ctx, js, repo, mode)
}
