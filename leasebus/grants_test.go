package leasebus

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
)

// TestGrantKeysOnlyToTheAcquirer: with a repository's storage secrets
// registered, the acquirer's answer carries the lease's grant keys, derived
// from them for this lease, fence, owner and claim; so does an attach (the
// renewal that proves the credential). Nobody else learns them: another
// holder's get and list, the change notices, the lease log and the audit
// stream hold no byte of them.
func TestGrantKeysOnlyToTheAcquirer(t *testing.T) {
	t.Parallel()
	secrets := t.TempDir()
	b := &bus{t: t, dir: t.TempDir(), cfg: ServiceConfig{FenceSecretDir: secrets}}
	b.start("127.0.0.1:0")
	t.Cleanup(b.stop)
	ctx := ctxT(t)
	gitSecret, pgSecret := bytes.Repeat([]byte{0x5a}, 32), bytes.Repeat([]byte{0xa5}, 32)
	if err := WriteFenceSecret(secrets, repo, lease.StorageGit, gitSecret); err != nil {
		t.Fatal(err)
	}
	if err := WriteFenceSecret(secrets, repo, lease.StoragePostgres, pgSecret); err != nil {
		t.Fatal(err)
	}

	other := connectAs(t, b.srv.ClientURL(), RoleHolder)
	var mu sync.Mutex
	var notices [][]byte
	sub, err := other.Subscribe(changedPrefix+".>", func(m *nats.Msg) {
		mu.Lock()
		notices = append(notices, m.Data)
		mu.Unlock()
	})
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	if err := other.Flush(); err != nil {
		t.Fatal(err)
	}

	acquirer := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	cred := NewCredential()
	c := claim(t, "services/billing")
	c.Tables = []string{"billing.*", "public.invoices"}
	l, err := acquirer.Acquire(ctx, AcquireRequest{Repo: repo, Scope: c, Owner: owner(1), TTL: lease.Duration(30 * time.Second)}, cred)
	if err != nil {
		t.Fatal(err)
	}
	want, err := lease.GrantKeysFor(l, gitSecret, pgSecret)
	if err != nil {
		t.Fatal(err)
	}
	if l.Grants == nil || !bytes.Equal(l.Grants.Git, want.Git) || !bytes.Equal(l.Grants.Postgres, want.Postgres) {
		t.Fatalf("acquire answered grant keys %+v, want %+v", l.Grants, want)
	}
	h, err := acquirer.Hold(t.Context(), l, cred, time.Now(), HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Orphan()
	if g := h.GrantKeys(); g == nil || !bytes.Equal(g.Git, want.Git) {
		t.Fatalf("the holder keeps grant keys %+v, want %+v", g, want)
	}

	attacher := NewClient(connectAs(t, b.srv.ClientURL(), RoleHolder))
	ah, err := attacher.AttachAndHold(ctx, l.LeaseID, cred, HoldOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer ah.Orphan()
	if g := ah.GrantKeys(); g == nil || !bytes.Equal(g.Git, want.Git) || !bytes.Equal(g.Postgres, want.Postgres) {
		t.Fatalf("attach got grant keys %+v, want %+v", g, want)
	}

	// Everyone else.
	oc := NewClient(other)
	got, err := oc.Get(ctx, l.LeaseID)
	if err != nil || got.Grants != nil {
		t.Fatalf("another holder's get: grants %+v (%v), want none", got.Grants, err)
	}
	all, err := oc.List(ctx, repo, true)
	if err != nil {
		t.Fatal(err)
	}
	for _, x := range all {
		if x.Grants != nil {
			t.Fatalf("another holder's list carries grant keys of %s", x.LeaseID)
		}
	}
	if _, err := NewClient(other).Renew(ctx, RenewRequest{LeaseID: l.LeaseID, Credential: NewCredential(), Version: ah.Lease().Version}); err == nil {
		t.Fatal("a renewal with another credential was answered")
	}
	if err := acquirer.Conn().Flush(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	seen := append([][]byte(nil), notices...)
	mu.Unlock()
	if len(seen) == 0 {
		t.Fatal("no change notice heard")
	}
	// The grant's audit event is written after the answer.
	checkFor(t, 10*time.Second, 20*time.Millisecond, func() error {
		evs, err := ReadAudit(ctx, b.nc, repo, 0)
		if err != nil {
			return err
		}
		for _, e := range evs {
			if e.Type == lease.EventGrant {
				return nil
			}
		}
		return errors.New("no audit event of the grant yet")
	})
	stored := append(seen, streamData(t, b.nc, LogStream)...)
	stored = append(stored, streamData(t, b.nc, AuditStream)...)
	for _, k := range [][]byte{want.Git, want.Postgres, gitSecret, pgSecret} {
		for _, enc := range [][]byte{k, []byte(hex.EncodeToString(k)), []byte(base64.StdEncoding.EncodeToString(k))} {
			for _, data := range stored {
				if bytes.Contains(data, enc) {
					t.Fatalf("a grant key or secret is in a notice, the lease log or the audit: %q", data)
				}
			}
		}
	}
}

// streamData is every message of stream.
func streamData(t *testing.T, nc *nats.Conn, stream string) [][]byte {
	t.Helper()
	js, err := JetStream(context.Background(), nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && seq > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			continue // deleted
		}
		out = append(out, m.Data)
	}
	if len(out) == 0 {
		t.Fatalf("stream %s is empty", stream)
	}
	return out
}
