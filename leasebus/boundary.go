package leasebus

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"golang.org/x/time/rate"
)

// Boundary events — a fence's refusals (git, Postgres, file, network) and a
// runner's shard cleaning — reach the audit stream through the lease
// service, never straight from their writer. A writer sends each event as a
// request (op "audit", in its own name like every request); the service
// bounds it, names the identity that sent it (RequestedBy: taken from the
// request subject, so no writer can write in another's name), writes it
// stamped as the service's, and answers once the stream has acknowledged
// it. So no runner writes the audit stream itself: none can write an event
// of megabytes, forge a writer, or write faster than its share.
//
// What an event carries of what an agent sent (a URL, a statement, a
// path) is an excerpt: every free-text field is clipped, on the writer's
// side already and again by the service.

const (
	// maxEventRequest bounds a boundary event's request; a larger one is
	// refused before it is decoded.
	maxEventRequest = 64 << 10
	// maxEventMessage bounds an event's message, maxEventField each of
	// its other free-text fields and each path or table of its claim,
	// maxEventItems how many paths and tables the claim carries.
	maxEventMessage = 2 << 10
	maxEventField   = 256
	maxEventItems   = 64
	// boundaryRate and boundaryBurst bound the boundary events one
	// identity writes one by one (per second, and at once); the rest are
	// counted and said in one event a second.
	boundaryRate  = 20
	boundaryBurst = 200
	// leaseRate and leaseBurst bound the boundary events of one lease
	// (its refusals, whoever sends them): an agent looping on a refused
	// write is said once a second, its count in the event of the
	// identity that sent them.
	leaseRate  = 5
	leaseBurst = 50
)

// boundaries are the boundaries whose events a writer may send.
var boundaries = []string{lease.BoundaryGit, lease.BoundaryPostgres, lease.BoundaryFile, lease.BoundaryNet, boundaryShard}

// clip returns s cut to at most n bytes at a character boundary, saying
// how much was cut.
func clip(s string, n int) string {
	if len(s) <= n {
		return s
	}
	cut := n
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + fmt.Sprintf("… (%d bytes cut)", len(s)-cut)
}

// boundEvent clips ev's free-text fields and its claim to their bounds.
func boundEvent(ev *lease.AuditEvent) {
	ev.Message = clip(ev.Message, maxEventMessage)
	for _, f := range []*string{&ev.Type, &ev.Boundary, &ev.Repo, &ev.LeaseID, &ev.Reason, &ev.RequestedBy,
		&ev.Owner.TaskID, &ev.Owner.AgentID, &ev.Owner.AttemptID, &ev.Owner.HostID, (*string)(&ev.Scope.Kind)} {
		*f = clip(*f, maxEventField)
	}
	ev.Scope.Paths, ev.Scope.Tables = clipItems(ev.Scope.Paths), clipItems(ev.Scope.Tables)
}

// clipItems returns items clipped to maxEventItems entries of at most
// maxEventField bytes: items itself when it is within them, else a new
// slice (the caller's stays as it is: it may be a lease's own claim).
func clipItems(items []string) []string {
	within := len(items) <= maxEventItems
	for _, it := range items {
		within = within && len(it) <= maxEventField
	}
	if within {
		return items
	}
	out := make([]string, 0, min(len(items), maxEventItems)+1)
	for _, it := range items[:min(len(items), maxEventItems)] {
		out = append(out, clip(it, maxEventField))
	}
	if len(items) > maxEventItems {
		out = append(out, fmt.Sprintf("… (%d more)", len(items)-maxEventItems))
	}
	return out
}

// checkBoundaryEvent refuses an event no boundary writes: one naming no
// repo, or the lease's or the bus's own boundary.
func checkBoundaryEvent(ev *lease.AuditEvent) error {
	if strings.TrimSpace(ev.Repo) == "" {
		return fmt.Errorf("audit event %q: %w: repo is empty", clip(ev.Type, maxEventField), lease.ErrInvalid)
	}
	if !slices.Contains(boundaries, ev.Boundary) {
		return fmt.Errorf("audit event %q: %w: boundary %q is not one a fence writes (want one of %s)",
			clip(ev.Type, maxEventField), lease.ErrInvalid, clip(ev.Boundary, maxEventField), strings.Join(boundaries, ", "))
	}
	return nil
}

// boundaryLimits keeps the rate of boundary events of each identity and
// of each lease, and counts what it drops.
type boundaryLimits struct {
	mu      sync.Mutex
	limits  map[string]*rate.Limiter   // by identity; guarded by mu
	leases  map[leaseKey]*rate.Limiter // guarded by mu
	dropped map[string]dropped         // by identity; guarded by mu
}

// leaseKey names a lease in the limits of the identity that writes about
// it: a lease id is unique only within its repo as far as a writer says,
// and one identity's events about a lease (any lease id it likes) take
// nothing from another's about the same lease. (Keyed by the lease
// alone, a runner that wrote about another's lease at its rate silenced
// the other's fences' refusals of that lease, and had them counted as
// the other's flood.)
type leaseKey struct{ id, repo, lease string }

