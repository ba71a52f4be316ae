package leasebus

import (
	"context"
	"fmt"
	"regexp"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats-server/v2/server"
)

// The bus's own refusals. NATS refuses a client that fails to authenticate
// and a publish or subscription its permissions deny before any fenceline
// code sees it; the server only logs it. AuditRefusals taps an embedded
// server's log for those lines and writes each as an audit event (type
// refused, boundary bus, the identity in RequestedBy), so that what the bus
// refuses lands in the audit stream like every other refusal. Against a
// NATS server fenceline does not embed, the server's own log (and its
// $SYS.SERVER.*.CLIENT.AUTH.ERR advisories) carry them.

// Reasons of the bus's own refusals.
const (
	ReasonBusPermission     = "bus-permission"     // a publish or subscription the identity's role does not allow
	ReasonBusAuthentication = "bus-authentication" // no or unknown credentials
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
		{server.ErrAuthentication.Error(), ReasonBusAuthentication},
	}
)

// refusalTap is a server.Logger that passes every line on and hands the
// refusal lines to a channel (dropping, and counting, what does not fit).
type refusalTap struct {
	next    server.Logger // nil: the server logged nothing before
	lines   chan string
	mu      sync.Mutex
	dropped int // guarded by mu
}

func (t *refusalTap) Noticef(format string, v ...any) {
	if t.next != nil {
		t.next.Noticef(format, v...)
	}
}
func (t *refusalTap) Warnf(format string, v ...any) {
	if t.next != nil {
		t.next.Warnf(format, v...)
	}
}
func (t *refusalTap) Fatalf(format string, v ...any) {
	if t.next != nil {
		t.next.Fatalf(format, v...)
	}
}
func (t *refusalTap) Debugf(format string, v ...any) {
	if t.next != nil {
		t.next.Debugf(format, v...)
	}
}
func (t *refusalTap) Tracef(format string, v ...any) {
	if t.next != nil {
		t.next.Tracef(format, v...)
	}
}

func (t *refusalTap) Errorf(format string, v ...any) {
	if t.next != nil {
		t.next.Errorf(format, v...)
	}
	line := fmt.Sprintf(format, v...)
	for _, vi := range violation {
		if strings.Contains(line, vi.marker) {
			select {
			case t.lines <- line:
			default:
				t.mu.Lock()
				t.dropped++
				t.mu.Unlock()
			}
			return
		}
	}
}

func (t *refusalTap) takeDropped() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := t.dropped
	t.dropped = 0
	return n
}

// AuditRefusals writes the refusals of srv, an embedded server this
// service runs on, to the audit stream until stop is called. debug and
// trace keep the server's own log levels (its logger, if any, still gets
// every line).
func (s *Service) AuditRefusals(srv *server.Server, debug, trace bool) (stop func()) {
	tap := &refusalTap{next: srv.Logger(), lines: make(chan string, 256)}
	srv.SetLoggerV2(tap, debug, trace, false)
	ctx, cancel := context.WithCancel(s.ctx)
	var wg sync.WaitGroup
	wg.Go(func() {
		// At most refusalRate events a second of each reason; the rest
		// are counted and said in one event at the end of the second.
		tick := time.NewTicker(time.Second)
		defer tick.Stop()
		written, skipped := map[string]int{}, map[string]int{}
		for {
			select {
			case <-ctx.Done():
				return
			case line := <-tap.lines:
				r := refusalReason(line)
				if written[r] >= refusalRate {
					skipped[r]++
					continue
				}
				written[r]++
				s.auditRefusal(ctx, r, line, 0)
			case <-tick.C:
				if n := tap.takeDropped(); n > 0 {
					skipped[ReasonBusPermission] += n // the tap cannot tell; most are
				}
				for r, n := range skipped {
					s.auditRefusal(ctx, r, "", n)
				}
				clear(written)
				clear(skipped)
			}
		}
	})
	return func() {
		srv.SetLoggerV2(tap.next, debug, trace, false)
		cancel()
		wg.Wait()
	}
}

func refusalReason(line string) string {
	for _, vi := range violation {
		if strings.Contains(line, vi.marker) {
			return vi.reason
		}
	}
	return ReasonBusPermission
}

// auditRefusal writes one refusal by the bus (line), or the count of those
// of reason not written one by one (skipped).
func (s *Service) auditRefusal(ctx context.Context, reason, line string, skipped int) {
	ev := AuditEvent{Time: s.cfg.Now().UTC(), Type: EventRefused, Boundary: BoundaryBus, Reason: reason, Message: "the bus refused: " + line}
	if skipped > 0 {
		ev.Message = fmt.Sprintf("the bus refused %d more (%s) in the last second, over the %d a second written one by one (its log has each)", skipped, reason, refusalRate)
	}
	if id := nkeyUserRe.FindString(line); id != "" {
		ev.RequestedBy = s.name(id)
	}
	err := s.writeBusEvent(ctx, ev)
	if err != nil {
		s.log.Warn("audit event of a refusal by the bus not written", "refusal", line, "skipped", skipped, "err", err)
	}
}
