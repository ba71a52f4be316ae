package lease

import (
	"bytes"
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease/scope"
)

// TestGrantKeysBindTheGrant: a grant key changes with every field the
// storage checks, the tables field is the same whatever the claim's order,
// and a lease gets keys only for the storages whose secret is given.
func TestGrantKeysBindTheGrant(t *testing.T) {
	secret := bytes.Repeat([]byte{1}, 32)
	c, err := scope.New([]string{"services/billing"}, false, []string{"public.b", "public.a"})
	if err != nil {
		t.Fatal(err)
	}
	l := Lease{LeaseID: "lease_a", Repo: "github.com/acme/payments", Scope: c, Fence: 7, Owner: Owner{TaskID: "t", AgentID: "a", AttemptID: "x"}}
	base, err := GrantKeysFor(&l, secret, secret)
	if err != nil || base == nil || base.Git == nil || base.Postgres == nil {
		t.Fatalf("GrantKeysFor = %+v, %v", base, err)
	}
	for name, mutate := range map[string]func(*Lease){
		"lease":  func(l *Lease) { l.LeaseID = "lease_b" },
		"fence":  func(l *Lease) { l.Fence++ },
		"repo":   func(l *Lease) { l.Repo = "github.com/acme/other" },
		"owner":  func(l *Lease) { l.Owner.AgentID = "b" },
		"claim":  func(l *Lease) { l.Scope.Paths = []string{"libs"} },
		"tables": func(l *Lease) { l.Scope.Tables = []string{"public.*"} },
	} {
		m := l
		m.Scope.Paths, m.Scope.Tables = append([]string{}, l.Scope.Paths...), append([]string{}, l.Scope.Tables...)
		mutate(&m)
		k, err := GrantKeysFor(&m, secret, secret)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Equal(k.Git, base.Git) && bytes.Equal(k.Postgres, base.Postgres) {
			t.Errorf("another %s, same grant keys", name)
		}
	}
	a, _ := PostgresTables([]string{"public.b", "public.a", "public.a"})
	b, _ := PostgresTables([]string{"public.a", "public.b"})
	if a != b || strings.Count(a, ",") != 3 {
		t.Errorf("PostgresTables not canonical: %q vs %q", a, b)
	}
	if k, err := GrantKeysFor(&l, nil, nil); k != nil || err != nil {
		t.Errorf("no secrets: %+v, %v; want no keys", k, err)
	}
	if _, err := GitGrantKey([]byte("short"), "r", "l", "o", "1", ""); err == nil {
		t.Error("a short storage secret was accepted")
	}
}
