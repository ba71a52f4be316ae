package embedded

import (
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/fenceline/fenceline/internal/lograte"
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

// syncBuffer is a log sink the server's goroutines may write while the
// test reads it.
type syncBuffer struct {
	mu    sync.Mutex
	b     strings.Builder
	wrote chan struct{} // a write since the last receive
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	select {
	case s.wrote <- struct{}{}:
	default:
	}
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// An operator sees what the embedded server warns of: its errors (here a
// client without credentials) reach the node's log, and so does a notice
// that it cannot keep up; its everyday notices stay at debug level.
func TestServerLogReachesTheNodeLog(t *testing.T) {
	out := syncBuffer{wrote: make(chan struct{}, 1)}
	log := slog.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelInfo}))
	srv, err := StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	if nc, err := nats.Connect(srv.ClientURL(), nats.NoReconnect()); err == nil {
		nc.Close()
		t.Fatal("a client without credentials connected")
	}
	timeout := time.After(10 * time.Second)
	for !strings.Contains(out.String(), "level=ERROR") {
		select {
		case <-out.wrote:
		case <-timeout:
			t.Fatalf("the server's refusal of a client without credentials is not in the node's log:\n%s", out.String())
		}
	}
	if got := out.String(); !strings.Contains(got, "component=nats-server") || strings.Contains(got, "Starting nats-server") {
		t.Fatalf("want the server's error, marked as the server's, and none of its start notices at info level:\n%s", got)
	}

	l := &lastError{log: log}
	l.Noticef("Slow Consumer Detected: WriteDeadline of %v exceeded with %d chunks of %d total bytes.", time.Second, 3, 100)
	l.Noticef("Server is ready")
	if got := out.String(); !strings.Contains(got, `level=WARN msg="Slow Consumer Detected`) || strings.Contains(got, "Server is ready") {
		t.Fatalf("want a slow consumer as a warning and an everyday notice left out:\n%s", got)
	}
	if l.get() != "" {
		t.Fatalf("a notice is not the server's last error: %q", l.get())
	}
}

// A stranger that connects again and again with credentials the bus does
// not take, under a new client name and user each time, does not flood the
// node's log: through internal/lograte (the CLI's logger) the server's
// refusals, which differ from one connection to the next in numbers (port,
// connection id) and in what the stranger chose (name, user), are one kind;
// five go through in the interval, and the next record says how many more
// there were.
func TestRefusedConnectionsDoNotFloodTheLog(t *testing.T) {
	out := syncBuffer{wrote: make(chan struct{}, 1)}
	now := time.Unix(1_700_000_000, 0)
	var clockMu sync.Mutex
	clock := func() time.Time { clockMu.Lock(); defer clockMu.Unlock(); return now }
	var errorsLogged atomic.Int64 // every ERROR record the server logged, before the limit
	limited := lograte.New(slog.NewTextHandler(&out, &slog.HandlerOptions{Level: slog.LevelInfo}),
		lograte.Options{Burst: 5, Interval: time.Minute, Now: clock})
	log := slog.New(&countErrors{next: limited, n: &errorsLogged})
	srv, err := StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir(), Log: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	const attempts = 40
	for i := range attempts {
		// A name and a user of the stranger's choosing in each line.
		who := strings.Repeat(string(rune('a'+i%26)), 1+i)
		if nc, err := nats.Connect(srv.ClientURL(), nats.NoReconnect(), nats.Name("client-"+who), nats.UserInfo("user-"+who, "pw")); err == nil {
			nc.Close()
			t.Fatalf("connection %d without credentials was taken", i)
		}
	}
	deadline := time.After(10 * time.Second)
	for errorsLogged.Load() < attempts {
		select {
		case <-out.wrote:
		case <-deadline:
			t.Fatalf("the server logged %d errors for %d refused connections", errorsLogged.Load(), attempts)
		case <-time.After(10 * time.Millisecond): // suppressed records write nothing
		}
	}
	logged := errorsLogged.Load()
	if n := strings.Count(out.String(), "level=ERROR"); n != 5 {
		t.Fatalf("%d of the server's %d errors written in one interval, want 5:\n%s", n, logged, out.String())
	}
	clockMu.Lock()
	now = now.Add(time.Minute)
	clockMu.Unlock()
	log.Info("marker")
	m := regexp.MustCompile(`suppressed=(\d+)`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("no count of the suppressed errors:\n%s", out.String())
	}
	if n, _ := strconv.Atoi(m[1]); int64(n) != logged-5 {
		t.Fatalf("the log counts %d suppressed of %d errors, want %d", n, logged, logged-5)
	}
}

