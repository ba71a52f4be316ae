package sidecar

import (
	"errors"
	"strings"
	"testing"
)

// TestUpstreamHeaders: the lines and the secret header are all added, in
// order; a bad one is a HeaderError naming its place and not its value.
func TestUpstreamHeaders(t *testing.T) {
	h, err := UpstreamHeaders([]string{"X-Tenant: acme", "x-tenant:  billing "}, "Authorization: Bearer from-env")
	if err != nil {
		t.Fatal(err)
	}
	if got := h.Values("X-Tenant"); len(got) != 2 || got[0] != "acme" || got[1] != "billing" {
		t.Fatalf("X-Tenant = %q", got)
	}
	if got := h.Get("Authorization"); got != "Bearer from-env" {
		t.Fatalf("Authorization = %q", got)
	}

	var he *HeaderError
	_, err = UpstreamHeaders([]string{"X-Ok: 1", "Bad Name: secret-value"}, "")
	if !errors.As(err, &he) || he.N != 2 || strings.Contains(err.Error(), "secret-value") {
		t.Fatalf("a bad second line: %v", err)
	}
	_, err = UpstreamHeaders([]string{"X-Smuggle: a\r\nHost: evil"}, "")
	if !errors.As(err, &he) || he.N != 1 || !strings.Contains(he.Err.Error(), "control character") {
		t.Fatalf("a line break in a value: %v", err)
	}

	_, err = UpstreamHeaders(nil, "no colon here")
	if !errors.As(err, &he) || he.N != 0 || !strings.Contains(err.Error(), "GitUpstreamSecretHeader") || strings.Contains(err.Error(), "no colon") {
		t.Fatalf("a bad secret header: %v", err)
	}
	if h, err := UpstreamHeaders(nil, ""); err != nil || len(h) != 0 {
		t.Fatalf("no headers: %v, %v", h, err)
	}
}
