package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
)

// wantLeaseEvents fails unless the audit of repo holds an event of each
// type in types for lease l.
func wantLeaseEvents(t *testing.T, nc *nats.Conn, repo string, l *lease.Lease, types ...string) {
	t.Helper()
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := ReadAudit(ctxT(t), nc, repo, 0)
		if err != nil {
			return err
		}
		for _, typ := range types {
			found := false
			for _, ev := range evs {
				found = found || (ev.LeaseID == l.LeaseID && ev.Type == typ)
			}
			if !found {
				return fmt.Errorf("the audit of %s has no %s event of %s (of %d events)", repo, typ, l.LeaseID, len(evs))
			}
		}
		return nil
	})
}

// A lease's refusals are rate-limited by the lease, not only by who sends
// them: past its burst, one lease's events are counted, while the same
// sender's events of another lease are still written one by one.
func TestBoundaryEventsRateLimitedPerLease(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	aud, err := NewAuditor(connectAs(t, b.srv.ClientURL(), RoleHolder))
	if err != nil {
		t.Fatal(err)
	}
	written, limited, took := flood(ctx, t, aud, 3*leaseBurst, func(i int) lease.AuditEvent {
		return lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile, Repo: repo, LeaseID: "lease_loud", Message: fmt.Sprintf("refusal %d", i)}
	})
	if most := leaseBurst + int(took.Seconds()*leaseRate) + 1; written > most || limited == 0 {
		t.Fatalf("%d events of one lease written one by one in %s (at most %d), %d refused over its rate", written, took.Round(time.Millisecond), most, limited)
	}
	if err := aud.Record(ctx, lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile, Repo: repo, LeaseID: "lease_quiet", Message: "another lease's refusal"}); err != nil {
		t.Fatalf("another lease's event from the same sender: %v", err)
	}
	// The loud lease's own holder's fences write on: the flood was
	// another identity's, and took only its own share of that lease.
	own, err := NewAuditor(connectAs(t, b.srv.ClientURL(), RoleOperator))
	if err != nil {
		t.Fatal(err)
	}
	if err := own.Record(ctx, lease.AuditEvent{Type: lease.EventDenied, Boundary: lease.BoundaryFile, Repo: repo, LeaseID: "lease_loud", Message: "its own fence's refusal"}); err != nil {
		t.Fatalf("another identity's event of the flooded lease: %v", err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		counted, quiet := 0, false
		for _, ev := range evs {
			var n int
			if ev.Reason == ReasonRateLimited {
				if _, err := fmt.Sscanf(ev.Message[strings.Index(ev.Message, " sent ")+1:], "sent %d boundary events more", &n); err != nil {
					return fmt.Errorf("rate-limited event %q: %v", ev.Message, err)
				}
			}
			counted += n
			quiet = quiet || ev.LeaseID == "lease_quiet"
		}
		if counted != limited || !quiet {
			return fmt.Errorf("the rate-limited events count %d dropped, want %d; the other lease's event: %v", counted, limited, quiet)
		}
		return nil
	})
}

// A lease log at its size limit refuses appends (it drops nothing) and
// says so by name, in the answer and in the metrics. (What fills it here
// is the server's answers to direct gets, sent onto the log's subject as
// their reply, by an identity of the service account: since the bus has
// accounts, no other can (replytrick_attack_test.go), so this stands in
// for any fault that fills the store.)
func TestLogAtItsLimitRefusesByName(t *testing.T) {
	t.Parallel()
	dir := testutil.Tmpfs(t, "32m")
	b := &storeBus{bus: &bus{t: t, dir: filepath.Join(dir, "bus")}}
	b.cfg.Metrics = NewServiceMetrics()
	b.start()
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, LogStream)
	if err != nil {
		t.Fatal(err)
	}
	size := st.CachedInfo().Config.MaxBytes
	if size <= 0 || st.CachedInfo().Config.Discard != jetstream.DiscardNew {
		t.Fatalf("lease log MaxBytes %d, discard %v: want a size, and new writes refused past it", size, st.CachedInfo().Config.Discard)
	}
	injector := connectAs(t, url, RoleService)
	for _, n := range []int{60 << 10, 512} { // large answers, then small ones for what room is left
		_, key := storeAt(t, url, make([]byte, n))
		req, _ := json.Marshal(map[string]any{"last_by_subj": "$KV.FENCELINE_ATTEMPTS." + key})
		for range int(size/int64(n))/4 + 200 {
			if err := injector.PublishRequest("$JS.API.DIRECT.GET.KV_FENCELINE_ATTEMPTS", logSubjectFor("junk"), req); err != nil {
				t.Fatal(err)
			}
		}
		if err := injector.Flush(); err != nil {
			t.Fatal(err)
		}
		checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
			info, err := st.Info(ctx)
			if err != nil {
				return err
			}
			if info.State.Bytes+uint64(2*n) < uint64(size) {
				return fmt.Errorf("the log holds %d of %d bytes", info.State.Bytes, size)
			}
			return nil
		})
	}
	_, err = acquirePath(t, b.c, "a")
	if !errors.Is(err, ErrLogFull) || !strings.Contains(err.Error(), "size limit") {
		t.Fatalf("a grant on a full lease log: %v, want ErrLogFull", err)
	}
	fams, err := b.cfg.Metrics.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	full := 0.0
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			for _, l := range m.GetLabel() {
				if f.GetName() == "fenceline_bus_appends_total" && l.GetName() == "result" && l.GetValue() == "full" {
					full += m.GetCounter().GetValue()
				}
			}
		}
	}
	if full < 1 {
		t.Fatalf("fenceline_bus_appends_total{result=\"full\"} = %v, want at least 1", full)
	}
}

// A store made before the budget (streams without a size) gets its
// budget when the service starts on it, and keeps its leases.
func TestStreamsWithoutASizeGetTheirBudget(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	l, err := acquirePath(t, b.c, "a")
	if err != nil {
		t.Fatal(err)
	}
	js, err := JetStream(context.Background(), b.nc)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{LogStream, shardPoolStream, shardAttemptStream} {
		st, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st.CachedInfo().Config
		cfg.MaxBytes, cfg.MaxMsgSize, cfg.Discard = -1, -1, jetstream.DiscardOld
		if _, err := js.UpdateStream(ctx, cfg); err != nil {
			t.Fatalf("unbound %s: %v", name, err)
		}
	}
	b.stop()
	b.start("127.0.0.1:0")
	if js, err = JetStream(context.Background(), b.nc); err != nil {
		t.Fatal(err)
	}
	for name, budget := range streamBudgets {
		st, err := js.Stream(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		cfg := st.CachedInfo().Config
		if cfg.MaxBytes < budget.min || cfg.MaxBytes > budget.max || cfg.MaxMsgSize != budget.maxMsgSize || cfg.Discard != budget.discard {
			t.Errorf("%s: MaxBytes %d (want %d to %d), MaxMsgSize %d (want %d), discard %v (want %v)",
				name, cfg.MaxBytes, budget.min, budget.max, cfg.MaxMsgSize, budget.maxMsgSize, cfg.Discard, budget.discard)
		}
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || got.Status != lease.StatusActive {
		t.Fatalf("the lease after the restart: %v %v", got, err)
	}
}
