// Package demo tells fenceline's whole story on a throwaway embedded lease
// bus, with the real parts: a git server behind the git fence, a Postgres
// behind the Postgres fence, and agents as child processes under the
// file-write guard in a pool of worktree shards (`fenceline demo`). Every
// step checks what it shows, so a run doubles as a smoke test.
//
// Its servers are real but throwaway (package gitserver's git
// http-backend, package pgserver's Postgres); it starts nothing that only
// a test may use.
package demo

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/leasebus/embedded"
	"github.com/fenceline/fenceline/runui"
	"github.com/fenceline/fenceline/shard"
)

// Repo is the repository the story is told for.
const Repo = "github.com/acme/payments"

// timeout bounds the whole story; it normally takes about 3 s (up to
// 30 s seen under -race with other packages' tests on both cores).
const timeout = 2 * time.Minute

// Config is what one run of the demo needs. Out, Fenceline and Command
// are required.
type Config struct {
	// Out receives the story.
	Out io.Writer
	// Fenceline is the path of the fenceline binary: the git server's
	// pre-receive hook runs "Fenceline hook pre-receive".
	Fenceline string
	// Command runs one fenceline command line in-process (without the
	// program name) and returns its exit status, as `fenceline` would:
	// the shard story's agents run through it ("fenceline run", "shard
	// commit") against the demo bus, with its address and credentials
	// on the command line.
	Command func(ctx context.Context, args []string, stdout, stderr io.Writer) int
	// Keep keeps the demo bus running and its store on disk once the
	// story is told, until ctx is done.
	Keep bool
	// UI, a host:port, serves the run UI of the demo bus there, and keeps
	// it up once the story is told, until ctx is done.
	UI string
	// PostgresDSN, a superuser DSN, names a running Postgres to tell the
	// Postgres story on (its public.invoices and public.rates are
	// replaced) instead of a throwaway one. Empty: a throwaway Postgres
	// from the machine's binaries, or no Postgres story without them.
	PostgresDSN string
}

// Validate reports a Config that cannot run, naming the field.
func (c Config) Validate() error {
	switch {
	case c.Out == nil:
		return errors.New("demo: Config.Out is required")
	case c.Fenceline == "":
		return errors.New("demo: Config.Fenceline is required (the hook's binary)")
	case c.Command == nil:
		return errors.New("demo: Config.Command is required")
	}
	if c.UI != "" {
		if _, _, err := net.SplitHostPort(c.UI); err != nil {
			return fmt.Errorf("demo: Config.UI %q: want host:port: %w", c.UI, err)
		}
	}
	return nil
}

// demo is one run of the story.
type demo struct {
	cfg     Config
	out     io.Writer
	url     string // the demo bus's client URL
	nc      *nats.Conn
	creds   string           // the demo bus's credentials directory (--creds of the commands it runs)
	op      *leasebus.Client // as the operator: revokes
	c       *leasebus.Client
	auditor *leasebus.Auditor
	grants  []grant // in the order this program learned of them
	// secrets is the lease service's FenceSecretDir: the storages'
	// secrets, which only the service and the storage hold.
	secrets string
}

type grant struct {
	agent string
	lease *lease.Lease
}

// fail is an expectation of the story that did not hold.
func fail(format string, args ...any) error {
	return fmt.Errorf("demo expectation failed: "+format, args...)
}

