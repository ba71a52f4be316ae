package scope

import (
	"reflect"
	"strconv"
	"strings"
	"testing"
)

var pathSeeds = []string{
	"", ".", "./", "/", "a", "a/", "a//b", "./a/./b/", "a/../b", "../a", "a/../../b",
	".git", ".git/x", ".GIT", ".gitignore", "a\\b", "a\x00b", "services/bill",
	"services/billing", "services/billing/api", "a-b", "Src", "src", "\xff", "…/ü",
}

func FuzzNormalizePath(f *testing.F) {
	for _, s := range pathSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		n, err := NormalizePath(in)
		if err != nil {
			if n != "" || !strings.Contains(err.Error(), strconv.Quote(in)) {
				t.Fatalf("NormalizePath(%q) = %q, %v: want no result and an error naming the input", in, n, err)
			}
			return
		}
		again, err := NormalizePath(n)
		if err != nil || again != n {
			t.Fatalf("NormalizePath(%q) = %q, but NormalizePath(%q) = %q, %v", in, n, n, again, err)
		}
		if strings.HasPrefix(n, "/") || strings.HasSuffix(n, "/") {
			t.Fatalf("NormalizePath(%q) = %q: leading or trailing slash", in, n)
		}
		if strings.IndexByte(n, 0) >= 0 || strings.IndexByte(n, '\\') >= 0 {
			t.Fatalf("NormalizePath(%q) = %q: NUL or backslash", in, n)
		}
		for _, comp := range strings.Split(n, "/") {
			if comp == "" || comp == "." || comp == ".." {
				t.Fatalf("NormalizePath(%q) = %q: component %q", in, n, comp)
			}
		}
		if first, _, _ := strings.Cut(n, "/"); strings.EqualFold(first, ".git") {
			t.Fatalf("NormalizePath(%q) = %q: in the git directory", in, n)
		}
		c, err := New([]string{in}, false, nil)
		if err != nil || !reflect.DeepEqual(c.Paths, []string{n}) || c.Validate() != nil {
			t.Fatalf("New([%q]) = %v, %v; want paths [%q]", in, c, err, n)
		}
	})
}

func FuzzOverlapSymmetric(f *testing.F) {
	for i, a := range pathSeeds {
		f.Add(a, pathSeeds[(i*7+3)%len(pathSeeds)], false, "public.users")
	}
	f.Add("services/billing", "services/billing/api", false, "public.*")
	f.Add("services/bill", "services/billing", true, `public."Users"`)
	f.Add("a", "a-b", false, "billing.*")
	f.Fuzz(func(t *testing.T, a, b string, wholeA bool, table string) {
		na, errA := NormalizePath(a)
		nb, errB := NormalizePath(b)
		if errA != nil || errB != nil {
			return
		}
		ab, ba := PathsOverlap(na, nb), PathsOverlap(nb, na)
		if ab != ba {
			t.Fatalf("PathsOverlap(%q, %q) = %v but reversed %v", na, nb, ab, ba)
		}

		ca := mustNew(t, []string{a}, false, nil)
		cb := mustNew(t, []string{b}, false, nil)
		if got := ca.Overlaps(cb); got != ab || cb.Overlaps(ca) != ab {
			t.Fatalf("claims %v and %v: Overlaps = %v / %v, PathsOverlap = %v", ca, cb, got, cb.Overlaps(ca), ab)
		}
		if ab && !ca.ContainsPath(nb) && !cb.ContainsPath(na) {
			t.Fatalf("%q overlaps %q but neither claim contains the other", na, nb)
		}
		if !ab && (ca.ContainsPath(nb) || cb.ContainsPath(na)) {
			t.Fatalf("%q and %q do not overlap but one claim contains the other", na, nb)
		}

		// Richer claims: a whole-repo or path claim with a table, against a
		// two-path claim and against a tables-only claim.
		var tables []string
		if _, err := NormalizeTable(table); err == nil {
			tables = []string{table}
		}
		var c1 Claim
		if wholeA {
			c1 = mustNew(t, nil, true, tables)
		} else {
			c1 = mustNew(t, []string{a}, false, tables)
		}
		others := []Claim{
			mustNew(t, []string{a, b}, false, nil),
			mustNew(t, []string{b}, false, []string{"public.*"}),
			mustNew(t, nil, false, tables),
			mustNew(t, nil, false, nil),
			mustNew(t, nil, true, nil),
		}
		for _, c2 := range append(others, c1) {
			o12, o21 := c1.Overlaps(c2), c2.Overlaps(c1)
			if o12 != o21 {
				t.Fatalf("%v.Overlaps(%v) = %v but reversed %v", c1, c2, o12, o21)
			}
			l12, l21 := c1.Overlap(c2), c2.Overlap(c1)
			if (len(l12) > 0) != o12 || len(l12) != len(l21) {
				t.Fatalf("%v vs %v: Overlaps %v, Overlap %q, reversed %q", c1, c2, o12, l12, l21)
			}
			for _, c := range []Claim{c1, c2} {
				if err := c.Validate(); err != nil {
					t.Fatalf("New built %v that does not validate: %v", c, err)
				}
			}
		}
	})
}

