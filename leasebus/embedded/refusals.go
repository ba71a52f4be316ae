package embedded

import (
	"fmt"
	"strconv"
	"strings"

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
	t.svc.AuditServerLog(formatClientLine(format, v))
}

// formatClientLine formats a line the server logs about a client. The
// server puts text the client chose into the format itself, not its
// arguments: its name, version and language (quoted, after its address),
// and a subscription's subject and SID in a violation's line (logged with
// no arguments). Their % would be read as verbs, taking the line's
// arguments or printing %!s(MISSING). A line with no arguments is the
// text as it is; in one with arguments, a % inside a quoted string of the
// format is the client's, and stays a %.
func formatClientLine(format string, v []any) string {
	if len(v) == 0 {
		return format
	}
	var b strings.Builder
	for rest := format; rest != ""; {
		i := strings.IndexByte(rest, '"')
		if i < 0 {
			b.WriteString(rest)
			break
		}
		b.WriteString(rest[:i])
		q, err := strconv.QuotedPrefix(rest[i:])
		if err != nil { // an unpaired quote: the rest as it is
			b.WriteString(rest[i:])
			break
		}
		b.WriteString(strings.ReplaceAll(q, "%", "%%"))
		rest = rest[i+len(q):]
	}
	return fmt.Sprintf(b.String(), v...)
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
