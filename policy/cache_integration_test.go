//go:build integration

package policy

import "testing"

// Every decision — evaluated once for both policies, then answered from
// the cache — is the one each policy asked on its own gives, for every
// combination of default, repository and shadow policies.
func TestDecisionsMatchCedarAskedPlainly(t *testing.T) {
	overflow := `@id("big") forbid (principal, action == Fenceline::Action::"claim", resource) when { context.ttl_seconds * 9223372036854775807 > 1 };`
	docsets := map[string][]Document{
		"default": {{Mode: ModeEnforce, Version: 1, Text: benchPolicy}},
		"default and repo": {{Mode: ModeEnforce, Version: 1, Text: benchPolicy},
			{Repo: repo, Mode: ModeEnforce, Version: 5, Text: `@id("no-migrations") forbid (principal, action, resource is Fenceline::Path) when { resource.path like "db/migrations/*" };` + "\n" + overflow}},
		"repo only": {{Repo: repo, Mode: ModeEnforce, Version: 2, Text: issueExample}},
		"shadows": {{Mode: ModeEnforce, Version: 1, Text: issueExample},
			{Mode: ModeShadow, Version: 3, Text: benchPolicy},
			{Repo: repo, Mode: ModeShadow, Version: 4, Text: `@id("no-docs") forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path like "docs/*" };`}},
		"repo shadow over the default": {{Mode: ModeEnforce, Version: 1, Text: benchPolicy},
			{Repo: repo, Mode: ModeShadow, Version: 9, Text: overflow}},
	}
	var reqs []Request
	for _, repoName := range []string{repo, "github.com/acme/other", ""} {
		for _, task := range []string{"job-1", "release"} {
			for _, rs := range []Resource{{Kind: KindPath, Name: ".github/workflows/ci.yml"}, {Kind: KindPath, Name: "db/migrations/1.sql"},
				{Kind: KindPath, Name: "docs/a.md"}, {Kind: KindPath, Name: "src/a.go"}, {Kind: KindPath, Name: ""},
				{Kind: KindTable, Name: "ledger.entries"}, {Kind: KindTable, Name: "public.users"}, {Kind: KindRef, Name: "refs/heads/main"},
				{Kind: KindHost, Name: "api.openai.com", Port: 443}, {Kind: KindHost, Name: "evil.example", Port: 443}} {
				for _, a := range Actions {
					for _, c := range []Context{{}, {LeaseID: "L1", WholeRepo: true, TTLSeconds: 7200}, {Force: true, TTLSeconds: 300}, {Delete: true, Create: true, WorkspaceMode: "shard"}} {
						reqs = append(reqs, Request{Agent: "codex-1", Task: task, Repo: repoName, Action: a, Resource: rs, Context: c})
					}
				}
			}
		}
	}
	for name, docs := range docsets {
		t.Run(name, func(t *testing.T) {
			s := storeWith(t, docs...)
			for pass := 0; pass < 2; pass++ { // evaluated, then cached
				for _, r := range reqs {
					got, want := s.Decide(r), refDecide(t, docs, r)
					if verdictString(got.Refused) != verdictString(want.Refused) || verdictString(got.Shadow) != verdictString(want.Shadow) {
						t.Fatalf("pass %d, %s (context %+v): got refused %s, shadow %s; want refused %s, shadow %s", pass, r, r.Context,
							verdictString(got.Refused), verdictString(got.Shadow), verdictString(want.Refused), verdictString(want.Shadow))
					}
				}
			}
		})
	}
}
