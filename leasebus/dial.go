package leasebus

import (
	"errors"
	"fmt"
	"io/fs"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/nats-io/nats.go"
)

// ConnectTimeout bounds dialing the bus and its handshake (Dial): a
// command never hangs on a bus that is not there.
const ConnectTimeout = 2 * time.Second

// BusCreds is the credential file a connection to the bus uses, and where
// the choice came from (ChooseCreds).
type BusCreds struct {
	Path   string // "" when none was found: connect without credentials
	Source string // where the choice came from: a flag, the env, the default dir
	Looked string // where the default was looked for, when none was found
	Role   Role
}

// ChooseCreds picks the credentials of role. setting (named by source) is
// a credentials directory, from which <role>.nk is taken (or the file of a
// role that may more: RolesCovering), or one file used for every role.
// An empty setting means <role>.nk in defaultDir (the default bus's
// credentials directory) when it exists, else none.
func ChooseCreds(setting, source, defaultDir string, role Role) (BusCreds, error) {
	if setting == "" {
		path := filepath.Join(defaultDir, CredsFile(role))
		if _, err := os.Stat(path); err != nil {
			return BusCreds{Role: role, Looked: path}, nil
		}
		return BusCreds{Path: path, Source: "the default bus's credentials", Role: role}, nil
	}
	fi, err := os.Stat(setting)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return BusCreds{}, fmt.Errorf("bus credentials %s (from %s) do not exist: pass a role's .nk file or a bus's credentials directory (the embedded bus writes one to <store>/creds on first start)", setting, source)
	case err != nil:
		return BusCreds{}, fmt.Errorf("bus credentials (from %s): %w", source, err)
	case fi.IsDir():
		// The least role that may, else one that may more (a person's
		// directory may hold operator.nk alone).
		for _, r := range RolesCovering(role) {
			path := filepath.Join(setting, CredsFile(r))
			if _, err := os.Stat(path); err == nil {
				return BusCreds{Path: path, Source: source, Role: r}, nil
			}
		}
		return BusCreds{}, fmt.Errorf("this command needs the bus's %s credentials, and %s (from %s) holds none that may (%s)", role, setting, source, credsFiles(RolesCovering(role)))
	}
	return BusCreds{Path: setting, Source: source, Role: role}, nil
}

// RolesCovering lists role and the roles that may everything it may, least
// privileged first.
func RolesCovering(role Role) []Role {
	switch role {
	case RoleViewer, RoleHolder:
		return []Role{role, RoleOperator, RoleService}
	case RoleOperator:
		return []Role{role, RoleService}
	}
	return []Role{role}
}

func credsFiles(roles []Role) string {
	names := make([]string, len(roles))
	for i, r := range roles {
		names[i] = CredsFile(r)
	}
	return strings.Join(names, ", ")
}

// CredsToHide lists the credentials a guarded agent must not read when
// setting names the bus credentials (a file or a directory): setting
// itself and, when it is a file (usually one role's file in a bus's
// credentials directory), every other credential beside it (each role's
// <role>.nk, the enrolled identities' seeds, any other *.nk or *.creds),
// or the agent could read the
// service's seed. An empty setting hides nothing.
func CredsToHide(setting string) []string {
	if setting == "" {
		return nil
	}
	out := []string{setting}
	if fi, err := os.Stat(setting); err == nil && fi.IsDir() {
		return out
	}
	dir := filepath.Dir(setting)
	out = append(out, HoldersDir(dir)) // the seeds `bus enroll` keeps
	for _, r := range Roles {
		out = append(out, filepath.Join(dir, CredsFile(r)))
	}
	for _, pat := range []string{"*.nk", "*.creds"} {
		m, _ := filepath.Glob(filepath.Join(dir, pat))
		out = append(out, m...)
	}
	return out
}

// CredsRefusedError is a bus that refused a connection's credentials (or
// their absence).
type CredsRefusedError struct {
	URL   string
	Creds BusCreds
	Err   error // nats.ErrAuthorization, ErrAuthExpired or ErrAuthRevoked
}

func (e *CredsRefusedError) Error() string {
	if e.Creds.Path == "" {
		return fmt.Sprintf("the bus at %s requires credentials (%v), and none were found (looked for %s)", e.URL, e.Err, e.Creds.Looked)
	}
	return fmt.Sprintf("the bus at %s refused the credentials %s (from %s, for the %s role): %v", e.URL, e.Creds.Path, e.Creds.Source, e.Creds.Role, e.Err)
}

func (e *CredsRefusedError) Unwrap() error { return e.Err }

// NoBusError is a dial that found no bus at URL.
type NoBusError struct {
	URL    string
	Source string // where URL came from ("" for the default)
	Err    error
}

func (e *NoBusError) Error() string {
	from := ""
	if e.Source != "" {
		from = " (from " + e.Source + ")"
	}
	return fmt.Sprintf("no bus at %s%s: %s", e.URL, from, e.Reason())
}

