package policy

import (
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
)

// issueExample is the policy of issue 30, verbatim.
const issueExample = `@id("no-workflows")
forbid (principal, action, resource is Fenceline::Path)
when { resource.path like ".github/workflows*" };

@id("ledger-read-only")
forbid (principal, action == Fenceline::Action::"sql_write", resource is Fenceline::Table)
when { resource.name like "ledger.*" };

@id("whole-repo-release-only")
forbid (principal, action == Fenceline::Action::"claim", resource)
when { context.whole_repo } unless { principal.task == "release" };
`

const repo = "github.com/acme/payments"

func storeWith(t testing.TB, docs ...Document) *Store {
	t.Helper()
	var s Store
	for _, d := range docs {
		if d.Mode == "" {
			d.Mode = ModeEnforce
		}
		if err := s.Put(d); err != nil {
			t.Fatalf("put %s policy: %v", d.Scope(), err)
		}
	}
	return &s
}

func req(a Action, k Kind, name string) Request {
	return Request{Agent: "codex-1", Task: "job-1", Repo: repo, Action: a, Resource: Resource{Kind: k, Name: name}}
}

func TestIssueExampleDecisions(t *testing.T) {
	s := storeWith(t, Document{Version: 3, Text: issueExample})
	whole := req(ActionClaim, KindPath, "")
	whole.Context.WholeRepo = true
	release := whole
	release.Task = "release"
	cases := []struct {
		name string
		r    Request
		rule string // "" = allowed
	}{
		{"write a workflow", req(ActionWrite, KindPath, ".github/workflows/ci.yml"), "no-workflows"},
		{"claim the workflows", req(ActionClaim, KindPath, ".github/workflows"), "no-workflows"},
		{"write elsewhere", req(ActionWrite, KindPath, "services/billing/a.go"), ""},
		{"write .github's other files", req(ActionWrite, KindPath, ".github/CODEOWNERS"), ""},
		{"sql write to the ledger", req(ActionSQLWrite, KindTable, "ledger.entries"), "ledger-read-only"},
		{"sql write elsewhere", req(ActionSQLWrite, KindTable, "public.users"), ""},
		{"claim the ledger table", req(ActionClaim, KindTable, "ledger.entries"), ""},
		{"whole repo, not release", whole, "whole-repo-release-only"},
		{"whole repo, release task", release, ""},
		{"path claim", req(ActionClaim, KindPath, "services"), ""},
		{"connect", Request{Agent: "a", Repo: repo, Action: ActionConnect, Resource: Resource{Kind: KindHost, Name: "api.openai.com", Port: 443}}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			d := s.Decide(c.r)
			got := ""
			if d.Refused != nil {
				got = d.Refused.Rule
				if d.Refused.Version != 3 || d.Refused.Policy != DefaultScope {
					t.Errorf("verdict %+v: want the default policy at version 3", d.Refused)
				}
			}
			if got != c.rule {
				t.Errorf("Decide(%s) refused by %q, want %q", c.r, got, c.rule)
			}
			// The cached answer is the same.
			if d2 := s.Decide(c.r); fmt.Sprint(d2.Refused) != fmt.Sprint(d.Refused) {
				t.Errorf("cached decision %v differs from %v", d2.Refused, d.Refused)
			}
		})
	}
}

func TestNoPolicyAllowsEverything(t *testing.T) {
	var s Store
	for _, a := range Actions {
		if d := s.Decide(req(a, KindPath, ".github/workflows/x")); !d.Allowed() || d.Shadow != nil {
			t.Errorf("no policy: %s decided %+v, want allowed", a, d)
		}
	}
}

func TestRepoAndDefaultBothApply(t *testing.T) {
	s := storeWith(t,
		Document{Version: 1, Text: `@id("no-env") forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path == ".env" };`},
		Document{Repo: repo, Version: 7, Text: `@id("no-migrations") forbid (principal, action, resource is Fenceline::Path) when { resource.path like "db/migrations/*" };`},
	)
	if d := s.Decide(req(ActionWrite, KindPath, ".env")); d.Refused == nil || d.Refused.Rule != "no-env" || d.Refused.Policy != DefaultScope || d.Refused.Version != 1 {
		t.Errorf("default rule: %+v", d.Refused)
	}
	if d := s.Decide(req(ActionWrite, KindPath, "db/migrations/1.sql")); d.Refused == nil || d.Refused.Rule != "no-migrations" || d.Refused.Policy != repo || d.Refused.Version != 7 {
		t.Errorf("repo rule: %+v", d.Refused)
	}
	other := req(ActionWrite, KindPath, "db/migrations/1.sql")
	other.Repo = "github.com/acme/other"
	if d := s.Decide(other); d.Refused != nil {
		t.Errorf("another repo follows only the default: %+v", d.Refused)
	}
	// A new version replaces the old at once (no cached decision survives).
	if err := s.Put(Document{Repo: repo, Mode: ModeEnforce, Version: 8, Text: ""}); err != nil {
		t.Fatal(err)
	}
	if d := s.Decide(req(ActionWrite, KindPath, "db/migrations/1.sql")); d.Refused != nil {
		t.Errorf("after the repo's policy was removed: %+v", d.Refused)
	}
	// An older version arriving late changes nothing.
	if err := s.Put(Document{Repo: repo, Mode: ModeEnforce, Version: 7, Text: `forbid (principal, action, resource);`}); err != nil {
		t.Fatal(err)
	}
	if d := s.Decide(req(ActionWrite, KindPath, "x")); d.Refused != nil {
		t.Errorf("a late older version took effect: %+v", d.Refused)
	}
}

