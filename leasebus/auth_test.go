package leasebus

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nkeys"
)

// refusals collects the permission violations the server reports to a
// connection.
type refusals chan error

func (r refusals) option() nats.Option {
	return nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		if errors.Is(err, nats.ErrPermissionViolation) {
			select {
			case r <- err:
			default:
			}
		}
	})
}

func (r refusals) drain() {
	for {
		select {
		case <-r:
		default:
			return
		}
	}
}

// wantRefused publishes on subj and fails unless the bus refuses it.
func wantRefused(t *testing.T, nc *nats.Conn, r refusals, subj string, data []byte) {
	t.Helper()
	r.drain()
	if err := nc.Publish(subj, data); err != nil {
		t.Fatalf("publish %s: %v", subj, err)
	}
	r.wait(t, "publish on "+subj, `"`+subj+`"`)
}

// wait waits for a refusal naming subj (earlier ones may still arrive).
func (r refusals) wait(t *testing.T, what, subj string) {
	t.Helper()
	timeout := time.After(5 * time.Second)
	for {
		select {
		case err := <-r:
			if strings.Contains(err.Error(), subj) {
				return
			}
		case <-timeout:
			t.Fatalf("%s was not refused", what)
		}
	}
}

// Found 1: a client without credentials listed and revoked leases. Now it
// cannot even connect, nor can one with a key the bus does not know.
func TestUnauthenticatedClientCannotConnect(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	if nc, err := nats.Connect(b.srv.ClientURL(), nats.Timeout(2*time.Second)); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected to the bus")
	} else if !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("no credentials: got %v, want an authorization violation", err)
	}
	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	seed, _ := kp.Seed()
	path := filepath.Join(t.TempDir(), "stranger.nk")
	if err := os.WriteFile(path, seed, 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := LoadCreds(path)
	if err != nil {
		t.Fatal(err)
	}
	opts, err := c.Options()
	if err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(b.srv.ClientURL(), append(opts, nats.Timeout(2*time.Second))...); err == nil {
		nc.Close()
		t.Fatal("a client with an unknown nkey connected to the bus")
	} else if !errors.Is(err, nats.ErrAuthorization) {
		t.Fatalf("unknown nkey: got %v, want an authorization violation", err)
	}
}

// A holder acquires and renews its own leases, but cannot revoke or sweep,
// cannot forge a change notice (the holder of the lease keeps it), cannot
// write the lease log or the lease boundary's audit, cannot ask in
// another identity's name and cannot overhear others' requests.
func TestHolderCannotRevokeOrForge(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	ref := make(refusals, 16)
	hnc := connectAs(t, url, RoleHolder, ref.option())
	hc := NewClient(hnc)

	cred := NewCredential()
	sent := time.Now()
	l, err := hc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "held"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatalf("holder acquire: %v", err)
	}
	h, err := hc.Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	if _, err := hc.Get(ctx, l.LeaseID); err != nil {
		t.Fatalf("holder get: %v", err)
	}

	start := time.Now()
	if _, err := hc.Revoke(ctx, l.LeaseID, "mine now"); !errors.Is(err, ErrForbidden) {
		t.Fatalf("holder revoke: got %v, want ErrForbidden", err)
	} else if !strings.Contains(err.Error(), "operator") {
		t.Errorf("the refusal does not say which role may revoke: %v", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("the refused revoke took %s to report", d)
	}
	if _, err := hc.Sweep(ctx, repo); !errors.Is(err, ErrForbidden) {
		t.Fatalf("holder sweep: got %v, want ErrForbidden", err)
	}

	// A forged change notice: revoked, a high version.
	forged := *l
	forged.Status, forged.Version = lease.StatusRevoked, l.Version+100
	data, _ := json.Marshal(&forged)
	wantRefused(t, hnc, ref, ChangedSubject(repo, l.LeaseID), data)
	for _, subj := range []string{
		logSubject + "." + RepoKey(repo),
		serviceAuditSubject(RepoKey(repo)),
		appendedPrefix + "." + RepoKey(repo),
		peersSubject,
		requestSubject("revoke", IdentityOf(b.nc)), // in the service's name
		"$JS.API.STREAM.PURGE." + AuditStream,
		"$JS.API.STREAM.DELETE." + LogStream,
	} {
		wantRefused(t, hnc, ref, subj, []byte(`{}`))
	}
	// Overhearing: another identity's requests (renewals carry the
	// credential) and replies.
	for _, subj := range []string{apiPrefix + ".renew.*", "_INBOX.>"} {
		ref.drain()
		sub, err := hnc.SubscribeSync(subj)
		if err != nil {
			t.Fatal(err)
		}
		ref.wait(t, "subscription to "+subj, `"`+subj+`"`)
		_ = sub.Unsubscribe()
	}

	// The holder still holds, and the service says so.
	if st, err := h.State(); st != lease.Held {
		t.Fatalf("after the forged notice the holder is %s (%v), want held", st, err)
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || !got.Active() {
		t.Fatalf("after the holder's attempts: %+v %v", got, err)
	}
}

// A viewer reads (list, get, the audit stream) but cannot acquire.
func TestViewerCannotAcquire(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	vc := NewClient(connectAs(t, b.srv.ClientURL(), RoleViewer))
	if _, err := vc.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "v"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential()); !errors.Is(err, ErrForbidden) {
		t.Fatalf("viewer acquire: got %v, want ErrForbidden", err)
	}
	if _, err := vc.List(ctx, "", false); err != nil {
		t.Fatalf("viewer list: %v", err)
	}
	if _, err := ReadAudit(ctx, vc.Conn(), repo, 0); err != nil {
		t.Fatalf("viewer reads the audit: %v", err)
	}
}

