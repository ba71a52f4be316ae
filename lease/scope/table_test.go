package scope

import (
	"strconv"
	"strings"
	"testing"
)

func TestNormalizeTable(t *testing.T) {
	long := strings.Repeat("x", maxIdentLen)
	good := []struct{ in, want string }{
		{"public.users", "public.users"},
		{"Public.Users", "public.users"},
		{"PUBLIC.*", "public.*"},
		{`public."Users"`, `public."Users"`},
		{`"public"."users"`, "public.users"},
		{`public."USERS"`, `public."USERS"`},
		{`public."my.table"`, `public."my.table"`},
		{`public."a""b"`, `public."a""b"`},
		{`public."*"`, `public."*"`},
		{`"*".*`, `"*".*`},
		{`public."1st"`, `public."1st"`},
		{"public.t$1", "public.t$1"},
		{"_s.x_1", "_s.x_1"},
		{"sch.Étoile", "sch.Étoile"},
		{`sch."Étoile"`, "sch.Étoile"},
		{"public." + long, "public." + long},
		{`schema_one."table two"`, `schema_one."table two"`},
		{`"CURRENT_SCHEMA".*`, `"CURRENT_SCHEMA".*`},
		{"sch.\"a\u00a0b\"", "sch.\"a\u00a0b\""},
	}
	for _, tc := range good {
		t.Run("ok "+tc.in, func(t *testing.T) {
			got, err := NormalizeTable(tc.in)
			if err != nil {
				t.Fatalf("NormalizeTable(%q) error: %v", tc.in, err)
			}
			if got != tc.want {
				t.Fatalf("NormalizeTable(%q) = %q, want %q", tc.in, got, tc.want)
			}
			again, err := NormalizeTable(got)
			if err != nil || again != got {
				t.Fatalf("NormalizeTable(%q) = %q, %v; not idempotent", got, again, err)
			}
		})
	}

	bad := []struct{ in, mention string }{
		{"", "schema.table"},
		{"users", "public.users"},
		{`"Users"`, "no schema"},
		{"public.", "ends with"},
		{".users", "empty identifier"},
		{"public..users", "empty identifier"},
		{`public.""`, "empty identifier"},
		{"db.public.users", "more than two parts"},
		{"*.users", "* as schema"},
		{"*.*", "* as schema"},
		{"public.us\x00ers", "NUL"},
		{"public. users", "whitespace"},
		{"public.users\n", "whitespace"},
		{"sch.a\u00a0b", "whitespace"},
		{`public."users`, "unterminated"},
		{`public.us"ers"`, "quote inside"},
		{`public."users"x`, "after a closing quote"},
		{"public.1st", "not a valid unquoted identifier"},
		{"public.us-ers", "not a valid unquoted identifier"},
		{"public.us*", "not a valid unquoted identifier"},
		{"public.$x", "not a valid unquoted identifier"},
		{"public." + long + "x", "longer than 63"},
		{"bad\xff.x", "UTF-8"},
	}
	for _, tc := range bad {
		t.Run("bad "+strconv.Quote(tc.in), func(t *testing.T) {
			got, err := NormalizeTable(tc.in)
			if err == nil {
				t.Fatalf("NormalizeTable(%q) = %q, want error", tc.in, got)
			}
			msg := err.Error()
			if !strings.Contains(msg, strconv.Quote(tc.in)) {
				t.Errorf("error %q does not name the input %q", msg, tc.in)
			}
			if !strings.Contains(msg, tc.mention) {
				t.Errorf("error %q does not mention %q", msg, tc.mention)
			}
		})
	}
}

func TestJoinTable(t *testing.T) {
	cases := []struct {
		schema, rel, want string
		ok                bool
	}{
		{"public", "users", "public.users", true},
		{"public", "Users", `public."Users"`, true},
		{"public", "*", `public."*"`, true},
		{"my.schema", `a"b`, `"my.schema"."a""b"`, true},
		{"public", "", "", false},
		{"public", "my table", `public."my table"`, true},
		{"public", "a\u00a0b", "public.\"a\u00a0b\"", true},
	}
	for _, tc := range cases {
		t.Run(tc.schema+"/"+tc.rel, func(t *testing.T) {
			got, err := JoinTable(tc.schema, tc.rel)
			if (err == nil) != tc.ok || got != tc.want {
				t.Fatalf("JoinTable(%q, %q) = %q, %v; want %q, ok=%v", tc.schema, tc.rel, got, err, tc.want, tc.ok)
			}
		})
	}
}

func TestTablesOverlap(t *testing.T) {
	cases := []struct {
		name string
		a, b string
		want bool
	}{
		{"equal", "public.users", "public.users", true},
		{"wildcard covers", "public.*", "public.users", true},
		{"two wildcards", "public.*", "public.*", true},
		{"other schema", "public.*", "billing.users", false},
		{"different tables", "public.users", "public.orders", false},
		{"quoted case differs", `public."Users"`, "public.users", false},
		{"quoted schema wildcard", `"My.Schema".*`, `"My.Schema"."T"`, true},
		{"quoted schema prefix", `"My.Schema".*`, `"My".x`, false},
		{"literal star is a table", `public."*"`, "public.users", false},
		{"literal star under wildcard", `public."*"`, "public.*", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := TablesOverlap(tc.a, tc.b); got != tc.want {
				t.Errorf("TablesOverlap(%q, %q) = %v, want %v", tc.a, tc.b, got, tc.want)
			}
			if got := TablesOverlap(tc.b, tc.a); got != tc.want {
				t.Errorf("TablesOverlap(%q, %q) = %v, want %v", tc.b, tc.a, got, tc.want)
			}
		})
	}
}

func TestSplitTable(t *testing.T) {
	for _, c := range []struct {
		in, schema, rel string
		wildcard        bool
	}{
		{"public.users", "public", "users", false},
		{"Public.*", "public", "*", true},
		{`"CURRENT_SCHEMA"."table two"`, "CURRENT_SCHEMA", "table two", false},
		{`public."*"`, "public", "*", false},
		{`"a""b".c`, `a"b`, "c", false},
	} {
		s, r, w, err := SplitTable(c.in)
		if err != nil || s != c.schema || r != c.rel || w != c.wildcard {
			t.Errorf("SplitTable(%q) = %q, %q, %v, %v; want %q, %q, %v", c.in, s, r, w, err, c.schema, c.rel, c.wildcard)
		}
	}
	if _, _, _, err := SplitTable("users"); err == nil {
		t.Error("SplitTable(users): no error for a name without a schema")
	}
}
