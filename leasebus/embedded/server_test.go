package embedded

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"testing"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/leasebus"
)

// The configuration for an external nats-server parses, with the real
// parser, into exactly the permissions the embedded server gets: every
// role's identity and every enrolled one.
func TestAuthConfigParses(t *testing.T) {
	dir := t.TempDir()
	if _, _, err := leasebus.EnrollIdentity(dir, "runner-1", leasebus.RoleHolder, ""); err != nil {
		t.Fatal(err)
	}
	users, err := leasebus.ServerUsers(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(users) != len(leasebus.Roles)+1 {
		t.Fatalf("%d users, want the %d roles and the enrolled runner", len(users), len(leasebus.Roles))
	}
	conf, err := leasebus.AuthConfig(users)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "nats.conf")
	if err := os.WriteFile(path, []byte("listen: 127.0.0.1:-1\njetstream { store_dir: "+strconv.Quote(t.TempDir())+" }\n"+conf), 0o600); err != nil {
		t.Fatal(err)
	}
	opts, err := server.ProcessConfigFile(path)
	if err != nil {
		t.Fatalf("nats-server rejects the generated config: %v\n%s", err, conf)
	}
	// Every user, and the lease service's fleet connection beside it,
	// each in its account with its grant.
	type want struct {
		role    leasebus.Role
		account string
	}
	wants := map[string]want{}
	for _, u := range users {
		wants[u.Nkey] = want{u.Role, leasebus.AccountOf(u.Role)}
		if u.Role == leasebus.RoleService {
			wants[u.FleetNkey] = want{leasebus.RoleServiceFleet, leasebus.FleetAccount}
		}
	}
	if len(opts.Nkeys) != len(wants) {
		t.Fatalf("%d nkey users parsed, want %d", len(opts.Nkeys), len(wants))
	}
	for _, u := range opts.Nkeys {
		w, ok := wants[u.Nkey]
		if !ok {
			t.Errorf("parsed a user %s nobody asked for", u.Nkey)
			continue
		}
		g, _ := leasebus.GrantOf(w.role, u.Nkey)
		if u.Account == nil || u.Account.Name != w.account {
			t.Errorf("user %s (%s) is in account %v, want %s", u.Nkey, w.role, u.Account, w.account)
		}
		if !slices.Equal(u.Permissions.Publish.Allow, g.Publish) || !slices.Equal(u.Permissions.Subscribe.Allow, g.Subscribe) {
			t.Errorf("user %s parsed as %+v %+v, want %s %+v %+v", u.Nkey, u.Permissions.Publish, u.Permissions.Subscribe, w.role, g.Publish, g.Subscribe)
		}
	}
}