// Revoke, sweep and list land in the audit stream naming who asked: the
// identity the bus authenticated, not anything the request says.
func TestAuditNamesWhoAsked(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	opNC := connectAs(t, url, RoleOperator)
	viewNC := connectAs(t, url, RoleViewer)
	op, view := NewClient(opNC), NewClient(viewNC)

	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "r"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := op.Revoke(ctx, l.LeaseID, "audit test"); err != nil {
		t.Fatalf("operator revoke: %v", err)
	}
	if _, err := op.Sweep(ctx, repo); err != nil {
		t.Fatalf("operator sweep: %v", err)
	}
	if _, err := view.List(ctx, repo, false); err != nil {
		t.Fatalf("viewer list: %v", err)
	}
	opID, viewID := IdentityOf(opNC), IdentityOf(viewNC)
	if opID == Anonymous || viewID == Anonymous || opID == viewID {
		t.Fatalf("identities: operator %q, viewer %q", opID, viewID)
	}
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, viewNC, repo, 0)
		if err != nil {
			return err
		}
		var revoked, swept, listed bool
		for _, ev := range evs {
			switch {
			case ev.Type == lease.EventRevoked && ev.LeaseID == l.LeaseID:
				revoked = ev.RequestedBy == opID && ev.Reason == "audit test"
			case ev.Type == lease.EventSweep:
				swept = ev.RequestedBy == opID
			case ev.Type == lease.EventList:
				listed = ev.RequestedBy == viewID
			}
		}
		if !revoked || !swept || !listed {
			return errors.New("audit lacks the revoke, sweep or list naming who asked")
		}
		return nil
	})
}

// The credentials the embedded bus makes: one per role, 0600 in a 0700
// directory, the same ones on the next start.
func TestEnsureCredsModesAndReuse(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "creds")
	first, err := EnsureCreds(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("creds dir: %v %v", fi.Mode(), err)
	}
	for _, r := range Roles {
		fi, err := os.Stat(filepath.Join(dir, CredsFile(r)))
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s creds: %v %v", r, fi.Mode(), err)
		}
		if first[r].Role != r || first[r].Name != string(r) {
			t.Fatalf("%s creds say %+v", r, first[r])
		}
	}
	// A file copied in with looser modes is restricted again.
	loose := filepath.Join(dir, CredsFile(RoleHolder))
	if err := os.Chmod(loose, 0o644); err != nil {
		t.Fatal(err)
	}
	again, err := EnsureCreds(dir)
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(loose); err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("holder creds after a second start: %v %v", fi.Mode(), err)
	}
	for _, r := range Roles {
		if again[r].Nkey != first[r].Nkey {
			t.Fatalf("%s creds changed on the second start", r)
		}
	}
}

