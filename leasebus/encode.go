package leasebus

import (
	"encoding/json"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/fenceline/fenceline/lease"
)

// Hand-written JSON encoders for the records on the request path: the
// lease record (every reply, watch and log record carries one), audit
// events (every log record and audit message) and the hot requests. Each
// writes exactly what encoding/json's Marshal writes for the same value
// (encode_test.go checks byte for byte, with awkward strings); reflection
// here was a tenth of the service's CPU per acquire. A value Marshal would
// refuse (a time outside years 0-9999) makes them report !ok, and the
// caller uses Marshal.

// safeASCII marks the bytes the string encoder below copies as they are:
// printable ASCII but for ", \, <, > and &.
var safeASCII = func() (t [utf8.RuneSelf]bool) {
	for c := 0x20; c < utf8.RuneSelf; c++ {
		t[c] = c != '"' && c != '\\' && c != '<' && c != '>' && c != '&'
	}
	return t
}()

// plainASCII reports whether every byte of s is in safeASCII (ids, hashes,
// times: most strings the bus writes).
func plainASCII(s string) bool {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c >= utf8.RuneSelf || !safeASCII[c] {
			return false
		}
	}
	return true
}

// appendString appends s as encoding/json writes a string: HTML-safe,
// invalid UTF-8 as \ufffd, U+2028 and U+2029 escaped.
func appendString(b []byte, s string) []byte {
	const hex = "0123456789abcdef"
	b = append(b, '"')
	if plainASCII(s) {
		return append(append(b, s...), '"')
	}
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if safeASCII[c] {
				i++
				continue
			}
			b = append(b, s[start:i]...)
			switch c {
			case '\\', '"':
				b = append(b, '\\', c)
			case '\b':
				b = append(b, '\\', 'b')
			case '\f':
				b = append(b, '\\', 'f')
			case '\n':
				b = append(b, '\\', 'n')
			case '\r':
				b = append(b, '\\', 'r')
			case '\t':
				b = append(b, '\\', 't')
			default:
				b = append(b, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xF])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			b = append(b, s[start:i]...)
			b = append(b, `\ufffd`...)
			i += size
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			b = append(b, s[start:i]...)
			b = append(b, '\\', 'u', '2', '0', '2', hex[r&0xF])
			i += size
			start = i
			continue
		}
		i += size
	}
	b = append(b, s[start:]...)
	return append(b, '"')
}

// appendTime appends t as time.Time's MarshalJSON does (RFC 3339 with
// nanoseconds); !ok where that refuses.
func appendTime(b []byte, t time.Time) ([]byte, bool) {
	if y := t.Year(); y < 0 || y > 9999 {
		return b, false
	}
	if _, off := t.Zone(); off <= -24*60*60 || off >= 24*60*60 {
		return b, false
	}
	b = append(b, '"')
	b = t.AppendFormat(b, time.RFC3339Nano)
	return append(b, '"'), true
}

func appendOwner(b []byte, o lease.Owner) []byte {
	b = append(b, `{"taskId":`...)
	b = appendString(b, o.TaskID)
	b = append(b, `,"agentId":`...)
	b = appendString(b, o.AgentID)
	b = append(b, `,"attemptId":`...)
	b = appendString(b, o.AttemptID)
	b = append(b, `,"hostId":`...)
	b = appendString(b, o.HostID)
	return append(b, '}')
}

func appendDuration(b []byte, d lease.Duration) []byte {
	return appendString(b, time.Duration(d).String())
}

