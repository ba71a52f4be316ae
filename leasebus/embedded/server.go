package embedded

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/nats-io/nats-server/v2/server"

	"github.com/fenceline/fenceline/internal/lograte"
	"github.com/fenceline/fenceline/leasebus"
)

// StartServer starts an in-process NATS server with JetStream on a file
// store that fsyncs every write before acknowledging it (SyncAlways: the
// default interval loses acknowledged writes on power loss).
func StartServer(cfg leasebus.ServerConfig) (*server.Server, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("bus config: %w", err)
	}
	if cfg.StoreDir == "" {
		return nil, fmt.Errorf("bus config: %w", &leasebus.FieldError{Field: "StoreDir", Err: errors.New("empty: the bus needs a store directory")})
	}
	withDefaults(&cfg)
	if err := os.MkdirAll(cfg.StoreDir, 0o700); err != nil {
		if errors.Is(err, syscall.EROFS) {
			return nil, fmt.Errorf("%w: cannot create %s: remount it read-write or give the bus a writable store directory", leasebus.ErrStoreReadOnly, cfg.StoreDir)
		}
		return nil, fmt.Errorf("bus store %s: %w", cfg.StoreDir, err)
	}
	// JetStream fails on a store it cannot write only deep in its start,
	// and the server then just never becomes ready: say what is wrong.
	if err := leasebus.CheckStoreDir(cfg.StoreDir); err != nil {
		return nil, fmt.Errorf("start bus: %w", err)
	}
	if err := moveToServiceAccount(cfg.StoreDir, cfg.ClusterName != ""); err != nil {
		return nil, fmt.Errorf("start bus: %w", err)
	}
	opts, auth, err := serverOptions(&cfg)
	if err != nil {
		return nil, err
	}
	s, err := server.NewServer(opts)
	if err != nil {
		return nil, fmt.Errorf("start bus: %w", err)
	}
	auth.srv.Store(s)
	auths.Store(s, auth)
	last := &lastError{log: cfg.Log}
	if cfg.Debug {
		s.ConfigureLogger()
	} else {
		s.SetLoggerV2(last, false, false, false) // its last error says why a start failed
	}
	go s.Start()
	if !s.ReadyForConnections(readyWait) {
		s.Shutdown()
		why := "port in use? another `fenceline bus serve` running?"
		if e := last.get(); e != "" {
			why = "the server said: " + e
		}
		return nil, fmt.Errorf("start bus on %s: not ready after %s (%s)", cfg.Listen, readyWait, why)
	}
	return s, nil
}

// readyWait bounds how long a starting server may take to listen: a
// clustered one recovering its JetStream store on a busy machine takes
// seconds.
const readyWait = 45 * time.Second

// lastError is the embedded server's logger when it does not log on its
// own: it keeps the last warning or error, and hands the server's lines
// on to log, if any, as slog records: warnings and errors as such, a
// notice that the server is falling behind as a warning, other notices
// at debug level.
type lastError struct {
	log *slog.Logger // nil: nothing passed on
	mu  sync.Mutex
	msg string
}

// behind marks the server's notices that say it cannot keep up: an
// operator must see them, not only its debug log.
var behind = []string{"Slow Consumer", "Readloop processing time", "queue limit"}

func (l *lastError) pass(level slog.Level, format string, v ...any) {
	if l.log == nil || !l.log.Enabled(context.Background(), level) {
		return
	}
	l.log.Log(context.Background(), level, fmt.Sprintf(format, v...), "component", "nats-server", lograte.KindKey, natsKind(format))
}

// natsKind is the kind of a server line of format (see internal/lograte):
// a client's lines start with its address, connection id, and its name and
// user quoted, which the client picks; without the quoted parts and with
// its numbers as one, every client's line of one kind is one kind.
func natsKind(format string) string {
	var b strings.Builder
	for i := 0; i < len(format); i++ {
		c := format[i]
		if c != '"' {
			b.WriteByte(c)
			continue
		}
		for i++; i < len(format) && format[i] != '"'; i++ { // to the closing quote (%q escapes inner ones)
			if format[i] == '\\' {
				i++
			}
		}
	}
	return lograte.Normalize(b.String())
}

