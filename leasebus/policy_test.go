package leasebus

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/policy"
)

const noWorkflows = `@id("no-workflows")
forbid (principal, action, resource is Fenceline::Path)
when { resource.path like ".github/workflows*" };
`

func jsOf(t testing.TB, nc *nats.Conn) jetstream.JetStream {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	return js
}

// operatorID is the tests' operator identity (the service names it by its
// nkey: the test bus has no names).
func operatorID(t testing.TB) string {
	c, err := LoadCreds(filepath.Join(testCredsDir(t), CredsFile(RoleOperator)))
	if err != nil {
		t.Fatal(err)
	}
	return c.Nkey
}

// Only operators set policies: the bus itself drops a holder's and a
// viewer's request (op policy is not in their grants), and nothing they
// can publish lands as a version readers take.
func TestPolicySetIsOperatorOnly(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	w := PolicyWrite{Repo: repo, Mode: policy.ModeEnforce, Text: noWorkflows}
	for _, role := range []Role{RoleHolder, RoleViewer} {
		ref := make(refusals, 16)
		c := NewClient(connectAs(t, url, role, ref.option()))
		if _, err := c.SetPolicy(ctx, w); !errors.Is(err, ErrForbidden) {
			t.Fatalf("%s set a policy: got %v, want ErrForbidden from the bus", role, err)
		}
	}
	// Nor can a holder publish a version straight onto the stream.
	hnc := connectAs(t, url, RoleHolder, make(refusals, 16).option())
	d := policy.Document{Repo: repo, Mode: policy.ModeEnforce, Version: 9, Text: "", Digest: policy.Digest("")}
	_ = hnc.Publish(PolicySubject(repo, policy.ModeEnforce), []byte(`{"repo":"`+repo+`","mode":"enforce","version":9,"text":"","digest":"`+d.Digest+`"}`))
	_ = hnc.Flush()

	oc := NewClient(connectAs(t, url, RoleOperator))
	got, err := oc.SetPolicy(ctx, w)
	if err != nil {
		t.Fatalf("operator set a policy: %v", err)
	}
	if got.Version != 1 || got.Digest != policy.Digest(noWorkflows) || got.SetBy != operatorID(t) {
		t.Errorf("stored %+v: want version 1, its digest, set by operator", got)
	}
	// A holder reads and follows it.
	var st policy.Store
	pw, err := WatchPolicies(ctx, jsOf(t, hnc), &st, repo)
	if err != nil {
		t.Fatalf("holder watches policies: %v", err)
	}
	t.Cleanup(pw.Stop)
	r := policy.Request{Agent: "a", Repo: repo, Action: policy.ActionWrite, Resource: policy.Resource{Kind: policy.KindPath, Name: ".github/workflows/ci.yml"}}
	if dec := st.Decide(r); dec.Refused == nil || dec.Refused.Rule != "no-workflows" || dec.Refused.Version != 1 {
		t.Errorf("holder's store decided %+v, want refused by no-workflows version 1", dec)
	}
}

// Every change is a compare-and-swap on the version, validated by the
// service (line and column), audited with the operator, version and
// digest, and followed by a watcher within a second.
func TestPolicyVersionsAuditAndWatch(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	oc := NewClient(connectAs(t, url, RoleOperator))
	hnc := connectAs(t, url, RoleHolder)
	js := jsOf(t, hnc)

	var st policy.Store
	pw, err := WatchPolicies(ctx, js, &st, repo)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pw.Stop)
	if !st.Empty() {
		t.Fatal("a store holds a policy before any was set")
	}
	r := policy.Request{Agent: "a", Repo: repo, Action: policy.ActionWrite, Resource: policy.Resource{Kind: policy.KindPath, Name: ".github/workflows/ci.yml"}}

	if _, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: "forbid (principal, action, resource)\nwhen { resource.nope };"}); !errors.Is(err, lease.ErrInvalid) || !strings.Contains(err.Error(), "1:1") {
		t.Fatalf("an invalid policy: got %v, want ErrInvalid naming 1:1", err)
	}
	set := time.Now()
	d1, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: noWorkflows})
	if err != nil {
		t.Fatal(err)
	}
	checkFor(t, time.Second-time.Since(set), 5*time.Millisecond, func() error {
		if st.Decide(r).Refused == nil {
			return errors.New("the watcher has not seen version 1")
		}
		return nil
	})
	t.Logf("version 1 in force at the holder %s after the set returned", time.Since(set))
	if _, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: "", Version: 0}); !errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		t.Fatalf("a write on a stale version: got %v, want a revision mismatch", err)
	}
	// An answer someone has the server send onto the subject (a JetStream
	// API reply) is no version: readers skip it and the next write still
	// works on version 1.
	if err := hnc.PublishRequest(FleetJSAPI+".STREAM.INFO."+PolicyStream, PolicySubject("", policy.ModeEnforce), nil); err != nil {
		t.Fatal(err)
	}
	_ = hnc.Flush()
	set = time.Now()
	d2, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: "", Version: d1.Version})
	if err != nil {
		t.Fatalf("remove the policy at version 1: %v", err)
	}
	if d2.Version != 2 {
		t.Fatalf("removal stored as version %d, want 2", d2.Version)
	}
	checkFor(t, time.Second-time.Since(set), 5*time.Millisecond, func() error {
		if st.Decide(r).Refused != nil {
			return errors.New("the watcher still enforces version 1")
		}
		return nil
	})
	h, err := PolicyHistory(ctx, js, "", policy.ModeEnforce)
	if err != nil || len(h) != 2 || h[0].Version != 1 || h[1].Version != 2 {
		t.Fatalf("history %+v (%v): want versions 1 and 2", h, err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, "", 1)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Type == EventPolicySet && ev.Boundary == BoundaryPolicy && ev.RequestedBy == operatorID(t) &&
				strings.Contains(ev.Message, "version ") && strings.Contains(ev.Message, "sha256:") {
				n++
			}
		}
		if n != 2 {
			return errors.New("want two policy-set events naming the operator, the version and the digest")
		}
		return nil
	})
}