// appendLease appends the lease record as json.Marshal(l) writes it.
func appendLease(l *lease.Lease, b []byte) ([]byte, bool) {
	ok := true
	b = append(b, `{"leaseId":`...)
	b = appendString(b, l.LeaseID)
	b = append(b, `,"repo":`...)
	b = appendString(b, l.Repo)
	b = append(b, `,"scope":`...)
	b = l.Scope.AppendJSON(b)
	b = append(b, `,"workspaceId":`...)
	b = appendString(b, l.WorkspaceID)
	b = append(b, `,"workspaceMode":`...)
	b = appendString(b, string(l.WorkspaceMode))
	b = append(b, `,"owner":`...)
	b = appendOwner(b, l.Owner)
	b = append(b, `,"status":`...)
	b = appendString(b, string(l.Status))
	b = append(b, `,"version":`...)
	b = strconv.AppendUint(b, l.Version, 10)
	b = append(b, `,"fence":`...)
	b = strconv.AppendUint(b, l.Fence, 10)
	for _, f := range []struct {
		name string
		t    time.Time
	}{{`,"acquiredAt":`, l.AcquiredAt}, {`,"renewedAt":`, l.RenewedAt}, {`,"expiresAt":`, l.ExpiresAt}} {
		var good bool
		b, good = appendTime(append(b, f.name...), f.t)
		ok = ok && good
	}
	b = append(b, `,"ttl":`...)
	b = appendDuration(b, l.TTL)
	if !l.EndedAt.IsZero() {
		var good bool
		b, good = appendTime(append(b, `,"endedAt":`...), l.EndedAt)
		ok = ok && good
	}
	if l.Reason != "" {
		b = append(b, `,"reason":`...)
		b = appendString(b, l.Reason)
	}
	return append(b, '}'), ok
}

// appendEvent appends an audit event as json.Marshal(ev) writes it.
func appendEvent(b []byte, ev *lease.AuditEvent) ([]byte, bool) {
	b = append(b, `{"time":`...)
	b, ok := appendTime(b, ev.Time)
	b = append(b, `,"type":`...)
	b = appendString(b, ev.Type)
	b = append(b, `,"boundary":`...)
	b = appendString(b, ev.Boundary)
	b = append(b, `,"repo":`...)
	b = appendString(b, ev.Repo)
	if ev.LeaseID != "" {
		b = append(b, `,"leaseId":`...)
		b = appendString(b, ev.LeaseID)
	}
	if ev.Owner != (lease.Owner{}) {
		b = append(b, `,"owner":`...)
		b = appendOwner(b, ev.Owner)
	}
	b = append(b, `,"scope":`...)
	b = ev.Scope.AppendJSON(b)
	if ev.Fence != 0 {
		b = append(b, `,"fence":`...)
		b = strconv.AppendUint(b, ev.Fence, 10)
	}
	if ev.Reason != "" {
		b = append(b, `,"reason":`...)
		b = appendString(b, ev.Reason)
	}
	if ev.RequestedBy != "" {
		b = append(b, `,"requestedBy":`...)
		b = appendString(b, ev.RequestedBy)
	}
	b = append(b, `,"message":`...)
	b = appendString(b, ev.Message)
	return append(b, '}'), ok
}

// appendEvents appends a list of audit events as json.Marshal writes it.
func appendEvents(b []byte, evs []lease.AuditEvent) ([]byte, error) {
	if evs == nil {
		return append(b, "null"...), nil
	}
	start := len(b)
	b = append(b, '[')
	for i := range evs {
		if i > 0 {
			b = append(b, ',')
		}
		var ok bool
		if b, ok = appendEvent(b, &evs[i]); !ok {
			data, err := json.Marshal(evs) // names what is wrong
			if err != nil {
				return b[:start], err
			}
			return append(b[:start], data...), nil
		}
	}
	return append(b, ']'), nil
}

// encode writes the audit message as json.Marshal would.
func (ab *auditBatch) encode() ([]byte, error) {
	b := make([]byte, 0, 64+320*len(ab.Events))
	b = append(b, `{"events":`...)
	b, err := appendEvents(b, ab.Events)
	if err != nil {
		return nil, err
	}
	if ab.LogSeq != 0 {
		b = append(b, `,"logSeq":`...)
		b = strconv.AppendUint(b, ab.LogSeq, 10)
	}
	if ab.From != 0 {
		b = append(b, `,"from":`...)
		b = strconv.AppendUint(b, ab.From, 10)
	}
	return append(b, '}'), nil
}

