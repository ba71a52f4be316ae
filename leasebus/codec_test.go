package leasebus

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// The hand-written encoders and fast decoders (encode.go, decode.go) must
// be indistinguishable from encoding/json: the same bytes out, the same
// values (or encoding/json's own error) in.

// awkward draws strings that exercise every escaping rule: quotes,
// backslashes, control characters, HTML characters, U+2028/U+2029,
// multi-byte runes, U+FFFD and invalid UTF-8.
func awkward(t *rapid.T, label string) string {
	parts := []string{"", "a", "lease_x", "svc/a", "\"", "\\", "\n", "\r", "\t", "\b", "\f", "\x00", "\x1f", "\x7f",
		"<", ">", "&", "\u2028", "\u2029", "é", "µs", "日本", "\U0001F600", "\uFFFD", "\xff", "\xe2\x80", "\xed\xa0\x80", " "}
	n := rapid.IntRange(0, 6).Draw(t, label+"Len")
	s := ""
	for i := range n {
		s += rapid.SampledFrom(parts).Draw(t, label+string(rune('0'+i)))
	}
	return s
}

func drawTime(t *rapid.T, label string) time.Time {
	if rapid.IntRange(0, 5).Draw(t, label+"Zero") == 0 {
		return time.Time{}
	}
	sec := rapid.Int64Range(-70000000000, 260000000000).Draw(t, label+"Sec") // years ~-250 to ~10200
	nsec := rapid.SampledFrom([]int64{0, 1, 1000000, 123000000, 999999999}).Draw(t, label+"Nsec")
	tm := time.Unix(sec, nsec)
	switch rapid.IntRange(0, 3).Draw(t, label+"Zone") {
	case 0:
		return tm.UTC()
	case 1:
		return tm.In(time.FixedZone("", 5*3600+30*60))
	case 2:
		return tm.In(time.FixedZone("X", -(23*3600 + 59*60)))
	}
	return tm.In(time.FixedZone("Y", 24*3600+60)) // Marshal refuses
}

func drawClaimAny(t *rapid.T) scope.Claim {
	c := scope.Claim{Kind: scope.Kind(rapid.SampledFrom([]string{"paths", "whole-repo", "none", "<x>"}).Draw(t, "kind"))}
	if rapid.Bool().Draw(t, "pathsNil") {
		for i := range rapid.IntRange(0, 3).Draw(t, "nPaths") {
			c.Paths = append(c.Paths, awkward(t, "path"+string(rune('0'+i))))
		}
	} else {
		c.Paths = []string{}
	}
	for i := range rapid.IntRange(0, 2).Draw(t, "nTables") {
		c.Tables = append(c.Tables, awkward(t, "table"+string(rune('0'+i))))
	}
	return c
}

func drawOwner(t *rapid.T) lease.Owner {
	if rapid.IntRange(0, 4).Draw(t, "ownerZero") == 0 {
		return lease.Owner{}
	}
	return lease.Owner{TaskID: awkward(t, "task"), AgentID: awkward(t, "agent"), AttemptID: awkward(t, "attempt"), HostID: awkward(t, "host")}
}

func drawDuration(t *rapid.T, label string) lease.Duration {
	return lease.Duration(rapid.SampledFrom([]time.Duration{0, time.Nanosecond, 1500 * time.Nanosecond, 2 * time.Millisecond,
		30 * time.Second, 300 * time.Second, 24 * time.Hour, -time.Second}).Draw(t, label))
}

func drawLease(t *rapid.T) lease.Lease {
	return lease.Lease{LeaseID: awkward(t, "id"), Repo: awkward(t, "repo"), Scope: drawClaimAny(t), WorkspaceID: awkward(t, "ws"),
		WorkspaceMode: lease.WorkspaceMode(awkward(t, "mode")), Owner: drawOwner(t), Status: lease.Status(awkward(t, "status")),
		Version: rapid.Uint64().Draw(t, "version"), Fence: rapid.Uint64().Draw(t, "fence"),
		AcquiredAt: drawTime(t, "acq"), RenewedAt: drawTime(t, "ren"), ExpiresAt: drawTime(t, "exp"),
		TTL: drawDuration(t, "ttl"), EndedAt: drawTime(t, "end"), Reason: awkward(t, "reason")}
}

func drawEvent(t *rapid.T) lease.AuditEvent {
	return lease.AuditEvent{Time: drawTime(t, "evTime"), Type: awkward(t, "evType"), Boundary: awkward(t, "boundary"), Repo: awkward(t, "evRepo"),
		LeaseID: awkward(t, "evLease"), Owner: drawOwner(t), Scope: drawClaimAny(t),
		Fence: rapid.SampledFrom([]uint64{0, 1, 1 << 63}).Draw(t, "evFence"), Reason: awkward(t, "evReason"), Message: awkward(t, "msg")}
}

