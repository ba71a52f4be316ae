package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/natstest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/busserve"
)

// serveInProcess runs "bus serve" with args until the returned stop is
// called, and returns the URL its lease service is ready on.
func serveInProcess(t *testing.T, args ...string) (url string, out, errOut *syncBuffer, stop func() int) {
	t.Helper()
	s, err := startServe(t, args...)
	if err != nil {
		t.Fatal(err)
	}
	return s.url, s.out, s.errOut, s.stop
}

type served struct {
	url         string
	out, errOut *syncBuffer
	stop        func() int // ends it and returns its exit status
}

// startServe is serveInProcess for any goroutine: it reports instead of
// failing the test.
func startServe(t *testing.T, args ...string) (*served, error) {
	ctx, cancel := context.WithCancel(context.Background())
	s := &served{out: &syncBuffer{}, errOut: &syncBuffer{}}
	done := make(chan int, 1)
	cfg := cfgOf(t)
	go func() {
		done <- run(ctx, append([]string{"bus", "serve"}, args...), s.out, s.errOut, leasebus.DefaultURL, cfg)
	}()
	var once sync.Once
	code := -1
	s.stop = func() int {
		once.Do(func() {
			cancel()
			select {
			case code = <-done:
			case <-time.After(15 * time.Second):
				t.Errorf("bus serve %v did not stop within 15s of its context ending", args)
			}
		})
		return code
	}
	t.Cleanup(func() { s.stop() })
	ready := regexp.MustCompile(`lease service ready on (nats://\S+)`)
	deadline := time.Now().Add(busserve.StartTimeout)
	for {
		if m := ready.FindStringSubmatch(s.out.String()); m != nil {
			s.url = m[1]
			return s, nil
		}
		select {
		case c := <-done:
			done <- c
			return nil, fmt.Errorf("bus serve %v exited %d early\nstdout:\n%s\nstderr:\n%s", args, c, s.out, s.errOut)
		case <-time.After(20 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("bus serve %v not ready after %s\nstdout:\n%s\nstderr:\n%s", args, busserve.StartTimeout, s.out, s.errOut)
		}
	}
}

func TestBusServeEmbedded(t *testing.T) {
	t.Parallel()
	isolate(t)
	store := filepath.Join(t.TempDir(), "bus")
	// A bus on another store than the default: its credentials are where
	// --creds or $FENCELINE_CREDS says, for it and for every command.
	setCfg(t, func(c *config) { c.Creds = filepath.Join(store, "creds") })
	url, out, errOut, stop := serveInProcess(t, "--listen", "127.0.0.1:0", "--store", store, "--log-format", "json", "--ui", "127.0.0.1:0")
	mustContain(t, "bus serve stdout", out.String(), "fenceline bus listening on "+url, "store: "+store, "(replicas 1)")

	a := acquireJSON(t, url, "--scope", "services/billing")
	fl(t, "lease", "renew", a.LeaseID).want(t, ExitOK)
	if ls := listJSON(t, url); len(ls) != 1 {
		t.Errorf("list: %d leases, want 1", len(ls))
	}
	if code := stop(); code != ExitOK {
		t.Fatalf("bus serve exited %d after its context ended\nstderr:\n%s", code, errOut)
	}
	mustContain(t, "bus serve stdout", out.String(), "lease service stopped")
	mustContain(t, "bus serve log", errOut.String(), `"msg":"bus started"`, `"msg":"bus stopped"`)

	// Stopped means stopped: nothing answers there any more.
	r := fl(t, "--nats", url, "lease", "list").want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "no bus at "+url)

	// The lease survives a restart on the same store, and its holder's
	// credential file still renews it there.
	url2, out2, _, stop2 := serveInProcess(t, "--listen", "127.0.0.1:0", "--store", store)
	ls := listJSON(t, url2)
	if len(ls) != 1 || ls[0].LeaseID != a.LeaseID || ls[0].Version != 2 {
		t.Errorf("after restart: %+v, want %s at version 2", ls, a.LeaseID)
	}
	fl(t, "--nats", url2, "lease", "renew", a.LeaseID).want(t, ExitOK)
	fl(t, "--nats", url2, "lease", "release", a.LeaseID).want(t, ExitOK)
	if code := stop2(); code != ExitOK {
		t.Errorf("second bus serve exited %d\n%s", code, out2)
	}
}

func TestBusServeServiceOnly(t *testing.T) {
	t.Parallel()
	isolate(t)
	// A bare NATS server (a "cluster" of one) with no lease service...
	srv := bustest.StartServer(t, leasebus.ServerConfig{})
	useTestCreds(t)
	natsURL := srv.ClientURL()
	r := fl(t, "--nats", natsURL, "lease", "list").want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "no lease service answers", "fenceline bus serve")

	// ...then "bus serve --nats" adds one.
	setCfg(t, func(c *config) { c.NATS = natsURL })
	url, out, _, stop := serveInProcess(t)
	if url != natsURL {
		t.Errorf("service ready on %s, want %s", url, natsURL)
	}
	if strings.Contains(out.String(), "listening") {
		t.Errorf("bus serve --nats must not start a server:\n%s", out)
	}
	a := acquireJSON(t, natsURL, "--scope", "x")
	if a.Fence == 0 {
		t.Error("no fence")
	}
	if code := stop(); code != ExitOK {
		t.Errorf("bus serve exited %d", code)
	}
}