// encode writes the request as json.Marshal would.
func (r *AcquireRequest) encode() []byte {
	b := make([]byte, 0, 384)
	b = append(b, `{"repo":`...)
	b = appendString(b, r.Repo)
	b = append(b, `,"scope":`...)
	b = r.Scope.AppendJSON(b)
	if r.WorkspaceID != "" {
		b = append(b, `,"workspaceId":`...)
		b = appendString(b, r.WorkspaceID)
	}
	if len(r.Workspaces) > 0 {
		b = append(b, `,"workspaces":[`...)
		for i, w := range r.Workspaces {
			if i > 0 {
				b = append(b, ',')
			}
			b = appendString(b, w)
		}
		b = append(b, ']')
	}
	if r.WorkspaceMode != "" {
		b = append(b, `,"workspaceMode":`...)
		b = appendString(b, string(r.WorkspaceMode))
	}
	if r.MaxSharers != 0 {
		b = append(b, `,"maxSharers":`...)
		b = strconv.AppendInt(b, int64(r.MaxSharers), 10)
	}
	b = append(b, `,"owner":`...)
	b = appendOwner(b, r.Owner)
	b = append(b, `,"ttl":`...)
	b = appendDuration(b, r.TTL)
	if r.Wait != 0 {
		b = append(b, `,"wait":`...)
		b = appendDuration(b, r.Wait)
	}
	b = append(b, `,"requestId":`...)
	b = appendString(b, r.RequestID)
	b = append(b, `,"credentialHash":`...)
	b = appendString(b, r.CredentialHash)
	if r.Session != "" {
		b = append(b, `,"session":`...)
		b = appendString(b, r.Session)
	}
	return append(b, '}')
}

// encode writes the request as json.Marshal would.
func (r *ReleaseRequest) encode() []byte {
	b := make([]byte, 0, 192)
	b = append(b, `{"leaseId":`...)
	b = appendString(b, r.LeaseID)
	if r.Repo != "" {
		b = append(b, `,"repo":`...)
		b = appendString(b, r.Repo)
	}
	b = append(b, `,"credential":`...)
	b = appendString(b, string(r.Credential))
	return append(b, '}')
}

// encode writes the request as json.Marshal would.
func (r *RenewRequest) encode() []byte {
	b := make([]byte, 0, 224)
	b = append(b, `{"leaseId":`...)
	b = appendString(b, r.LeaseID)
	if r.Repo != "" {
		b = append(b, `,"repo":`...)
		b = appendString(b, r.Repo)
	}
	if r.Proof != "" {
		b = append(b, `,"proof":`...)
		b = appendString(b, r.Proof)
	}
	b = append(b, `,"version":`...)
	b = strconv.AppendUint(b, r.Version, 10)
	if r.RenewID != "" {
		b = append(b, `,"renewId":`...)
		b = appendString(b, r.RenewID)
	}
	return append(b, '}')
}

// encode writes the request as json.Marshal would.
func (r *keepaliveRequest) encode() []byte {
	b := make([]byte, 0, 48+len(r.Leases)*128)
	b = append(b, `{"session":`...)
	b = appendString(b, r.Session)
	b = append(b, `,"leases":`...)
	if r.Leases == nil {
		b = append(b, "null"...)
	} else {
		b = append(b, '[')
		for i := range r.Leases {
			k := &r.Leases[i]
			if i > 0 {
				b = append(b, ',')
			}
			b = append(b, `{"leaseId":`...)
			b = appendString(b, k.LeaseID)
			b = append(b, `,"repo":`...)
			b = appendString(b, k.Repo)
			b = append(b, `,"fence":`...)
			b = strconv.AppendUint(b, k.Fence, 10)
			b = append(b, `,"version":`...)
			b = strconv.AppendUint(b, k.Version, 10)
			b = append(b, '}')
		}
		b = append(b, ']')
	}
	if r.Compact {
		b = append(b, `,"compact":true`...)
	}
	return append(b, '}')
}

// keptRestReply writes reply{KeptRest: &keptRest{Age: age}} as
// json.Marshal would: the answer to most keepalives.
func keptRestReply(age lease.Duration) []byte {
	b := make([]byte, 0, 40)
	b = append(b, `{"keptRest":{"age":`...)
	b = appendDuration(b, age)
	return append(b, "}}"...)
}
