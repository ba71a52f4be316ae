package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
)

// connectTimeout bounds dialing the bus and its handshake: a CLI command
// never hangs on a bus that is not there.
const connectTimeout = 2 * time.Second

// EnvCreds names the environment variable that selects the bus
// credentials, like --creds.
const EnvCreds = "FENCELINE_CREDS"

// busCreds is the credential file a command connects with.
type busCreds struct {
	path   string // "" when none was found: connect without credentials
	source string // where the choice came from: --creds, the env, the default dir
	looked string // where the default was looked for, when none was found
	role   leasebus.Role
}

// credsSetting returns --creds, else $FENCELINE_CREDS, and its source.
func (a *app) credsSetting() (path, source string) {
	if a.credsFlag != "" {
		return a.credsFlag, "--creds"
	}
	if v := strings.TrimSpace(os.Getenv(EnvCreds)); v != "" {
		return v, EnvCreds
	}
	return "", ""
}

// credsToHide are the bus credentials paths --creds or $FENCELINE_CREDS
// names (a file or a directory), for the guard to hide from the agent; the
// default bus's are in the state dir, hidden anyway. A single file is
// usually one role's file in a bus's credentials directory: the other
// credentials beside it (every role's <role>.nk, any other *.nk or *.creds)
// are hidden too, or a guarded agent could read the service's seed.
func (a *app) credsToHide() []string {
	p, _ := a.credsSetting()
	if p == "" {
		return nil
	}
	out := []string{p}
	if fi, err := os.Stat(p); err == nil && fi.IsDir() {
		return out
	}
	dir := filepath.Dir(p)
	for _, r := range leasebus.Roles {
		out = append(out, filepath.Join(dir, leasebus.CredsFile(r)))
	}
	for _, pat := range []string{"*.nk", "*.creds"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		out = append(out, m...)
	}
	return out
}

// defaultCredsDir is where the embedded default bus keeps its credentials.
func defaultCredsDir() string { return leasebus.CredsDirOf(leasebus.DefaultStoreDir()) }

// credsFor picks the credentials of role: --creds or $FENCELINE_CREDS (a
// credentials directory, from which <role>.nk is taken, or one file used
// for every command), else <role>.nk in the default bus's credentials
// directory when it exists, else none.
func (a *app) credsFor(role leasebus.Role) (busCreds, error) {
	p, source := a.credsSetting()
	if p == "" {
		path := filepath.Join(defaultCredsDir(), leasebus.CredsFile(role))
		if _, err := os.Stat(path); err != nil {
			return busCreds{role: role, looked: path}, nil
		}
		return busCreds{path: path, source: "the default bus's credentials", role: role}, nil
	}
	fi, err := os.Stat(p)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return busCreds{}, fmt.Errorf("bus credentials %s (from %s) do not exist: pass a role's .nk file or a bus's credentials directory (the embedded bus writes one to <store>/creds on first start)", p, source)
	case err != nil:
		return busCreds{}, fmt.Errorf("bus credentials (from %s): %w", source, err)
	case fi.IsDir():
		// The least role that may, else one that may more (a person's
		// directory may hold operator.nk alone).
		for _, r := range rolesCovering(role) {
			path := filepath.Join(p, leasebus.CredsFile(r))
			if _, err := os.Stat(path); err == nil {
				return busCreds{path: path, source: source, role: r}, nil
			}
		}
		return busCreds{}, fmt.Errorf("this command needs the bus's %s credentials, and %s (from %s) holds none that may (%s)", role, p, source, credsFiles(rolesCovering(role)))
	}
	return busCreds{path: p, source: source, role: role}, nil
}

// rolesCovering lists role and the roles that may everything it may, least
// privileged first.
func rolesCovering(role leasebus.Role) []leasebus.Role {
	switch role {
	case leasebus.RoleViewer, leasebus.RoleHolder:
		return []leasebus.Role{role, leasebus.RoleOperator, leasebus.RoleService}
	case leasebus.RoleOperator:
		return []leasebus.Role{role, leasebus.RoleService}
	}
	return []leasebus.Role{role}
}

func credsFiles(roles []leasebus.Role) string {
	names := make([]string, len(roles))
	for i, r := range roles {
		names[i] = leasebus.CredsFile(r)
	}
	return strings.Join(names, ", ")
}

// connect dials the bus at url (named by source: "--nats", the env
// variable, a credential file, or "" for the default) with a short
// timeout, as role (see credsFor).
func (a *app) connect(role leasebus.Role, url, source string, opts ...nats.Option) (*nats.Conn, error) {
	bc, err := a.credsFor(role)
	if err != nil {
		return nil, err
	}
	return a.connectWith(bc, url, source, opts...)
}