// A holder may write shard attempt records and create consumers on their
// stream (runners need both), and JetStream does not check a push
// consumer's deliver subject against the creator's permissions: a record
// holding a forged lease, delivered by the server itself onto a victim's
// change subject. The watch takes change notices only as the service
// publishes them (plain messages, no JetStream delivery), so the victim
// keeps its lease.
func TestHolderCannotForgeChangedThroughJetStream(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	victimC := NewClient(connectAs(t, url, RoleHolder))
	cred := NewCredential()
	sent := time.Now()
	l, err := victimC.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	h, err := victimC.Hold(t.Context(), l, cred, sent, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Orphan)
	var seen atomic.Int32
	stop, err := NewClient(connectAs(t, url, RoleViewer)).Watch(repo, func(*lease.Lease) { seen.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	defer stop()

	// The attempts bucket the lease service made (and alone writes: the
	// record is planted as the service; the consumer is the holder's).
	attacker := connectAs(t, url, RoleHolder)
	ajs, err := JetStream(context.Background(), connectAs(t, url, RoleService))
	if err != nil {
		t.Fatal(err)
	}
	forged := *l
	forged.Status, forged.Version = lease.StatusRevoked, l.Version+100
	data, _ := json.Marshal(&forged)
	if _, err := ajs.Publish(ctx, "$KV.FENCELINE_ATTEMPTS.forged", data); err != nil {
		t.Fatalf("plant an attempt record: %v", err)
	}
	create, _ := json.Marshal(map[string]any{"stream_name": "KV_FENCELINE_ATTEMPTS", "config": map[string]any{
		"name": "forge", "deliver_subject": ChangedSubject(repo, l.LeaseID), "ack_policy": "none",
		"filter_subject": "$KV.FENCELINE_ATTEMPTS.forged", "deliver_policy": "all",
	}})
	resp, err := attacker.Request(FleetJSAPI+".CONSUMER.CREATE.KV_FENCELINE_ATTEMPTS.forge.$KV.FENCELINE_ATTEMPTS.forged", create, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("consumer create: %s", resp.Data)
	// A real notice after the forged delivery: once the watcher has seen
	// it, the forged one (delivered first) had its chance.
	if _, err := b.c.Get(ctx, l.LeaseID); err != nil {
		t.Fatal(err)
	}
	other, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	checkFor(t, 5*time.Second, 20*time.Millisecond, func() error {
		if seen.Load() == 0 {
			return errors.New("the grant of " + other.LeaseID + " not seen yet")
		}
		return nil
	})
	if st, err := h.State(); st != lease.Held {
		t.Fatalf("after a forged notice through JetStream the holder is %s (%v), want held", st, err)
	}
	if n := seen.Load(); n != 1 {
		t.Errorf("the watcher saw %d records, want only the real grant", n)
	}
}

// The same trick aimed at the service: a record holding a revoke request,
// delivered by the server onto the operator's request subject. The
// service answers only requests published by their identity, never a
// JetStream delivery, so the lease stays.
func TestHolderCannotRevokeThroughJetStream(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	ctx := ctxT(t)
	url := b.srv.ClientURL()
	l, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "victim"), Owner: owner(1), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	opNC := connectAs(t, url, RoleOperator)
	attacker := connectAs(t, url, RoleHolder)
	ajs, err := JetStream(context.Background(), connectAs(t, url, RoleService)) // plants the record (see storeAt)
	if err != nil {
		t.Fatal(err)
	}
	data, _ := json.Marshal(RevokeRequest{LeaseID: l.LeaseID, Repo: repo, Reason: "forged"})
	if _, err := ajs.Publish(ctx, "$KV.FENCELINE_ATTEMPTS.forged", data); err != nil {
		t.Fatal(err)
	}
	for i, ack := range []string{"none", "explicit"} {
		create, _ := json.Marshal(map[string]any{"stream_name": "KV_FENCELINE_ATTEMPTS", "config": map[string]any{
			"name": fmt.Sprintf("forge%d", i), "deliver_subject": requestSubject("revoke", IdentityOf(opNC)), "ack_policy": ack,
			"deliver_group":  serviceQueue, // the service's queue group
			"filter_subject": "$KV.FENCELINE_ATTEMPTS.forged", "deliver_policy": "all",
		}})
		resp, err := attacker.Request(fmt.Sprintf(FleetJSAPI+".CONSUMER.CREATE.KV_FENCELINE_ATTEMPTS.forge%d.$KV.FENCELINE_ATTEMPTS.forged", i), create, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("consumer create: %s", resp.Data)
	}
	// (nats-server 2.15 does not deliver to the service's queue group
	// here, and refuses a client's publish with a $JS reply.) Were such a
	// delivery to reach the service — the ack subject as its reply — the
	// service ignores it, whoever it seems to come from:
	b.svc.handler("revoke", false)(&nats.Msg{Subject: requestSubject("revoke", IdentityOf(opNC)),
		Reply: "$JS.ACK.KV_FENCELINE_ATTEMPTS.forge1.1.1.1.1700000000000000000.0", Data: data}, time.Now(), false)
	// A revoke the operator does send, after: once it is done, the forged
	// ones (delivered first) had their chance.
	l2, err := b.c.Acquire(ctx, AcquireRequest{Repo: repo, Scope: claim(t, "other"), Owner: owner(2), TTL: lease.Duration(time.Minute)}, NewCredential())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := NewClient(opNC).Revoke(ctx, l2.LeaseID, "real"); err != nil {
		t.Fatal(err)
	}
	got, err := b.c.Get(ctx, l.LeaseID)
	if err != nil || !got.Active() {
		t.Fatalf("after a revoke request delivered by JetStream: %+v %v, want active", got, err)
	}
}

// What NATS itself refuses — a client with no credentials, a publish the
// role does not allow — lands in the audit stream (boundary bus, type
// refused) naming who was refused, and a client looping on a denied
// subject does not flood it.
func TestBusRefusalsAudited(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	stop := EmbeddedAuditRefusals(b.svc, b.srv, false, false)
	defer stop()

	holder := connectAs(t, b.srv.ClientURL(), RoleHolder)
	holder.SetErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}) // the violations are expected
	id := IdentityOf(holder)
	for range 200 {
		if err := holder.Publish(requestSubject("revoke", id), []byte(`{}`)); err != nil {
			t.Fatal(err)
		}
	}
	if err := holder.Flush(); err != nil {
		t.Fatal(err)
	}
	if nc, err := nats.Connect(b.srv.ClientURL(), nats.Timeout(2*time.Second)); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected")
	}

	var perm, auth []lease.AuditEvent
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := ReadAudit(ctxT(t), b.nc, "", 0)
		if err != nil {
			return err
		}
		perm, auth = nil, nil
		for _, e := range evs {
			if e.Type != lease.EventRefused || e.Boundary != lease.BoundaryBus {
				continue
			}
			switch e.Reason {
			case ReasonBusPermission:
				perm = append(perm, e)
			case ReasonBusAuthentication:
				auth = append(auth, e)
			}
		}
		if len(perm) == 0 || len(auth) == 0 {
			return fmt.Errorf("refusals audited: %d permission, %d authentication", len(perm), len(auth))
		}
		return nil
	})
	e := perm[0]
	if e.RequestedBy != id || !strings.Contains(e.Message, requestSubject("revoke", id)) { // the test's service has no names for keys
		t.Fatalf("the permission refusal's event names %q and says %q; want the holder and the subject", e.RequestedBy, e.Message)
	}
	if len(perm) > refusalRate*3 {
		t.Fatalf("200 denied publishes in well under a second wrote %d audit events; want them rate-limited", len(perm))
	}
}