func FuzzNormalizeTable(f *testing.F) {
	for _, s := range []string{
		"public.users", "Public.Users", "public.*", `public."Users"`, `"a.b"."c""d"`,
		`public."*"`, "users", "a.b.c", "*.x", `"`, `a."`, "a.", ".a", "a.1", "a.$", "É.x",
		`"public".users`,
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		n, err := NormalizeTable(in)
		if err != nil {
			return
		}
		again, err := NormalizeTable(n)
		if err != nil || again != n {
			t.Fatalf("NormalizeTable(%q) = %q, but NormalizeTable(%q) = %q, %v", in, n, n, again, err)
		}
		schema, rel, ok := splitTable(n)
		if !ok {
			t.Fatalf("splitTable(%q) failed", n)
		}
		if !TablesOverlap(n, n) || !TablesOverlap(n, schema+".*") || !TablesOverlap(schema+".*", n) {
			t.Fatalf("%q does not overlap itself or %s.*", n, schema)
		}
		c := mustNew(t, nil, false, []string{in})
		if !c.ContainsTable(n) || c.Validate() != nil {
			t.Fatalf("claim %v does not contain %q or does not validate", c, n)
		}
		if rel != "*" {
			raw := func(s string) string {
				if strings.HasPrefix(s, `"`) {
					return strings.ReplaceAll(s[1:len(s)-1], `""`, `"`)
				}
				return s
			}
			j, err := JoinTable(raw(schema), raw(rel))
			if err != nil || j != n {
				t.Fatalf("JoinTable of the parts of %q = %q, %v", n, j, err)
			}
		}
	})
}

// FuzzJoinTable: JoinTable's shortcut answers exactly what the round trip
// through NormalizeTable does, result and error alike.
func FuzzJoinTable(f *testing.F) {
	for _, seed := range [][2]string{
		{"public", "users"}, {"Public", "Users"}, {"my schema", "t"}, {"s", ""}, {"", "t"},
		{"s", `we"ird`}, {"s", "t\x00"}, {"s", "\xff"}, {"s", "*"}, {"*", "t"}, {"s", "a.b"},
		{"s", strings.Repeat("x", 63)}, {"s", strings.Repeat("x", 64)}, {"s", "tab\u00a0le"}, {"ß", "Ω"},
	} {
		f.Add(seed[0], seed[1])
	}
	f.Fuzz(func(t *testing.T, schema, rel string) {
		got, err := JoinTable(schema, rel)
		want, werr := NormalizeTable(quoteIdent(schema) + "." + quoteIdent(rel))
		if got != want || (err == nil) != (werr == nil) || err != nil && err.Error() != werr.Error() {
			t.Fatalf("JoinTable(%q, %q) = %q, %v; the round trip gives %q, %v", schema, rel, got, err, want, werr)
		}
	})
}

// BenchmarkJoinTable: what the Postgres fence pays per write target.
func BenchmarkJoinTable(b *testing.B) {
	for b.Loop() {
		if _, err := JoinTable("public", "pgbench_accounts"); err != nil {
			b.Fatal(err)
		}
	}
}
