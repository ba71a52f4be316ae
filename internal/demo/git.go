package demo

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/fenceline/fenceline/gitproxy"
	"github.com/fenceline/fenceline/internal/gitserver"
	"github.com/fenceline/fenceline/lease"
	"github.com/fenceline/fenceline/lease/scope"
	"github.com/fenceline/fenceline/leasebus"
	"github.com/fenceline/fenceline/sidecar"
)

// demoGit is the git part of the story: a real git server (git
// http-backend) with fenceline's pre-receive hook, agents pushing with the
// real git CLI through their sidecars' git fences.
type demoGit struct {
	*demo
	dir  string // scratch space
	srv  *gitserver.Server
	bare string
	key  []byte // the repository's hook secret: the hook's and the lease service's alone
}

// git runs the real git for an agent with env and returns its output.
func (g *demoGit) git(ctx context.Context, dir string, env []string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, "git", args...)
	cmd.Dir = dir
	cmd.Env = append(gitserver.ClientEnv(g.dir, "demo"), env...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	return out.String(), err
}

func (g *demoGit) mustGit(ctx context.Context, dir string, env []string, args ...string) error {
	if out, err := g.git(ctx, dir, env, args...); err != nil {
		return fmt.Errorf("git %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// commit writes content to path in the agent's clone and commits it.
func (g *demoGit) commit(ctx context.Context, work, path, content string) error {
	p := filepath.Join(work, filepath.FromSlash(path))
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
		return err
	}
	if err := g.mustGit(ctx, work, nil, "add", "-A"); err != nil {
		return err
	}
	return g.mustGit(ctx, work, nil, "commit", "--quiet", "-m", "change "+path)
}

// rejected returns what git push printed about the refusal: the
// fence's "remote: fenceline: …" line and git's "! [remote rejected]" line.
func rejected(out string) string {
	var lines []string
	for _, l := range strings.Split(out, "\n") {
		if strings.Contains(l, "[remote rejected]") || strings.Contains(l, "remote: fenceline:") {
			lines = append(lines, strings.TrimSpace(l))
		}
	}
	if len(lines) == 0 {
		return strings.TrimSpace(out)
	}
	return strings.Join(lines, "\n    ")
}

func (d *demo) gitStory(ctx context.Context, dir string) error {
	if _, err := exec.LookPath("git"); err != nil {
		return fmt.Errorf("the demo's git part needs git on PATH: %w", err)
	}
	exe := d.cfg.Fenceline
	g := &demoGit{demo: d, dir: dir}
	root := filepath.Join(dir, "git")
	if err := os.MkdirAll(root, 0o755); err != nil {
		return err
	}
	var err error
	if g.srv, err = gitserver.Start(root); err != nil {
		return err
	}
	defer g.srv.Close()
	if g.bare, err = g.srv.NewRepo("payments.git"); err != nil {
		return err
	}
	seed := filepath.Join(dir, "seed")
	if err := g.mustGit(ctx, "", nil, "init", "--quiet", "--initial-branch=main", seed); err != nil {
		return err
	}
	for _, f := range []string{"services/billing/invoice.go", "libs/tax/rates.go", "README.md"} {
		if err := g.commit(ctx, seed, f, "// "+f+"\n"); err != nil {
			return err
		}
	}
	if err := g.mustGit(ctx, seed, nil, "push", "--quiet", g.bare, "main"); err != nil {
		return err
	}
	// What "fenceline hook install --git-dir DIR --repo R" does.
	in, err := gitproxy.InstallHook(ctx, gitproxy.HookInstall{GitDir: g.bare, Repo: Repo, Fenceline: exe})
	if err != nil {
		return err
	}
	g.key = in.Key
	// What "fenceline bus fence-secret set --repo R --git KEYFILE" does.
	if err := leasebus.WriteFenceSecret(d.secrets, Repo, lease.StorageGit, in.Key); err != nil {
		return err
	}
	upstream := g.srv.URL + "/payments.git"

	d.section("7. The git fence")
	fmt.Fprintf(d.out, "a real git server (git http-backend) at %s, with \"fenceline hook pre-receive\" installed\n", upstream)
	fmt.Fprintf(d.out, "by \"fenceline hook install\": it accepts only fences the lease service granted. The repository's secret\n(%s, mode 0600) is registered with the lease service (\"fenceline bus fence-secret set\"); no sidecar\nholds it. Each acquirer gets a grant key for its own lease, fence and claim, and its sidecar signs pushes with it.\n", in.KeyFile)
	f, err := g.agent(ctx, "agent-f", "services/billing", 30*time.Second)
	if err != nil {
		return err
	}
	defer f.close(ctx)
	fmt.Fprintf(d.out, "agent-f holds %s [services/billing] in an exclusive workspace (fence %d); its sidecar's git fence is %s.\n",
		f.lease.LeaseID, f.lease.Fence, f.sc.GitURL())
	fmt.Fprintln(d.out, "agent-f's git is unmodified: the sidecar's env routes its remote (GIT_CONFIG_* insteadOf).")
	work := filepath.Join(dir, "agent-f")
	if err := g.mustGit(ctx, "", f.env, "clone", "--quiet", upstream, work); err != nil {
		return err
	}
	if err := g.commit(ctx, work, "services/billing/invoice.go", "// invoices v2\n"); err != nil {
		return err
	}
	if out, err := g.git(ctx, work, f.env, "push", "origin", "main"); err != nil {
		return fail("agent-f's in-scope push should land: %v\n%s", err, out)
	}
	fmt.Fprintln(d.out, "  git push (services/billing/invoice.go): landed")
	if err := g.commit(ctx, work, "libs/tax/rates.go", "// agent-f was here\n"); err != nil {
		return err
	}
	out, err := g.git(ctx, work, f.env, "push", "origin", "main")
	if err == nil || !strings.Contains(out, "libs/tax/rates.go is outside lease "+f.lease.LeaseID) {
		return fail("agent-f's push touching libs/tax should be refused naming the path and lease: %v\n%s", err, out)
	}
	fmt.Fprintf(d.out, "  git push (libs/tax/rates.go):\n    %s\n", rejected(out))
	if err := g.mustGit(ctx, work, nil, "reset", "--quiet", "--hard", "origin/main"); err != nil {
		return err
	}

	// The zombie.
	fmt.Fprintln(d.out, "\nagent-g takes [libs/tax] with a 1s ttl, then its sidecar freezes (a paused VM, a GC stall):")
	z, err := g.agent(ctx, "agent-g", "libs/tax", time.Second)
	if err != nil {
		return err
	}
	z.holder.Orphan() // frozen: no more renewals
	z.sc.Close(ctx)
	zombie := z.lease
	frozen, err := gitproxy.New(gitproxy.Config{
		Upstream: g.srv.URL, Lease: leasebus.Frozen{Record: *zombie}, Repo: Repo, Bus: d.c, Audit: d.auditor,
		MirrorDir: filepath.Join(dir, "mirror-g"), TempDir: dir,
	})
	if err != nil {
		return err
	}
	zsrv, zurl, err := serveHandler(frozen)
	if err != nil {
		return err
	}
	defer zsrv.Close()
	zenv := []string{"GIT_CONFIG_COUNT=1", "GIT_CONFIG_KEY_0=url." + zurl + "/.insteadOf", "GIT_CONFIG_VALUE_0=" + g.srv.URL + "/"}
	zwork := filepath.Join(dir, "agent-g")
	if err := g.mustGit(ctx, "", zenv, "clone", "--quiet", upstream, zwork); err != nil {
		return err
	}
	if err := g.commit(ctx, zwork, "libs/tax/rates.go", "// stale rates from agent-g\n"); err != nil {
		return err
	}
	fmt.Fprintln(d.out, "agent-h asks for [libs/tax] and waits; the lease expires and is reclaimed ...")
	h, err := g.agentWait(ctx, "agent-h", "libs/tax", 30*time.Second, 5*time.Second)
	if err != nil {
		return err
	}
	defer h.close(ctx)
	fmt.Fprintf(d.out, "  agent-h got %s [libs/tax] (fence %d > %d) and pushes new rates: ", h.lease.LeaseID, h.lease.Fence, zombie.Fence)
	hwork := filepath.Join(dir, "agent-h")
	if err := g.mustGit(ctx, "", h.env, "clone", "--quiet", upstream, hwork); err != nil {
		return err
	}
	if err := g.commit(ctx, hwork, "libs/tax/rates.go", "// rates 2027 from agent-h\n"); err != nil {
		return err
	}
	if out, err := g.git(ctx, hwork, h.env, "push", "origin", "main"); err != nil {
		return fail("agent-h's push should land: %v\n%s", err, out)
	}
	fmt.Fprintln(d.out, "landed")

	fmt.Fprintln(d.out, "agent-g wakes up, still believing it holds fence", zombie.Fence, "and pushes:")
	if err := g.mustGit(ctx, zwork, zenv, "pull", "--quiet", "--rebase", "-X", "theirs", "origin", "main"); err != nil {
		return err
	}
	out, err = g.git(ctx, zwork, zenv, "push", "origin", "main")
	if err == nil || !strings.Contains(out, "fenceline: lease "+zombie.LeaseID) {
		return fail("the zombie's push should be refused at its git fence: %v\n%s", err, out)
	}
	fmt.Fprintf(d.out, "  at its git fence (the bus says the lease is gone):\n    %s\n", rejected(out))
	out, err = g.git(ctx, zwork, nil, "push",
		"-o", gitproxy.OptionLease+"="+zombie.LeaseID, "-o", gitproxy.OptionFence+"=999999", upstream, "HEAD:main")
	if err == nil || !strings.Contains(out, "not signed") {
		return fail("the zombie's direct push with a made-up fence should be refused by the server's hook: %v\n%s", err, out)
	}
	fmt.Fprintf(d.out, "  straight at the server, past any fence, with a made-up fence 999999: the pre-receive hook refuses it:\n    %s\n", rejected(out))
	// A sidecar that signed its push just before it froze, and delivers it
	// on waking: the signature is genuine, the fence stale.
	late, err := g.lateSignedPush(ctx, zwork, zombie)
	if err != nil {
		return err
	}
	out, err = g.git(ctx, zwork, nil, append(late, upstream, "HEAD:main")...)
	if err == nil || !strings.Contains(out, "is stale") {
		return fail("the zombie sidecar's late, signed push should be refused by the server's hook: %v\n%s", err, out)
	}
	fmt.Fprintf(d.out, "  its sidecar's push, signed just before it froze and delivered on waking, carries fence %d: the hook refuses it:\n    %s\n", zombie.Fence, rejected(out))

	evs, err := leasebus.ReadAudit(ctx, d.nc, Repo, 0)
	if err != nil {
		return err
	}
	fmt.Fprintln(d.out, "git fence refusals in the audit stream:")
	n := 0
	for _, ev := range evs {
		if ev.Boundary == lease.BoundaryGit {
			n++
			fmt.Fprintf(d.out, "  %s %s fence %d %s: %s\n", ev.Type, ev.LeaseID, ev.Fence, ev.Reason, ev.Message)
		}
	}
	if n < 2 {
		return fail("both git refusals should be audited, found %d", n)
	}
	return nil
}

// lateSignedPush is the push options a zombie's sidecar signed for
// pushing work's HEAD to main before it froze, as git push arguments.
func (g *demoGit) lateSignedPush(ctx context.Context, work string, l *lease.Lease) ([]string, error) {
	old, err := g.git(ctx, g.bare, nil, "rev-parse", "refs/heads/main")
	if err != nil {
		return nil, fmt.Errorf("read the server's main: %w\n%s", err, old)
	}
	head, err := g.git(ctx, work, nil, "rev-parse", "HEAD")
	if err != nil {
		return nil, fmt.Errorf("read agent-g's HEAD: %w\n%s", err, head)
	}
	opts, err := gitproxy.FenceOptions(l.Grants.Git, *l, l.Fence,
		[]gitproxy.RefUpdate{{Old: strings.TrimSpace(old), New: strings.TrimSpace(head), Ref: "refs/heads/main"}})
	if err != nil {
		return nil, err
	}
	args := []string{"push"}
	for _, o := range opts {
		args = append(args, "-o", o)
	}
	return args, nil
}

// demoAgent is an agent with a held lease and a sidecar serving its git fence.
type demoAgent struct {
	lease  *lease.Lease
	holder *leasebus.Holder
	sc     *sidecar.Sidecar
	env    []string
}

func (a *demoAgent) close(ctx context.Context) {
	if a.sc != nil {
		a.sc.Close(ctx)
	}
	a.holder.Close(ctx)
}

func (g *demoGit) agent(ctx context.Context, name, path string, ttl time.Duration) (*demoAgent, error) {
	return g.agentWait(ctx, name, path, ttl, 0)
}

func (g *demoGit) agentWait(ctx context.Context, name, path string, ttl, wait time.Duration) (*demoAgent, error) {
	claim, err := scope.New([]string{path}, false, nil)
	if err != nil {
		return nil, err
	}
	return g.startAgent(ctx, name, claim, ttl, wait, sidecar.Config{GitUpstream: g.srv.URL, StateDir: filepath.Join(g.dir, "sidecar-"+name)})
}

// startAgent acquires claim for agent name in an exclusive workspace,
// holds it, and starts its sidecar with the fences cfg names.
func (d *demo) startAgent(ctx context.Context, name string, claim scope.Claim, ttl, wait time.Duration, cfg sidecar.Config) (*demoAgent, error) {
	h, err := d.c.AcquireAndHold(ctx, leasebus.AcquireRequest{
		Repo: Repo, Scope: claim, WorkspaceMode: lease.WorkspaceExclusive, WorkspaceID: "ws-" + name,
		Owner: lease.Owner{TaskID: "demo", AgentID: name, AttemptID: lease.NewAttemptID()},
		TTL:   lease.Duration(ttl), Wait: lease.Duration(wait),
	}, leasebus.NewCredential(), leasebus.HoldOptions{})
	if err != nil {
		return nil, fail("%s should get %s: %v", name, claim, err)
	}
	rec := h.Lease()
	rec.Grants = h.GrantKeys()
	l := &rec
	d.grants = append(d.grants, grant{agent: name, lease: l})
	a := &demoAgent{lease: l, holder: h}
	cfg.Lease, cfg.Bus, cfg.Audit = h, d.c, d.auditor
	if a.sc, err = sidecar.Start(ctx, cfg); err != nil {
		a.close(ctx)
		return nil, err
	}
	a.env = a.sc.AgentEnv(nil)
	return a, nil
}

// serveHandler serves h on a free loopback port.
func serveHandler(h http.Handler) (*http.Server, string, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, "", err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: time.Minute}
	go srv.Serve(ln)
	return srv, "http://" + ln.Addr().String(), nil
}