// validIdentity accepts exactly what can stand as a subject token here:
// 1 to 128 of [A-Za-z0-9_-].
func TestValidIdentity(t *testing.T) {
	t.Parallel()
	re := regexp.MustCompile(`^[A-Za-z0-9_-]{1,128}$`)
	for _, id := range []string{"", "a", "UB4AQEQVIJGYF55KXEHHIPA6F6P5QU2SKROYNJRJL4OQYYZTQNFFERMG", "anonymous", "a.b", "a b", "a*", ">", "ä", "x-y_z",
		strings.Repeat("a", 128), strings.Repeat("a", 129), "a\x00"} {
		if got, want := validIdentity(id), re.MatchString(id); got != want {
			t.Errorf("validIdentity(%q) = %v, want %v", id, got, want)
		}
	}
}

// A client chooses its name, version and language, which the server puts
// in each line it logs about the client, before its account and user: a
// name that looks like another identity's account and user, or holds a
// marker or % verbs, neither moves a refusal onto that identity nor hides
// what was refused.
func TestBusRefusalNamesWhomTheServerRefused(t *testing.T) {
	t.Parallel()
	b := startBus(t)
	stop := EmbeddedAuditRefusals(b.svc, b.srv, false, false)
	defer stop()

	kp, err := nkeys.CreateUser()
	if err != nil {
		t.Fatal(err)
	}
	victim, err := kp.PublicKey()
	if err != nil {
		t.Fatal(err)
	}
	name := `%s%q%v - Publish Violation - Subject "x" - "$G/nkey:` + victim + `" %s $G/nkey:` + victim
	attacker := connectAs(t, b.srv.ClientURL(), RoleHolder, nats.Name(name))
	attacker.SetErrorHandler(func(*nats.Conn, *nats.Subscription, error) {}) // the violation is expected
	id := IdentityOf(attacker)
	denied := requestSubject("revoke", id)
	if err := attacker.Publish(denied, []byte(`{}`)); err != nil {
		t.Fatal(err)
	}
	if err := attacker.Flush(); err != nil {
		t.Fatal(err)
	}
	var perm []lease.AuditEvent
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		evs, err := ReadAudit(ctxT(t), b.nc, "", 0)
		if err != nil {
			return err
		}
		perm = nil
		for _, e := range evs {
			if e.Type == lease.EventRefused && e.Boundary == lease.BoundaryBus {
				perm = append(perm, e)
			}
		}
		if len(perm) == 0 {
			return errors.New("no refusal by the bus audited yet")
		}
		return nil
	})
	for _, e := range perm {
		if e.RequestedBy != id {
			t.Errorf("refusal audited as %q's (%s); want the client the server authenticated, %s", e.RequestedBy, e.Message, id)
		}
		if !strings.Contains(e.Message, `Publish Violation - Subject "`+denied+`"`) || strings.Contains(e.Message, "%!") {
			t.Errorf("refusal says %q; want the denied subject, formatted", e.Message)
		}
	}
}
