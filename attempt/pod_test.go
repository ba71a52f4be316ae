package attempt

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/bustest"
	"github.com/fenceline/fenceline/internal/testutil"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// TestNarrow: a pod's flags narrow the sidecar's lease, never widen it.
func TestNarrow(t *testing.T) {
	held := lease.Lease{LeaseID: "lease_s", WorkspaceMode: lease.WorkspaceShared, Scope: claim(t, "services")}
	held.Scope.Tables = []string{"public.invoices"}
	unknown := lease.Lease{Scope: scope.Claim{Kind: scope.KindNone}, WorkspaceMode: lease.WorkspaceExclusive}
	for _, tc := range []struct {
		name  string
		l     lease.Lease
		known bool
		paths []string
		mode  lease.WorkspaceMode
		want  string // the claim, or the error's text
		ws    lease.WorkspaceMode
	}{
		{"the lease as it is", held, true, nil, "", "[services] tables=[public.invoices]", lease.WorkspaceShared},
		{"a path inside the claim", held, true, []string{"services/billing"}, "", "[services/billing] tables=[public.invoices]", lease.WorkspaceShared},
		{"a path outside the claim", held, true, []string{"libs"}, "", "Paths libs: is outside lease lease_s's claim", ""},
		{"shared never widens to exclusive", held, true, nil, lease.WorkspaceExclusive, "has a shared workspace", ""},
		{"a bad path", held, true, []string{"../x"}, "", "Paths: ", ""},
		{"unknown lease: paths make it shared", unknown, false, []string{"in"}, "", "[in]", lease.WorkspaceShared},
		{"unknown lease: exclusive stays", unknown, false, nil, "", "none", lease.WorkspaceExclusive},
		{"unknown lease: a mode is taken", unknown, false, []string{"in"}, lease.WorkspaceExclusive, "[in]", lease.WorkspaceExclusive},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Narrow(tc.l, tc.known, tc.paths, tc.mode)
			if tc.ws == "" {
				var fe *FieldError
				if !errors.Is(err, ErrInvalid) || !errors.As(err, &fe) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Narrow = %v, want an ErrInvalid FieldError saying %q", err, tc.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if s := got.Scope.String(); s != tc.want || got.WorkspaceMode != tc.ws {
				t.Errorf("Narrow = %s (%s), want %s (%s)", s, got.WorkspaceMode, tc.want, tc.ws)
			}
			if tc.known && len(got.Scope.Tables) != 1 {
				t.Errorf("Narrow dropped the lease's tables: %v", got.Scope.Tables)
			}
		})
	}
}

func TestEgressAllows(t *testing.T) {
	f := sidecar.Fences{Egress: "http://127.0.0.1:1", EgressAllow: []string{"api.openai.com", "*.example.test"}}
	for _, tc := range []struct {
		fences sidecar.Fences
		hosts  []string
		err    string
	}{
		{f, nil, ""},
		{f, []string{"api.openai.com"}, ""},
		{f, []string{"a.example.test"}, ""},
		{f, []string{"api.anthropic.com"}, "does not allow it"},
		{sidecar.Fences{}, []string{"api.openai.com"}, "serves no egress proxy"},
		{sidecar.Fences{}, nil, ""},
	} {
		err := egressAllows(tc.fences, tc.hosts)
		if (tc.err == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), tc.err) {
			t.Errorf("egressAllows(%v, %v) = %v, want %q", tc.fences.EgressAllow, tc.hosts, err, tc.err)
		}
	}
}