// countErrors counts the ERROR records it passes on.
type countErrors struct {
	next slog.Handler
	n    *atomic.Int64
}

func (c *countErrors) Enabled(ctx context.Context, l slog.Level) bool { return c.next.Enabled(ctx, l) }

func (c *countErrors) Handle(ctx context.Context, r slog.Record) error {
	if r.Level == slog.LevelError {
		c.n.Add(1)
	}
	return c.next.Handle(ctx, r)
}

func (c *countErrors) WithAttrs(as []slog.Attr) slog.Handler {
	return &countErrors{next: c.next.WithAttrs(as), n: c.n}
}

func (c *countErrors) WithGroup(name string) slog.Handler {
	return &countErrors{next: c.next.WithGroup(name), n: c.n}
}

// A client's lines carry its name and user quoted (the client picks them):
// one kind whatever they are, and apart from the client's other kinds.
func TestNATSKindIgnoresWhatTheClientPicks(t *testing.T) {
	a := natsKind(`127.0.0.1:50312 - cid:7 - "v1.37.0:go:runner-1" - "FLEET/runner-1" - Slow Consumer Detected`)
	b := natsKind(`10.0.0.9:61000 - cid:12345 - "v1.37.0:go:x \" - y" - "FLEET/` + strings.Repeat("z", 300) + `" - Slow Consumer Detected`)
	if a != b {
		t.Fatalf("two clients' slow-consumer lines are kinds %q and %q, want one", a, b)
	}
	if c := natsKind(`127.0.0.1:50312 - cid:7 - "v1.37.0:go:runner-1" - "FLEET/runner-1" - authentication error`); c == a {
		t.Fatalf("a slow consumer and an authentication error are one kind %q", c)
	}
}

// A node's route keepalive is what its config says (bus serve
// --route-ping-interval and --route-pings-out), the defaults when it says
// nothing; a single node has no routes to ping.
func TestRoutePingSettings(t *testing.T) {
	t.Parallel()
	clustered := func(interval time.Duration, out int) leasebus.ServerConfig {
		return leasebus.ServerConfig{
			StoreDir: t.TempDir(), CredsDir: t.TempDir(),
			ClusterName: "fl", ClusterListen: "127.0.0.1:6222", Routes: []string{"nats://127.0.0.1:6223"},
			RoutePingInterval: interval, RoutePingsOut: out,
		}
	}
	for _, tc := range []struct {
		name     string
		cfg      leasebus.ServerConfig
		interval time.Duration
		out      int
	}{
		{"defaults", clustered(0, 0), leasebus.DefaultRoutePingInterval, leasebus.DefaultRoutePingsOut},
		{"set", clustered(750*time.Millisecond, 5), 750 * time.Millisecond, 5},
		{"interval only", clustered(10*time.Second, 0), 10 * time.Second, leasebus.DefaultRoutePingsOut},
		{"single node", leasebus.ServerConfig{StoreDir: t.TempDir(), CredsDir: t.TempDir()}, 0, 0},
	} {
		if err := tc.cfg.Validate(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		withDefaults(&tc.cfg)
		opts, _, err := serverOptions(&tc.cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if opts.Cluster.PingInterval != tc.interval || opts.Cluster.MaxPingsOut != tc.out {
			t.Errorf("%s: routes pinged every %s, dropped after %d out; want %s and %d", tc.name, opts.Cluster.PingInterval, opts.Cluster.MaxPingsOut, tc.interval, tc.out)
		}
	}
}