// fataler is *testing.T or *rapid.T.
type fataler interface {
	Fatalf(format string, args ...any)
}

// sameAsMarshal fails t unless got is what json.Marshal(v) writes (or, if
// Marshal refuses v, unless the encoder refused too).
func sameAsMarshal(t fataler, what string, got []byte, ok bool, v any) {
	want, err := json.Marshal(v)
	if err != nil {
		if ok {
			t.Fatalf("%s: Marshal refuses (%v) but the encoder wrote %s", what, err, got)
		}
		return
	}
	if !ok {
		t.Fatalf("%s: the encoder refused what Marshal writes: %s", what, want)
	}
	if string(got) != string(want) {
		t.Fatalf("%s differs from json.Marshal:\n got %s\nwant %s", what, got, want)
	}
}

func TestEncodersMatchMarshal(t *testing.T) {
	t.Parallel()
	rapid.Check(t, func(t *rapid.T) {
		l := drawLease(t)
		got, ok := appendLease(&l, nil)
		sameAsMarshal(t, "lease", got, ok, &l)

		e := &entry{Lease: l, SecretHash: awkward(t, "secret"), RequestID: awkward(t, "req"), RenewID: awkward(t, "renew")}
		if _, err := json.Marshal(&l); err == nil {
			sameAsMarshal(t, "stored entry", e.storedJSON(), true, e)
		}

		var evs []lease.AuditEvent
		if rapid.IntRange(0, 4).Draw(t, "eventsNil") > 0 {
			evs = []lease.AuditEvent{}
			for range rapid.IntRange(0, 3).Draw(t, "nEvents") {
				evs = append(evs, drawEvent(t))
			}
		}
		ab := auditBatch{Events: evs, LogSeq: rapid.SampledFrom([]uint64{0, 7}).Draw(t, "logSeq"), From: rapid.SampledFrom([]uint64{0, 5}).Draw(t, "from")}
		data, err := ab.encode()
		sameAsMarshal(t, "audit batch", data, err == nil, &ab)

		acq := AcquireRequest{Repo: awkward(t, "aRepo"), Scope: drawClaimAny(t), WorkspaceID: awkward(t, "aWs"),
			WorkspaceMode: lease.WorkspaceMode(awkward(t, "aMode")), MaxSharers: rapid.IntRange(-2, 3).Draw(t, "maxSharers"),
			Owner: drawOwner(t), TTL: drawDuration(t, "aTTL"), Wait: drawDuration(t, "aWait"),
			RequestID: awkward(t, "aReq"), CredentialHash: awkward(t, "aHash")}
		for range rapid.IntRange(0, 2).Draw(t, "nWorkspaces") {
			acq.Workspaces = append(acq.Workspaces, awkward(t, "aWorkspaces"))
		}
		sameAsMarshal(t, "acquire request", acq.encode(), true, &acq)
		rel := ReleaseRequest{LeaseID: awkward(t, "rId"), Repo: awkward(t, "rRepo"), Credential: Credential(awkward(t, "rCred"))}
		sameAsMarshal(t, "release request", rel.encode(), true, &rel)
		ren := RenewRequest{LeaseID: awkward(t, "nId"), Repo: awkward(t, "nRepo"), Credential: Credential(awkward(t, "nCred")), Proof: awkward(t, "nProof"),
			Version: rapid.Uint64().Draw(t, "nVersion"), RenewID: awkward(t, "nRenew")}
		sameAsMarshal(t, "renew request", ren.encode(), true, &ren)
		ka := keepaliveRequest{Session: awkward(t, "kSession"), Compact: rapid.Bool().Draw(t, "kCompact")}
		if rapid.IntRange(0, 4).Draw(t, "kLeasesNil") > 0 {
			ka.Leases = []keptLease{}
			for range rapid.IntRange(0, 3).Draw(t, "kLeases") {
				ka.Leases = append(ka.Leases, keptLease{LeaseID: awkward(t, "kId"), Repo: awkward(t, "kRepo"),
					Fence: rapid.Uint64().Draw(t, "kFence"), Version: rapid.Uint64().Draw(t, "kVersion")})
			}
		}
		sameAsMarshal(t, "keepalive request", ka.encode(), true, &ka)
		age := drawDuration(t, "kAge")
		sameAsMarshal(t, "keepalive answer", keptRestReply(age), true, reply{KeptRest: &keptRest{Age: age}})

		// What the encoders write, the fast decoders read as encoding/json does.
		if got, ok := appendLease(&l, nil); ok {
			checkReplyDecode(t, append(append([]byte(`{"lease":`), got...), '}'))
		}
		checkRequestDecode(t, acq.encode())
		checkRequestDecode(t, rel.encode())
		checkRequestDecode(t, ren.encode())
		checkRequestDecode(t, ka.encode())
		checkReplyDecode(t, keptRestReply(age))
	})
}

