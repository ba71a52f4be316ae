package scope

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"
)

func mustNew(t *testing.T, paths []string, whole bool, tables []string) Claim {
	t.Helper()
	c, err := New(paths, whole, tables)
	if err != nil {
		t.Fatalf("New(%q, %v, %q): %v", paths, whole, tables, err)
	}
	return c
}

func TestNew(t *testing.T) {
	cases := []struct {
		name   string
		paths  []string
		whole  bool
		tables []string
		want   Claim
	}{
		{"none", nil, false, nil, Claim{KindNone, []string{}, []string{}}},
		{"whole", nil, true, nil, Claim{KindWholeRepo, []string{}, []string{}}},
		{"sorted", []string{"services/billing", "libs/tax"}, false, nil,
			Claim{KindPaths, []string{"libs/tax", "services/billing"}, []string{}}},
		{"dedupe after cleaning", []string{"a/b/", "./a//b", "a/b"}, false, nil,
			Claim{KindPaths, []string{"a/b"}, []string{}}},
		{"ancestor collapse", []string{"a/b/c", "a-b", "a", "a/x", "b/c"}, false, nil,
			Claim{KindPaths, []string{"a", "a-b", "b/c"}, []string{}}},
		{"name prefix kept", []string{"services/bill", "services/billing"}, false, nil,
			Claim{KindPaths, []string{"services/bill", "services/billing"}, []string{}}},
		{"tables", nil, false, []string{"Public.Users", "public.users", "billing.*", "billing.invoices", `public."Orders"`}, Claim{
			KindNone, []string{}, []string{`billing.*`, `public."Orders"`, "public.users"}}},
		{"whole with tables", nil, true, []string{"public.*"},
			Claim{KindWholeRepo, []string{}, []string{"public.*"}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := mustNew(t, tc.paths, tc.whole, tc.tables)
			if !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("New = %#v, want %#v", got, tc.want)
			}
			if err := got.Validate(); err != nil {
				t.Fatalf("New result does not validate: %v", err)
			}
		})
	}

	bad := []struct {
		name    string
		paths   []string
		whole   bool
		tables  []string
		mention []string
	}{
		{"whole and paths", []string{"a"}, true, nil, []string{"--whole-repo and --scope are exclusive"}},
		{"escaping path", []string{"ok", "../x"}, false, nil, []string{"--scope", `"../x"`, "escapes"}},
		{"root path", []string{"./"}, false, nil, []string{"--scope", `"./"`, "--whole-repo"}},
		{"table without schema", nil, false, []string{"users"}, []string{"--table", `"users"`, "public.users"}},
	}
	for _, tc := range bad {
		t.Run("bad "+tc.name, func(t *testing.T) {
			c, err := New(tc.paths, tc.whole, tc.tables)
			if err == nil {
				t.Fatalf("New = %v, want error", c)
			}
			for _, m := range tc.mention {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("error %q does not mention %q", err, m)
				}
			}
		})
	}
}

func TestClaimOverlaps(t *testing.T) {
	none := Claim{KindNone, []string{}, []string{}}
	whole := Claim{KindWholeRepo, []string{}, []string{}}
	billing := Claim{KindPaths, []string{"libs/tax", "services/billing"}, []string{}}
	api := Claim{KindPaths, []string{"services/billing/api"}, []string{}}
	bill := Claim{KindPaths, []string{"services/bill"}, []string{}}
	users := Claim{KindNone, []string{}, []string{"public.users"}}
	public := Claim{KindPaths, []string{"docs"}, []string{"public.*"}}
	wholeOrders := Claim{KindWholeRepo, []string{}, []string{"public.orders"}}

	cases := []struct {
		name string
		a, b Claim
		want []string
	}{
		{"whole vs whole", whole, whole, []string{"whole-repo ⟷ whole-repo"}},
		{"whole vs paths", whole, billing, []string{"whole-repo ⟷ libs/tax", "whole-repo ⟷ services/billing"}},
		{"paths vs whole", api, whole, []string{"services/billing/api ⟷ whole-repo"}},
		{"whole vs none", whole, none, nil},
		{"whole vs tables only", whole, users, nil},
		{"none vs none", none, none, nil},
		{"none vs paths", none, billing, nil},
		{"ancestor", billing, api, []string{"services/billing ⟷ services/billing/api"}},
		{"name prefix", billing, bill, nil},
		{"disjoint paths", api, bill, nil},
		{"tables equal", users, users, []string{"public.users ⟷ public.users"}},
		{"tables wildcard", users, public, []string{"public.users ⟷ public.*"}},
		{"tables disjoint", users, wholeOrders, nil},
		{"paths and tables", wholeOrders, public, []string{"whole-repo ⟷ docs", "public.orders ⟷ public.*"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.a.Overlap(tc.b)
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("Overlap = %q, want %q", got, tc.want)
			}
			want := len(tc.want) > 0
			if ab, ba := tc.a.Overlaps(tc.b), tc.b.Overlaps(tc.a); ab != want || ba != want {
				t.Errorf("Overlaps = %v / reversed %v, want %v", ab, ba, want)
			}
			if n := len(tc.b.Overlap(tc.a)); n != len(tc.want) {
				t.Errorf("reversed Overlap has %d items, want %d", n, len(tc.want))
			}
		})
	}
}