func TestBusServePortInUse(t *testing.T) {
	t.Parallel()
	isolate(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	start := time.Now()
	r := fl(t, "bus", "serve", "--listen", ln.Addr().String(), "--store", t.TempDir()).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "cannot listen on "+ln.Addr().String())
	if time.Since(start) > 3*time.Second {
		t.Errorf("took %s to notice the port is taken", time.Since(start))
	}
}

func TestBusServeReadOnlyStore(t *testing.T) {
	t.Parallel()
	isolate(t)
	vol := testutil.Tmpfs(t, "4m")
	testutil.Remount(t, vol, "ro")
	defer testutil.Remount(t, vol, "rw")
	store := filepath.Join(vol, "bus")
	start := time.Now()
	r := fl(t, "bus", "serve", "--listen", "127.0.0.1:0", "--store", store).want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "store is read-only")
	mustContain(t, "stderr", r.stderr, store)
	if time.Since(start) > 3*time.Second {
		t.Errorf("took %s to notice the store is read-only", time.Since(start))
	}
}

// TestBusCredentials: "bus serve" on the default store makes one
// credentials file per role (0600 in a 0700 directory) and reuses them on
// the next start; commands on this machine find them with no flag, each as
// the least role it needs, and the audit names who revoked. A bus refuses
// a client without its credentials, and each refusal says what to do.
func TestBusCredentials(t *testing.T) {
	t.Parallel()
	isolate(t)
	url, out, _, stop := serveInProcess(t, "--listen", "127.0.0.1:0")
	dir := defaultCredsDir(t)
	mustContain(t, "bus serve stdout", out.String(), "credentials: "+dir)
	if fi, err := os.Stat(dir); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("credentials dir %s: %v %v", dir, fi, err)
	}
	seeds := map[leasebus.Role][]byte{}
	for _, r := range leasebus.Roles {
		p := filepath.Join(dir, leasebus.CredsFile(r))
		fi, err := os.Stat(p)
		if err != nil || fi.Mode().Perm() != 0o600 {
			t.Fatalf("%s: %v %v", p, fi, err)
		}
		if seeds[r], err = os.ReadFile(p); err != nil {
			t.Fatal(err)
		}
	}

	// No --creds, no $FENCELINE_CREDS: the default bus's own.
	a := acquireJSON(t, url, "--scope", "services/billing")
	if ls := listJSON(t, url); len(ls) != 1 {
		t.Fatalf("list: %+v", ls)
	}
	fl(t, "--nats", url, "lease", "revoke", a.LeaseID, "--reason", "credentials test").want(t, ExitOK)
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error { // the service writes its audit events in the background
		r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
		var evs []lease.AuditEvent
		if err := json.Unmarshal([]byte(r.stdout), &evs); err != nil {
			t.Fatal(err)
		}
		var revokedBy, listedBy string
		for _, ev := range evs {
			switch ev.Type {
			case lease.EventRevoked:
				revokedBy = ev.RequestedBy
			case lease.EventList:
				listedBy = ev.RequestedBy
			}
		}
		if revokedBy != "operator" || listedBy != "viewer" {
			return fmt.Errorf("audit: revoked by %q, listed by %q; want operator and viewer\n%s", revokedBy, listedBy, r.stdout)
		}
		return nil
	})

	// A role that may not: a viewer's revoke is refused at once, clearly.
	b := acquireJSON(t, url, "--scope", "libs")
	r := fl(t, "--nats", url, "--creds", filepath.Join(dir, "viewer.nk"), "lease", "revoke", b.LeaseID, "--reason", "x").want(t, ExitConflict)
	mustContain(t, "viewer revoke stderr", r.stderr, "not permitted", "operator", "--creds")
	// Another bus's credentials.
	other := t.TempDir()
	if _, err := leasebus.EnsureCreds(other); err != nil {
		t.Fatal(err)
	}
	r = fl(t, "--nats", url, "--creds", other, "lease", "list").want(t, ExitError)
	mustContain(t, "wrong credentials stderr", r.stderr, "refused the credentials", filepath.Join(other, "viewer.nk"), "--creds")
	// Credentials that are not there.
	r = fl(t, "--nats", url, "--creds", filepath.Join(other, "nope"), "lease", "list").want(t, ExitError)
	mustContain(t, "missing credentials stderr", r.stderr, "do not exist", "nope")
	// None at all: another user's state dir.
	here, elsewhere := stateDir(t), t.TempDir()
	setCfg(t, func(c *config) { c.StateDir = elsewhere })
	r = fl(t, "--nats", url, "lease", "list").want(t, ExitError)
	mustContain(t, "no credentials stderr", r.stderr, "requires credentials", "none were found", "--creds", EnvCreds)
	setCfg(t, func(c *config) { c.StateDir = here })
	if defaultCredsDir(t) != dir {
		t.Fatalf("state dir not restored: %s", defaultCredsDir(t))
	}
	// What the bus itself refused is in the audit: the viewer's revoke and
	// the client without credentials.
	checkFor(t, 10*time.Second, 50*time.Millisecond, func() error {
		r := fl(t, "--nats", url, "lease", "audit", "--json").want(t, ExitOK)
		var evs []lease.AuditEvent
		if err := json.Unmarshal([]byte(r.stdout), &evs); err != nil {
			t.Fatal(err)
		}
		seen := map[string]bool{}
		for _, ev := range evs {
			if ev.Type == lease.EventRefused && ev.Boundary == lease.BoundaryBus {
				seen[ev.Reason+" "+ev.RequestedBy] = true
			}
		}
		if !seen[leasebus.ReasonBusPermission+" viewer"] || !seen[leasebus.ReasonBusAuthentication+" "] {
			return fmt.Errorf("the bus's refusals in the audit: %v", seen)
		}
		return nil
	})

	if code := stop(); code != ExitOK {
		t.Fatalf("bus serve exited %d", code)
	}
	// The next start reuses them: the first lease's owner still renews.
	url2, _, _, stop2 := serveInProcess(t, "--listen", "127.0.0.1:0")
	for _, r := range leasebus.Roles {
		data, err := os.ReadFile(filepath.Join(dir, leasebus.CredsFile(r)))
		if err != nil || !bytes.Equal(data, seeds[r]) {
			t.Fatalf("%s credentials changed on the second start (%v)", r, err)
		}
	}
	fl(t, "--nats", url2, "lease", "renew", b.LeaseID).want(t, ExitOK)
	if code := stop2(); code != ExitOK {
		t.Fatalf("second bus serve exited %d", code)
	}
}

