package sidecar

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// dupKeys returns the keys a JSON object line repeats at its top level.
func dupKeys(t *testing.T, line string) []string {
	t.Helper()
	dec := json.NewDecoder(strings.NewReader(line))
	if tok, err := dec.Token(); err != nil || tok != json.Delim('{') {
		t.Fatalf("not a JSON object: %q", line)
	}
	seen, dups := map[string]bool{}, []string(nil)
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			t.Fatal(err)
		}
		k := tok.(string)
		if seen[k] {
			dups = append(dups, k)
		}
		seen[k] = true
		var v json.RawMessage
		if err := dec.Decode(&v); err != nil {
			t.Fatal(err)
		}
	}
	return dups
}

// TestLeaseLoggerNoDuplicateKeys: a line about the lease names lease,
// attempt and fence once, even when the code that logs it names them too
// (the fences log their refusals with their own lease and fence); the
// line's own values win. Seen in a pod: git refusals in JSON with "lease"
// and "fence" twice.
func TestLeaseLoggerNoDuplicateKeys(t *testing.T) {
	var buf bytes.Buffer
	l := lease.Lease{LeaseID: "lease_1", Fence: 7, Owner: lease.Owner{AttemptID: "att_1"}}
	log := LeaseLogger(slog.New(slog.NewJSONHandler(&buf, nil)), l).With("boundary", "git")
	log.Warn("refused", "lease", "lease_1", "fence", uint64(8), "reason", "scope")
	log.Info("git fence serving", "listen", "127.0.0.1:7070")
	log.WithGroup("g").Info("grouped", "k", "v")
	sc := bufio.NewScanner(&buf)
	var lines []map[string]any
	for sc.Scan() {
		if d := dupKeys(t, sc.Text()); len(d) > 0 {
			t.Errorf("keys %v twice in %s", d, sc.Text())
		}
		var m map[string]any
		json.Unmarshal(sc.Bytes(), &m)
		lines = append(lines, m)
	}
	if len(lines) != 3 {
		t.Fatalf("%d lines, want 3", len(lines))
	}
	for i, want := range []string{"lease_1 att_1 8 git", "lease_1 att_1 7 git", "lease_1 att_1 7 git"} {
		m := lines[i]
		if got := fmt.Sprint(m["lease"], " ", m["attempt"], " ", m["fence"], " ", m["boundary"]); got != want {
			t.Errorf("line %d: lease attempt fence boundary %q, want %q", i+1, got, want)
		}
	}
	if g, ok := lines[2]["g"].(map[string]any); !ok || g["k"] != "v" {
		t.Errorf("grouped line %v, want k under g", lines[2])
	}
}
