package embedded

import (
	"fmt"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/leasebus"
)

// refusalTap is a server.Logger that passes every line on and queues the
// refusal lines for the audit.
type refusalTap struct {
	next server.Logger // nil: the server logged nothing before
	svc  *leasebus.Service
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
	t.svc.AuditServerLog(fmt.Sprintf(format, v...))
}

// AuditRefusals writes the refusals of srv, an embedded server svc runs
// on, to the audit stream until stop is called (see
// leasebus.Service.AuditServerLog). debug and
// trace keep the server's own log levels (its logger, if any, still gets
// every line).
func AuditRefusals(svc *leasebus.Service, srv *server.Server, debug, trace bool) (stop func()) {
	tap := &refusalTap{next: srv.Logger(), svc: svc}
	srv.SetLoggerV2(tap, debug, trace, false)
	return func() { srv.SetLoggerV2(tap.next, debug, trace, false) }
}