func (l *lastError) set(format string, v ...any) {
	l.mu.Lock()
	l.msg = fmt.Sprintf(format, v...)
	l.mu.Unlock()
}

func (l *lastError) get() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.msg
}

func (l *lastError) Noticef(format string, v ...any) {
	level := slog.LevelDebug
	for _, b := range behind {
		if strings.Contains(format, b) {
			level = slog.LevelWarn
			break
		}
	}
	l.pass(level, format, v...)
}
func (l *lastError) Debugf(string, ...any) {}
func (l *lastError) Tracef(string, ...any) {}
func (l *lastError) Warnf(format string, v ...any) {
	l.set(format, v...)
	l.pass(slog.LevelWarn, format, v...)
}
func (l *lastError) Errorf(format string, v ...any) {
	l.set(format, v...)
	l.pass(slog.LevelError, format, v...)
}
func (l *lastError) Fatalf(format string, v ...any) {
	l.set(format, v...)
	l.pass(slog.LevelError, format, v...)
}

func withDefaults(cfg *leasebus.ServerConfig) {
	if cfg.Listen == "" {
		cfg.Listen = leasebus.DefaultListen
	}
	if cfg.Name == "" {
		cfg.Name = "fenceline"
	}
	if cfg.RoutePingInterval == 0 {
		cfg.RoutePingInterval = leasebus.DefaultRoutePingInterval
	}
	if cfg.RoutePingsOut == 0 {
		cfg.RoutePingsOut = leasebus.DefaultRoutePingsOut
	}
}

// ReloadUsers has srv, started by StartServer(cfg), read its users again
// (the identities enrolled in or removed from cfg.CredsDir since): a user
// no longer there is disconnected at once and refused from then on; the
// others keep their connections. cfg.Users, when set, stays as it is. The
// server's configuration is not reloaded (identityAuth says why).
func ReloadUsers(srv *server.Server, cfg leasebus.ServerConfig) error {
	withDefaults(&cfg)
	a, ok := auths.Load(srv)
	if !ok {
		return fmt.Errorf("reload the bus's users: not a server StartServer started")
	}
	users, err := serverUsers(&cfg)
	if err != nil {
		return err
	}
	if err := a.(*identityAuth).set(users); err != nil {
		return fmt.Errorf("reload the bus's users: %w", err)
	}
	return nil
}

// serverUsers are cfg's users, read now: cfg.Users, else every identity of
// cfg.CredsDir (leasebus.ServerUsers).
func serverUsers(cfg *leasebus.ServerConfig) ([]leasebus.ServerUser, error) {
	if len(cfg.Users) > 0 {
		return cfg.Users, nil
	}
	if cfg.CredsDir == "" {
		cfg.CredsDir = leasebus.CredsDirOf(cfg.StoreDir)
	}
	return leasebus.ServerUsers(cfg.CredsDir)
}

