package pgproxy

import (
	"strings"
	"testing"
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