func TestValidateGivesLineAndColumn(t *testing.T) {
	cases := []struct {
		name, text string
		line, col  int
		want       string
	}{
		{"syntax", "forbid (principal, action, resource);\n\nforbid (principal, acton, resource);\n", 3, 25, "acton"},
		{"unknown attribute", "\n\n@id(\"b\")\nforbid (principal, action, resource is Fenceline::Path)\nwhen { resource.nme == \"x\" };\n", 3, 1, "nme"},
		{"unknown action", "forbid (principal, action == Fenceline::Action::\"delete\", resource);\n", 1, 1, "delete"},
		{"wrong type", "\n@id(\"t\") forbid (principal, action, resource) when { context.ttl_seconds like \"x\" };\n", 2, 1, ""},
		{"permit", "@id(\"p\")\npermit (principal, action, resource);", 1, 1, "only narrows"},
		{"duplicate id", "@id(\"d\") forbid (principal, action, resource) when { context.force };\n@id(\"d\") forbid (principal, action, resource) when { context.delete };\n", 2, 1, "also the id"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("p.cedar", c.text)
			var pe *ParseError
			if !errors.As(err, &pe) || !errors.Is(err, ErrInvalid) {
				t.Fatalf("Parse: %v, want a ParseError", err)
			}
			p := pe.Problems[0]
			if p.Line != c.line || p.Column != c.col || !strings.Contains(p.Message, c.want) {
				t.Errorf("problem %+v: want line %d column %d mentioning %q", p, c.line, c.col, c.want)
			}
			if !strings.Contains(err.Error(), fmt.Sprintf("p.cedar:%d:%d: ", c.line, c.col)) {
				t.Errorf("error %q does not say p.cedar:%d:%d", err, c.line, c.col)
			}
		})
	}
	if _, err := Parse("ok.cedar", issueExample); err != nil {
		t.Fatalf("the issue's example: %v", err)
	}
}

func TestShadowAuditsWithoutRefusing(t *testing.T) {
	s := storeWith(t,
		Document{Version: 1, Text: issueExample},
		Document{Repo: repo, Mode: ModeShadow, Version: 2, Text: `@id("no-docs") forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path like "docs/*" };`},
	)
	d := s.Decide(req(ActionWrite, KindPath, "docs/a.md"))
	if !d.Allowed() {
		t.Fatalf("a shadow rule refused: %+v", d.Refused)
	}
	if d.Shadow == nil || d.Shadow.Rule != "no-docs" || d.Shadow.Version != 2 || d.Shadow.Policy != repo {
		t.Errorf("shadow verdict %+v, want no-docs of %s version 2", d.Shadow, repo)
	}
	if d := s.Decide(req(ActionWrite, KindPath, ".github/workflows/x")); d.Refused == nil || d.Shadow != nil {
		t.Errorf("enforced refusal: %+v", d)
	}
	if d := s.Decide(req(ActionWrite, KindPath, "src/a.go")); d.Refused != nil || d.Shadow != nil {
		t.Errorf("allowed by both: %+v", d)
	}
}

func TestErroringRuleRefuses(t *testing.T) {
	// A rule whose evaluation fails (an overflow) would be skipped by
	// Cedar's own Authorize; here it refuses, naming the error.
	overflow := `@id("big") forbid (principal, action == Fenceline::Action::"claim", resource) when { context.ttl_seconds * 9223372036854775807 > 1 };`
	s := storeWith(t, Document{Version: 4, Text: overflow})
	r := req(ActionClaim, KindPath, "x")
	r.Context.TTLSeconds = 300
	d := s.Decide(r)
	if d.Refused == nil || d.Refused.Rule != "big" || d.Refused.Error == "" {
		t.Errorf("an overflowing rule: %+v, want refused by big with its error", d.Refused)
	}
}