// serverOptions are the server options cfg (defaults filled in) describes:
// the bus's accounts, and its identities (read now) admitted by an
// identityAuth.
func serverOptions(cfg *leasebus.ServerConfig) (*server.Options, *identityAuth, error) {
	users, err := serverUsers(cfg)
	if err != nil {
		return nil, nil, err
	}
	auth := &identityAuth{}
	if err := auth.set(users); err != nil {
		return nil, nil, fmt.Errorf("bus users: %w", err)
	}
	// The accounts are the configuration `bus creds` prints for any other
	// server (there with the users in them), parsed by nats-server's own
	// parser: one source for both.
	conf, err := leasebus.AuthConfig(nil)
	if err != nil {
		return nil, nil, fmt.Errorf("bus accounts: %w", err)
	}
	opts := &server.Options{}
	if err := opts.ProcessConfigString(conf); err != nil {
		return nil, nil, fmt.Errorf("bus accounts: the configuration does not parse: %w", err)
	}
	opts.CustomClientAuthentication = auth
	opts.AlwaysEnableNonce = true // the clients sign it with their nkeys
	host, port, _ := splitHostPort(cfg.Listen)
	opts.ServerName = cfg.Name
	opts.Host, opts.Port = host, port
	opts.JetStream = true
	opts.StoreDir = cfg.StoreDir
	opts.SyncAlways = true
	opts.MaxPayload = 8 << 20 // room for large repo snapshots
	opts.NoSigs = true
	opts.NoLog = !cfg.Debug
	// A client should notice a dead bus quickly.
	opts.PingInterval = 10 * time.Second
	if cfg.ClusterName != "" {
		chost, cport, _ := splitHostPort(cfg.ClusterListen)
		opts.Cluster.Name = cfg.ClusterName
		opts.Cluster.Host = chost
		opts.Cluster.Port = cport
		// A node cut off or paused answers no route PING. The others drop
		// its routes after RoutePingsOut unanswered ones, and with them
		// its interest: its lease service instance leaves the queue group,
		// and the requests NATS would have handed it (a member at random)
		// or a standby forwarded to it (its primary) are answered "no
		// responders" at once instead of vanishing. At the client
		// interval (10 s, two out) that took 20-30 s; by default now
		// 6-8 s, about as long as the cluster's own raft elections take
		// to notice.
		opts.Cluster.PingInterval = cfg.RoutePingInterval
		opts.Cluster.MaxPingsOut = cfg.RoutePingsOut
		opts.Cluster.Advertise = cfg.ClusterAdvertise
		for _, r := range cfg.Routes {
			u, _ := url.Parse(r)
			opts.Routes = append(opts.Routes, u)
		}
		// Sorted, as a reload would sort them (nats-server's
		// ReloadOptions sorts the running options' routes in place while
		// its route-soliciting goroutines read them); the bus no longer
		// reloads for its users (identityAuth), but keeps them so.
		slices.SortFunc(opts.Routes, func(a, b *url.URL) int { return strings.Compare(a.String(), b.String()) })
	}
	return opts, auth, nil
}

// splitHostPort splits a host:port the config validated; port 0 becomes
// -1, with which nats-server picks a free port.
func splitHostPort(hp string) (string, int, error) {
	host, p, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(p)
	if err != nil || port < -1 || port > 65535 {
		return "", 0, fmt.Errorf("bad port %q", p)
	}
	if port == 0 {
		port = -1
	}
	return host, port, nil
}

// moveToServiceAccount moves the streams of a store made before the bus
// had accounts (everything in NATS's global account, "$G") into the
// service account, where the lease service now finds them. A single
// server's file store keeps each account's streams in a directory of its
// own, so the move is a rename; a cluster's nodes also name the account in
// their replicated assignments, which a rename cannot change.
func moveToServiceAccount(storeDir string, clustered bool) error {
	old := filepath.Join(storeDir, "jetstream", "$G")
	if _, err := os.Stat(filepath.Join(old, "streams")); err != nil {
		return nil // nothing there (or unreadable: the server says so)
	}
	dst := filepath.Join(storeDir, "jetstream", leasebus.ServiceAccount)
	if _, err := os.Stat(dst); err == nil {
		return nil // moved already; what is left in $G is not read
	}
	if clustered {
		return &leasebus.FieldError{Field: "StoreDir", Err: fmt.Errorf("%s holds the lease streams in NATS's global account, from a fenceline before the bus had accounts: a cluster cannot move them; start the cluster on a new store (leases held then are taken again; keep the old store for its audit)", storeDir)}
	}
	if err := os.Rename(old, dst); err != nil {
		return fmt.Errorf("move the lease streams of %s into the service account: %w", storeDir, err)
	}
	return nil
}
