package gitproxy

import (
	"bufio"
	"bytes"
	"reflect"
	"testing"
)

func FuzzReadPushRequest(f *testing.F) {
	a := "1111111111111111111111111111111111111111"
	b := "2222222222222222222222222222222222222222"
	f.Add(appendFlush(appendPkt(nil, a, " ", b, " refs/heads/main\x00report-status side-band-64k")))
	f.Add(appendFlush(appendPkt(appendFlush(appendPkt(nil, a, " ", b, " refs/heads/main\x00push-options")), "ci.skip")))
	f.Add(appendFlush(appendPkt(appendPkt(nil, "shallow ", a), a, " ", zeroOID, " refs/tags/v1\x00")))
	f.Add([]byte("0000"))
	f.Add([]byte("ffff"))
	f.Add([]byte("0004"))
	f.Fuzz(func(t *testing.T, data []byte) {
		req, err := readPushRequest(bufio.NewReader(bytes.NewReader(data)))
		if err != nil {
			return
		}
		// What parses must survive re-encoding for the upstream unchanged.
		again, err := readPushRequest(bufio.NewReader(bytes.NewReader(req.encodeHead(nil))))
		if err != nil {
			t.Fatalf("re-encoded request does not parse: %v", err)
		}
		if !reflect.DeepEqual(normalize(req), normalize(again)) {
			t.Fatalf("round trip changed the request:\n%+v\n%+v", req, again)
		}
		for _, c := range req.Commands {
			if !validOID(c.Old) || !validOID(c.New) || checkRefName(c.Ref) != nil {
				t.Fatalf("accepted invalid command %+v", c)
			}
		}
	})
}

// normalize makes empty and nil slices compare equal.
func normalize(r *pushRequest) pushRequest {
	c := *r
	for _, s := range []*[]string{&c.Shallow, &c.Caps, &c.Options} {
		if len(*s) == 0 {
			*s = nil
		}
	}
	return c
}

func FuzzPktReader(f *testing.F) {
	f.Add([]byte("0009hello0000"))
	f.Add([]byte("000"))
	f.Add([]byte("fff0"))
	f.Fuzz(func(t *testing.T, data []byte) {
		pr := newPktReader(bufio.NewReader(bytes.NewReader(data)))
		consumed := 0
		for {
			line, err := pr.next()
			if err == errFlush {
				consumed += 4
				continue
			}
			if err != nil {
				return
			}
			if len(line) > maxPktPayload {
				t.Fatalf("payload of %d bytes", len(line))
			}
			enc, in := appendPkt(nil, string(line)), data[consumed:consumed+4+len(line)]
			if !bytes.EqualFold(enc[:4], in[:4]) || !bytes.Equal(enc[4:], in[4:]) {
				t.Fatalf("line %q does not re-encode to its input", line)
			}
			consumed += 4 + len(line)
		}
	})
}

// FuzzAdvertisement: the upstream's ref advertisement is read (for HEAD
// and for a delete's ref) and rewritten (push-cert dropped) by the proxy;
// the rewrite keeps every ref and parses like its input.
func FuzzAdvertisement(f *testing.F) {
	a := "1111111111111111111111111111111111111111"
	adv := func(lines ...string) []byte {
		b := appendFlush(appendPkt(nil, "# service=git-receive-pack\n"))
		for _, l := range lines {
			b = appendPkt(b, l)
		}
		return appendFlush(b)
	}
	f.Add(adv(a+" refs/heads/main\x00report-status push-cert=1700000000-abc delete-refs\n", a+" refs/tags/v1\n"))
	f.Add(adv(zeroOID + " capabilities^{}\x00report-status push-cert\n"))
	f.Add(adv(a+" HEAD\x00symref=HEAD:refs/heads/main\n", a+" refs/heads/main\n", a+" refs/tags/v1^{}\n"))
	f.Add([]byte("0000"))
	f.Fuzz(func(t *testing.T, data []byte) {
		refs, err := parseAdvertisement(bufio.NewReader(bytes.NewReader(data)))
		out := withoutCapability(data, "push-cert")
		again, err2 := parseAdvertisement(bufio.NewReader(bytes.NewReader(out)))
		if (err == nil) != (err2 == nil) {
			t.Fatalf("rewrite changed whether it parses: %v / %v", err, err2)
		}
		if err == nil && !reflect.DeepEqual(refs, again) {
			t.Fatalf("rewrite changed the refs: %v / %v", refs, again)
		}
		if err == nil && advertisesCapability(out, "push-cert") {
			t.Fatalf("push-cert still advertised: %q", out)
		}
	})
}

// advertisesCapability reports whether the first capability list of an
// advertisement names c (or c=value).
func advertisesCapability(body []byte, c string) bool {
	pr := newPktReader(bufio.NewReader(bytes.NewReader(body)))
	for range 3 {
		line, err := pr.next()
		if err == errFlush {
			continue
		}
		if err != nil {
			return false
		}
		if _, caps, ok := bytes.Cut(line, []byte{0}); ok {
			for _, f := range bytes.Fields(caps) {
				if string(f) == c || bytes.HasPrefix(f, []byte(c+"=")) {
					return true
				}
			}
			return false
		}
	}
	return false
}