// Run tells the whole story on a throwaway embedded bus: it starts one on
// a free loopback port with its own temporary store (never the default
// bus or the user's state dir, so it runs beside a real bus) and shows,
// for Repo, two agents racing for overlapping scopes, a disjoint scope
// granted alongside, a crashed holder's lease reclaimed by the sweeper,
// fence tokens rising, an operator's revoke seen by the holder, the audit
// trail; then a real git server behind the git fence, a throwaway
// Postgres behind the Postgres fence (when its binaries are found), and a
// pool of worktree shards with agents as real child processes under the
// file-write guard. It returns nil when every expectation held, else an
// error naming the one that did not.
func Run(parent context.Context, cfg Config) error {
	if err := cfg.Validate(); err != nil {
		return err
	}
	out, keep, ui := cfg.Out, cfg.Keep, cfg.UI
	ctx, cancel := context.WithTimeout(parent, timeout)
	defer cancel()

	dir, err := os.MkdirTemp("", "fenceline-demo-")
	if err != nil {
		return fmt.Errorf("demo store: %w", err)
	}
	if !keep {
		defer os.RemoveAll(dir)
	}
	srv, err := embedded.StartServer(leasebus.ServerConfig{Listen: "127.0.0.1:0", StoreDir: filepath.Join(dir, "bus"), Name: "fenceline-demo"})
	if err != nil {
		return fmt.Errorf("demo bus: %w", err)
	}
	defer func() {
		srv.Shutdown()
		srv.WaitForShutdown()
	}()
	// The demo plays every part on its own bus: it connects as the lease
	// service, with the credentials the bus made in its store.
	credsDir := leasebus.CredsDirOf(filepath.Join(dir, "bus"))
	copts, err := leasebus.RoleOptions(credsDir, leasebus.RoleService)
	if err != nil {
		return fmt.Errorf("demo bus: %w", err)
	}
	nc, err := nats.Connect(srv.ClientURL(), append(copts, nats.Name("fenceline-demo"), nats.Timeout(leasebus.ConnectTimeout), nats.InProcessServer(srv))...)
	if err != nil {
		return fmt.Errorf("demo bus: connect: %w", err)
	}
	defer nc.Close()
	secrets := filepath.Join(dir, "fence-secrets")
	svc, err := leasebus.StartService(ctx, nc, leasebus.ServiceConfig{Names: leasebus.NamesIn(credsDir), FenceSecretDir: secrets})
	if err != nil {
		return fmt.Errorf("demo lease service: %w", err)
	}
	defer svc.Stop()

	auditor, err := leasebus.NewAuditor(nc)
	if err != nil {
		return err
	}
	// The operator's revokes go out in the operator's name (the audit says
	// who asked).
	oopts, err := leasebus.RoleOptions(credsDir, leasebus.RoleOperator)
	if err != nil {
		return fmt.Errorf("demo bus: %w", err)
	}
	onc, err := nats.Connect(srv.ClientURL(), append(oopts, nats.Name("fenceline-demo-operator"), nats.Timeout(leasebus.ConnectTimeout), nats.InProcessServer(srv))...)
	if err != nil {
		return fmt.Errorf("demo bus: connect the operator: %w", err)
	}
	defer onc.Close()
	d := &demo{cfg: cfg, out: out, url: srv.ClientURL(), nc: nc, c: leasebus.NewClient(nc), op: leasebus.NewClient(onc), auditor: auditor, creds: credsDir, secrets: secrets}
	fmt.Fprintf(out, "fenceline demo: %s\n", Repo)
	fmt.Fprintf(out, "bus: %s (embedded, its own store in %s; the default bus is untouched)\n", srv.ClientURL(), dir)
	var page *runui.Running
	if ui != "" {
		// The run UI reads as a viewer, as under `bus serve --ui`.
		vopts, err := leasebus.RoleOptions(credsDir, leasebus.RoleViewer)
		if err != nil {
			return fmt.Errorf("demo bus: %w", err)
		}
		unc, err := nats.Connect(srv.ClientURL(), append(vopts, nats.Name("fenceline-demo-ui"), nats.Timeout(leasebus.ConnectTimeout), nats.InProcessServer(srv))...)
		if err != nil {
			return fmt.Errorf("demo bus: connect the run UI: %w", err)
		}
		defer unc.Close()
		shards, err := shard.Open(leasebus.NewShardRecords(unc), shard.Config{})
		if err != nil {
			return err
		}
		if page, err = runui.Listen(ui, runui.Config{Source: leasebus.NewUIReader(unc), Shards: runui.StoreSource(shards)}); err != nil {
			return err
		}
		defer func() {
			sctx, cancel := context.WithTimeout(context.WithoutCancel(parent), 5*time.Second)
			defer cancel()
			_ = page.Close(sctx)
		}()
		fmt.Fprintf(out, "run UI: %s (leases, shards, attempts and the audit feed, live)\n", page.URL())
	}
	if err := d.story(ctx); err != nil {
		return err
	}
	if err := d.gitStory(ctx, dir); err != nil {
		return err
	}
	if err := d.pgStory(ctx, dir); err != nil {
		return err
	}
	if err := d.shardStory(ctx, dir, srv.ClientURL()); err != nil {
		return err
	}
	if err := d.zombieStory(ctx, dir, srv.ClientURL()); err != nil {
		return err
	}
	fmt.Fprintln(out, "\ndemo complete: every expectation held")
	if page != nil && !keep {
		fmt.Fprintf(out, "\nthe run UI stays up at %s; stop it with Ctrl-C\n", page.URL())
		<-parent.Done()
	}
	if keep {
		fmt.Fprintf(out, "\nthe demo bus keeps running at %s (store %s)\n", srv.ClientURL(), dir)
		fmt.Fprintf(out, "inspect it: fenceline --nats %s lease list --all; fenceline --nats %s lease audit\n", srv.ClientURL(), srv.ClientURL())
		fmt.Fprintln(out, "stop it with Ctrl-C")
		<-parent.Done()
	}
	return nil
}