// Shadow and repo policies are their own subjects; a watcher for one repo
// takes the default and that repo's, not another's.
func TestPolicyWatchScopes(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	oc := NewClient(connectAs(t, b.srv.ClientURL(), RoleOperator))
	for _, w := range []PolicyWrite{
		{Repo: repo, Mode: policy.ModeShadow, Text: noWorkflows},
		{Repo: "github.com/acme/other", Text: noWorkflows},
	} {
		if _, err := oc.SetPolicy(ctx, w); err != nil {
			t.Fatal(err)
		}
	}
	var st policy.Store
	pw, err := WatchPolicies(ctx, jsOf(t, connectAs(t, b.srv.ClientURL(), RoleViewer)), &st, "https://github.com/acme/payments.git")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pw.Stop)
	docs := st.Documents(repo)
	if len(docs) != 1 || docs[0].Mode != policy.ModeShadow {
		t.Fatalf("documents %+v: want only %s's shadow policy", docs, repo)
	}
	dec := st.Decide(policy.Request{Agent: "a", Repo: repo, Action: policy.ActionWrite, Resource: policy.Resource{Kind: policy.KindPath, Name: ".github/workflows/x"}})
	if dec.Refused != nil || dec.Shadow == nil || dec.Shadow.Rule != "no-workflows" {
		t.Errorf("decision %+v: want allowed with a shadow refusal", dec)
	}
}

const wholeRepoReleaseOnly = `@id("whole-repo-release-only")
forbid (principal, action == Fenceline::Action::"claim", resource)
when { context.whole_repo } unless { principal.task == "release" };

@id("max-ttl")
forbid (principal, action == Fenceline::Action::"claim", resource)
when { context.ttl_seconds > 3600 };
`

// The lease service judges claims by the policy in force: a protected
// path, a whole-repo claim by a task the policy does not name and a TTL
// above the maximum are refused naming the rule and version, and
// audited; a lease a new policy forbids is revoked, and its holder stops
// writing, within a second.
func TestPolicyRefusesClaims(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	oc := NewClient(connectAs(t, url, RoleOperator))
	hc := NewClient(connectAs(t, url, RoleHolder))

	// Held before the policy: a whole-repo lease of a task that is not
	// the release.
	cred := NewCredential()
	sent := time.Now()
	whole, err := scope.New(nil, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	l, err := hc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: whole, Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	h, err := hc.Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	if _, err := h.Fence(); err != nil {
		t.Fatalf("holder before the policy: %v", err)
	}

	set := time.Now()
	if _, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: noWorkflows + wholeRepoReleaseOnly}); err != nil {
		t.Fatal(err)
	}
	checkFor(t, time.Second-time.Since(set), 5*time.Millisecond, func() error {
		if _, err := h.Fence(); !errors.Is(err, lease.ErrLeaseLost) {
			return fmt.Errorf("holder's fence: %v, want lost", err)
		}
		return nil
	})
	t.Logf("the whole-repo lease stopped writing %s after the policy was set", time.Since(set))
	got, err := hc.Get(ctx, l.LeaseID)
	if err != nil || got.Status != lease.StatusRevoked || !strings.Contains(got.Reason, `"whole-repo-release-only"`) || !strings.Contains(got.Reason, "version 1") {
		t.Fatalf("lease after the policy: %+v (%v), want revoked naming the rule and version", got, err)
	}

	refuse := []struct {
		name string
		req  AcquireRequest
		rule string
	}{
		{"whole repo", AcquireRequest{Repo: repo, Scope: whole, Owner: owner(2), TTL: lease.Duration(time.Minute)}, "whole-repo-release-only"},
		{"protected path", AcquireRequest{Repo: repo, Scope: claim(t, "src", ".github/workflows"), Owner: owner(3), TTL: lease.Duration(time.Minute)}, "no-workflows"},
		{"ttl", AcquireRequest{Repo: repo, Scope: claim(t, "docs"), Owner: owner(4), TTL: lease.Duration(2 * time.Hour)}, "max-ttl"},
	}
	for _, c := range refuse {
		_, err := hc.Acquire(ctx, c.req, NewCredential())
		if !errors.Is(err, policy.ErrRefused) || !strings.Contains(err.Error(), `"`+c.rule+`"`) || !strings.Contains(err.Error(), "version 1") {
			t.Errorf("%s: acquire got %v, want refused by %s at version 1", c.name, err, c.rule)
		}
	}
	rel := owner(5)
	rel.TaskID = "release"
	if _, err := hc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: whole, Owner: rel, TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Errorf("the release task's whole-repo claim: %v", err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 1)
		if err != nil {
			return err
		}
		n := 0
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Reason == lease.ReasonPolicy && ev.Boundary == lease.BoundaryLease && strings.Contains(ev.Message, "policy rule") {
				n++
			}
		}
		if n != len(refuse) {
			return fmt.Errorf("%d policy refusals audited, want %d", n, len(refuse))
		}
		return nil
	})
}

