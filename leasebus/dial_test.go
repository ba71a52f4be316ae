package leasebus

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
)

// copyCreds copies role's file from the tests' credentials into dir.
func copyCreds(t *testing.T, dir string, role Role) string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(testCredsDir(t), CredsFile(role)))
	if err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, CredsFile(role))
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func TestChooseCreds(t *testing.T) {
	t.Parallel()
	full := testCredsDir(t)
	// A directory: the role's own file.
	bc, err := ChooseCreds(full, "--creds", "", RoleViewer)
	if err != nil || bc != (BusCreds{Path: filepath.Join(full, "viewer.nk"), Source: "--creds", Role: RoleViewer}) {
		t.Errorf("dir: %+v %v", bc, err)
	}
	// A directory with only a wider role's file: that one.
	mine := t.TempDir()
	op := copyCreds(t, mine, RoleOperator)
	bc, err = ChooseCreds(mine, "env", "", RoleHolder)
	if err != nil || bc.Path != op || bc.Role != RoleOperator {
		t.Errorf("operator's dir for a holder: %+v %v", bc, err)
	}
	// ...but not a narrower one.
	_, err = ChooseCreds(mine, "env", "", RoleService)
	if err == nil || err.Error() != "this command needs the bus's service credentials, and "+mine+" (from env) holds none that may (service.nk)" {
		t.Errorf("operator's dir for the service: %v", err)
	}
	_, err = ChooseCreds(t.TempDir(), "env", "", RoleViewer)
	if err == nil || !strings.HasSuffix(err.Error(), "holds none that may (viewer.nk, operator.nk, service.nk)") {
		t.Errorf("empty dir: %v", err)
	}
	// One file: for every role.
	bc, err = ChooseCreds(op, "--creds", "", RoleService)
	if err != nil || bc != (BusCreds{Path: op, Source: "--creds", Role: RoleService}) {
		t.Errorf("file: %+v %v", bc, err)
	}
	// Nothing there.
	nope := filepath.Join(mine, "nope")
	if _, err = ChooseCreds(nope, "--creds", "", RoleViewer); err == nil || !strings.HasPrefix(err.Error(), "bus credentials "+nope+" (from --creds) do not exist") {
		t.Errorf("missing: %v", err)
	}
	// No setting: the default directory's, or none (saying where it looked).
	bc, err = ChooseCreds("", "", full, RoleOperator)
	if err != nil || bc != (BusCreds{Path: filepath.Join(full, "operator.nk"), Source: "the default bus's credentials", Role: RoleOperator}) {
		t.Errorf("default: %+v %v", bc, err)
	}
	bc, err = ChooseCreds("", "", mine, RoleViewer)
	if err != nil || bc != (BusCreds{Role: RoleViewer, Looked: filepath.Join(mine, "viewer.nk")}) {
		t.Errorf("no default: %+v %v", bc, err)
	}
}

func TestCredsToHide(t *testing.T) {
	t.Parallel()
	if got := CredsToHide(""); got != nil {
		t.Errorf("no setting: %v", got)
	}
	dir := t.TempDir()
	if got := CredsToHide(dir); !slices.Equal(got, []string{dir}) {
		t.Errorf("dir: %v", got)
	}
	holder := copyCreds(t, dir, RoleHolder)
	other := filepath.Join(dir, "ci.creds")
	if err := os.WriteFile(other, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	got := CredsToHide(holder)
	for _, want := range []string{holder, other, filepath.Join(dir, "service.nk"), filepath.Join(dir, "operator.nk"), filepath.Join(dir, "viewer.nk")} {
		if !slices.Contains(got, want) {
			t.Errorf("a holder's file: %v lacks %s", got, want)
		}
	}
}

// Dial connects with the chosen credentials, and says why it did not:
// credentials refused or missing, or no bus at all.
func TestDial(t *testing.T) {
	t.Parallel()
	srv, err := EmbeddedStartServer(serverConfig(t, ServerConfig{Listen: "127.0.0.1:0", StoreDir: t.TempDir()}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Shutdown(); srv.WaitForShutdown() })
	url := srv.ClientURL()

	bc, err := ChooseCreds(testCredsDir(t), "--creds", "", RoleHolder)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := Dial(url, "", bc, append(HolderConnOptions(), nats.Name("dial-test"))...)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	if IdentityOf(nc) == Anonymous || nc.Opts.Name != "dial-test" || nc.Opts.Timeout != ConnectTimeout {
		t.Errorf("connected as %q, name %q, timeout %s", IdentityOf(nc), nc.Opts.Name, nc.Opts.Timeout)
	}
	if o := nc.Opts; o.MaxReconnect != -1 || o.ReconnectWait != holderReconnectWait || o.PingInterval != holderPingInterval || o.MaxPingsOut != holderMaxPingsOut {
		t.Errorf("holder options not applied: reconnects %d wait %s ping %s maxPings %d", o.MaxReconnect, o.ReconnectWait, o.PingInterval, o.MaxPingsOut)
	}

	var refused *CredsRefusedError
	none := BusCreds{Role: RoleViewer, Looked: "/nowhere/viewer.nk"}
	if _, err := Dial(url, "", none); !errors.As(err, &refused) || !errors.Is(err, nats.ErrAuthorization) ||
		!strings.HasPrefix(err.Error(), "the bus at "+url+" requires credentials (") || !strings.HasSuffix(err.Error(), "none were found (looked for /nowhere/viewer.nk)") {
		t.Errorf("no credentials: %v", err)
	}
	otherDir := t.TempDir()
	if _, err := EnsureCreds(otherDir); err != nil {
		t.Fatal(err)
	}
	other := BusCreds{Path: filepath.Join(otherDir, "viewer.nk"), Source: "--creds", Role: RoleViewer}
	if _, err := Dial(url, "", other); !errors.As(err, &refused) || refused.Creds != other ||
		!strings.HasPrefix(err.Error(), "the bus at "+url+" refused the credentials "+other.Path+" (from --creds, for the viewer role): ") {
		t.Errorf("another bus's credentials: %v", err)
	}
	missing := BusCreds{Path: filepath.Join(otherDir, "nope.nk"), Source: "env", Role: RoleViewer}
	if _, err := Dial(url, "", missing); err == nil || !errors.Is(err, os.ErrNotExist) || !strings.HasSuffix(err.Error(), " (from env)") {
		t.Errorf("missing credentials: %v", err)
	}

	// Nobody listens on a port just closed.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	var noBus *NoBusError
	_, err = Dial("nats://"+addr, "--nats", bc)
	if !errors.As(err, &noBus) || noBus.HostPort() != addr || err.Error() != "no bus at nats://"+addr+" (from --nats): nothing answers (connection refused)" {
		t.Errorf("no bus: %v", err)
	}
}