// TestBusCredsExternalServer: a plain nats-server configured with what
// "bus creds" prints (docs/trust.md) runs the lease service and every
// command, each as its role, and refuses a client without credentials.
func TestBusCredsExternalServer(t *testing.T) {
	t.Parallel()
	isolate(t)
	dir := filepath.Join(t.TempDir(), "creds")
	r := fl(t, "bus", "creds", "--dir", dir).want(t, ExitOK)
	srv := natstest.Start(t, r.stdout)
	natsURL := srv.ClientURL()
	setCfg(t, func(c *config) { c.Creds = dir })
	setCfg(t, func(c *config) { c.NATS = natsURL })
	_, _, _, stop := serveInProcess(t)
	a := acquireJSON(t, natsURL, "--scope", "x")
	if ls := listJSON(t, natsURL); len(ls) != 1 {
		t.Fatalf("list: %+v", ls)
	}
	fl(t, "lease", "revoke", a.LeaseID, "--reason", "external").want(t, ExitOK)
	setCfg(t, func(c *config) { c.Creds = "" })
	r = fl(t, "lease", "list").want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "requires credentials")
	if code := stop(); code != ExitOK {
		t.Errorf("bus serve exited %d", code)
	}
}

// A credentials directory without the least role's file: the command
// takes a role that may more, or says which files would do.
func TestCredsDirFallsBackToAWiderRole(t *testing.T) {
	t.Parallel()
	isolate(t)
	url := startBus(t)
	mine := t.TempDir()
	data, err := os.ReadFile(filepath.Join(bustest.CredsDir(t), "operator.nk"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(mine, "operator.nk"), data, 0o600); err != nil {
		t.Fatal(err)
	}
	setCfg(t, func(c *config) { c.Creds = mine })
	listJSON(t, url)                                                                             // viewer's command, as the operator
	fl(t, "--nats", url, "lease", "acquire", "--repo", testRepo, "--scope", "x").want(t, ExitOK) // holder's
	setCfg(t, func(c *config) { c.Creds = t.TempDir() })
	r := fl(t, "--nats", url, "lease", "list").want(t, ExitError)
	mustContain(t, "stderr", r.stderr, "holds none that may", "viewer.nk, operator.nk, service.nk")
}

// TestBusServeMetrics: bus serve --metrics exports the lease service's
// Prometheus metrics; a bad address is a usage error before anything
// starts.
func TestBusServeMetrics(t *testing.T) {
	t.Parallel()
	isolate(t)
	fl(t, "bus", "serve", "--metrics", "nohostport", "--store", t.TempDir()).want(t, ExitUsage)
	store := filepath.Join(t.TempDir(), "bus")
	setCfg(t, func(c *config) { c.Creds = filepath.Join(store, "creds") })
	url, out, _, _ := serveInProcess(t, "--listen", "127.0.0.1:0", "--store", store, "--metrics", "127.0.0.1:0")
	m := regexp.MustCompile(`metrics: (http://\S+/metrics)`).FindStringSubmatch(out.String())
	if m == nil {
		t.Fatalf("bus serve did not say where its metrics are:\n%s", out)
	}
	acquireJSON(t, url, "--scope", "services/billing")
	resp, err := http.Get(m[1])
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	mustContain(t, "metrics", string(body), `fenceline_bus_requests_total{op="acquire",result="ok"} 1`, "fenceline_bus_active_leases 1", "fenceline_bus_append_seconds_count")
}