func (e *NoBusError) Unwrap() error { return e.Err }

// Reason says in words why the dial failed.
func (e *NoBusError) Reason() string {
	switch {
	case errors.Is(e.Err, nats.ErrNoServers):
		return "nothing answers (connection refused)"
	case errors.Is(e.Err, nats.ErrTimeout):
		return fmt.Sprintf("no answer within %s", ConnectTimeout)
	default:
		return e.Err.Error()
	}
}

// HostPort is the host:port of URL, or "" when it has none.
func (e *NoBusError) HostPort() string {
	p, err := url.Parse(e.URL)
	if err != nil || p.Host == "" {
		return ""
	}
	return p.Host
}

// Dial connects to the bus at url (named by source, for errors) with the
// credentials creds (none when creds.Path is empty) within
// ConnectTimeout, then opts. A bus that refuses the credentials is a
// *CredsRefusedError, no bus a *NoBusError.
func Dial(url, source string, creds BusCreds, opts ...nats.Option) (*nats.Conn, error) {
	base := []nats.Option{nats.Timeout(ConnectTimeout)}
	if creds.Path != "" {
		c, err := LoadCreds(creds.Path)
		if err != nil {
			return nil, fmt.Errorf("%w (from %s)", err, creds.Source)
		}
		copts, err := c.Options()
		if err != nil {
			return nil, err
		}
		base = append(base, copts...)
	}
	nc, err := nats.Connect(url, append(base, opts...)...)
	if err != nil && caughtByReload(err) {
		// The embedded bus reloads its users when an identity comes or
		// leaves, and nats-server then fails every connection still in
		// its handshake (refused, or its socket closed mid-write). Once
		// more after the reload; credentials it really refuses are
		// refused again.
		time.Sleep(reloadRetry)
		nc, err = nats.Connect(url, append(base, opts...)...)
	}
	if err == nil {
		return nc, nil
	}
	if errors.Is(err, nats.ErrAuthorization) || errors.Is(err, nats.ErrAuthExpired) || errors.Is(err, nats.ErrAuthRevoked) {
		return nil, &CredsRefusedError{URL: url, Creds: creds, Err: err}
	}
	return nil, &NoBusError{URL: url, Source: source, Err: err}
}

// reloadRetry is how long Dial waits before its second try.
const reloadRetry = 250 * time.Millisecond

// caughtByReload reports whether a connect failed as one caught by a
// reload of the bus's users does: refused, or its socket closed during
// the handshake.
func caughtByReload(err error) bool {
	return errors.Is(err, nats.ErrAuthorization) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET)
}

// Reconnect settings of a holder's connection (HolderConnOptions). While
// the connection is down the holder fails writes closed, and after a
// reconnect it re-checks its lease before the next write: the sooner it is
// back, the shorter the stall, and a revoke made meanwhile is found at
// once. nats.go's defaults (2 s between tries to one server, 2 min between
// pings) would stall writes for seconds after a bus restart and notice a
// silent, half-open connection only after minutes.
//
// A connection is given up as stale once holderMaxPingsOut pings in a row
// go unanswered: 8–10 s. A holder does not need the connection's pings to
// stay safe (it stops writing after its Silence without the service's
// word); the pings only find a connection that died without a word. Given
// up sooner (2 pings, 4–6 s, as it was), a bus slowed for a few
// seconds — a fleet at its machines' limit — had hundreds of connections
// dropped and made again at once, each reconnect costing the servers more,
// and their sessions silent past the grace: 285 and 6,524 leases reclaimed
// in two runs at 10,000 leases (docs/benchmarks.md). A connection that is
// only slow catches up instead, and its keepalives, late, still arrive.
const (
	holderReconnectWait   = 100 * time.Millisecond
	holderReconnectJitter = 50 * time.Millisecond
	holderPingInterval    = 2 * time.Second
	holderMaxPingsOut     = 4
)

// ServiceConnOptions are the keepalive of the lease service's connections:
// one whose server froze or went silent is given up, as a holder's is,
// and made again to another server of the cluster, rather than after
// nats.go's default of minutes; meanwhile the instance neither takes nor
// renews the primary's claim (hearsFleet).
func ServiceConnOptions() []nats.Option {
	return []nats.Option{
		nats.PingInterval(holderPingInterval),
		nats.MaxPingsOutstanding(holderMaxPingsOut),
	}
}

// HolderConnOptions are the options of a long-lived holder's connection
// (a runner's, a sidecar's): it reconnects forever, soon after a drop.
func HolderConnOptions() []nats.Option {
	return []nats.Option{
		nats.MaxReconnects(-1),
		nats.ReconnectWait(holderReconnectWait),
		nats.ReconnectJitter(holderReconnectJitter, holderReconnectJitter),
		nats.PingInterval(holderPingInterval),
		nats.MaxPingsOutstanding(holderMaxPingsOut),
	}
}