// TestPolicyBindsClaimsToIdentities: an owner's task and agent are the
// asker's word — a runner could name the release task and get the
// whole-repo claim a rule keeps for it. The bus identity that asks is the
// bus's word (context.identity), so a security team binds a claim to the
// runners allowed it: another runner naming the release task is refused,
// at its acquire and, for a lease held before the policy, at the policy's
// change; the release runner's claims stand.
func TestPolicyBindsClaimsToIdentities(t *testing.T) {
	t.Parallel()
	b := startIdentityBus(t, "release-bot", "agent-runner")
	ctx := ctxT(t)
	oc := NewClient(connectFile(t, b.url, filepath.Join(b.dir, CredsFile(RoleOperator))))
	bot, runner := NewClient(b.holders["release-bot"]), NewClient(b.holders["agent-runner"])
	whole, err := scope.New(nil, true, nil)
	if err != nil {
		t.Fatal(err)
	}
	rel := owner(1)
	rel.TaskID = "release"
	before := map[*Client]*lease.Lease{}
	for i, c := range []*Client{bot, runner} {
		l, err := c.Acquire(ctx, AcquireRequest{Repo: fmt.Sprintf("github.com/acme/held-%d", i), Scope: whole, Owner: rel, TTL: lease.Duration(time.Minute)}, NewCredential())
		if err != nil {
			t.Fatal(err)
		}
		before[c] = l
	}
	const bound = `@id("whole-repo-release-bot-only")
forbid (principal, action == Fenceline::Action::"claim", resource)
when { context.whole_repo } unless { context.identity == "release-bot" };
`
	if _, err := oc.SetPolicy(ctx, PolicyWrite{Default: true, Text: bound}); err != nil {
		t.Fatal(err)
	}
	// The policy is in force once the service has judged the leases held
	// by it (it follows the policy stream, after SetPolicy returns).
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		got, err := runner.Get(ctx, before[runner].LeaseID)
		if err != nil {
			return err
		}
		if got.Status != lease.StatusRevoked || !strings.Contains(got.Reason, "whole-repo-release-bot-only") {
			return fmt.Errorf("the other runner's lease held before the policy: %s (%s), want revoked by the rule", got.Status, got.Reason)
		}
		return nil
	})
	if _, err := runner.Acquire(ctx, AcquireRequest{Repo: repo, Scope: whole, Owner: rel, TTL: lease.Duration(time.Minute)}, NewCredential()); !errors.Is(err, policy.ErrRefused) || !strings.Contains(err.Error(), "whole-repo-release-bot-only") {
		t.Fatalf("another runner's whole-repo claim naming the release task: %v, want refused by the rule", err)
	}
	if _, err := bot.Acquire(ctx, AcquireRequest{Repo: repo, Scope: whole, Owner: rel, TTL: lease.Duration(time.Minute)}, NewCredential()); err != nil {
		t.Fatalf("the release runner's whole-repo claim: %v", err)
	}
	if got, err := bot.Get(ctx, before[bot].LeaseID); err != nil || !got.Active() {
		t.Fatalf("the release runner's lease held before the policy: %+v, %v: want it kept", got, err)
	}
}
