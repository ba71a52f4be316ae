package leasebus

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
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
	// ReasonBusOverload: a request refused because its identity has its
	// share of the service's room in use already (requests queued at a
	// repo, acquires waiting there, requests in flight, sessions kept);
	// the identity retries once some are answered, and other identities
	// are not held up by it.
	ReasonBusOverload = "bus-overload"
)

// refusalRate bounds how many of the bus's refusals per second become
// audit events; the rest are counted into the next one, so a client
// looping on a denied subject cannot flood the audit stream.
const refusalRate = 20

var (
	nkeyRe    = regexp.MustCompile(`^U[A-Z2-7]{55}$`)
	authKeyRe = regexp.MustCompile(`^authentication error - Nkey "(U[A-Z2-7]{55})"`)
	violation = []struct{ marker, reason string }{
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
	if reason == ReasonBusOverload && s.overloadsQueued.Add(1) > refusalRate {
		// More than the writer writes one by one this second: counted
		// here, so a flood's refusals leave the queue to the others'.
		s.overloadsDropped.Add(1)
		return
	}
	select {
	case s.refusals <- busRefusal{reason: reason, id: id, what: what}:
	default:
		if reason == ReasonBusOverload {
			s.overloadsDropped.Add(1)
		} else {
			s.refusalsDropped.Add(1)
		}
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
			s.overloadsQueued.Store(0)
			if n := s.overloadsDropped.Swap(0); n > 0 {
				skipped[ReasonBusOverload] += int(n)
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
//
// The line begins with the client's address and id, then the client's own
// name, version and language, quoted, and (once it has authenticated) its
// account and user, quoted, last ("$G/nkey:U..."); the message follows. A
// client chooses its name, so neither the marker nor the identity is
// looked for there: the marker must begin the message, and the identity is
// the user the server authenticated (the last quoted part), or, for a
// failed authentication, the key the message says was presented.
func (s *Service) AuditServerLog(line string) {
	quoted, msg, ok := splitClientLine(line)
	for _, vi := range violation {
		if !strings.HasPrefix(msg, vi.marker) {
			continue
		}
		id := ""
		switch {
		case !ok:
		case vi.reason == ReasonBusAuthentication:
			if m := authKeyRe.FindStringSubmatch(msg); m != nil {
				id = m[1]
			}
		case len(quoted) > 0:
			last := quoted[len(quoted)-1]
			if i := strings.LastIndex(last, "/nkey:"); i >= 0 && nkeyRe.MatchString(last[i+len("/nkey:"):]) {
				id = last[i+len("/nkey:"):]
			}
		}
		s.refuse(vi.reason, id, "the bus refused: "+line)
		return
	}
}

// clientLineRe matches the start of a line the server logs about a client:
// its address and its id (cid:5, lid:2, ...).
var clientLineRe = regexp.MustCompile(`^\S+ - [a-z_]+:[0-9]+`)

// splitClientLine returns the quoted parts after a client line's address
// and id, unquoted, and the message after them; ok false (and the whole
// line as msg) when line is not one.
func splitClientLine(line string) (quoted []string, msg string, ok bool) {
	loc := clientLineRe.FindStringIndex(line)
	if loc == nil {
		return nil, line, false
	}
	rest := line[loc[1]:]
	for strings.HasPrefix(rest, ` - "`) {
		q, err := strconv.QuotedPrefix(rest[len(" - "):])
		if err != nil {
			return nil, line, false
		}
		u, err := strconv.Unquote(q)
		if err != nil {
			return nil, line, false
		}
		quoted = append(quoted, u)
		rest = rest[len(" - ")+len(q):]
	}
	if !strings.HasPrefix(rest, " - ") {
		return nil, line, false
	}
	return quoted, rest[len(" - "):], true
}

// auditRefusal writes one refusal by the bus, or (skipped > 0) the count of
// those of its reason not written one by one.
func (s *Service) auditRefusal(ctx context.Context, r busRefusal, skipped int) {
	ev := lease.AuditEvent{Time: s.cfg.Now().UTC(), Type: lease.EventRefused, Boundary: lease.BoundaryBus, Reason: r.reason, Message: r.what}
	if skipped > 0 {
		ev.Message = fmt.Sprintf("the bus refused %d more (%s) in the last second, over the %d a second written one by one (the bus's log has each)", skipped, r.reason, refusalRate)
		if r.reason == ReasonBusOverload {
			// The service's own refusals: no server log line has them.
			ev.Message = fmt.Sprintf("the bus refused %d more (%s) in the last second, over the %d a second written one by one", skipped, r.reason, refusalRate)
		}
	}
	if r.id != "" {
		ev.RequestedBy = s.name(r.id)
	}
	if err := s.writeBusEvent(ctx, r.id, ev); err != nil {
		s.log.Warn("audit event of a refusal by the bus not written", "refusal", r.what, "skipped", skipped, "err", err)
	}
}