// TestRunInPodFailsClosed: with no sidecar answering, the attempt runs
// with every write refused (the guard's gate is closed from the start),
// and its exit status is the result.
func TestRunInPodFailsClosed(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	nowhere := "http://" + ln.Addr().String()
	ln.Close()
	var out strings.Builder
	res, err := RunInPod(context.Background(), PodSpec{
		Argv: []string{"sh", "-c", "echo no > in/x 2>/dev/null && echo wrote || echo refused; exit 5"}, Checkout: co,
		SidecarURL: nowhere, Grace: time.Second, Wait: 100 * time.Millisecond, Paths: []string{"in"},
		KillGrace: 5 * time.Second, Stdout: &out, Stderr: io.Discard, FencelineStateDir: t.TempDir(),
		Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		t.Fatal(err)
	}
	if !res.Started || res.Code != 5 || strings.TrimSpace(out.String()) != "refused" || res.Refused.AfterLoss == 0 || res.Refused.Confined != 0 {
		t.Errorf("RunInPod = %+v, agent said %q; want exit 5 and the write refused for the unknown lease", res, out.String())
	}
	if _, err := os.Lstat(filepath.Join(repo, "in", "x")); err == nil {
		t.Error("the agent wrote with no sidecar's word on a lease")
	}
}

// syncBuf is an io.Writer the test reads while the agent writes it.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string { s.mu.Lock(); defer s.mu.Unlock(); return s.b.String() }

// podAgent is the agent of TestPodAgentCannotTakeSidecarPort: it writes
// its claim, waits for the sidecar to be gone, tries to listen on its admin
// port on two addresses, says how each went, writes until the guard
// refuses (the wrapper no longer hears the sidecar), and waits to be told
// to exit (so that a port it took would still be held).
const podAgent = `
import errno, os, socket, sys, time
port, gone, done = int(sys.argv[1]), sys.argv[2], sys.argv[3]
open("in/started", "w").write("x")
while not os.path.exists(gone):
    time.sleep(0.01)
said = []
for host in ("127.0.0.1", "0.0.0.0"):
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # past the sidecar's TIME_WAIT connections
    try:
        s.bind((host, port))
        s.listen()
        said.append("listening")
    except OSError as e:
        said.append(errno.errorcode[e.errno])
print(" ".join(said), flush=True)
deadline = time.time() + 20
while time.time() < deadline:  # the wrapper's gate closes within --grace of the sidecar's last word
    try:
        open("in/after", "w").write("x")
    except PermissionError:
        print("write refused", flush=True)
        break
    time.sleep(0.05)
while not os.path.exists(done):
    time.sleep(0.01)
`

// TestPodAgentCannotTakeSidecarPort is issue 28's pod-mode attack: the
// sidecar is killed while its agent runs; the agent listens on the
// sidecar's admin port, where the agent wrapper asks for the lease, so the
// restarted sidecar fails with "address already in use" (and, before the
// wrapper authenticated its sidecar, the agent answered "held" there).
// Under the guard the agent's binds are refused with EACCES, its writes
// are refused once the wrapper no longer hears the sidecar, the restarted
// sidecar listens on its port again, and the wrapper's settle report
// reaches it.
func TestPodAgentCannotTakeSidecarPort(t *testing.T) {
	t.Setenv("XDG_STATE_HOME", t.TempDir())
	b := bustest.Start(t)
	repo := newRepo(t, "")
	co, err := FindCheckout(context.Background(), repo)
	if err != nil {
		t.Fatal(err)
	}
	l := b.Acquire(t, leasebus.AcquireRequest{Repo: co.Repo, Scope: claim(t, "in"), WorkspaceMode: lease.WorkspaceShared,
		TTL: lease.Duration(30 * time.Second)}, leasebus.HoldOptions{})
	const token = "0123456789abcdef0123"
	startSidecar := func(listen string) (*sidecar.Admin, error) {
		a, err := sidecar.StartAdmin(sidecar.AdminConfig{Listen: listen, Token: token, Audit: b.Auditor,
			KeepAlive: 50 * time.Millisecond, Poll: 20 * time.Millisecond})
		if err == nil {
			a.SetLease(l.Holder, sidecar.Fences{})
		}
		return a, err
	}
	first, err := startSidecar("")
	if err != nil {
		t.Fatal(err)
	}
	u, _ := url.Parse(first.URL())
	signals := t.TempDir()
	gone, done := filepath.Join(signals, "gone"), filepath.Join(signals, "done")
	out := &syncBuf{}
	type ran struct {
		res Result
		err error
	}
	finished := make(chan ran, 1)
	go func() {
		res, err := RunInPod(context.Background(), PodSpec{
			Argv: []string{"/usr/bin/python3", "-c", podAgent, u.Port(), gone, done}, Checkout: co,
			SidecarURL: first.URL(), Token: token, Grace: time.Second, Wait: 10 * time.Second,
			KillGrace: 5 * time.Second, Stdout: out, Stderr: out, FencelineStateDir: t.TempDir(),
			Log: slog.New(slog.NewTextHandler(io.Discard, nil)),
		})
		finished <- ran{res, err}
	}()
	testutil.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if _, err := os.Stat(filepath.Join(repo, "in", "started")); err != nil {
			return fmt.Errorf("the agent has not written its claim yet (%q)", out.String())
		}
		return nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := first.Close(ctx); err != nil { // the sidecar is killed
		t.Fatal(err)
	}
	if err := os.WriteFile(gone, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	testutil.CheckFor(t, 30*time.Second, 10*time.Millisecond, func() error {
		if !strings.Contains(out.String(), "write refused") {
			return fmt.Errorf("the agent has not been refused a write yet (%q)", out.String())
		}
		return nil
	})
	if got := strings.TrimSpace(out.String()); got != "EACCES EACCES\nwrite refused" {
		t.Errorf("the agent listening on the sidecar's admin port %s, then writing: %q, want EACCES EACCES, then the write refused", u.Port(), got)
	}
	restarted, err := startSidecar(u.Host)
	if err != nil {
		t.Errorf("the restarted sidecar: %v", err)
	} else {
		t.Cleanup(func() { restarted.Close(context.Background()) })
	}
	if err := os.WriteFile(done, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	r := <-finished
	if r.err != nil {
		t.Fatal(r.err)
	}
	if r.res.Code != 0 || r.res.Refused.Confined < 2 || r.res.Refused.AfterLoss < 1 {
		t.Errorf("RunInPod = %+v, want exit 0, the two binds refused and a write after the sidecar was gone", r.res)
	}
	if restarted != nil && restarted.WaitSettled(10*time.Second) != sidecar.SettleReported {
		t.Error("the restarted sidecar heard no settle report from the wrapper")
	}
}
