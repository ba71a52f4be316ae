package gitproxy

import (
	"strings"
	"testing"
)

// TestParseUpstream: only an http(s) URL with a host is a git upstream.
func TestParseUpstream(t *testing.T) {
	t.Parallel()
	for raw, ok := range map[string]bool{
		"https://git.example.com/acme/payments.git": true,
		"http://127.0.0.1:8080":                     true,
		"ftp://x":                                   false,
		"git@github.com:acme/payments.git":          false,
		"https://":                                  false,
		"http://:80/x.git":                          false,
		"/srv/git/payments.git":                     false,
		"":                                          false,
	} {
		_, err := ParseUpstream(raw)
		if (err == nil) != ok {
			t.Errorf("ParseUpstream(%q) = %v, want ok=%v", raw, err, ok)
		}
		if err != nil && !strings.Contains(err.Error(), "http:// or https://") {
			t.Errorf("ParseUpstream(%q): %v does not say what to give", raw, err)
		}
	}
	if err := (&Config{Upstream: "ftp://x"}).Validate(); err == nil || !strings.Contains(err.Error(), "http:// or https://") {
		t.Errorf("Validate of an ftp upstream: %v", err)
	}
}

// TestParseHeader: "Name: value", a token name, and no line break in the
// value; errors never repeat the value nor the name (a line without the
// colon after the name has the credential before its first colon).
func TestParseHeader(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ line, name, value, err string }{
		{line: "Authorization: Bearer s3cret", name: "Authorization", value: "Bearer s3cret"},
		{line: " X-Token :  a:b ", name: "X-Token", value: "a:b"},
		{line: "X-Empty:", name: "X-Empty", value: ""},
		{line: "Authorization Bearer s3cret", err: `want "Name: value"`},
		{line: ": s3cret", err: `want "Name: value"`},
		{line: "Bad Name: s3cret", err: "not an HTTP token"},
		{line: "Authorization Bearer s3cret:x", err: "not an HTTP token"}, // the colon in the token: its "name" is the credential
		{line: "X-A: s3cret\r\nX-B: smuggled", err: "control character"},
	} {
		name, value, err := ParseHeader(tc.line)
		switch {
		case tc.err == "" && (err != nil || name != tc.name || value != tc.value):
			t.Errorf("ParseHeader(%q) = %q, %q, %v; want %q, %q", tc.line, name, value, err, tc.name, tc.value)
		case tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err)):
			t.Errorf("ParseHeader(%q) = %v, want an error saying %q", tc.line, err, tc.err)
		case err != nil && strings.Contains(err.Error(), "s3cret"):
			t.Errorf("ParseHeader(%q): the error %q shows the value", tc.line, err)
		}
	}
}