type dropped struct {
	n    int
	repo string // of the last event dropped
}

// allow reports whether identity id may write an event of lease leaseID
// (none: the event names no lease) of repo now, and counts it when it may
// not. The identity's rate is asked first: the leases an identity names
// are its choice, so only an identity within its rate adds one.
func (b *boundaryLimits) allow(id, repo, leaseID string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.limits == nil {
		b.limits, b.leases, b.dropped = map[string]*rate.Limiter{}, map[leaseKey]*rate.Limiter{}, map[string]dropped{}
	}
	l := b.limits[id]
	if l == nil {
		l = rate.NewLimiter(boundaryRate, boundaryBurst)
		b.limits[id] = l
	}
	ok := l.Allow()
	if ok && leaseID != "" {
		k := leaseKey{id, repo, leaseID}
		ll := b.leases[k]
		if ll == nil {
			ll = rate.NewLimiter(leaseRate, leaseBurst)
			b.leases[k] = ll
		}
		ok = ll.Allow()
	}
	if !ok {
		d := b.dropped[id]
		b.dropped[id] = dropped{n: d.n + 1, repo: repo}
	}
	return ok
}

// takeDropped returns and forgets what was dropped since the last call,
// and forgets the limits that are full again (a limiter at its burst is a
// new limiter).
func (b *boundaryLimits) takeDropped() map[string]dropped {
	b.mu.Lock()
	defer b.mu.Unlock()
	now := time.Now()
	for id, l := range b.limits {
		if l.TokensAt(now) >= boundaryBurst {
			delete(b.limits, id)
		}
	}
	for k, l := range b.leases {
		if l.TokensAt(now) >= leaseBurst {
			delete(b.leases, k)
		}
	}
	out := b.dropped
	b.dropped = map[string]dropped{}
	return out
}

// recordBoundary writes a boundary event sent by identity id, once it is
// within id's rate, and answers once the stream has acknowledged it.
func (s *Service) recordBoundary(ctx context.Context, id string, ev lease.AuditEvent) reply {
	if !s.boundary.allow(id, ev.Repo, ev.LeaseID) {
		return reply{Error: toWire(fmt.Errorf("%w: %s writes boundary events faster than %d a second (bursts of %d), or of lease %q faster than %d a second (bursts of %d): this one is counted, not written",
			lease.ErrUnavailable, s.name(id), boundaryRate, boundaryBurst, clip(ev.LeaseID, maxEventField), leaseRate, leaseBurst))}
	}
	boundEvent(&ev)
	ev.RequestedBy = s.name(id)
	if ev.Time.IsZero() {
		ev.Time = s.cfg.Now().UTC()
	}
	if err := s.writeEvent(ctx, eventsSubjectFor(ev.Repo, ev.Boundary, id), ev); err != nil {
		return reply{Error: toWire(fmt.Errorf("%w: write audit event %s for %s: %v", lease.ErrUnavailable, ev.Type, ev.Repo, err))}
	}
	return reply{}
}

// auditDropped writes, for each identity whose boundary events were
// dropped over its rate since the last call, one event saying how many.
func (s *Service) auditDropped(ctx context.Context) {
	for id, d := range s.boundary.takeDropped() {
		ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: lease.EventRefused, Boundary: lease.BoundaryBus, Repo: d.repo, Reason: ReasonRateLimited,
			RequestedBy: s.name(id), Message: fmt.Sprintf("%s sent %d boundary events more than its %d a second (or a lease's %d a second): counted, not written one by one", s.name(id), d.n, boundaryRate, leaseRate)}
		if err := s.writeBusEvent(ctx, id, ev); err != nil {
			s.log.Warn("audit event of dropped boundary events not written", "identity", id, "dropped", d.n, "err", err)
		}
	}
}

// ReasonRateLimited: events an identity sent faster than its rate,
// counted rather than written one by one.
const ReasonRateLimited = "rate-limited"

// Auditor writes audit events from a boundary (a sidecar's git, Postgres,
// file or network fence, a runner's shard cleaning) through the lease
// service, one acknowledged event at a time.
type Auditor struct {
	c *Client
}

// NewAuditor returns an Auditor asking the lease service on nc.
func NewAuditor(nc *nats.Conn) (*Auditor, error) {
	return &Auditor{c: NewClient(nc)}, nil
}

// Record durably writes one event: it returns once the audit stream
// acknowledged it. Free-text fields are clipped to an excerpt first (see
// boundEvent); the service names the identity that sent it.
func (a *Auditor) Record(ctx context.Context, ev lease.AuditEvent) error {
	if ev.Time.IsZero() {
		ev.Time = time.Now().UTC()
	}
	if err := checkBoundaryEvent(&ev); err != nil {
		return err
	}
	boundEvent(&ev)
	r, err := a.c.request(ctx, "audit", &ev, 0)
	if err != nil {
		return fmt.Errorf("write audit event %s for %s: %w", ev.Type, ev.Repo, err)
	}
	if err := r.Error.err(); err != nil {
		return fmt.Errorf("write audit event %s for %s: %w", ev.Type, ev.Repo, err)
	}
	return nil
}
