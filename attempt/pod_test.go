package attempt

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/fenceline/fenceline/internal/scope"
	"github.com/fenceline/fenceline/lease"
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
		{"a path outside the claim", held, true, []string{"libs"}, "", "--scope libs is outside lease lease_s's claim", ""},
		{"shared never widens to exclusive", held, true, nil, lease.WorkspaceExclusive, "has a shared workspace", ""},
		{"a bad path", held, true, []string{"../x"}, "", "--scope: ", ""},
		{"unknown lease: paths make it shared", unknown, false, []string{"in"}, "", "[in]", lease.WorkspaceShared},
		{"unknown lease: exclusive stays", unknown, false, nil, "", "none", lease.WorkspaceExclusive},
		{"unknown lease: a mode is taken", unknown, false, []string{"in"}, lease.WorkspaceExclusive, "[in]", lease.WorkspaceExclusive},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Narrow(tc.l, tc.known, tc.paths, tc.mode)
			if tc.ws == "" {
				if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("Narrow = %v, want an ErrInvalid saying %q", err, tc.want)
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
		KillGrace: 5 * time.Second, Stdout: &out, Stderr: io.Discard,
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
