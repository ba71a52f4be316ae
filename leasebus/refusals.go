package leasebus

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// The bus's own refusals. The service ignores messages on its request
// subjects that their identity did not send, and audits them. NATS refuses a client that fails to authenticate
// and a publish or subscription its permissions deny before any fenceline
// code sees it; the server only logs it. embedded.AuditRefusals taps an embedded
// server's log for those lines and writes each as an audit event (type
// refused, boundary bus, the identity in RequestedBy), so that what the bus
// refuses lands in the audit stream like every other refusal. Against a
// NATS server fenceline does not embed, the server's own log (and its
// $SYS.SERVER.*.CLIENT.AUTH.ERR advisories) carry them.

// Reasons of the bus's own refusals.
const (
	ReasonBusPermission     = "bus-permission"     // a publish or subscription the identity's role does not allow
	ReasonBusAuthentication = "bus-authentication" // no or unknown credentials
	// ReasonBusForged: a message on a request subject that its identity
	// did not send (a JetStream delivery, or an answer someone had the
	// server or the service send there as a reply); ignored.
	ReasonBusForged = "bus-forged"
)

// refusalRate bounds how many of the bus's refusals per second become
// audit events; the rest are counted into the next one, so a client
// looping on a denied subject cannot flood the audit stream.
const refusalRate = 20

var (
	nkeyUserRe = regexp.MustCompile(`\bU[A-Z2-7]{55}\b`)
	violation  = []struct{ marker, reason string }{
		{"Publish Violation", ReasonBusPermission},
		{"Subscription Violation", ReasonBusPermission},
		{"Permissions Violation", ReasonBusPermission},
		{"authentication error", ReasonBusAuthentication}, // nats-server's ErrAuthentication
	}
)

// busRefusal is one refusal by the bus to audit: its reason, the identity
// refused (when known) and what happened.
type busRefusal struct {
	reason, id, what string
}

// refuse queues a refusal by the bus for the audit (refusalWriter); when
// the queue is full it is counted instead.
func (s *Service) refuse(reason, id, what string) {
	select {
	case s.refusals <- busRefusal{reason: reason, id: id, what: what}:
	default:
		s.refusalsDropped.Add(1)
	}
}

// refusalWriter writes the queued refusals to the audit stream until ctx
// ends: at most refusalRate events a second of each reason; the rest are
// counted and said in one event at the end of the second, so a client
// looping on a denied subject cannot flood the audit.
func (s *Service) refusalWriter(ctx context.Context) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	written, skipped := map[string]int{}, map[string]int{}
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-s.refusals:
			if written[r.reason] >= refusalRate {
				skipped[r.reason]++
				continue
			}
			written[r.reason]++
			s.auditRefusal(ctx, r, 0)
		case <-tick.C:
			if n := s.refusalsDropped.Swap(0); n > 0 {
				skipped[ReasonBusPermission] += int(n) // the queue cannot tell; most are
			}
			for reason, n := range skipped {
				s.auditRefusal(ctx, busRefusal{reason: reason}, n)
			}
			s.auditDropped(ctx)
			clear(written)
			clear(skipped)
		}
	}
}

// AuditServerLog reads one line of the error log of the server this
// service runs on: a line saying the server refused a client (failed
// authentication, a publish or subscription its permissions deny) is
// audited as a refusal by the bus (type refused, boundary bus, the
// identity in RequestedBy). embedded.AuditRefusals feeds it an embedded
// server's log.
func (s *Service) AuditServerLog(line string) {
	for _, vi := range violation {
		if strings.Contains(line, vi.marker) {
			s.refuse(vi.reason, nkeyUserRe.FindString(line), "the bus refused: "+line)
			return
		}
	}
}

// auditRefusal writes one refusal by the bus, or (skipped > 0) the count of
// those of its reason not written one by one.
func (s *Service) auditRefusal(ctx context.Context, r busRefusal, skipped int) {
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: lease.EventRefused, Boundary: lease.BoundaryBus, Reason: r.reason, Message: r.what}
	if skipped > 0 {
		ev.Message = fmt.Sprintf("the bus refused %d more (%s) in the last second, over the %d a second written one by one (the bus's log has each)", skipped, r.reason, refusalRate)
	}
	if r.id != "" {
		ev.RequestedBy = s.name(r.id)
	}
	if err := s.writeBusEvent(ctx, r.id, ev); err != nil {
		s.log.Warn("audit event of a refusal by the bus not written", "refusal", r.what, "skipped", skipped, "err", err)
	}
}