func TestContains(t *testing.T) {
	paths := Claim{KindPaths, []string{"libs/tax", "services/billing"}, []string{"billing.*", "public.users"}}
	whole := Claim{KindWholeRepo, []string{}, []string{}}
	none := Claim{KindNone, []string{}, []string{}}

	pathCases := []struct {
		c    Claim
		p    string
		want bool
	}{
		{paths, "services/billing", true},
		{paths, "services/billing/api/x.go", true},
		{paths, "services/bill", false},
		{paths, "services/billing2", false},
		{paths, "services", false},
		{paths, "libs/tax/rates.go", true},
		{whole, "anything/at/all", true},
		{none, "services/billing", false},
	}
	for _, tc := range pathCases {
		t.Run(tc.c.String()+" "+tc.p, func(t *testing.T) {
			if got := tc.c.ContainsPath(tc.p); got != tc.want {
				t.Errorf("ContainsPath(%q) = %v, want %v", tc.p, got, tc.want)
			}
		})
	}

	tableCases := []struct {
		c    Claim
		t    string
		want bool
	}{
		{paths, "public.users", true},
		{paths, "public.orders", false},
		{paths, "public.*", false},
		{paths, "billing.invoices", true},
		{paths, "billing.*", true},
		{paths, `billing."Invoices"`, true},
		{paths, "billing2.x", false},
		{whole, "public.users", false},
		{none, "public.users", false},
	}
	for _, tc := range tableCases {
		t.Run(tc.c.String()+" "+tc.t, func(t *testing.T) {
			if got := tc.c.ContainsTable(tc.t); got != tc.want {
				t.Errorf("ContainsTable(%q) = %v, want %v", tc.t, got, tc.want)
			}
		})
	}
}

func TestIsZeroAndString(t *testing.T) {
	cases := []struct {
		c    Claim
		zero bool
		str  string
	}{
		{Claim{}, true, "none"},
		{Claim{KindNone, []string{}, []string{}}, true, "none"},
		{Claim{KindNone, []string{}, []string{"public.users"}}, false, "none tables=[public.users]"},
		{Claim{KindWholeRepo, []string{}, []string{}}, false, "whole-repo"},
		{Claim{KindPaths, []string{"libs/tax", "services/billing"}, nil}, false, "[libs/tax services/billing]"},
		{Claim{KindPaths, []string{"a", "b"}, []string{"public.users", "x.*"}}, false, "[a b] tables=[public.users x.*]"},
	}
	for _, tc := range cases {
		t.Run(tc.str, func(t *testing.T) {
			if got := tc.c.IsZero(); got != tc.zero {
				t.Errorf("IsZero = %v, want %v", got, tc.zero)
			}
			if got := tc.c.String(); got != tc.str {
				t.Errorf("String = %q, want %q", got, tc.str)
			}
		})
	}
}