func (d *demo) section(title string) {
	fmt.Fprintf(d.out, "\n== %s ==\n", title)
}

// acquire asks for path as agent.
func (d *demo) acquire(ctx context.Context, agent, path string, ttl, wait time.Duration) (*lease.Lease, leasebus.Credential, error) {
	req, err := demoRequest(agent, path, ttl, wait)
	if err != nil {
		return nil, "", err
	}
	cred := leasebus.NewCredential()
	l, err := d.c.Acquire(ctx, req, cred)
	if err == nil {
		d.grants = append(d.grants, grant{agent: agent, lease: l})
	}
	return l, cred, err
}

// acquireAndHold asks for path as agent and holds what it gets.
func (d *demo) acquireAndHold(ctx context.Context, agent, path string, ttl, wait time.Duration) (*leasebus.Holder, error) {
	req, err := demoRequest(agent, path, ttl, wait)
	if err != nil {
		return nil, err
	}
	h, err := d.c.AcquireAndHold(ctx, req, leasebus.NewCredential(), leasebus.HoldOptions{})
	if err == nil {
		l := h.Lease()
		d.grants = append(d.grants, grant{agent: agent, lease: &l})
	}
	return h, err
}

func demoRequest(agent, path string, ttl, wait time.Duration) (leasebus.AcquireRequest, error) {
	claim, err := scope.New([]string{path}, false, nil)
	if err != nil {
		return leasebus.AcquireRequest{}, err
	}
	return leasebus.AcquireRequest{
		Repo:  Repo,
		Scope: claim,
		Owner: lease.Owner{TaskID: "demo", AgentID: agent, AttemptID: lease.NewAttemptID()},
		TTL:   lease.Duration(ttl),
		Wait:  lease.Duration(wait),
	}, nil
}

