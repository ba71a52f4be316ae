package gitproxy

import (
	"strings"
	"testing"

	"github.com/fenceline/fenceline/lease"
)

// pushOut runs git push and returns its output and whether it succeeded.
func pushOut(t *testing.T, dir string, args ...string) (string, bool) {
	t.Helper()
	out, err := gitCmd(t, dir, nil, append([]string{"push"}, args...)...)
	return out, err == nil
}

func TestInScopePushLands(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	l := e.lease([]string{"services/billing"}, lease.WorkspaceExclusive)
	srv := e.proxy(l)
	dir := e.clone(srv.URL)
	head := e.commit(dir, "bill", "services/billing/invoice.go", "package billing // v2\n", "services/billing/new.go", "package billing\n")
	out, ok := pushOut(t, dir, "origin", "main")
	if !ok {
		t.Fatalf("in-scope push refused:\n%s", out)
	}
	if got := e.upstreamRef("refs/heads/main"); got != head {
		t.Fatalf("upstream main = %s, want %s", got, head)
	}
	if evs := e.audit(); len(evs) != 0 {
		t.Fatalf("accepted push audited as refused: %+v", evs)
	}
}

func TestRefusals(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name    string
		claim   []string
		mode    lease.WorkspaceMode
		commits [][]string
		want    string // in git push's output
		reason  string
	}{
		{
			name:    "out of scope",
			claim:   []string{"services/billing"},
			commits: [][]string{{"libs/tax/rates.go", "package tax // changed\n"}},
			want:    "! [remote rejected] main -> main (fenceline: libs/tax/rates.go is outside lease lease_",
			reason:  ReasonOutsideLease,
		},
		{
			name:    "mixed commit",
			claim:   []string{"services/billing"},
			commits: [][]string{{"services/billing/invoice.go", "x\n", "libs/tax/rates.go", "y\n"}},
			want:    "libs/tax/rates.go is outside lease",
			reason:  ReasonOutsideLease,
		},
		{
			name:  "touch then revert",
			claim: []string{"services/billing"},
			commits: [][]string{
				{"libs/tax/rates.go", "package tax // sneaky\n"},
				{"libs/tax/rates.go", "package tax\n", "services/billing/invoice.go", "ok\n"},
			},
			want:   "libs/tax/rates.go is outside lease",
			reason: ReasonOutsideLease,
		},
		{
			name:    "sibling prefix is not inside",
			claim:   []string{"services/bill"},
			commits: [][]string{{"services/billing/invoice.go", "x\n"}},
			want:    "services/billing/invoice.go is outside lease",
			reason:  ReasonOutsideLease,
		},
		{
			name:    "shared workspace may not push",
			claim:   []string{"services/billing"},
			mode:    lease.WorkspaceShared,
			commits: [][]string{{"services/billing/invoice.go", "x\n"}},
			want:    "works in a shared workspace and may not push",
			reason:  ReasonSharedWorkspace,
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			mode := tc.mode
			if mode == "" {
				mode = lease.WorkspaceExclusive
			}
			l := e.lease(tc.claim, mode)
			srv := e.proxy(l)
			dir := e.clone(srv.URL)
			before := e.upstreamRef("refs/heads/main")
			for _, files := range tc.commits {
				e.commit(dir, "step", files...)
			}
			out, ok := pushOut(t, dir, "origin", "main")
			if ok {
				t.Fatalf("push accepted, want refused:\n%s", out)
			}
			if !strings.Contains(out, tc.want) {
				t.Fatalf("git push output lacks %q:\n%s", tc.want, out)
			}
			if got := e.upstreamRef("refs/heads/main"); got != before {
				t.Fatalf("upstream main moved to %s on a refused push", got)
			}
			evs := e.audit()
			if len(evs) != 1 {
				t.Fatalf("want 1 audit event, got %+v", evs)
			}
			ev := evs[0]
			if ev.Type != lease.EventDenied || ev.Reason != tc.reason || ev.LeaseID != l.Record.LeaseID ||
				ev.Fence != l.Record.Fence || ev.Owner != l.Record.Owner || !strings.Contains(ev.Message, "refs/heads/main") {
				t.Fatalf("audit event = %+v, want denied/%s for lease %s fence %d", ev, tc.reason, l.Record.LeaseID, l.Record.Fence)
			}
		})
	}
}
