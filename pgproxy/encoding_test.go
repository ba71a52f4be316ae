package pgproxy

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"strings"
	"testing"
	"time"
)

// An unquoted name not in ASCII may be folded otherwise by a single-byte
// server encoding's locale (this machine has no such locale to show it
// with); quoted, or in ASCII, it is read alike.
func TestCutElsewhere(t *testing.T) {
	for _, tc := range []struct {
		sql    string
		refuse bool
	}{
		{"INSERT INTO ÉCOLE.t VALUES (1)", true},
		{`INSERT INTO "ÉCOLE".t VALUES (1)`, false},
		{`INSERT INTO U&"\00C9COLE".t VALUES (1)`, false},
		{"INSERT INTO ecole.t VALUES ('ÉCOLE')", false},
		{"INSERT INTO " + strings.Repeat("é", 16) + ".t VALUES (1)", true},
		{`INSERT INTO "` + strings.Repeat("é", 16) + `".t VALUES (1)`, true},
		{`INSERT INTO "` + strings.Repeat("é", 15) + `".t VALUES (1)`, false},
		{"SELECT 'unterminated é", true},
		{`INSERT INTO U&"` + strings.Repeat(`\00E9`, 16) + `".t VALUES (1)`, true}, // in ASCII, yet 16 characters that are not
		{`INSERT INTO U&"` + strings.Repeat(`a`, 16) + `".t VALUES (1)`, true},
		{`INSERT INTO U&"` + strings.Repeat(`a`, 15) + `".t VALUES (1)`, false},
		{`SELECT 1 & 3`, false},
	} {
		if why := cutElsewhere(tc.sql); (why != "") != tc.refuse {
			t.Errorf("cutElsewhere(%q) = %q; want a refusal: %v", tc.sql, why, tc.refuse)
		}
	}
}

func TestMayBeCut(t *testing.T) {
	for _, tc := range []struct {
		name string
		want bool
	}{
		{strings.Repeat("a", 200), false}, // ASCII: cut alike everywhere
		{strings.Repeat("é", 15), false},  // 60 bytes at most
		{strings.Repeat("é", 16), true},   // 64 in a 4-byte encoding
		{strings.Repeat("a", 59) + "é", false},
		{strings.Repeat("a", 60) + "é", true},
		{`"` + strings.Repeat("é", 16) + `"`, true},
	} {
		if got := mayBeCut(tc.name); got != tc.want {
			t.Errorf("mayBeCut(%q) = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// A Turkish locale in a single-byte encoding folds an unquoted İ to i, so
// the guard takes FENCELİNE for fenceline (a review read the gate's
// sequence as 'FENCELİNE.gate_<oid>' in a LATIN5 database under tr_TR).
func TestGuardFoldsDottedI(t *testing.T) {
	for _, s := range []string{"FENCELİNE.epoch", "fencelİne.gate_16384", `"fenceline".session`} {
		if !namesFence(s) {
			t.Errorf("namesFence(%q) = false: want the fence's schema", s)
		}
	}
	if !pathHasFence("public, FENCELİNE") {
		t.Error(`pathHasFence("public, FENCELİNE") = false`)
	}
	if namesFence(`"FENCELİNE".epoch`) {
		t.Error(`namesFence("\"FENCELİNE\".epoch") = true: a quoted name is not folded`)
	}
}

// A session's first ask for its database's slot may come with the
// catalog's lock held (cachedCatalog asks connectsVia under it): the slot
// takes no lock of the catalog's (a review found the first version, which
// kept the slots behind that lock, deadlocked there, and every session
// with it).
func TestSlotTakesNoCatalogLock(t *testing.T) {
	s := &session{p: &Proxy{catalog: newCatalog()}, database: "d"}
	s.p.catalog.mu.Lock()
	defer s.p.catalog.mu.Unlock()
	done := make(chan string)
	go func() { done <- s.connectsVia() }()
	select {
	case via := <-done:
		if via != "" {
			t.Errorf("connectsVia() = %q with nothing learned", via)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("connectsVia() waits for the catalog's lock")
	}
}

// The error of a statement of the proxy's own reaches the client without
// the fields that place it in the proxy's text: its context can show the
// statement's parameters, the token among them (a review:
// log_parameter_max_length_on_error = -1, then a cancel landing on it).
func TestOwnStatementErrorShowsNoParameters(t *testing.T) {
	var out bytes.Buffer
	s := &session{cw: bufio.NewWriter(&out)}
	s.push(&expect{kind: expSingle, swallow: true, own: true}, &expect{kind: expExecute, swallow: true, own: true}, &expect{kind: expSync})
	e := errorResponseFields(map[byte]string{'S': "ERROR", 'C': "57014", 'M': "canceling statement due to user request",
		'W': "unnamed portal with parameters: $1 = 'v5:secret-token'"})
	if err := s.relayError(s.head(), e); err != nil {
		t.Fatal(err)
	}
	s.cw.Flush()
	if got := out.String(); strings.Contains(got, "secret-token") || !strings.Contains(got, "canceling statement") {
		t.Errorf("the client got %q: want the cancel without the statement's parameters", got)
	}
}

// errorResponseFields is an ErrorResponse of fields f, in the order
// S, C, M, W.
func errorResponseFields(f map[byte]string) []byte {
	b := []byte{'E', 0, 0, 0, 0}
	for _, k := range []byte("SCMW") {
		if v, ok := f[k]; ok {
			b = append(append(append(b, k), v...), 0)
		}
	}
	b = append(b, 0)
	binary.BigEndian.PutUint32(b[1:], uint32(len(b)-1))
	return b
}
