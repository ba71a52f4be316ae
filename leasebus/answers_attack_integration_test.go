//go:build integration

package leasebus

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
)

// One holder identity shared by two runners: the attacker hears the
// victim's replies, predicts its next reply subjects, and has the service
// send its own answers there. A refusal meant for the attacker (a renew
// with a wrong credential) must not make the victim lost, a lease granted
// to the attacker must not become the victim's lease (fence, scope, ttl),
// and a genuine but older answer ("active") must not keep the victim
// writing after an operator's revoke.
func TestHolderIgnoresAnswersItDidNotAskFor(t *testing.T) {
	t.Run("refusal", func(t *testing.T) {
		b := startBus(t)
		h, spy, attacker := victimHolder(t, b, 300*time.Millisecond)
		l := h.Lease()
		inject(t, attacker, "renew", RenewRequest{LeaseID: l.LeaseID, Repo: repo, Credential: "not-the-owner", Version: l.Version}, spy.next(8))
		stays(t, h, l, 2*time.Second)
		if got, err := b.c.Get(ctxT(t), l.LeaseID); err != nil || !got.Active() {
			t.Fatalf("service: %+v %v", got, err)
		}
	})
	t.Run("foreign-lease", func(t *testing.T) {
		b := startBus(t)
		h, spy, attacker := victimHolder(t, b, 300*time.Millisecond)
		l := h.Lease()
		whole, err := scope.New(nil, true, []string{"public.*"})
		if err != nil {
			t.Fatal(err)
		}
		for i, subj := range spy.next(8) {
			cred := NewCredential()
			inject(t, attacker, "acquire", AcquireRequest{Repo: fmt.Sprintf("github.com/evil/r%d", i), Scope: whole, Owner: owner(9),
				TTL: lease.Duration(MaxTTL), RequestID: NewRequestID(), CredentialHash: cred.hash()}, []string{subj})
		}
		stays(t, h, l, 2*time.Second)
	})
	t.Run("stale-active-after-revoke", func(t *testing.T) {
		b := startBus(t)
		// Renewals 5 s apart: the injected answers wait in the victim's
		// mailbox for the renewals after the revoke, each keeping a victim
		// that takes them writing for 5 s more.
		h, spy, attacker := victimHolder(t, b, 5*time.Second)
		l := h.Lease()
		// Genuine answers of the service, from before the revoke.
		subjects := spy.next(12)
		inject(t, attacker, "get", getRequest{LeaseID: l.LeaseID, Repo: repo}, subjects)
		var want uint64 // the highest sequence injected onto
		for _, subj := range subjects {
			seq, _ := strconv.ParseUint(subj[strings.LastIndexByte(subj, '.')+1:], 36, 64)
			want = max(want, seq)
		}
		checkFor(t, 10*time.Second, 10*time.Millisecond, func() error {
			if spy.highest() < want {
				return errors.New("the service has not answered the injected gets yet")
			}
			return nil
		})
		op := NewClient(connectAs(t, b.srv.ClientURL(), RoleOperator))
		revoked := time.Now()
		if _, err := op.Revoke(ctxT(t), l.LeaseID, "attack test"); err != nil {
			t.Fatal(err)
		}
		select {
		case <-h.Lost():
			t.Logf("lost %s after the revoke", time.Since(revoked).Round(time.Millisecond))
		case <-time.After(3 * time.Second): // the bound is 1 s; room for two busy cores
			st, err := h.State()
			t.Fatalf("3 s after a revoke the victim's holder is %s (%v): injected answers kept it writing", st, err)
		}
	})
}
