package policy

import (
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"

	cedar "github.com/cedar-policy/cedar-go"
	"github.com/cedar-policy/cedar-go/types"
)

// refDecide is what a Store must answer, computed the plain way: each
// policy in force asked on its own through cedar.Authorize, with a
// PolicySet and an EntityMap built for the request.
func refDecide(t *testing.T, docs []Document, r Request) Decision {
	t.Helper()
	find := func(repo string, m Mode) *Document {
		for i := range docs {
			if docs[i].Repo == repo && docs[i].Mode == m && docs[i].Text != "" {
				return &docs[i]
			}
		}
		return nil
	}
	principal := types.NewEntityUID(Namespace+"::Agent", types.String(r.Agent))
	resource := types.NewEntityUID(types.EntityType(Namespace+"::"+string(r.Resource.Kind)), types.String(r.Resource.Name))
	attrs := types.RecordMap{"name": types.String(r.Resource.Name)}
	switch r.Resource.Kind {
	case KindPath:
		attrs = types.RecordMap{"path": types.String(r.Resource.Name)}
	case KindHost:
		attrs["port"] = types.Long(r.Resource.Port)
	}
	ents := types.EntityMap{
		principal: {UID: principal, Attributes: types.NewRecord(types.RecordMap{"task": types.String(r.Task), "repo": types.String(r.Repo)})},
		resource:  {UID: resource, Attributes: types.NewRecord(attrs)},
	}
	c := r.Context
	req := cedar.Request{Principal: principal, Action: types.NewEntityUID(Namespace+"::Action", types.String(r.Action)), Resource: resource,
		Context: types.NewRecord(types.RecordMap{
			"repo": types.String(r.Repo), "lease_id": types.String(c.LeaseID), "workspace_mode": types.String(c.WorkspaceMode),
			"ttl_seconds": types.Long(c.TTLSeconds), "whole_repo": types.Boolean(c.WholeRepo),
			"force": types.Boolean(c.Force), "delete": types.Boolean(c.Delete), "create": types.Boolean(c.Create)})}
	judge := func(d *Document) *Verdict {
		if d == nil {
			return nil
		}
		p, err := d.Check()
		if err != nil {
			t.Fatal(err)
		}
		ps := cedar.NewPolicySet()
		for i, rule := range p.Rules {
			ps.Add(cedar.PolicyID(strconv.Itoa(i)), rule.policy)
		}
		_, diag := cedar.Authorize(ps, ents, req)
		first, msg := len(p.Rules), ""
		for _, x := range diag.Reasons {
			if i, _ := strconv.Atoi(string(x.PolicyID)); i < first {
				first, msg = i, ""
			}
		}
		for _, x := range diag.Errors {
			if i, _ := strconv.Atoi(string(x.PolicyID)); i < first {
				first, msg = i, x.Message
			}
		}
		if first == len(p.Rules) {
			return nil
		}
		return &Verdict{Rule: p.Rules[first].ID, Policy: d.Scope(), Version: d.Version, Error: msg}
	}
	def, defShadow := find("", ModeEnforce), find("", ModeShadow)
	var own, ownShadow *Document
	if r.Repo != "" {
		own, ownShadow = find(r.Repo, ModeEnforce), find(r.Repo, ModeShadow)
	}
	var d Decision
	for _, l := range []*Document{def, own} {
		if d.Refused = judge(l); d.Refused != nil {
			return d
		}
	}
	if defShadow == nil && ownShadow == nil {
		return d
	}
	if defShadow == nil {
		defShadow = def
	}
	if ownShadow == nil {
		ownShadow = own
	}
	for _, l := range []*Document{defShadow, ownShadow} {
		if d.Shadow = judge(l); d.Shadow != nil {
			return d
		}
	}
	return d
}

func verdictString(v *Verdict) string {
	if v == nil {
		return "allowed"
	}
	return v.String()
}

// The attack: two requests whose fields, joined with NUL bytes, read the
// same. A cache keyed by the joined fields answered the second with the
// first's decision: a path the policy forbids was allowed.
func TestCacheKeysDoNotCollide(t *testing.T) {
	s := storeWith(t, Document{Version: 1, Text: `@id("no-a") forbid (principal, action == Fenceline::Action::"write", resource is Fenceline::Path) when { resource.path == "a" };`})
	allowed := req(ActionWrite, KindPath, "a\x00b")
	allowed.Context.LeaseID = "c"
	forbidden := req(ActionWrite, KindPath, "a")
	forbidden.Context.LeaseID, forbidden.Context.WorkspaceMode = "b", "c\x00"
	if d := s.Decide(allowed); d.Refused != nil {
		t.Fatalf("path %q refused: %v", allowed.Resource.Name, d.Refused)
	}
	if d := s.Decide(forbidden); d.Refused == nil || d.Refused.Rule != "no-a" {
		t.Fatalf("path %q after %q: %+v, want refused by no-a", forbidden.Resource.Name, allowed.Resource.Name, d.Refused)
	}
}

// Past its bound the cache starts again, and a key too long to keep is
// decided every time: the answers stay right.
func TestCacheBoundsKeepDecisionsRight(t *testing.T) {
	s := storeWith(t, Document{Version: 1, Text: issueExample})
	long := ".github/workflows/" + strings.Repeat("x", decisionCacheBytes/32)
	for pass := 0; pass < 2; pass++ {
		for i := 0; i < decisionCacheMax+100; i++ {
			p := "src/f" + strconv.Itoa(i) + ".go"
			if i%7 == 0 {
				p = ".github/workflows/w" + strconv.Itoa(i)
			}
			if d := s.Decide(req(ActionWrite, KindPath, p)); (d.Refused != nil) != (i%7 == 0) {
				t.Fatalf("pass %d, %s: %+v", pass, p, d.Refused)
			}
		}
		if d := s.Decide(req(ActionWrite, KindPath, long)); d.Refused == nil {
			t.Fatalf("pass %d: a long workflow path allowed", pass)
		}
	}
}

// A decision evaluated under a policy that a Put replaced meanwhile is
// not answered again under the new one.
func TestNoDecisionOutlivesItsPolicy(t *testing.T) {
	forbidDocs := `@id("no-docs") forbid (principal, action, resource is Fenceline::Path) when { resource.path like "docs/*" };`
	var s Store
	r := req(ActionWrite, KindPath, "docs/a.md")
	var wg sync.WaitGroup
	stop := make(chan struct{})
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
					s.Decide(r)
					s.Decide(req(ActionWrite, KindPath, fmt.Sprintf("docs/%d", g)))
				}
			}
		}()
	}
	for v := uint64(1); v <= 200; v++ {
		text := forbidDocs
		if v%2 == 0 {
			text = issueExample
		}
		if err := s.Put(Document{Mode: ModeEnforce, Version: v, Text: text}); err != nil {
			t.Fatal(err)
		}
		d := s.Decide(r)
		if refused := d.Refused != nil; refused != (v%2 == 1) {
			t.Fatalf("version %d: %+v", v, d.Refused)
		}
		if d.Refused != nil && d.Refused.Version != v {
			t.Fatalf("version %d answered by version %d", v, d.Refused.Version)
		}
	}
	close(stop)
	wg.Wait()
}