func (d *demo) story(ctx context.Context) error {
	const ttl = 30 * time.Second

	// 1 and 2: three agents at once; a and b overlap, c is disjoint.
	d.section("1. Two agents race for overlapping scopes")
	fmt.Fprintln(d.out, "agent-a asks for [services/billing] and agent-b for [services/billing/api], at the same moment;")
	fmt.Fprintln(d.out, "agent-c asks for [libs/tax] in the same instant.")
	type ask struct {
		agent, path string
		lease       *lease.Lease
		cred        leasebus.Credential
		sent        time.Time
		err         error
	}
	asks := []*ask{{agent: "agent-a", path: "services/billing"}, {agent: "agent-b", path: "services/billing/api"}, {agent: "agent-c", path: "libs/tax"}}
	start := make(chan struct{})
	var mu sync.Mutex // guards d.grants while the racers run
	var wg sync.WaitGroup
	for _, q := range asks {
		wg.Go(func() {
			<-start
			claim, err := scope.New([]string{q.path}, false, nil)
			if err != nil {
				q.err = err
				return
			}
			q.cred, q.sent = leasebus.NewCredential(), time.Now()
			q.lease, q.err = d.c.Acquire(ctx, leasebus.AcquireRequest{
				Repo: Repo, Scope: claim, TTL: lease.Duration(ttl),
				Owner: lease.Owner{TaskID: "demo", AgentID: q.agent, AttemptID: lease.NewAttemptID()},
			}, q.cred)
			if q.err == nil {
				mu.Lock()
				d.grants = append(d.grants, grant{agent: q.agent, lease: q.lease})
				mu.Unlock()
			}
		})
	}
	close(start)
	wg.Wait()
	// The racers were granted in one repo, whose fences count grants.
	slices.SortFunc(d.grants, func(x, y grant) int { return cmp.Compare(x.lease.Fence, y.lease.Fence) })

	a, b, c := asks[0], asks[1], asks[2]
	var winner, loser *ask
	switch {
	case a.err == nil && b.err != nil:
		winner, loser = a, b
	case b.err == nil && a.err != nil:
		winner, loser = b, a
	default:
		return fail("exactly one of agent-a and agent-b must win the race; agent-a: %v, agent-b: %v", errText(a.err), errText(b.err))
	}
	var ce *lease.ConflictError
	if !errors.As(loser.err, &ce) {
		return fail("%s should be refused with a conflict, got: %v", loser.agent, loser.err)
	}
	if !slices.ContainsFunc(ce.Conflicts, func(x lease.Conflict) bool {
		return x.LeaseID == winner.lease.LeaseID && x.Owner.AgentID == winner.agent && !x.ExpiresAt.IsZero()
	}) {
		return fail("%s's refusal should name %s, its owner %s and its expiry: %v", loser.agent, winner.lease.LeaseID, winner.agent, ce)
	}
	fmt.Fprintf(d.out, "  winner: %s got %s [%s] (fence %d)\n", winner.agent, winner.lease.LeaseID, winner.path, winner.lease.Fence)
	fmt.Fprintf(d.out, "  loser:  %s was refused:\n          %s\n", loser.agent, ce)

	d.section("2. A disjoint scope is granted alongside")
	if c.err != nil {
		return fail("agent-c's disjoint [libs/tax] should be granted, got: %v", c.err)
	}
	fmt.Fprintf(d.out, "agent-c got %s [libs/tax] (fence %d) while the race went on: disjoint claims share the workspace.\n", c.lease.LeaseID, c.lease.Fence)
	holdC, err := d.c.Hold(ctx, c.lease, c.cred, c.sent, leasebus.HoldOptions{})
	if err != nil {
		return fmt.Errorf("hold agent-c's lease: %w", err)
	}
	defer holdC.Orphan()
	fmt.Fprintln(d.out, "agent-c's holder renews it in the background and watches for its end.")

	// 3: a crashed holder.
	d.section("3. A crashed holder's lease is reclaimed")
	holdD, err := d.acquireAndHold(ctx, "agent-d", "docs", 2*time.Second, 0)
	if err != nil {
		return fail("agent-d should get [docs]: %v", err)
	}
	dl := holdD.Lease()
	fmt.Fprintf(d.out, "agent-d got %s [docs] (fence %d) with ttl %s and a holder renewing it.\n", dl.LeaseID, dl.Fence, dl.TTL)
	holdD.Orphan()
	fmt.Fprintln(d.out, "agent-d crashes: its holder stops renewing and nothing is released.")
	fmt.Fprintln(d.out, "agent-e asks for [docs] and waits up to 5s ...")
	t0 := time.Now()
	el, ecred, err := d.acquire(ctx, "agent-e", "docs", ttl, 5*time.Second)
	if err != nil {
		return fail("agent-e should be granted [docs] once agent-d's lease is reclaimed: %v", err)
	}
	fmt.Fprintf(d.out, "  agent-e got %s [docs] (fence %d) after %.1fs, once the sweeper reclaimed agent-d's lease:\n",
		el.LeaseID, el.Fence, time.Since(t0).Seconds())
	ev, err := d.awaitAudit(ctx, func(ev lease.AuditEvent) bool {
		return ev.Type == lease.EventReclaimed && ev.LeaseID == dl.LeaseID
	})
	if err != nil {
		return fail("the reclaim of %s should be audited: %v", dl.LeaseID, err)
	}
	fmt.Fprintf(d.out, "  %s\n", ev.Message)
	if el.Fence <= dl.Fence {
		return fail("agent-e's fence %d should exceed agent-d's %d", el.Fence, dl.Fence)
	}

	// 4: fences rise.
	d.section("4. Fence tokens rise")
	if _, err := d.c.Release(ctx, winner.lease.LeaseID, winner.cred); err != nil {
		return fmt.Errorf("release %s's lease: %w", winner.agent, err)
	}
	fmt.Fprintf(d.out, "%s releases %s; %s retries [%s] ...\n", winner.agent, winner.lease.LeaseID, loser.agent, loser.path)
	rl, rcred, err := d.acquire(ctx, loser.agent, loser.path, ttl, 0)
	if err != nil {
		return fail("%s's retry should be granted after the release: %v", loser.agent, err)
	}
	fmt.Fprintf(d.out, "  %s got %s (fence %d)\n", loser.agent, rl.LeaseID, rl.Fence)
	fmt.Fprintln(d.out, "grants, in order:")
	for _, g := range d.grants {
		fmt.Fprintf(d.out, "  fence %d  %s  %-8s %s\n", g.lease.Fence, g.lease.LeaseID, g.agent, g.lease.Scope)
	}
	if err := checkFences(d.grants); err != nil {
		return fail("%v", err)
	}
	fences := make([]uint64, len(d.grants))
	for i, g := range d.grants {
		fences[i] = g.lease.Fence
	}
	slices.Sort(fences)
	fmt.Fprintf(d.out, "fence tokens: %s (strictly increasing for overlapping grants)\n", joinFences(fences))

	// 5: a revoke seen by the holder.
	d.section("5. An operator revokes a lease")
	const reason = "demo: operator ends agent-c's lease"
	fmt.Fprintf(d.out, "operator: fenceline lease revoke %s --reason %q\n", c.lease.LeaseID, reason)
	t1 := time.Now()
	if _, err := d.op.Revoke(ctx, c.lease.LeaseID, reason); err != nil {
		return fmt.Errorf("revoke %s: %w", c.lease.LeaseID, err)
	}
	select {
	case <-holdC.Lost():
	case <-time.After(time.Second):
		return fail("agent-c's holder should see the revoke within 1s")
	case <-ctx.Done():
		return ctx.Err()
	}
	took := time.Since(t1)
	_, ferr := holdC.Fence()
	if !errors.Is(ferr, lease.ErrLeaseLost) {
		return fail("agent-c's Fence() after the revoke should be lease lost, got %v", ferr)
	}
	fmt.Fprintf(d.out, "agent-c's holder saw it after %s (watch, not the next renewal)\n", took.Round(10*time.Microsecond))
	fmt.Fprintf(d.out, "agent-c's next write asks for a fence and is refused: %v\n", ferr)

	// Tidy up, then 6: the audit trail.
	if _, err := d.c.Release(ctx, rl.LeaseID, rcred); err != nil {
		return fmt.Errorf("release %s: %w", rl.LeaseID, err)
	}
	if _, err := d.c.Release(ctx, el.LeaseID, ecred); err != nil {
		return fmt.Errorf("release %s: %w", el.LeaseID, err)
	}
	if _, err := d.awaitAudit(ctx, func(ev lease.AuditEvent) bool {
		return ev.LeaseID == el.LeaseID && ev.Type == lease.EventRelease
	}); err != nil {
		return fail("the last release should be audited: %v", err)
	}
	evs, err := leasebus.ReadAudit(ctx, d.nc, Repo, 0)
	if err != nil {
		return fmt.Errorf("read audit trail: %w", err)
	}
	for _, want := range []struct{ typ, lease string }{
		{lease.EventRefused, ""}, {lease.EventReclaimed, dl.LeaseID},
		{lease.EventRelease, winner.lease.LeaseID}, {lease.EventRelease, rl.LeaseID},
		{lease.EventRevoked, c.lease.LeaseID},
	} {
		if !slices.ContainsFunc(evs, func(ev lease.AuditEvent) bool {
			return ev.Type == want.typ && (want.lease == "" || ev.LeaseID == want.lease)
		}) {
			return fail("the audit trail should hold a %s event %s", want.typ, want.lease)
		}
	}
	d.section("6. The audit trail")
	// What "fenceline lease audit --repo R" prints.
	var errOut strings.Builder
	if code := d.cfg.Command(ctx, []string{"--nats", d.url, "--creds", d.creds, "lease", "audit", "--repo", Repo}, d.out, &errOut); code != 0 {
		return fmt.Errorf("fenceline lease audit: exit %d: %s", code, errOut.String())
	}
	return nil
}

