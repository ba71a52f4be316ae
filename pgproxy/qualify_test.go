package pgproxy

import (
	"errors"
	"strings"
	"testing"
)

// Every catalog lookup the proxy makes runs with each operator, function
// and type it names in pg_catalog.
func TestCatalogLookupsAreQualified(t *testing.T) {
	lookups := map[string]string{
		"calls":   callsSQL([]string{"ffoo", "obar", "rbaz", "tqux", "y16390", "qseq", "qs.seq", "q?"}),
		"foreign": foreignSQL,
	}
	for _, tc := range []bool{false, true} {
		for _, only := range []bool{false, true} {
			lookups["reach"+map[bool]string{false: "", true: " cascade"}[tc]+map[bool]string{false: "", true: " only"}[only]] = reachSQL([]string{`"public"."t"`, `"a b"."C"`}, tc, only)
		}
	}
	// Run before each lookup, as written.
	for name, q := range map[string]string{"planner defaults": plannerDefaultsSQL, "pin path": pinPathSQL, "prepared": preparedSQL,
		"sequences by path": seqsByPathSQL([]string{"qseq", `q"Seq"`})} {
		if err := qualifiedOnly(q); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for name, q := range lookups {
		out, err := qualifyCatalogSQL(q)
		if err != nil {
			t.Errorf("%s: %v", name, err)
			continue
		}
		if strings.Contains(out, " IN (") || strings.Contains(out, " = ") {
			t.Errorf("%s: an operator left unqualified: %s", name, out)
		}
	}
}

func TestQualifyCatalogSQL(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{"SELECT p.oid >= 16384 FROM pg_catalog.pg_proc p", "SELECT p.oid OPERATOR(pg_catalog.>=) 16384 FROM pg_catalog.pg_proc p"},
		{"SELECT 1 WHERE 2 IN (SELECT 3)", "SELECT 1 WHERE 2 OPERATOR(pg_catalog.=) ANY (SELECT 3)"},
		{"SELECT 1 WHERE 2 NOT IN (3, 4)", "SELECT 1 WHERE 2 OPERATOR(pg_catalog.<>) ALL(ARRAY[3, 4])"},
		{"SELECT 'a' || 'b', count(*), 1::oid", "SELECT 'a' OPERATOR(pg_catalog.||) 'b', pg_catalog.count(*), 1::pg_catalog.oid"},
		{"SELECT x.y.z(1)", "SELECT x.y.z(1)"}, // three parts: refused below
	} {
		got, err := qualifyCatalogSQL(tc.in)
		if tc.in == "SELECT x.y.z(1)" {
			if !errors.Is(err, errUnqualified) {
				t.Errorf("%s: %q, %v; want refused", tc.in, got, err)
			}
			continue
		}
		if err != nil || got != tc.want {
			t.Errorf("%s:\n got %q, %v\nwant %q", tc.in, got, err, tc.want)
		}
	}
	// Forms whose operator Postgres looks up by the path whatever the text
	// says, or that the deparser prints without its schema: refused, never
	// run.
	for _, q := range []string{
		"SELECT CASE 1 WHEN 2 THEN 3 END",
		"SELECT NULLIF(1, 2)",
		"SELECT 'a' LIKE 'b'",
		"SELECT 1 IS DISTINCT FROM 2",
		"SELECT 2 BETWEEN 1 AND 3",
		"SELECT FROM pg_catalog.pg_class a JOIN pg_catalog.pg_class b USING (oid)",
		"SELECT FROM pg_catalog.pg_class a NATURAL JOIN pg_catalog.pg_class b",
		"SELECT other.f(1)",
	} {
		if got, err := qualifyCatalogSQL(q); !errors.Is(err, errUnqualified) {
			t.Errorf("%s: %q, %v; want refused", q, got, err)
		}
	}
}