// tb is what testing.T and rapid.T share.
type tb interface {
	Helper()
	Fatalf(format string, args ...any)
}

// checkRequestDecode fails t unless unmarshalRequest and json.Unmarshal
// agree on data for every request type: both fail, or both give the
// same value.
func checkRequestDecode(t tb, data []byte) {
	t.Helper()
	for _, mk := range []func() any{
		func() any { return new(AcquireRequest) },
		func() any { return new(ReleaseRequest) },
		func() any { return new(RenewRequest) },
		func() any { return new(keepaliveRequest) },
	} {
		got, want := mk(), mk()
		gotErr, wantErr := unmarshalRequest(data, got), json.Unmarshal(data, want)
		if (gotErr == nil) != (wantErr == nil) || gotErr != nil && gotErr.Error() != wantErr.Error() {
			t.Fatalf("%T from %q: fast decode error %v, encoding/json error %v", got, data, gotErr, wantErr)
		}
		if wantErr == nil && !reflect.DeepEqual(got, want) {
			t.Fatalf("%T from %q: fast decode %+v, encoding/json %+v", got, data, got, want)
		}
	}
}

// checkReplyDecode is checkRequestDecode for a service reply.
func checkReplyDecode(t tb, data []byte) {
	t.Helper()
	var got, want reply
	gotErr, wantErr := unmarshalReply(data, &got), json.Unmarshal(data, &want)
	if (gotErr == nil) != (wantErr == nil) || gotErr != nil && gotErr.Error() != wantErr.Error() {
		t.Fatalf("reply from %q: fast decode error %v, encoding/json error %v", data, gotErr, wantErr)
	}
	if wantErr == nil && !reflect.DeepEqual(got, want) {
		t.Fatalf("reply from %q: fast decode %+v, encoding/json %+v", data, got, want)
	}
}

// codecSeeds are valid encodings of the hot shapes plus near misses.
func codecSeeds() [][]byte {
	now := time.Date(2026, 11, 29, 10, 0, 0, 123000000, time.UTC)
	c, _ := scope.New([]string{"svc/a", "z"}, false, []string{"public.*"})
	l := lease.Lease{LeaseID: "lease_0abc", Repo: "github.com/a/b", Scope: c, WorkspaceID: "checkout", WorkspaceMode: lease.WorkspaceShared,
		Owner: lease.Owner{TaskID: "t", AgentID: "a"}, Status: lease.StatusActive, Version: 1, Fence: 9,
		AcquiredAt: now, RenewedAt: now, ExpiresAt: now.Add(time.Minute), TTL: lease.Duration(time.Minute)}
	pub, _ := appendLease(&l, nil)
	ended := l
	ended.Status, ended.EndedAt, ended.Reason = lease.StatusReleased, now, "released by owner"
	endedPub, _ := appendLease(&ended, nil)
	acq := AcquireRequest{Repo: "github.com/a/b", Scope: c, Owner: lease.Owner{TaskID: "t"}, TTL: lease.Duration(30 * time.Second),
		Wait: lease.Duration(time.Second), MaxSharers: 2, RequestID: "req_1", CredentialHash: NewCredential().hash()}
	rel := ReleaseRequest{LeaseID: "lease_0abc", Credential: "secret"}
	ren := RenewRequest{LeaseID: "lease_0abc", Repo: "r", Credential: "secret", Version: 3, RenewID: "req_2"}
	ka := keepaliveRequest{Session: "sess_0123456789abcdef0123456789abcdef", Compact: true,
		Leases: []keptLease{{LeaseID: "lease_0abc", Repo: "github.com/a/b", Fence: 9, Version: 1}, {LeaseID: "lease_0abd", Repo: "r", Fence: 10, Version: 4}}}
	return [][]byte{
		append(append([]byte(`{"lease":`), pub...), '}'),
		append(append([]byte(`{"lease":`), endedPub...), '}'),
		acq.encode(), rel.encode(), ren.encode(), ka.encode(), keptRestReply(lease.Duration(120 * time.Millisecond)),
		[]byte(`{"session":"s","leases":[],"compact":false}`),
		[]byte(`{"session":"s","leases":null}`),
		[]byte(`{"session":"s","leases":[{"leaseId":"a","leaseId":"b"}]}`),
		[]byte(`{"session":"s","leases":[{"fence":-1}],"compact":tru}`),
		[]byte(`{"session":"s","compact":truex}`),
		[]byte(`{"keptRest":{"age":"1s"},"kept":[{"leaseId":"a","missing":true}]}`),
		[]byte(`{"keptRest":{"age":"soon"}}`),
		[]byte(`{"keptRest":null}`),
		[]byte(`{"lease":null}`),
		[]byte(`{"error":{"code":"lost","message":"gone"}}`),
		[]byte(`{"lease":{"leaseId":"a","LeaseId":"b"}}`),
		[]byte(`{"lease":{"version":1,"version":2}}`),
		[]byte(`{"lease":{"owner":{"taskId":"a"},"owner":{"agentId":"b"}}}`),
		[]byte(`{"lease":{"scope":{"paths":[]},"ttl":"1s","expiresAt":"2026-01-02T03:04:05.6+01:00"}} `),
		[]byte(`{"lease":{"ttl":"forever"}}`),
		[]byte(`{"lease":{"version":-1}}`),
		[]byte(`{"lease":{"version":18446744073709551616}}`),
		[]byte(`{"lease":{"version":01}}`),
		[]byte(`{"lease":{"version":1.0}}`),
		[]byte(`{"leaseId":"lease_\u0030","credential":"x"}`),
		[]byte(`{"leaseId":"\xff","credential":"x"}`),
		[]byte(` {"repo":"r","maxSharers":3,"maxSharers":4} `),
		[]byte(`{"repo":"r","scope":{"kind":"paths","paths":["a"],"tables":[]},"extra":1}`),
		[]byte(`{"repo":"r"}x`),
		[]byte(`{"repo":"r",}`),
		[]byte(`{}`),
		[]byte(``),
	}
}

