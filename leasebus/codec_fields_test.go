package leasebus

import (
	"encoding/json"
	"reflect"
	"strconv"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
)

// fillAll sets every exported field reachable from v (nested structs,
// slices, maps and pointers) to a distinct non-zero value, so a
// field the hand-written codecs do not know cannot hide behind a zero
// value. The generators of codec_test.go are hand-written: a new field
// would be left zero there and pass.
func fillAll(t *testing.T, v reflect.Value, n *int) {
	t.Helper()
	*n++
	switch v.Kind() {
	case reflect.String:
		v.SetString("v" + strconv.Itoa(*n))
	case reflect.Bool:
		v.SetBool(true)
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		v.SetInt(int64(*n) * int64(time.Millisecond))
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		v.SetUint(uint64(*n))
	case reflect.Pointer:
		v.Set(reflect.New(v.Type().Elem()))
		fillAll(t, v.Elem(), n)
	case reflect.Slice:
		s := reflect.MakeSlice(v.Type(), 2, 2)
		for i := range 2 {
			fillAll(t, s.Index(i), n)
		}
		v.Set(s)
	case reflect.Map:
		m := reflect.MakeMap(v.Type())
		k, e := reflect.New(v.Type().Key()).Elem(), reflect.New(v.Type().Elem()).Elem()
		fillAll(t, k, n)
		fillAll(t, e, n)
		m.SetMapIndex(k, e)
		v.Set(m)
	case reflect.Struct:
		if v.Type() == reflect.TypeFor[time.Time]() {
			v.Set(reflect.ValueOf(time.Date(2026, 12, 1, 6, 0, *n, 1000**n, time.UTC)))
			return
		}
		for i := range v.NumField() {
			if f := v.Type().Field(i); !f.IsExported() || f.Tag.Get("json") == "-" {
				continue // never encoded (caches, the monotonic deadline, a renewal's credential)
			}
			fillAll(t, v.Field(i), n)
		}
	case reflect.Interface:
		// An interface field carries whatever encoding/json makes of it;
		// the hand-written codecs have none.
		t.Fatalf("%s: interface field; extend fillAll", v.Type())
	default:
		t.Fatalf("%s: kind %s not filled; extend fillAll", v.Type(), v.Kind())
	}
}

// TestCodecsKnowEveryField: each hand-encoded type, with every field set,
// encodes to json.Marshal's bytes, and its fast decoder reads them back
// to the same value. Adding a field to Lease, AuditEvent or a request
// without teaching encode.go and decode.go fails here.
func TestCodecsKnowEveryField(t *testing.T) {
	t.Parallel()
	n := 0
	var l lease.Lease
	fillAll(t, reflect.ValueOf(&l).Elem(), &n)
	got, ok := appendLease(&l, nil)
	sameAsMarshal(t, "lease", got, ok, &l)
	var back reply
	if err := unmarshalReply(append(append([]byte(`{"lease":`), got...), '}'), &back); err != nil || !reflect.DeepEqual(back.Lease, &l) {
		t.Errorf("lease decoded as %+v (%v), want %+v", back.Lease, err, l)
	}

	var rest keptRest
	fillAll(t, reflect.ValueOf(&rest).Elem(), &n)
	data := keptRestReply(rest.Age)
	sameAsMarshal(t, "keepalive answer", data, true, reply{KeptRest: &rest})
	if err := unmarshalReply(data, &back); err != nil || !reflect.DeepEqual(back.KeptRest, &rest) {
		t.Errorf("keepalive answer decoded as %+v (%v), want %+v", back.KeptRest, err, rest)
	}

	var e entry
	fillAll(t, reflect.ValueOf(&e).Elem(), &n)
	sameAsMarshal(t, "stored entry", e.storedJSON(), true, &e)

	var ab auditBatch
	fillAll(t, reflect.ValueOf(&ab).Elem(), &n)
	data, err := ab.encode()
	sameAsMarshal(t, "audit batch", data, err == nil, &ab)

	for _, req := range []interface {
		encode() []byte
	}{new(AcquireRequest), new(ReleaseRequest), new(RenewRequest), new(keepaliveRequest)} {
		fillAll(t, reflect.ValueOf(req).Elem(), &n)
		data := req.encode()
		sameAsMarshal(t, reflect.TypeOf(req).Elem().Name(), data, true, req)
		back := reflect.New(reflect.TypeOf(req).Elem()).Interface()
		if err := unmarshalRequest(data, back); err != nil || !reflect.DeepEqual(back, req) {
			t.Errorf("%T decoded as %+v (%v), want %+v", req, back, err, req)
		}
		var viaJSON = reflect.New(reflect.TypeOf(req).Elem()).Interface()
		if err := json.Unmarshal(data, viaJSON); err != nil || !reflect.DeepEqual(viaJSON, req) {
			t.Errorf("%T: encoding/json reads back %+v (%v): a field does not round-trip", req, viaJSON, err)
		}
	}
}
