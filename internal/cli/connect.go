package cli

import (
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/leasebus"
)

// connectTimeout bounds dialing the bus and its handshake.
const connectTimeout = leasebus.ConnectTimeout

// EnvCreds names the environment variable that selects the bus
// credentials, like --creds.
const EnvCreds = "FENCELINE_CREDS"

// busCreds is the credential file a command connects with.
type busCreds = leasebus.BusCreds

// credsSetting returns --creds, else $FENCELINE_CREDS, and its source.
func (a *app) credsSetting() (path, source string) {
	if a.credsFlag != "" {
		return a.credsFlag, "--creds"
	}
	if a.cfg.Creds != "" {
		return a.cfg.Creds, EnvCreds
	}
	return "", ""
}

// credsToHide are the bus credentials --creds or $FENCELINE_CREDS names,
// for the guard to hide from the agent (see leasebus.CredsToHide); the
// default bus's are in the state dir, hidden anyway.
func (a *app) credsToHide() []string {
	p, _ := a.credsSetting()
	return leasebus.CredsToHide(p)
}

// defaultCredsDir is where the embedded default bus keeps its credentials.
func (a *app) defaultCredsDir() string { return leasebus.CredsDirOf(leasebus.StoreDirIn(a.stateDir)) }

// credsFor picks the credentials of role from --creds or $FENCELINE_CREDS,
// else the default bus's (see leasebus.ChooseCreds).
func (a *app) credsFor(role leasebus.Role) (busCreds, error) {
	p, source := a.credsSetting()
	return leasebus.ChooseCreds(p, source, a.defaultCredsDir(), role)
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
	nc, err := leasebus.Dial(url, source, bc, append([]nats.Option{nats.Name("fenceline-cli")}, opts...)...)
	if err != nil {
		return nil, a.dialError(err)
	}
	return nc, nil
}

// dialError words a failed leasebus.Dial for the command line: what to
// pass or start.
func (a *app) dialError(err error) error {
	var refused *leasebus.CredsRefusedError
	var noBus *leasebus.NoBusError
	switch {
	case errors.As(err, &refused):
		if refused.Creds.Path == "" {
			return fmt.Errorf("%w: pass --creds PATH (a role's .nk file or the bus's credentials directory) or set %s; the embedded bus writes its credentials to <store>/creds on first start", refused, EnvCreds)
		}
		return fmt.Errorf("%w; they are not among that bus's users (credentials of another bus, or a store made anew?): pass that bus's credentials with --creds PATH or %s (the embedded bus keeps them in <store>/creds)", refused, EnvCreds)
	case errors.As(err, &noBus):
		if noBus.Source == "" && noBus.URL == a.defaultURL {
			return fmt.Errorf("no bus at %s: start one with \"fenceline bus serve\" (or set --nats/%s)", noBus.URL, EnvNATS)
		}
		hint := "check the URL"
		if hp := noBus.HostPort(); hp != "" {
			hint += fmt.Sprintf(", or start a bus there with \"fenceline bus serve --listen %s\"", hp)
		}
		return fmt.Errorf("%w; %s", noBus, hint)
	}
	return err
}

// holderConnOptions are the options of a long-lived holder's connection:
// it reconnects forever, soon after a drop.
func holderConnOptions() []nats.Option { return leasebus.HolderConnOptions() }

// session is a connection to the bus with a lease client on it.
type session struct {
	nc     *nats.Conn
	client *leasebus.Client
	url    string
	// leave, when set, removes the identity enrolled for this session
	// (dialEphemeral), and keeping stops keeping it heard; Close calls
	// them.
	leave, keeping func()
}

func (s *session) Close() {
	if s.keeping != nil {
		s.keeping()
		s.keeping = nil
	}
	if s.leave != nil {
		s.leave()
		s.leave = nil
	}
	s.nc.Close()
}

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