func (a *app) connectWith(bc busCreds, url, source string, opts ...nats.Option) (*nats.Conn, error) {
	base := []nats.Option{nats.Name("fenceline-cli"), nats.Timeout(connectTimeout)}
	if bc.path != "" {
		c, err := leasebus.LoadCreds(bc.path)
		if err != nil {
			return nil, fmt.Errorf("%w (from %s)", err, bc.source)
		}
		copts, err := c.Options()
		if err != nil {
			return nil, err
		}
		base = append(base, copts...)
	}
	nc, err := nats.Connect(url, append(base, opts...)...)
	if err == nil {
		return nc, nil
	}
	if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked) {
		return nil, refusedCredsError(url, bc, err)
	}
	return nil, noBusError(url, source, a.defaultURL, err)
}

// refusedCredsError explains a bus that refused the connection's
// credentials (or their absence).
func refusedCredsError(url string, bc busCreds, err error) error {
	if bc.path == "" {
		return fmt.Errorf("the bus at %s requires credentials (%v), and none were found (looked for %s): pass --creds PATH (a role's .nk file or the bus's credentials directory) or set %s; the embedded bus writes its credentials to <store>/creds on first start", url, err, bc.looked, EnvCreds)
	}
	return fmt.Errorf("the bus at %s refused the credentials %s (from %s, for the %s role): %v; they are not among that bus's users (credentials of another bus, or a store made anew?): pass that bus's credentials with --creds PATH or %s (the embedded bus keeps them in <store>/creds)", url, bc.path, bc.source, bc.role, err, EnvCreds)
}

func noBusError(url, source, defaultURL string, err error) error {
	if source == "" && url == defaultURL {
		return fmt.Errorf("no bus at %s: start one with \"fenceline bus serve\" (or set --nats/%s)", url, EnvNATS)
	}
	from := ""
	if source != "" {
		from = " (from " + source + ")"
	}
	hint := "check the URL"
	if hp := hostPort(url); hp != "" {
		hint += fmt.Sprintf(", or start a bus there with \"fenceline bus serve --listen %s\"", hp)
	}
	return fmt.Errorf("no bus at %s%s: %s; %s", url, from, describeDialError(err), hint)
}

func describeDialError(err error) string {
	switch {
	case errors.Is(err, nats.ErrNoServers):
		return "nothing answers (connection refused)"
	case errors.Is(err, nats.ErrTimeout):
		return fmt.Sprintf("no answer within %s", connectTimeout)
	default:
		return err.Error()
	}
}

func hostPort(u string) string {
	p, err := url.Parse(u)
	if err != nil || p.Host == "" {
		return ""
	}
	return p.Host
}

// Reconnect settings of a holder's connection (run, sidecar). While the
// connection is down the holder fails writes closed, and after a reconnect
// it re-checks its lease before the next write: the sooner it is back, the
// shorter the stall, and a revoke made meanwhile is found at once. nats.go's
// defaults (2 s between tries to one server, 2 min between pings) would
// stall writes for seconds after a bus restart and notice a silent,
// half-open connection only after minutes.
const (
	holderReconnectWait   = 100 * time.Millisecond
	holderReconnectJitter = 50 * time.Millisecond
	holderPingInterval    = 2 * time.Second
	holderMaxPingsOut     = 2
)

// holderConnOptions are the options of a long-lived holder's connection:
// it reconnects forever, soon after a drop.
func holderConnOptions() []nats.Option {
	return []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(holderReconnectWait),
		nats.ReconnectJitter(holderReconnectJitter, holderReconnectJitter),
		nats.PingInterval(holderPingInterval),
		nats.MaxPingsOutstanding(holderMaxPingsOut),
	}
}

// session is a connection to the bus with a lease client on it.
type session struct {
	nc     *nats.Conn
	client *leasebus.Client
	url    string
}

func (s *session) Close() { s.nc.Close() }

// dial connects to the bus chosen by the global flags as role.
func (a *app) dial(role leasebus.Role) (*session, error) {
	url, source := a.busURL()
	return a.dialURL(role, url, source)
}

func (a *app) dialURL(role leasebus.Role, url, source string) (*session, error) {
	nc, err := a.connect(role, url, source)
	if err != nil {
		return nil, err
	}
	c := leasebus.NewClient(nc)
	c.Timeout = 5 * time.Second
	c.Tries = 2
	return &session{nc: nc, client: c, url: url}, nil
}