// awaitAudit polls the repo's audit trail (written off the request path)
// until an event matches.
func (d *demo) awaitAudit(ctx context.Context, match func(lease.AuditEvent) bool) (lease.AuditEvent, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		evs, err := leasebus.ReadAudit(ctx, d.nc, Repo, 0)
		if err == nil {
			for _, ev := range evs {
				if match(ev) {
					return ev, nil
				}
			}
		}
		select {
		case <-ctx.Done():
			if err == nil {
				err = errors.New("no such event within 5s")
			}
			return lease.AuditEvent{}, err
		case <-tick.C:
		}
	}
}

// checkFences checks invariant 2 on grants listed in the order they were
// learned: every grant has a distinct fence, and a grant that overlaps an
// earlier one carries a greater fence.
func checkFences(grants []grant) error {
	seen := map[uint64]string{}
	for j, g := range grants {
		if g.lease.Fence == 0 {
			return fmt.Errorf("%s has no fence", g.lease.LeaseID)
		}
		if other, dup := seen[g.lease.Fence]; dup {
			return fmt.Errorf("fence %d granted twice: %s and %s", g.lease.Fence, other, g.lease.LeaseID)
		}
		seen[g.lease.Fence] = g.lease.LeaseID
		for _, e := range grants[:j] {
			if e.lease.Scope.Overlaps(g.lease.Scope) && g.lease.Fence <= e.lease.Fence {
				return fmt.Errorf("%s %s (fence %d) overlaps the earlier %s %s (fence %d) but its fence is not greater",
					g.lease.LeaseID, g.lease.Scope, g.lease.Fence, e.lease.LeaseID, e.lease.Scope, e.lease.Fence)
			}
		}
	}
	return nil
}

func joinFences(fs []uint64) string {
	s := make([]string, len(fs))
	for i, f := range fs {
		s[i] = fmt.Sprint(f)
	}
	return strings.Join(s, " → ")
}

func errText(err error) string {
	if err == nil {
		return "granted"
	}
	return err.Error()
}
