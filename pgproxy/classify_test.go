package pgproxy

import (
	"os"
	"slices"
	"strings"
	"testing"
)

type corpusCase struct {
	class   string
	targets []string
	sql     string
	line    int
}

func loadCorpus(t testing.TB) []corpusCase {
	t.Helper()
	b, err := os.ReadFile("testdata/classify.txt")
	if err != nil {
		t.Fatal(err)
	}
	var cases []corpusCase
	var cur *corpusCase
	var body []string
	flush := func() {
		if cur != nil {
			cur.sql = strings.TrimRight(strings.Join(body, "\n"), "\n")
			cases = append(cases, *cur)
		}
		body = nil
	}
	for i, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(line, "# ") && cur == nil {
			continue
		}
		if h, ok := strings.CutPrefix(line, "=== "); ok {
			flush()
			f := strings.Fields(h)
			cur = &corpusCase{class: f[0], targets: f[1:], line: i + 1}
			continue
		}
		body = append(body, line)
	}
	flush()
	return cases
}

func TestClassifierCorpus(t *testing.T) {
	cases := loadCorpus(t)
	if len(cases) < 100 {
		t.Fatalf("corpus has %d statements, want at least 100", len(cases))
	}
	for _, c := range cases {
		got := Classify(c.sql)
		if got.Class.String() != c.class {
			t.Errorf("line %d %q: class %s, want %s", c.line, c.sql, got.Class, c.class)
			continue
		}
		if c.class != "write" || len(c.targets) == 0 {
			continue
		}
		var have []string
		opaque, forbidden := false, false
		for _, st := range got.Stmts {
			if st.Class != ClassWrite {
				continue
			}
			opaque = opaque || st.Opaque
			forbidden = forbidden || st.Forbidden != ""
			for _, tg := range st.Targets {
				have = append(have, quoteTarget(tg))
			}
		}
		switch c.targets[0] {
		case "?":
			if !opaque {
				t.Errorf("line %d %q: want opaque, got targets %v", c.line, c.sql, have)
			}
		case "!":
			if !forbidden {
				t.Errorf("line %d %q: want forbidden", c.line, c.sql)
			}
		default:
			slices.Sort(have)
			want := slices.Clone(c.targets)
			slices.Sort(want)
			if !slices.Equal(have, want) || opaque {
				t.Errorf("line %d %q: targets %v (opaque %v), want %v", c.line, c.sql, have, opaque, want)
			}
		}
	}
}

func quoteTarget(t Target) string {
	q := func(s string) string {
		if s == "*" || s == strings.ToLower(s) && !strings.ContainsAny(s, " \"") {
			return s
		}
		return `"` + s + `"`
	}
	if t.Schema == "" {
		return q(t.Name)
	}
	return q(t.Schema) + "." + q(t.Name)
}

func TestClassifierCache(t *testing.T) {
	c := NewClassifier(2)
	a := c.Classify("SELECT a")
	if c.Classify("SELECT a") != a {
		t.Fatal("not cached")
	}
	c.Classify("SELECT b")
	c.Classify("SELECT c") // clears
	if got := c.Classify("SELECT a"); got == a || got.Class != ClassRead {
		t.Fatal("cache not bounded")
	}
}

// TestClassifierLiteralCache: statements that differ only in constants share
// a cache entry, and get the same answer as classifying each text afresh.
func TestClassifierLiteralCache(t *testing.T) {
	c := NewClassifier(0)
	for _, cs := range loadCorpus(t) {
		for _, v := range []string{cs.sql, strings.ReplaceAll(cs.sql, "1", "42"), strings.ReplaceAll(cs.sql, "'x'", "'yy'")} {
			got, want := c.Classify(v), Classify(v)
			if got.Class != want.Class || len(got.Stmts) != len(want.Stmts) {
				t.Fatalf("%q: cached %v, fresh %v", v, got.Class, want.Class)
			}
			for i := range got.Stmts {
				g, w := got.Stmts[i], want.Stmts[i]
				if g.Class != w.Class || g.Start != w.Start || g.End != w.End || !slices.Equal(g.Targets, w.Targets) || g.Forbidden != w.Forbidden || g.Opaque != w.Opaque {
					t.Fatalf("%q: cached %+v, fresh %+v", v, g, w)
				}
			}
		}
	}
	if literalKey("SELECT abalance FROM pgbench_accounts WHERE aid = 4711") != literalKey("SELECT abalance FROM pgbench_accounts WHERE aid = 12") {
		t.Fatal("constants not folded")
	}
	for _, q := range []string{"SELECT 1; SELECT 2", "SELECT $$x$$", "SELECT E'\\x'", "SET x = 1", "SELECT 1 -- c", "SELECT U&'x'"} {
		if literalKey(q) != "" {
			t.Errorf("%q: want no key", q)
		}
	}
}
