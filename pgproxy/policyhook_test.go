package pgproxy

import (
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/fenceline/fenceline/policy"
)

// The security team's policy narrows the Postgres fence at the real
// server: a write to a table the lease claims but the policy protects
// (the ledger-read-only) is refused naming the rule and version,
// an opaque write the fence would pass (--pg-allow-opaque) is refused by
// sql_opaque, both audited with reason policy; a policy change applies to
// the open connection's next statement; reads go on.
func TestPolicyRefusesSQLWrites(t *testing.T) {
	var st policy.Store
	put := func(version uint64, text string) {
		t.Helper()
		if err := st.Put(policy.Document{Mode: policy.ModeEnforce, Version: version, Text: text}); err != nil {
			t.Fatal(err)
		}
	}
	lease := newStaticLease(t, "lease_pol1", 5, "public.accounts", "public.other")
	rec := &recorder{}
	p := startProxy(t, Config{Lease: lease, Audit: rec, AllowOpaque: true, Policy: &st})
	ctx := ctxT(t)
	c := connect(t, proxyDSN(p, "agent"))
	mode := pgx.QueryExecModeSimpleProtocol
	if _, err := c.Exec(ctx, "UPDATE public.other SET note = 'before' WHERE id = 1", mode); err != nil {
		t.Fatalf("write before any policy: %v", err)
	}
	put(1, `@id("other-read-only")
forbid (principal, action == Fenceline::Action::"sql_write", resource is Fenceline::Table)
when { resource.name like "public.oth*" };

@id("no-opaque")
forbid (principal, action == Fenceline::Action::"sql_opaque", resource);
`)
	_, err := c.Exec(ctx, "UPDATE public.other SET note = 'x' WHERE id = 1", mode)
	if err == nil || pgCode(err) != "42501" || !strings.Contains(err.Error(), `policy rule "other-read-only" (default policy, version 1)`) {
		t.Fatalf("write to a protected table: got %v", err)
	}
	if _, err := c.Exec(ctx, "UPDATE public.accounts SET balance = balance + 1 WHERE id = 1", mode); err != nil {
		t.Fatalf("write to a table the policy leaves alone: %v", err)
	}
	_, err = c.Exec(ctx, "DO $$BEGIN PERFORM 1; END$$", mode)
	if err == nil || !strings.Contains(err.Error(), `"no-opaque"`) {
		t.Fatalf("opaque write under --pg-allow-opaque: got %v, want refused by no-opaque", err)
	}
	var n int
	if err := c.QueryRow(ctx, "SELECT count(*) FROM public.other", mode).Scan(&n); err != nil {
		t.Fatalf("read of a protected table: %v", err)
	}
	put(2, "") // removed: the same connection writes again
	if _, err := c.Exec(ctx, "UPDATE public.other SET note = 'after' WHERE id = 1", mode); err != nil {
		t.Fatalf("write after the policy was removed: %v", err)
	}
	var policyEvents int
	for _, ev := range rec.events() {
		if ev.Reason == policy.ReasonPolicy && strings.Contains(ev.Message, "policy rule") {
			policyEvents++
		}
	}
	if policyEvents != 2 {
		t.Fatalf("%d audit events with reason policy, want 2: %+v", policyEvents, rec.events())
	}
}