func TestFastDecodersMatchUnmarshal(t *testing.T) {
	t.Parallel()
	for _, s := range codecSeeds() {
		checkRequestDecode(t, s)
		checkReplyDecode(t, s)
	}
	// The shapes the bus writes take the fast path (else it is no faster).
	seeds := codecSeeds()
	var l lease.Lease
	var acq AcquireRequest
	var rel ReleaseRequest
	var ren RenewRequest
	var ka keepaliveRequest
	for i, ok := range []bool{
		fastDecode(seeds[0], func(d *fastDec, key []byte) (uint32, bool) { return 1, d.object(leaseFields(&l)) }),
		fastDecode(seeds[1], func(d *fastDec, key []byte) (uint32, bool) { return 1, d.object(leaseFields(&l)) }),
		fastDecode(seeds[2], acq.decodeField), fastDecode(seeds[3], rel.decodeField), fastDecode(seeds[4], ren.decodeField),
		fastDecode(seeds[5], ka.decodeField), keptRestOK(fastKeptRest(seeds[6])),
	} {
		if !ok {
			t.Errorf("the fast decoder gives up on %s", seeds[i])
		}
	}
}

func keptRestOK(r *keptRest, ok bool) bool {
	return ok && r.Age == lease.Duration(120*time.Millisecond)
}

// FuzzFastDecoders checks the fast decoders against encoding/json on
// arbitrary input: the same value where encoding/json accepts it, its own
// error where it does not.
func FuzzFastDecoders(f *testing.F) {
	for _, s := range codecSeeds() {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		checkRequestDecode(t, data)
		checkReplyDecode(t, data)
	})
}

func TestParsePubAck(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		in      string
		seq     uint64
		wantErr string
	}{
		{`{"stream":"FENCELINE_LOG","seq":42}`, 42, ""},
		{`{"stream":"FENCELINE_LOG","domain":"hub","seq":7}`, 7, ""},
		{`{"stream":"FENCELINE_LOG","seq":5,"duplicate":true}`, 5, ""},
		{`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 4"},"stream":"FENCELINE_LOG","seq":0}`, 0, "wrong last sequence"},
		{`{"stream":"","seq":3}`, 0, "invalid jetstream publish response"},
		{`{"stream":"X","seq":01}`, 0, "invalid jetstream publish response"},
		{`nonsense`, 0, "invalid jetstream publish response"},
	} {
		seq, err := parsePubAck([]byte(tc.in))
		if tc.wantErr == "" {
			if err != nil || seq != tc.seq {
				t.Errorf("parsePubAck(%s) = %d, %v; want %d", tc.in, seq, err, tc.seq)
			}
			continue
		}
		if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("parsePubAck(%s) = %d, %v; want an error with %q", tc.in, seq, err, tc.wantErr)
		}
	}
	_, err := parsePubAck([]byte(`{"error":{"code":400,"err_code":10071,"description":"wrong last sequence: 4"}}`))
	if !isCASMismatch(err) {
		t.Errorf("a wrong-last-sequence ack is not a CAS mismatch: %v", err)
	}
}
