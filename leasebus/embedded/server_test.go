package embedded

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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

// A store made before the bus had accounts (every stream in NATS's global
// account) is moved into the service account on a single server's start,
// so the lease log survives the upgrade; a cluster's is refused by name.
func TestStoreBeforeAccountsMoves(t *testing.T) {
	dir := t.TempDir()
	old, err := server.NewServer(&server.Options{Host: "127.0.0.1", Port: -1, JetStream: true, StoreDir: dir, NoLog: true, NoSigs: true})
	if err != nil {
		t.Fatal(err)
	}
	go old.Start()
	if !old.ReadyForConnections(10 * time.Second) {
		t.Fatal("old-layout server not ready")
	}
	nc, err := nats.Connect(old.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: leasebus.LogStream, Subjects: []string{"fenceline.log.>"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := js.Publish(ctx, "fenceline.log.k", []byte("a record of before")); err != nil {
		t.Fatal(err)
	}
	nc.Close()
	old.Shutdown()
	old.WaitForShutdown()

	var fe *leasebus.FieldError
	if err := moveToServiceAccount(dir, true); !errors.As(err, &fe) || fe.Field != "StoreDir" || !strings.Contains(err.Error(), "new store") {
		t.Fatalf("a cluster node on an old store: %v, want a refusal naming the field StoreDir and what to do", err)
	}
	srv, err := StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	opts, err := leasebus.RoleOptions(leasebus.CredsDirOf(dir), leasebus.RoleService)
	if err != nil {
		t.Fatal(err)
	}
	svc, err := nats.Connect(srv.ClientURL(), opts...)
	if err != nil {
		t.Fatal(err)
	}
	defer svc.Close()
	sjs, err := jetstream.New(svc)
	if err != nil {
		t.Fatal(err)
	}
	st, err := sjs.Stream(ctx, leasebus.LogStream)
	if err != nil {
		t.Fatalf("the lease log after the move: %v", err)
	}
	m, err := st.GetLastMsgForSubject(ctx, "fenceline.log.k")
	if err != nil || string(m.Data) != "a record of before" {
		t.Fatalf("the record of before: %v %v", m, err)
	}
}
