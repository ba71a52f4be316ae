package cli

import (
	"errors"
	"fmt"
	"net/url"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
)

// connectTimeout bounds dialing the bus and its handshake: a CLI command
// never hangs on a bus that is not there.
const connectTimeout = 2 * time.Second

// connect dials the bus at url (named by source: "--nats", the env
// variable, a credential file, or "" for the default) with a short timeout.
func (a *app) connect(url, source string, opts ...nats.Option) (*nats.Conn, error) {
	opts = append([]nats.Option{
		nats.Name("fenceline-cli"),
		nats.Timeout(connectTimeout),
	}, opts...)
	nc, err := nats.Connect(url, opts...)
	if err == nil {
		return nc, nil
	}
	return nil, noBusError(url, source, a.defaultURL, err)
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

// dial connects to the bus chosen by the global flags.
func (a *app) dial() (*session, error) {
	url, source := a.busURL()
	return a.dialURL(url, source)
}

func (a *app) dialURL(url, source string) (*session, error) {
	nc, err := a.connect(url, source)
	if err != nil {
		return nil, err
	}
	c := leasebus.NewClient(nc)
	c.Timeout = 5 * time.Second
	c.Tries = 2
	return &session{nc: nc, client: c, url: url}, nil
}
