package cli

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// config is everything fenceline takes from its environment. Main reads it
// once (configFromEnv) and the commands hand what each package needs to it
// through that package's config struct (leasebus.ServerConfig.StoreDir,
// attempt.Spec.FencelineStateDir, sidecar.FenceOptions...): nothing below
// the command tree reads the environment, so tests build a config and run
// the command tree in parallel (gVisor's runsc/config is the model).
type config struct {
	// StateDir is fenceline's per-user state directory:
	// $XDG_STATE_HOME/fenceline, else ~/.local/state/fenceline.
	StateDir string
	// Home is $HOME, against which --private-state paths are read.
	Home string
	// User is $USER, the user of the default agent id
	// (leasebus.DefaultAgentID).
	User string
	// NATS is $FENCELINE_NATS: the bus when --nats is not given.
	NATS string
	// Creds is $FENCELINE_CREDS: the bus credentials when --creds is not
	// given.
	Creds string
	// UIToken is $FENCELINE_UI_TOKEN: the run UI's token off loopback.
	UIToken string
	// AdminToken is $FENCELINE_ADMIN_TOKEN: the sidecar's admin API token
	// when --admin-token-file is not given.
	AdminToken string
	// GitUpstreamHeader is $FENCELINE_GIT_UPSTREAM_HEADER: one more
	// --git-upstream-header, kept off the command line.
	GitUpstreamHeader string
	// DemoPostgres is $FENCELINE_TEST_PG: a running Postgres for the demo.
	DemoPostgres string
	// PushOptions are the push options git gives "fenceline hook" as its
	// pre-receive hook (GIT_PUSH_OPTION_*, gitproxy.PushOptionsFrom).
	PushOptions []string
}

// configFromEnv reads config from the environment through getenv
// (os.Getenv in Main).
func configFromEnv(getenv func(string) string) config {
	trim := func(k string) string { return strings.TrimSpace(getenv(k)) }
	return config{
		StateDir:          stateDirFrom(getenv("XDG_STATE_HOME"), getenv("HOME")),
		Home:              getenv("HOME"),
		User:              getenv("USER"),
		NATS:              trim(EnvNATS),
		Creds:             trim(EnvCreds),
		UIToken:           getenv(EnvUIToken),
		AdminToken:        trim(sidecar.EnvAdminToken),
		GitUpstreamHeader: getenv(envGitUpstreamHeader),
		DemoPostgres:      getenv(envDemoPostgres),
		PushOptions:       gitproxy.PushOptionsFrom(getenv),
	}
}

// stateDirFrom is fenceline's state dir given $XDG_STATE_HOME and $HOME.
func stateDirFrom(xdgStateHome, home string) string {
	switch {
	case xdgStateHome != "":
		return filepath.Join(xdgStateHome, "fenceline")
	case home != "":
		return filepath.Join(home, ".local", "state", "fenceline")
	}
	return filepath.Join(os.TempDir(), "fenceline-state")
}

// settingHint names the CLI's settings that would change the outcome of
// a leasebus error, which speaks of credentials and buses, not of flags.
func settingHint(err error) string {
	switch {
	case errors.Is(err, leasebus.ErrForbidden):
		return " (--creds or $" + EnvCreds + ")"
	case leasebus.NoService(err):
		return " (--nats or $" + EnvNATS + ")"
	}
	return ""
}

// fieldFlags names the command line flag of each config field the packages
// name in their errors (leasebus.FieldError).
var fieldFlags = map[string]string{
	"Listen":            "--listen",
	"StoreDir":          "--store",
	"Name":              "--name",
	"ClusterName":       "--cluster-name",
	"ClusterListen":     "--cluster-listen",
	"ClusterAdvertise":  "--cluster-advertise",
	"RoutePingInterval": "--route-ping-interval",
	"RoutePingsOut":     "--route-pings-out",
	"Routes":            "--routes",
	"Replicas":          "--replicas",
}

// flagError words a package's error about a config field in terms of the
// flag that sets it: "--cluster-listen: ..." for leasebus's
// "ClusterListen: ...". Other errors are returned as they are.
func flagError(err error) error {
	var fe *leasebus.FieldError
	if !errors.As(err, &fe) {
		return err
	}
	flag, ok := fieldFlags[fe.Field]
	if !ok {
		return err
	}
	msg := fe.Err.Error()
	for field, f := range fieldFlags { // the fields the message names beside its own
		msg = strings.ReplaceAll(msg, "("+field+")", "("+f+")")
		msg = strings.ReplaceAll(msg, "("+field+";", "("+f+";")
	}
	return &flagErr{flag: flag, msg: msg, err: err}
}

// flagErr is a field error reworded for the command line; it still
// unwraps to the package's error (errors.Is finds its sentinels).
type flagErr struct {
	flag, msg string
	err       error
}

func (e *flagErr) Error() string { return fmt.Sprintf("%s: %s", e.flag, e.msg) }
func (e *flagErr) Unwrap() error { return e.err }
