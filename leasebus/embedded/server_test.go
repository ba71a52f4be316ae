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
	if len(opts.Nkeys) != len(users) {
		t.Fatalf("%d nkey users parsed, want %d", len(opts.Nkeys), len(users))
	}
	for i, u := range opts.Nkeys {
		want, _ := Permissions(users[i].Role, users[i].Nkey)
		if u.Nkey != users[i].Nkey || !slices.Equal(u.Permissions.Publish.Allow, want.Publish.Allow) || !slices.Equal(u.Permissions.Subscribe.Allow, want.Subscribe.Allow) {
			t.Errorf("user %d parsed as %+v %+v, want %s %+v %+v", i, u.Permissions.Publish, u.Permissions.Subscribe, users[i].Role, want.Publish, want.Subscribe)
		}
	}
}
