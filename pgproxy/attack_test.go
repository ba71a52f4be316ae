package pgproxy

import (
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
)

// TestAgentCannotSwitchOffTheStorageFence: an agent whose database role
// owns a fenced table, holding a lease on it, opens a block through the
// proxy (writable: the lease is live) and calls a function that runs
// ALTER TABLE ... DISABLE TRIGGER on it. The proxy refuses that statement
// when it sees it, but a SELECT of a function is a read to it. Were it to
// pass, the storage-side fence would be gone for every later lease, and
// the agent could write the table straight to Postgres with no token at
// all once its lease is revoked.
func TestAgentCannotSwitchOffTheStorageFence(t *testing.T) {
	forEachTrigger(t, testAgentCannotSwitchOffTheStorageFence)
}

func testAgentCannotSwitchOffTheStorageFence(t *testing.T, f *fenceDB) {
	ctx := ctxT(t)
	f.reset(t, "TRUNCATE public.race")
	f.resetEpoch(t, "public.race")
	admin := f.admin(t)
	var me string
	if err := admin.QueryRow(ctx, "SELECT current_user").Scan(&me); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"ALTER TABLE public.race OWNER TO agent",
		`CREATE OR REPLACE FUNCTION public.f_unfence(q text) RETURNS int LANGUAGE plpgsql AS $$
BEGIN EXECUTE q; RETURN 1; END $$`,
		`CREATE OR REPLACE FUNCTION public.f_noop() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RETURN NULL; END $$`,
	} {
		if _, err := admin.Exec(ctx, q); err != nil {
			t.Fatalf("%s: %v", q, err)
		}
	}
	t.Cleanup(func() {
		for _, q := range []string{"ALTER TABLE public.race ENABLE TRIGGER fenceline_fence", "ALTER TABLE public.race OWNER TO " + me, "DROP FUNCTION public.f_unfence(text)", "DROP FUNCTION public.f_noop()"} {
			if _, err := f.admin(t).Exec(ctxT(t), q); err != nil {
				t.Errorf("cleanup: %s: %v", q, err)
			}
		}
	})
	b := bustest.Start(t)
	l := holdTables(t, b, "ws-unfence", 30*time.Second, "public.race")
	p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
	c := f.via(t, p, "agent")
	for _, sql := range []string{"ALTER TABLE public.race DISABLE TRIGGER fenceline_fence", "DROP TRIGGER fenceline_fence ON public.race"} {
		if _, err := c.Exec(ctx, sql); err == nil {
			t.Errorf("%s through the proxy: accepted", sql)
		}
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO public.race VALUES (1, 'through the proxy')"); err != nil {
		t.Fatalf("fenced write through the proxy: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		"ALTER TABLE public.race DISABLE TRIGGER fenceline_fence",
		"ALTER TABLE public.race DISABLE TRIGGER ALL",
		"ALTER TABLE public.race ENABLE REPLICA TRIGGER fenceline_fence",
		"DROP TRIGGER fenceline_fence ON public.race",
		"ALTER TRIGGER fenceline_fence ON public.race RENAME TO off",
		"CREATE OR REPLACE TRIGGER fenceline_fence BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON public.race FOR EACH STATEMENT EXECUTE FUNCTION public.f_noop()",
	} {
		tx, err := c.Begin(ctx) // writable: the lease is live
		if err != nil {
			t.Fatal(err)
		}
		_, ferr := tx.Exec(ctx, "SELECT public.f_unfence($1)", q)
		cerr := tx.Commit(ctx)
		if ferr == nil || pgCode(ferr) != "42501" {
			t.Errorf("%s, in a function the block calls: %v (commit: %v), want 42501", q, ferr, cerr)
		}
	}
	var enabled string
	if err := admin.QueryRow(ctx, "SELECT tgenabled FROM pg_trigger WHERE tgrelid = 'public.race'::regclass AND tgname = 'fenceline_fence'").Scan(&enabled); err != nil {
		t.Fatal(err)
	}
	revoke(t, b, l)
	_, werr := f.agent(t).Exec(ctx, "INSERT INTO public.race VALUES (2, 'straight, after the revoke')")
	if enabled != "O" || werr == nil {
		t.Fatalf("the agent switched the fence trigger off (tgenabled %q) and wrote the table without a token after the revoke (%v)", enabled, werr)
	}
}
