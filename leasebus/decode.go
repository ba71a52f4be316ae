package leasebus

import (
	"bytes"
	"encoding/json"
	"strconv"
	"time"
	"unicode/utf8"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// Fast decoders for the hot request and reply shapes. They read only the
// JSON this package writes — objects with known keys each at most once,
// strings without escapes, unsigned integers without leading zeros,
// arrays of strings — and give up on anything else (escapes, unknown,
// repeated or differently cased keys, null, signs, fractions, exponents,
// invalid UTF-8, a time or duration the type refuses); the caller then
// decodes with encoding/json. So their results are always exactly
// encoding/json's (decode_test.go fuzzes this): the same value on input
// they accept, encoding/json's own error on invalid input.

// unmarshalRequest decodes a request like json.Unmarshal into a zero v.
func unmarshalRequest(data []byte, v any) error {
	var ok bool
	switch r := v.(type) {
	case *AcquireRequest:
		ok = fastDecode(data, r.decodeField)
		if !ok {
			*r = AcquireRequest{}
		}
	case *ReleaseRequest:
		ok = fastDecode(data, r.decodeField)
		if !ok {
			*r = ReleaseRequest{}
		}
	case *RenewRequest:
		ok = fastDecode(data, r.decodeField)
		if !ok {
			*r = RenewRequest{}
		}
	case *keepaliveRequest:
		ok = fastDecode(data, r.decodeField)
		if !ok {
			*r = keepaliveRequest{}
		}
	}
	if ok {
		return nil
	}
	return json.Unmarshal(data, v)
}

// unmarshalReply decodes a service reply like json.Unmarshal into a zero r.
func unmarshalReply(data []byte, r *reply) error {
	if bytes.HasPrefix(data, []byte(`{"lease":`)) {
		l := new(lease.Lease)
		if fastDecode(data, func(d *fastDec, key []byte) (uint32, bool) {
			return 1, string(key) == "lease" && d.object(leaseFields(l))
		}) {
			r.Lease = l
			return nil
		}
	}
	if bytes.HasPrefix(data, []byte(`{"keptRest":`)) {
		if rest, ok := fastKeptRest(data); ok {
			r.KeptRest = rest
			return nil
		}
	}
	return json.Unmarshal(data, r)
}

// fastKeptRest reads the answer to most keepalives (keptRestReply).
func fastKeptRest(data []byte) (*keptRest, bool) {
	rest := new(keptRest)
	return rest, fastDecode(data, func(d *fastDec, key []byte) (uint32, bool) {
		return 1, string(key) == "keptRest" && d.object(func(d *fastDec, key []byte) (uint32, bool) {
			return 1, string(key) == "age" && d.duration(&rest.Age)
		})
	})
}

// fastDec reads one JSON value from b; ok is false once it gave up.
type fastDec struct {
	b []byte
	i int
}

// fastDecode reads data as one object whose fields field decodes, and
// nothing after it but whitespace.
func fastDecode(data []byte, field fieldFunc) bool {
	d := &fastDec{b: data}
	if !d.object(field) {
		return false
	}
	d.ws()
	return d.i == len(d.b)
}

func (d *fastDec) ws() {
	for d.i < len(d.b) {
		switch d.b[d.i] {
		case ' ', '\t', '\n', '\r':
			d.i++
		default:
			return
		}
	}
}

// next skips whitespace and consumes c if it is next.
func (d *fastDec) next(c byte) bool {
	d.ws()
	if d.i < len(d.b) && d.b[d.i] == c {
		d.i++
		return true
	}
	return false
}

// fieldFunc reads the value of the field named key, with d at the value,
// and returns the field's bit in its object; ok is false for a key it does
// not know or a value it does not take.
type fieldFunc func(d *fastDec, key []byte) (bit uint32, ok bool)

// object reads {"key":value,...}, each key at most once.
func (d *fastDec) object(field fieldFunc) bool {
	if !d.next('{') {
		return false
	}
	if d.next('}') {
		return true
	}
	var seen uint32
	for {
		key, ok := d.rawString()
		if !ok || !d.next(':') {
			return false
		}
		d.ws()
		bit, ok := field(d, key[1:len(key)-1])
		if !ok || seen&bit != 0 {
			return false
		}
		seen |= bit
		if d.next(',') {
			continue
		}
		return d.next('}')
	}
}

// rawString reads a string without escapes or control characters, in
// valid UTF-8, and returns it with its quotes.
func (d *fastDec) rawString() ([]byte, bool) {
	d.ws()
	if d.i >= len(d.b) || d.b[d.i] != '"' {
		return nil, false
	}
	start := d.i
	ascii := true
	for j := d.i + 1; j < len(d.b); j++ {
		switch c := d.b[j]; {
		case c == '"':
			if !ascii && !utf8.Valid(d.b[start+1:j]) {
				return nil, false
			}
			d.i = j + 1
			return d.b[start:d.i], true
		case c == '\\' || c < 0x20:
			return nil, false
		case c >= utf8.RuneSelf:
			ascii = false
		}
	}
	return nil, false
}

func (d *fastDec) str(dst *string) bool {
	s, ok := d.rawString()
	if ok {
		*dst = string(s[1 : len(s)-1])
	}
	return ok
}

// uint reads a non-negative integer that fits in 64 bits.
func (d *fastDec) uint(dst *uint64) bool {
	start := d.i
	for d.i < len(d.b) && d.b[d.i] >= '0' && d.b[d.i] <= '9' {
		d.i++
	}
	digits := d.b[start:d.i]
	if len(digits) == 0 || len(digits) > 1 && digits[0] == '0' {
		return false
	}
	if d.i < len(d.b) && (d.b[d.i] == '.' || d.b[d.i] == 'e' || d.b[d.i] == 'E') {
		return false
	}
	v, err := strconv.ParseUint(string(digits), 10, 64)
	*dst = v
	return err == nil
}

func (d *fastDec) int(dst *int) bool {
	var v uint64
	if !d.uint(&v) || v > uint64(int(^uint(0)>>1)) {
		return false
	}
	*dst = int(v)
	return true
}

func (d *fastDec) time(dst *time.Time) bool {
	s, ok := d.rawString()
	return ok && dst.UnmarshalJSON(s) == nil
}

func (d *fastDec) duration(dst *lease.Duration) bool {
	s, ok := d.rawString()
	return ok && dst.UnmarshalText(s[1:len(s)-1]) == nil
}

// strings reads an array of strings; [] is an empty, non-nil slice, as
// encoding/json makes it.
func (d *fastDec) strings(dst *[]string) bool { return fastArray(d, dst, (*fastDec).str) }

// fastArray reads an array whose elements elem reads; [] is an empty,
// non-nil slice, as encoding/json makes it.
func fastArray[T any](d *fastDec, dst *[]T, elem func(*fastDec, *T) bool) bool {
	if !d.next('[') {
		return false
	}
	out := []T{}
	if !d.next(']') {
		for {
			var v T
			if !elem(d, &v) {
				return false
			}
			out = append(out, v)
			if d.next(',') {
				continue
			}
			if !d.next(']') {
				return false
			}
			break
		}
	}
	*dst = out
	return true
}

func (d *fastDec) claim(c *scope.Claim) bool {
	return d.object(func(d *fastDec, key []byte) (uint32, bool) {
		switch string(key) {
		case "kind":
			return 1 << 0, d.str((*string)(&c.Kind))
		case "paths":
			return 1 << 1, d.strings(&c.Paths)
		case "tables":
			return 1 << 2, d.strings(&c.Tables)
		}
		return 0, false
	})
}

func (d *fastDec) owner(o *lease.Owner) bool {
	return d.object(func(d *fastDec, key []byte) (uint32, bool) {
		switch string(key) {
		case "taskId":
			return 1 << 0, d.str(&o.TaskID)
		case "agentId":
			return 1 << 1, d.str(&o.AgentID)
		case "attemptId":
			return 1 << 2, d.str(&o.AttemptID)
		case "hostId":
			return 1 << 3, d.str(&o.HostID)
		}
		return 0, false
	})
}

// leaseFields reads the fields of a lease record into l; each at most once.
func leaseFields(l *lease.Lease) fieldFunc {
	return func(d *fastDec, key []byte) (uint32, bool) { return decodeLeaseField(l, d, key) }
}

func decodeLeaseField(l *lease.Lease, d *fastDec, key []byte) (uint32, bool) {
	var bit uint32
	var ok bool
	switch string(key) {
	case "leaseId":
		bit, ok = 1<<0, d.str(&l.LeaseID)
	case "repo":
		bit, ok = 1<<1, d.str(&l.Repo)
	case "scope":
		bit, ok = 1<<2, d.claim(&l.Scope)
	case "workspaceId":
		bit, ok = 1<<3, d.str(&l.WorkspaceID)
	case "workspaceMode":
		bit, ok = 1<<4, d.str((*string)(&l.WorkspaceMode))
	case "owner":
		bit, ok = 1<<5, d.owner(&l.Owner)
	case "status":
		bit, ok = 1<<6, d.str((*string)(&l.Status))
	case "version":
		bit, ok = 1<<7, d.uint(&l.Version)
	case "fence":
		bit, ok = 1<<8, d.uint(&l.Fence)
	case "acquiredAt":
		bit, ok = 1<<9, d.time(&l.AcquiredAt)
	case "renewedAt":
		bit, ok = 1<<10, d.time(&l.RenewedAt)
	case "expiresAt":
		bit, ok = 1<<11, d.time(&l.ExpiresAt)
	case "ttl":
		bit, ok = 1<<12, d.duration(&l.TTL)
	case "endedAt":
		bit, ok = 1<<13, d.time(&l.EndedAt)
	case "reason":
		bit, ok = 1<<14, d.str(&l.Reason)
	}
	return bit, ok
}

func (r *AcquireRequest) decodeField(d *fastDec, key []byte) (uint32, bool) {
	var bit uint32
	var ok bool
	switch string(key) {
	case "repo":
		bit, ok = 1<<0, d.str(&r.Repo)
	case "scope":
		bit, ok = 1<<1, d.claim(&r.Scope)
	case "workspaceId":
		bit, ok = 1<<2, d.str(&r.WorkspaceID)
	case "workspaceMode":
		bit, ok = 1<<3, d.str((*string)(&r.WorkspaceMode))
	case "maxSharers":
		bit, ok = 1<<4, d.int(&r.MaxSharers)
	case "owner":
		bit, ok = 1<<5, d.owner(&r.Owner)
	case "ttl":
		bit, ok = 1<<6, d.duration(&r.TTL)
	case "wait":
		bit, ok = 1<<7, d.duration(&r.Wait)
	case "requestId":
		bit, ok = 1<<8, d.str(&r.RequestID)
	case "credentialHash":
		bit, ok = 1<<9, d.str(&r.CredentialHash)
	case "workspaces":
		bit, ok = 1<<10, d.strings(&r.Workspaces)
	case "session":
		bit, ok = 1<<11, d.str(&r.Session)
	}
	return bit, ok
}

func (r *ReleaseRequest) decodeField(d *fastDec, key []byte) (uint32, bool) {
	var bit uint32
	var ok bool
	switch string(key) {
	case "leaseId":
		bit, ok = 1<<0, d.str(&r.LeaseID)
	case "repo":
		bit, ok = 1<<1, d.str(&r.Repo)
	case "credential":
		bit, ok = 1<<2, d.str((*string)(&r.Credential))
	}
	return bit, ok
}

func (r *RenewRequest) decodeField(d *fastDec, key []byte) (uint32, bool) {
	var bit uint32
	var ok bool
	switch string(key) {
	case "leaseId":
		bit, ok = 1<<0, d.str(&r.LeaseID)
	case "repo":
		bit, ok = 1<<1, d.str(&r.Repo)
	case "proof":
		bit, ok = 1<<2, d.str(&r.Proof)
	case "version":
		bit, ok = 1<<3, d.uint(&r.Version)
	case "renewId":
		bit, ok = 1<<4, d.str(&r.RenewID)
	}
	return bit, ok
}

func (r *keepaliveRequest) decodeField(d *fastDec, key []byte) (uint32, bool) {
	var bit uint32
	var ok bool
	switch string(key) {
	case "session":
		bit, ok = 1<<0, d.str(&r.Session)
	case "leases":
		bit, ok = 1<<1, d.keptLeases(&r.Leases)
	case "compact":
		bit, ok = 1<<2, d.boolean(&r.Compact)
	}
	return bit, ok
}

// keptLeases reads an array of keptLease objects.
func (d *fastDec) keptLeases(dst *[]keptLease) bool {
	return fastArray(d, dst, func(d *fastDec, k *keptLease) bool {
		return d.object(func(d *fastDec, key []byte) (uint32, bool) {
			switch string(key) {
			case "leaseId":
				return 1 << 0, d.str(&k.LeaseID)
			case "repo":
				return 1 << 1, d.str(&k.Repo)
			case "fence":
				return 1 << 2, d.uint(&k.Fence)
			case "version":
				return 1 << 3, d.uint(&k.Version)
			}
			return 0, false
		})
	})
}

// boolean reads true or false.
func (d *fastDec) boolean(dst *bool) bool {
	switch {
	case bytes.HasPrefix(d.b[d.i:], []byte("true")):
		d.i += 4
		*dst = true
	case bytes.HasPrefix(d.b[d.i:], []byte("false")):
		d.i += 5
		*dst = false
	default:
		return false
	}
	return true
}