func TestJSON(t *testing.T) {
	cases := []struct {
		c    Claim
		want string
	}{
		{mustNew(t, []string{"services/billing", "libs/tax"}, false, []string{"public.users"}),
			`{"kind":"paths","paths":["libs/tax","services/billing"],"tables":["public.users"]}`},
		{mustNew(t, nil, true, nil), `{"kind":"whole-repo","paths":[],"tables":[]}`},
		{mustNew(t, nil, false, nil), `{"kind":"none","paths":[],"tables":[]}`},
		{Claim{Kind: KindNone}, `{"kind":"none","paths":[],"tables":[]}`},
	}
	for _, tc := range cases {
		t.Run(tc.c.String(), func(t *testing.T) {
			b, err := json.Marshal(tc.c)
			if err != nil {
				t.Fatal(err)
			}
			if string(b) != tc.want {
				t.Fatalf("Marshal = %s, want %s", b, tc.want)
			}
			var back Claim
			if err := json.Unmarshal(b, &back); err != nil {
				t.Fatal(err)
			}
			if err := back.Validate(); err != nil {
				t.Fatalf("round trip does not validate: %v", err)
			}
			b2, err := json.Marshal(back)
			if err != nil || string(b2) != tc.want {
				t.Fatalf("re-Marshal = %s, %v; want %s", b2, err, tc.want)
			}
		})
	}

	t.Run("pointer inside a record", func(t *testing.T) {
		type record struct {
			Scope *Claim `json:"scope"`
		}
		b, err := json.Marshal(record{&Claim{Kind: KindWholeRepo}})
		if err != nil || string(b) != `{"scope":{"kind":"whole-repo","paths":[],"tables":[]}}` {
			t.Fatalf("Marshal = %s, %v", b, err)
		}
	})

	t.Run("null and missing arrays encode as empty arrays again", func(t *testing.T) {
		var c Claim
		if err := json.Unmarshal([]byte(`{"kind":"none","paths":null}`), &c); err != nil {
			t.Fatal(err)
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("decoded %#v does not validate: %v", c, err)
		}
		b, err := json.Marshal(c)
		if err != nil || string(b) != `{"kind":"none","paths":[],"tables":[]}` {
			t.Fatalf("re-Marshal = %s, %v", b, err)
		}
	})
}

func TestValidate(t *testing.T) {
	good := []Claim{
		{KindNone, []string{}, []string{}},
		{KindNone, nil, nil},
		{KindWholeRepo, []string{}, []string{"public.*"}},
		{KindPaths, []string{"a", "a-b", "b/c"}, []string{`public."Users"`, "public.users"}},
	}
	for _, c := range good {
		t.Run("ok "+c.String(), func(t *testing.T) {
			if err := c.Validate(); err != nil {
				t.Fatalf("Validate: %v", err)
			}
		})
	}

	bad := []struct {
		name    string
		c       Claim
		mention string
	}{
		{"empty kind", Claim{}, "kind"},
		{"unknown kind", Claim{Kind: "some"}, `"some"`},
		{"paths without paths", Claim{Kind: KindPaths}, "no paths"},
		{"whole with paths", Claim{KindWholeRepo, []string{"a"}, nil}, "only kind paths"},
		{"none with paths", Claim{KindNone, []string{"a"}, nil}, "only kind paths"},
		{"unnormalized path", Claim{KindPaths, []string{"a/"}, nil}, `write it as "a"`},
		{"bad path", Claim{KindPaths, []string{"../a"}, nil}, "escapes"},
		{"unsorted paths", Claim{KindPaths, []string{"b", "a"}, nil}, "sorted"},
		{"duplicate paths", Claim{KindPaths, []string{"a", "a"}, nil}, "unique"},
		{"nested paths", Claim{KindPaths, []string{"a", "a-b", "a/b"}, nil}, `lies under claimed path "a"`},
		{"unnormalized table", Claim{KindNone, nil, []string{"Public.Users"}}, `write it as "public.users"`},
		{"bad table", Claim{KindNone, nil, []string{"users"}}, "no schema"},
		{"unsorted tables", Claim{KindNone, nil, []string{"b.x", "a.x"}}, "sorted"},
		{"covered table", Claim{KindNone, nil, []string{"a.*", "a.x"}}, `covered by claimed "a.*"`},
	}
	for _, tc := range bad {
		t.Run("bad "+tc.name, func(t *testing.T) {
			err := tc.c.Validate()
			if err == nil {
				t.Fatalf("Validate(%#v) = nil, want error", tc.c)
			}
			if !strings.Contains(err.Error(), tc.mention) {
				t.Errorf("error %q does not mention %q", err, tc.mention)
			}
		})
	}
}

// TestMarshalJSONMatchesEncodingJSON checks the hand-written encoder
// against encoding/json on awkward strings.
func TestMarshalJSONMatchesEncodingJSON(t *testing.T) {
	type plain struct {
		Kind   Kind     `json:"kind"`
		Paths  []string `json:"paths"`
		Tables []string `json:"tables"`
	}
	for _, c := range []Claim{
		{Kind: KindPaths, Paths: []string{"a", `q"uote`, `back\slash`, "tab\there", "nl\nx", "ünïcødé/日本", "ctl\x01"}, Tables: []string{`public."Odd ""Name"""`}},
		{Kind: KindNone, Paths: []string{}, Tables: []string{}},
	} {
		got, err := json.Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(plain{c.Kind, c.Paths, c.Tables})
		// encoding/json escapes <, > and & for HTML; none occur here.
		if string(got) != string(want) {
			t.Errorf("Marshal(%v)\n got %s\nwant %s", c, got, want)
		}
	}
}