func TestCheckFlags(t *testing.T) {
	s := storeWith(t, Document{Version: 2, Text: issueExample + `
@id("max-ttl") forbid (principal, action == Fenceline::Action::"claim", resource) when { context.ttl_seconds > 3600 };
@id("only-openai") forbid (principal, action == Fenceline::Action::"connect", resource is Fenceline::Host) unless { resource.name == "api.openai.com" };
@id("no-force") forbid (principal, action == Fenceline::Action::"push", resource) when { context.force };
@id("no-opaque") forbid (principal, action == Fenceline::Action::"sql_opaque", resource);
`})
	base := Flags{Agent: "a", Task: "job", Repo: repo, TTLSeconds: 300}
	if err := s.CheckFlags(base); err != nil {
		t.Fatalf("plain flags: %v", err)
	}
	cases := []struct {
		name string
		f    func(*Flags)
		rule string
	}{
		{"whole repo", func(f *Flags) { f.WholeRepo = true }, "whole-repo-release-only"},
		{"ttl", func(f *Flags) { f.TTLSeconds = 7200 }, "max-ttl"},
		{"scope", func(f *Flags) { f.Paths = []string{".github/workflows"} }, "no-workflows"},
		{"allow write", func(f *Flags) { f.AllowWrite = []string{".github/workflows/ci.yml"} }, "no-workflows"},
		{"allow host", func(f *Flags) { f.AllowHosts = []Resource{{Kind: KindHost, Name: "evil.example", Port: 443}} }, "only-openai"},
		{"force push", func(f *Flags) { f.AllowForcePush = true }, "no-force"},
		{"opaque", func(f *Flags) { f.PGAllowOpaque = true }, "no-opaque"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := base
			c.f(&f)
			err := s.CheckFlags(f)
			var fe *FlagError
			if !errors.As(err, &fe) || !errors.Is(err, ErrFlagForbidden) {
				t.Fatalf("CheckFlags: %v, want a FlagError", err)
			}
			if fe.Refusals[0].Verdict.Rule != c.rule || !strings.Contains(err.Error(), `"`+c.rule+`"`) {
				t.Errorf("error %q: want rule %q named", err, c.rule)
			}
		})
	}
	f := base
	f.Task, f.WholeRepo = "release", true
	f.AllowHosts = []Resource{{Kind: KindHost, Name: "api.openai.com", Port: 443}}
	if err := s.CheckFlags(f); err != nil {
		t.Errorf("flags within the policy: %v", err)
	}
}

func TestRunCasesFailsOnAWrongExpectation(t *testing.T) {
	s := storeWith(t, Document{Version: 1, Text: issueExample})
	cs, err := ParseCases([]byte(`[
	 {"name": "workflow write", "request": {"agent": "a", "task": "t", "repo": "r", "action": "write", "resource": {"kind": "Path", "name": ".github/workflows/ci.yml"}}, "expect": "deny", "rule": "no-workflows"},
	 {"name": "wrong: ledger allowed", "request": {"agent": "a", "action": "sql_write", "resource": {"kind": "Table", "name": "ledger.x"}}, "expect": "allow"},
	 {"name": "wrong rule", "request": {"agent": "a", "action": "sql_write", "resource": {"kind": "Table", "name": "ledger.x"}}, "expect": "deny", "rule": "no-workflows"}
	]`))
	if err != nil {
		t.Fatal(err)
	}
	res := RunCases(s, cs)
	if !res[0].Passed || res[1].Passed || res[2].Passed {
		t.Errorf("results %+v: want pass, fail, fail", res)
	}
	if _, err := ParseCases([]byte(`[{"name": "x", "expect": "maybe"}]`)); err == nil {
		t.Error("an expectation of maybe was accepted")
	}
}

func TestSchemaParsesAndNamesTheVocabulary(t *testing.T) {
	if _, err := schemaValidator(); err != nil {
		t.Fatal(err)
	}
	for _, w := range []string{"entity Agent", `"task"`, `"repo"`, "entity Path", "entity Ref", "entity Table", "entity Host", `"port"`,
		"action claim", "action write", "action push", "action sql_write", "action sql_opaque", "action connect",
		`"lease_id"`, `"workspace_mode"`, `"ttl_seconds"`, `"whole_repo"`, `"force"`, `"delete"`, `"create"`} {
		if !strings.Contains(SchemaText, w) {
			t.Errorf("schema lacks %s", w)
		}
	}
}

func TestChangedFiresOnPut(t *testing.T) {
	var s Store
	ch := s.Changed()
	if err := s.Put(Document{Mode: ModeEnforce, Version: 1, Text: issueExample}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ch:
	default:
		t.Fatal("Changed did not fire on Put")
	}
	if s.Changed() == ch {
		t.Fatal("Changed returned the closed channel again")
	}
}

// Every Cedar block of docs/policy.md validates against the schema, and
// the first is the issue's example verbatim.
func TestDocRecipesValidate(t *testing.T) {
	data, err := os.ReadFile("../docs/policy.md")
	if err != nil {
		t.Fatal(err)
	}
	blocks := strings.Split(string(data), "```cedar\n")[1:]
	if len(blocks) < 6 {
		t.Fatalf("%d cedar blocks in docs/policy.md, want the recipes", len(blocks))
	}
	for i, b := range blocks {
		text, _, _ := strings.Cut(b, "```")
		if i == 0 && text != issueExample {
			t.Errorf("the first block is not the issue's example verbatim:\n%s", text)
		}
		if _, err := Parse(fmt.Sprintf("docs/policy.md block %d", i+1), text); err != nil {
			t.Errorf("%v", err)
		}
	}
}
