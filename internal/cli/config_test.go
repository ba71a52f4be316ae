package cli

import (
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/leasebus"
)

// TestConfigFromEnv: the environment is read in one place, into config.
func TestConfigFromEnv(t *testing.T) {
	t.Parallel()
	env := map[string]string{"HOME": "/home/ada", "USER": "ada", EnvNATS: " nats://bus:4222 ", EnvCreds: "/creds\n", EnvUIToken: "ui", envGitUpstreamHeader: "Authorization: x",
		"GIT_PUSH_OPTION_COUNT": "2", "GIT_PUSH_OPTION_0": "fenceline-lease=lease_x", "GIT_PUSH_OPTION_1": "ci.skip"}
	c := configFromEnv(func(k string) string { return env[k] })
	want := config{StateDir: "/home/ada/.local/state/fenceline", Home: "/home/ada", User: "ada", NATS: "nats://bus:4222", Creds: "/creds", UIToken: "ui", GitUpstreamHeader: "Authorization: x",
		PushOptions: []string{"fenceline-lease=lease_x", "ci.skip"}}
	if !reflect.DeepEqual(c, want) {
		t.Errorf("configFromEnv = %+v, want %+v", c, want)
	}
	env["XDG_STATE_HOME"] = "/state"
	if c := configFromEnv(func(k string) string { return env[k] }); c.StateDir != filepath.Join("/state", "fenceline") {
		t.Errorf("state dir with XDG_STATE_HOME: %s", c.StateDir)
	}
	if c := configFromEnv(func(string) string { return "" }); !strings.HasSuffix(c.StateDir, "fenceline-state") {
		t.Errorf("state dir without HOME: %s", c.StateDir)
	}
}

// TestFlagError: a package's error naming a config field is worded as the
// flag that sets it, and still unwraps to the package's error.
func TestFlagError(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		cfg  leasebus.ServerConfig
		want string
	}{
		{leasebus.ServerConfig{ClusterName: "fl"}, "--cluster-listen: a cluster needs a name (--cluster-name), a listen address and routes to its peers (--routes)"},
		{leasebus.ServerConfig{ClusterListen: "127.0.0.1:6222"}, "--cluster-name: "},
		{leasebus.ServerConfig{Listen: "nohostport"}, "--listen: \"nohostport\""},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", Routes: []string{"http://x"}}, "--routes: \"http://x\": want nats://host:port"},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", Routes: []string{"nats://n2:6222"}, ClusterAdvertise: ":6222"}, "--cluster-advertise: \":6222\": want the host and port"},
		{leasebus.ServerConfig{ClusterAdvertise: "10.0.0.1:6222"}, "--cluster-advertise: only a cluster's node"},
		{leasebus.ServerConfig{RoutePingInterval: time.Second}, "--route-ping-interval: only a cluster's node pings routes"},
		{leasebus.ServerConfig{RoutePingsOut: 4}, "--route-pings-out: only a cluster's node pings routes"},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", RoutePingInterval: 10 * time.Millisecond}, "--route-ping-interval: 10ms: want 250ms to 5m0s"},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", RoutePingInterval: -1}, "--route-ping-interval: -1ns: want 250ms to 5m0s"},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", RoutePingsOut: -1}, "--route-pings-out: -1: want 1 to 100 unanswered pings"},
		{leasebus.ServerConfig{ClusterName: "fl", ClusterListen: "127.0.0.1:6222", RoutePingsOut: 101}, "--route-pings-out: 101: want 1 to 100"},
	} {
		err := tc.cfg.Validate()
		var fe *leasebus.FieldError
		if !errors.As(err, &fe) {
			t.Fatalf("Validate(%+v) = %v, want a FieldError", tc.cfg, err)
		}
		if strings.Contains(err.Error(), "--") {
			t.Errorf("leasebus names a flag: %v", err)
		}
		got := flagError(err)
		if !strings.HasPrefix(got.Error(), tc.want) || !errors.Is(got, fe) {
			t.Errorf("flagError(%v) = %v, want it to start %q and wrap the field error", err, got, tc.want)
		}
	}
	plain := errors.New("plain")
	if flagError(plain) != plain {
		t.Error("an error naming no field is changed")
	}
}
