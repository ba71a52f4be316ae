package pgproxy

import (
	"math"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
)

func testStolenGrantKey(t *testing.T, f *fenceDB) {
	f.reset(t, "TRUNCATE public.race, public.other")
	f.resetEpoch(t, "public.race")
	f.resetEpoch(t, "public.other")
	ctx := ctxT(t)
	b := bustest.Start(t)
	if err := leasebus.WriteFenceSecret(b.FenceSecrets, "github.com/acme/tokens", lease.StoragePostgres, f.secret); err != nil {
		t.Fatal(err)
	}
	l := holdTables(t, b, "ws-stolen", 30*time.Second, "public.race")
	keys := l.GrantKeys()
	if keys == nil || len(keys.Postgres) == 0 {
		t.Fatal("the lease service gave the acquirer no Postgres grant key")
	}
	stolen, L, F := keys.Postgres, l.Record.LeaseID, l.Record.Fence

	// L's own write, through its proxy with the key the service gave it.
	p := f.proxy(t, Config{Lease: l.Holder, Audit: b.Auditor})
	if _, ok := p.cfg.Lease.(heldWithGrant); ok {
		t.Fatal("the test stood in for the lease service: the holder should carry the service's key")
	}
	if _, err := f.via(t, p, "agent").Exec(ctx, "INSERT INTO public.race VALUES (1, 'granted')"); err != nil {
		t.Fatalf("L's write with its grant key: %v", err)
	}

	c := f.agent(t) // straight to Postgres, past the proxy
	session := sessionOf(t, c)
	for _, tc := range []struct {
		name, lease, table string
		fence              uint64
		tables             []string
	}{
		{"a lease that does not exist, fence 2^63-1, every table", "lease_doesnotexist", "public.race", math.MaxInt64, []string{"public.*"}},
		{"its own lease at a greater fence", L, "public.race", F + 1000, []string{"public.race"}},
		{"its own lease and fence, a wider claim", L, "public.other", F, []string{"public.*"}},
		{"its own lease and fence, another table", L, "public.other", F, []string{"public.other"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tok, err := MakeToken(stolen, tc.lease, tc.fence, session, tc.tables)
			if err != nil {
				t.Fatal(err)
			}
			err = writeWithToken(ctx, c, tok, "INSERT INTO "+tc.table+" VALUES (99, 'minted')")
			if pgCode(err) != "40001" {
				t.Fatalf("minted token: want SQLSTATE 40001, got %v", err)
			}
			for _, want := range []string{"forged", "lease " + tc.lease, "fence " + strconv.FormatUint(tc.fence, 10), "did not grant"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("refusal lacks %q: %v", want, err)
				}
			}
		})
	}
	admin := f.admin(t)
	for table, want := range map[string]uint64{"public.race": F, "public.other": 0} {
		var epoch uint64
		if err := admin.QueryRow(ctx, "SELECT coalesce(pg_sequence_last_value(seq), 0) FROM fenceline.epoch WHERE relid = $1::regclass", table).Scan(&epoch); err != nil {
			t.Fatal(err)
		}
		if epoch != want {
			t.Errorf("epoch of %s = %d after the minted tokens, want %d", table, epoch, want)
		}
	}
	var minted int
	if err := admin.QueryRow(ctx, "SELECT count(*) FROM public.race WHERE id = 99").Scan(&minted); err != nil || minted != 0 {
		t.Fatalf("a minted token's write landed (%d, %v)", minted, err)
	}
}
